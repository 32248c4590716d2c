"""Per-patch bitwise diff (issue 21): what a patch changes in the numbers against the revision
it applies to. tree.py builds REV in a temporary worktree and runs driver.py there; cache.py
keeps REV's captures; compare.py judges each (reference | toggle, scenario, tensor kind) and
applies the gate's rules; diff.py runs both sides; report.py writes the reports and the
`k3verify all --base` section."""
