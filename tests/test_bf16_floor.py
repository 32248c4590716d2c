"""perf/bf16_floor: the table a bf16 budget is declared from. It measures (the floor is bf16
noise, not zero), it tells a fault from a reordering (the mask-leak mutant drifts far more than
the legitimate mla_sdpa against the same bf16 reference), and bad names exit 2."""
from __future__ import annotations

import json

from k3verify.perf import bf16_floor


def test_rows_measure_and_tell_a_fault_from_a_reordering(tmp_path, capsys):
    out = tmp_path / "floor.json"
    assert bf16_floor.main(["--toggles", "mla_sdpa,mut_mla_sdpa_mask_leaks_next", "--scenarios", "single",
                            "--scale", "0.25", "--out", str(out)]) == 0
    rows = {r["what"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"floor", "mla_sdpa", "mut_mla_sdpa_mask_leaks_next"}
    assert rows["floor"]["kl_mean"] > 0 and rows["floor"]["rows"] > 0     # bf16 noise was measured
    assert rows["mut_mla_sdpa_mask_leaks_next"]["kind"] == "mutant"
    # the negative control: the leak's drift is far above the reordering's on the same reference
    assert rows["mut_mla_sdpa_mask_leaks_next"]["kl_mean"] > 10 * rows["mla_sdpa"]["kl_mean"]
    assert "mut_mla_sdpa_mask_leaks_next" in capsys.readouterr().out


def test_bad_names_exit_2_with_one_line(capsys, tmp_path):
    assert bf16_floor.main(["--toggles", "no_such_toggle"]) == 2
    assert bf16_floor.main(["--scenarios", "nope"]) == 2
    assert bf16_floor.main(["--scale", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
