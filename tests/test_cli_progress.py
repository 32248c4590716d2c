"""The progress line of long commands: done/total, elapsed and an estimate of the rest on a
terminal (stderr); nothing of it, and no control codes, when stdout is not a terminal; never
on stdout. The estimate is checked with an injected clock, the wiring with a fake TTY."""
from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
from rich.console import Console

from k3verify import cli, kinds
from k3verify.commands import all as all_cmd
from k3verify.commands._progress import Estimate, Item, RunProgress
from k3verify.kinds.base import CheckSpec, Unit

PROGRESS = re.compile(r"\d+/\d+ +elapsed \d+:\d\d:\d\d +(ETA \d+:\d\d:\d\d|done)")


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def tty(monkeypatch):
    """A context manager: sys.stdout and sys.stderr as terminals (rich then draws the live line).
    Entered in the test body: pytest's own capture resets sys.stdout between set-up and call."""
    monkeypatch.setenv("TERM", "xterm-256color")
    for var in ("NO_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "FORCE_COLOR"):
        monkeypatch.delenv(var, raising=False)

    @contextlib.contextmanager
    def terminal():
        out, err = FakeTTY(), FakeTTY()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield out, err
    return terminal


# ---- the estimate ------------------------------------------------------------------------

def test_eta_starts_from_the_priors_then_follows_each_kinds_measured_speed():
    t = [0.0]
    e = Estimate([Item("a", "diff", 10), Item("b", "diff", 10), Item("g", "golden", 5), Item("c", "diff", 20)],
                 clock=lambda: t[0])
    assert (e.done, e.total, e.remaining_s()) == (0, 4, 45.0), "before anything ran: the priors"
    e.begin(); t[0] = 20.0; e.finish()                   # a diff item took twice its prior
    assert e.rate("diff") == 2.0 and e.rate("golden") == 2.0, "a kind not seen yet borrows the overall rate"
    assert e.remaining_s() == 2 * 10 + 2 * 5 + 2 * 20
    e.begin(); t[0] = 40.0; e.finish()
    e.begin(); t[0] = 41.0; e.finish()                   # golden: 1 s for a 5 s prior
    assert e.rate("golden") == 0.2 and e.rate("diff") == 2.0
    assert (e.done, e.remaining_s()) == (3, 40.0)
    t[0] = 50.0                                          # the last item has run 9 s of its expected 40
    assert e.remaining_s() == 31.0


def test_resumed_items_count_as_done_but_do_not_calibrate():
    t = [0.0]
    e = Estimate([Item("a", "diff", 10), Item("b", "diff", 10)], clock=lambda: t[0])
    e.skip()                                             # finished by an earlier attempt: 0 s here
    assert e.done == 1 and e.rate("diff") == 1.0 and e.remaining_s() == 10.0


def test_a_batch_shares_its_time_among_its_items():
    t = [0.0]
    e = Estimate([Item("q", "gsm8k", 1.0)] * 10, clock=lambda: t[0])
    t[0] = 8.0
    e.complete(4)                                        # 4 questions answered in one 8 s batch
    assert e.done == 4 and e.rate("gsm8k") == 2.0 and e.remaining_s() == 12.0


def test_the_line_shows_done_total_elapsed_and_eta():
    t = [0.0]
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=140)
    bar = RunProgress("all", [Item("u1", "diff", 10), Item("u2", "diff", 10), Item("u3", "diff", 10)],
                      enabled=True, console=con, clock=lambda: t[0])
    with bar:
        bar.step("u1"); t[0] = 12.0
        bar.step("u2"); t[0] = 24.0
        assert bar.status() == "1/3  elapsed 0:00:24  ETA 0:00:12"
    assert bar.status() == "2/3  elapsed 0:00:24  ETA 0:00:12", "leaving the block finishes the item"
    assert "all: u2" in buf.getvalue() and "\x1b[" in buf.getvalue(), "drawn for a terminal"


# ---- wiring: a terminal gets the line, a pipe gets nothing of it -------------------------

def test_diff_on_a_terminal_shows_progress_on_stderr_only(tty, tmp_path):
    with tty() as (out, err):
        code = cli.main(["diff", "--toggle", "prefill_step_api", "--scenario", "single", "--scale", "0.25",
                         "--report-dir", str(tmp_path / "r"), "--json"])
    assert code == 0
    assert PROGRESS.search(err.getvalue()) and "1/1" in err.getvalue(), err.getvalue()[-500:]
    json.loads(out.getvalue())                           # stdout: only the document, no control codes


def test_without_a_terminal_nothing_of_the_progress_appears(capfd, tmp_path):
    code = cli.main(["diff", "--toggle", "prefill_step_api", "--scenario", "single", "--scale", "0.25",
                     "--report-dir", str(tmp_path / "r")])
    out, err = capfd.readouterr()
    assert code == 0
    assert "  running prefill_step_api on single" in err, "the plain log line stays"
    for stream in (out, err):
        assert not PROGRESS.search(stream) and "ETA" not in stream and "\x1b" not in stream


def test_all_on_a_terminal_counts_units_with_an_eta(tty, tmp_path):
    """Display in k3verify all: units done/total, an ETA from per-kind costs, the live counts."""
    diff = CheckSpec("diff", options={"toggles": ["prefill_step_api"], "scenarios": ["single"], "scale": 0.25})
    units = [Unit("diff", "d", diff.options, "prefill_step_api", "single", id=f"00{i}-d") for i in (1, 2)]
    units.append(Unit("golden", "golden", CheckSpec("golden").options, id="003-golden"))
    row = {"toggle": "prefill_step_api", "status": "pass"}
    with tty() as (_, err), all_cmd.Display(units) as display:
        display.unit_done(units[0], [row])               # resumed: finished by an earlier attempt
        display.start(units[1])
        display.note("prefill_step_api on single")
        display.unit_done(units[1], [row])
        assert display.bar.status().startswith("2/3") and "ETA" in display.bar.status()
    text = err.getvalue()
    assert PROGRESS.search(text) and "so far" in text and "prefill_step_api" in text


def test_all_off_a_terminal_prints_one_plain_line_per_unit(capfd):
    units = [Unit("golden", "golden", CheckSpec("golden").options, id="001-golden")]
    with all_cmd.Display(units) as display:
        display.start(units[0])
        display.note("golden check")
        display.unit_done(units[0], [{"toggle": "(reference)", "status": "pass"}])
    out, err = capfd.readouterr()
    assert out == "" and err == "  001-golden ...\n    golden check\n"


def test_unit_costs_grow_with_the_work():
    def unit(kind, toggle=None, scenario=None, **options):
        return Unit(kind, kind, CheckSpec(kind, options=options).options, toggle, scenario)
    diff, quarter = unit("diff", "t", "single"), unit("diff", "t", "single", scale=0.25)
    needle, longer = unit("needle", "t", lengths=[4096]), unit("needle", "t", lengths=[32768])
    gsm, gsm_t = unit("gsm8k", limit=20), unit("gsm8k", "t", limit=20)
    assert kinds.cost_s(quarter) < kinds.cost_s(diff)
    assert kinds.cost_s(longer) > 8 * kinds.cost_s(needle), "attention makes long needles superlinear"
    assert kinds.cost_s(gsm_t) == 2 * kinds.cost_s(gsm), "a toggle answers every question twice"
