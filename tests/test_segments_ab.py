"""perf/segments_ab on the CPU (k3-mini, tiny): both arms prefill the same prompts in one step, the
candidate's path really ran (its event: K segments a layer where K > 1, none for one prompt), the
file and table are written; bad arguments are one line and exit 2. The figure itself is a
measurement (NOTES.md), not asserted here."""
from __future__ import annotations

import json

from k3verify.perf import segments_ab


def test_segments_ab_times_both_arms_and_proves_the_candidate_ran(tmp_path, capsys):
    assert segments_ab.main(["--out", str(tmp_path), "--prompts", "1,3", "--tokens", "9", "--repeats", "2"]) == 0
    doc = json.loads((tmp_path / "segments_ab.json").read_text())
    one, three = doc["cells"]
    assert (one["prompts"], three["prompts"]) == (1, 3) and three["tokens"] == 3 * 9
    assert one["events_per_step"] == one["events_expected"] == 0          # one prompt: nothing to batch
    assert three["events_per_step"] == three["events_expected"] == 3 * 8  # k3-mini: 8 mixer layers
    assert three["repeats"] == 2 and three["ci95"][0] <= three["ratio"] <= three["ci95"][1]
    out = capsys.readouterr().out
    assert "| 3 |" in out and json.loads(out.strip().splitlines()[-1])["cells"][1]["prompts"] == 3


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    assert segments_ab.main(["--out", str(tmp_path), "--prompts", "0"]) == 2
    assert segments_ab.main(["--out", str(tmp_path), "--prompts", "x"]) == 2
    assert segments_ab.main(["--out", str(tmp_path), "--device", "tpu"]) == 2
    assert segments_ab.main(["--out", str(tmp_path), "--base", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(e.startswith("error: ") for e in err)
