"""Sign-off of a release configuration (suites/signoff.py configuration_problems; the suite's
`ships`, `k3verify signoff --ships`): a report in which the gate rejected a toggle that does not
ship signs the configuration that ships, while each thing that must still block does: a shipped
toggle rejected or never counted, an error, a unit not run, a mutant not caught, a failure of
anything but a non-shipped optimization, a check skipped as a whole. Each case beside the report
it breaks, so every rule is seen to fail."""
from __future__ import annotations

import copy
import json

import pytest

from k3verify import cli
from k3verify.errors import UsageError
from k3verify.suites.signoff import configuration_problems, problems, render_signoff
from k3verify.suites.suite import parse_ships, parse_suite

SHIPS = ("batched_decode", "moe_grouped_static")


def _row(toggle, status, kind="optimization", check="selftest", reason="r", **extra):
    return {"toggle": toggle, "kind": kind, "check": check, "status": status, "reason": reason, **extra}


def _verdict(toggle, verdict, model=None, reason="why"):
    return {"toggle": toggle, "verdict": verdict, "reason": reason, "contract": "exact",
            **({"model": model} if model else {})}


@pytest.fixture
def report():
    """The shape of the fifth H200 release run: what ships counted, an FP8 toggle rejected on its
    drift budget (a fail row and a failed check), every mutant caught."""
    return {
        "run_id": "r", "created": "now", "command": "k3verify all", "environment": {},
        "summary": {"passed": 4, "failed": 1, "skipped": 1, "errors": 0, "inconclusive": 0, "verdict": "fail"},
        "suite": {"name": "release.cuda", "version": 2,
                  "checks": [{"name": "exact", "kind": "selftest", "status": "pass", "counts": {"pass": 3}},
                             {"name": "drift", "kind": "drift", "status": "fail", "counts": {"pass": 1, "fail": 1}}]},
        "results": [_row("batched_decode", "pass"), _row("moe_grouped_static", "pass", check="drift_budget"),
                    _row("mut_fast_pad_shares_table", "pass", kind="mutant"),
                    _row("mla_fp8_prefill", "fail", check="drift_budget", reason="max KL 0.966 > budget 0.5"),
                    _row("moe_grouped_static", "skip", check="needle", model="golden/k3-dims")],
        "verdicts": [_verdict("batched_decode", "counted"), _verdict("batched_decode", "counted", "k3-small"),
                     _verdict("moe_grouped_static", "counted"),
                     _verdict("moe_grouped_static", "skipped", "golden/k3-dims", "needle (not in this suite)"),
                     _verdict("mla_fp8_prefill", "rejected", reason="drift_budget failed on long_prompt")],
        "negative_controls": {"caught": 1, "total": 1},
    }


def test_a_rejected_toggle_that_does_not_ship_is_off_not_blocking(report):
    assert configuration_problems(report, SHIPS) == []
    text, signed = render_signoff(report, SHIPS)
    assert signed and text.rstrip().endswith("\nSIGNED-OFF")
    assert "## Release configuration" in text and "| mla_fp8_prefill | rejected | drift_budget failed" in text
    assert "| batched_decode | batched_decode: counted; batched_decode@k3-small: counted |" in text
    # the negative control: without a configuration every judged toggle must hold, so it blocks
    assert any("mla_fp8_prefill rejected" in p for p in problems(report))
    assert not render_signoff(report)[1]


def test_the_suite_declares_the_configuration(report):
    assert problems(report) != []
    report["suite"]["ships"] = list(SHIPS)
    assert problems(report) == [] and render_signoff(report)[1]
    assert "the suite's `ships`" in render_signoff(report)[0]


@pytest.mark.parametrize("case,expect", [
    ("shipped_rejected", "shipped toggle moe_grouped_static@golden/k3-dims rejected"),
    ("shipped_never_counted", "shipped toggle moe_grouped_static counted on no model"),
    ("shipped_not_judged", "shipped toggle batched_decode: no verdict in this report"),
    ("error", "1 results errored"),
    ("not_run", "the run is incomplete: 1 units not run"),
    ("mutant_missed", "1 of 2 mutants not caught"),
    ("endpoint_failed", "endpoint / kvv/tools: fail"),
    ("shipped_row_failed", "batched_decode / selftest / multi_turn: not_exercised"),
    ("check_skipped", "suite check 'kvv' (kvv) skipped as a whole"),
])
def test_what_still_blocks_a_configuration(report, case, expect):
    assert configuration_problems(report, SHIPS) == []
    broken = copy.deepcopy(report)
    if case == "shipped_rejected":
        broken["verdicts"][3] = _verdict("moe_grouped_static", "rejected", "golden/k3-dims")
    elif case == "shipped_never_counted":
        broken["verdicts"][2] = _verdict("moe_grouped_static", "skipped")
    elif case == "shipped_not_judged":
        broken["verdicts"] = [v for v in broken["verdicts"] if v["toggle"] != "batched_decode"]
    elif case == "error":
        broken["results"].append(_row("kda_fla_chunk", "error", reason="RuntimeError: CUBLAS"))
    elif case == "not_run":
        broken["results"].append(_row("mla_sdpa", "inconclusive", check="gsm8k", unit="u1", not_run="time_limit",
                                      reason="not run: the run's --time-limit of 0.001 s passed"))
    elif case == "mutant_missed":
        broken["negative_controls"] = {"caught": 1, "total": 2}
    elif case == "endpoint_failed":
        broken["results"].append(_row("endpoint", "fail", check="kvv/tools"))
    elif case == "shipped_row_failed":
        broken["results"].append(_row("batched_decode", "not_exercised", scenario="multi_turn"))
    elif case == "check_skipped":
        broken["suite"]["checks"].append({"name": "kvv", "kind": "kvv", "status": "skip", "reason": "no fastapi"})
    found = configuration_problems(broken, SHIPS)
    assert any(expect in p for p in found), found
    assert not render_signoff(broken, SHIPS)[1]


