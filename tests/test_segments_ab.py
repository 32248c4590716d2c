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
    assert one["warm"] is True and three["warm"] is True
    out = capsys.readouterr().out
    assert "| 3 |" in out and json.loads(out.strip().splitlines()[-1])["cells"][1]["prompts"] == 3


def test_the_warm_step_counts_only_its_own_segments_and_cold_is_the_first_step():
    """Warm: the engine prefilled (and finished) a batch before the timed step; the events returned are
    the timed step's alone (the warm batch fired as many again). Cold: a fresh engine's first step."""
    from optimized_stack import load_model
    model = load_model("k3-mini")
    prompts = [[5] * 9, [7] * 11, [9] * 6]
    base = ["batched_decode", "prefill_batched_mixers"]
    for warm in (True, False):
        seconds, fired = segments_ab.prefill_step(model, base, prompts, warm=warm)
        assert seconds > 0 and fired == 3 * 8, (warm, fired)


def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys):
    assert segments_ab.main(["--out", str(tmp_path), "--prompts", "0"]) == 2
    assert segments_ab.main(["--out", str(tmp_path), "--prompts", "x"]) == 2
    assert segments_ab.main(["--out", str(tmp_path), "--device", "tpu"]) == 2
    assert segments_ab.main(["--out", str(tmp_path), "--base", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(e.startswith("error: ") for e in err)