def test_an_undecided_toggle_that_does_not_ship_is_off(report):
    report["results"].append(_row("mla_absorbed", "inconclusive", check="gsm8k/strict-match",
                                  reason="inconclusive: the lower bound -0.0102 does not exclude a drop"))
    report["verdicts"].append(_verdict("mla_absorbed", "skipped", reason="gsm8k inconclusive"))
    assert configuration_problems(report, SHIPS) == []
    assert configuration_problems(report, SHIPS + ("mla_absorbed",)) != [], "... but it blocks once it ships"


@pytest.mark.parametrize("value,message", [
    ([], "expected a non-empty list of toggle names"), ("batched_decode", "expected a non-empty list"),
    (["batched_decod"], "not a registered optimization toggle; did you mean 'batched_decode'?"),
    (["mut_fast_pad_shares_table"], "is a mutant, which never ships"),
    (["batched_decode", "batched_decode"], "'batched_decode' is listed twice")])
def test_ships_is_validated(value, message):
    with pytest.raises(UsageError, match=message.replace("?", r"\?").replace("(", r"\(")):
        parse_ships(value, "ships")
    assert parse_ships(list(SHIPS), "ships") == SHIPS


def test_a_suite_carries_its_configuration_into_the_report():
    text = 'version = 2\nships = ["batched_decode"]\n[[check]]\nkind = "diff"\ntoggles = ["batched_decode"]\n'
    assert parse_suite(text).to_dict()["ships"] == ["batched_decode"]
    assert "ships" not in parse_suite(text.replace('ships = ["batched_decode"]\n', "")).to_dict()
    with pytest.raises(UsageError, match="ships: 'nope' is not a registered optimization toggle"):
        parse_suite(text.replace('["batched_decode"]\n[[', '["nope"]\n[['))


def test_release_suites_declare_what_ships():
    from k3verify.suites.suite import load_suite
    suite = load_suite("release", device="cuda")
    assert suite.ships and "cuda_graphs" in suite.ships and "moe_grouped_static" in suite.ships
    assert not any(name.startswith("mla_fp8") for name in suite.ships)


@pytest.fixture
def broken_toggle():
    """An 'optimization' that swaps the row-stable GEMM for torch's batch-dependent one."""
    from optimized_stack import toggles as registry
    from optimized_stack.model import ops
    t = registry.register(registry.Toggle(
        name="broken_plain_linear_ships", description="test: torch GEMM instead of the row-stable one",
        contract=registry.EXACT, touches=("logits",), ops={"linear": ops.plain_linear}))
    yield t.name
    del registry._REGISTRY[t.name]


def test_signoff_command_signs_what_ships_from_a_real_run(broken_toggle, tmp_path, capsys):
    """`k3verify all` on a toggle that holds and one the gate rejects, then the sign-off: red for
    everything (exit 1), signed for the configuration without the rejected toggle (exit 0)."""
    body = "version = 2\n" + "".join(
        f'[[check]]\nname = "d-{t}"\nkind = "diff"\ntoggles = ["{t}"]\nscenarios = ["single"]\nscale = 0.25\n'
        for t in ("state_offload_roundtrip", broken_toggle))
    (tmp_path / "s.toml").write_text(body)
    run_dir = tmp_path / "run"
    assert cli.main(["all", "--suite", str(tmp_path / "s.toml"), "--report-dir", str(run_dir)]) == 1
    assert cli.main(["signoff", "--report", str(run_dir), "--out", str(tmp_path / "a.md")]) == 1
    assert cli.main(["signoff", "--report", str(run_dir), "--out", str(tmp_path / "b.md"),
                     "--ships", "state_offload_roundtrip"]) == 0
    text = (tmp_path / "b.md").read_text()
    assert text.rstrip().endswith("\nSIGNED-OFF") and f"| {broken_toggle} | rejected |" in text
    capsys.readouterr()
    assert cli.main(["signoff", "--report", str(run_dir), "--out", str(tmp_path / "c.md"),
                     "--ships", f"state_offload_roundtrip,{broken_toggle}"]) == 1, "it blocks once it ships"
    assert cli.main(["signoff", "--report", str(run_dir), "--out", str(tmp_path / "d.md"), "--ships", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--ships: 'nope' is not a registered optimization toggle" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d.md").exists(), "nothing written on bad input"
