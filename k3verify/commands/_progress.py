"""Progress for long commands: one line with the current item, items done/total, elapsed
time and an estimate of the rest.

Drawn with rich on stderr, and only when a person watches (commands.interactive(): the
real stdout and stderr are terminals). Otherwise it draws nothing, so logs and pipes get
no control codes; each step's one plain message still goes to stderr as the commands
always printed it. Never on stdout, so a piped table or --json output stays clean.

The estimate of the rest: every item carries a prior cost in seconds for its kind (for
`k3verify all`, run_all.unit_cost_s). Once items finish, a kind's priors are scaled by
measured / prior over its finished items (over all finished items until one of that
kind has finished), so the estimate follows this machine's speed and each kind's own.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from k3verify.commands import interactive


@dataclass(frozen=True)
class Item:
    label: str
    kind: str = "item"
    cost_s: float = 1.0          # prior estimate, seconds on the 2-core dev CPU


def clock_text(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Estimate:
    """Items done / total and seconds left; pure bookkeeping (the clock is injected for tests).

    An item runs from the mark (its begin(), or the end of the one before) to its finish."""

    def __init__(self, items: Sequence[Item], clock: Callable[[], float] = time.monotonic) -> None:
        self.items, self.clock = list(items), clock
        self.t0 = self.mark = clock()
        self.next = 0                                  # index of the next item not yet finished
        self.running = False                           # begin() called and not finished
        self.measured: list[tuple[Item, float]] = []   # finished items that ran here, with seconds

    @property
    def total(self) -> int:
        return max(len(self.items), self.done + self.running)

    @property
    def done(self) -> int:
        return self.next

    def _item(self, i: int) -> Item:
        return self.items[min(i, len(self.items) - 1)] if self.items else Item("item")

    def begin(self) -> None:
        self.finish()
        self.running, self.mark = True, self.clock()

    def finish(self) -> None:
        if self.running:
            self.complete(1)

    def complete(self, n: int) -> None:
        """n items finished now; the seconds since the mark are shared among them."""
        now = self.clock()
        for k in range(n):
            self.measured.append((self._item(self.next + k), (now - self.mark) / n))
        self.next += n
        self.running, self.mark = False, now

    def skip(self) -> None:
        """The next item is already done (a resumed run): it counts, but calibrates nothing."""
        self.finish()
        self.next += 1
        self.mark = self.clock()

    def rate(self, kind: str) -> float:
        """measured / prior seconds over finished items of this kind, else of every kind, else 1."""
        for rows in ([(i, s) for i, s in self.measured if i.kind == kind], self.measured):
            prior = sum(i.cost_s for i, _ in rows)
            if rows and prior > 0:
                return sum(s for _, s in rows) / prior
        return 1.0

    def _expected_s(self, i: int) -> float:
        item = self._item(i)
        return item.cost_s * self.rate(item.kind)

    def remaining_s(self) -> float:
        left = sum(self._expected_s(i) for i in range(self.next, len(self.items)))
        if self.next < len(self.items):               # the next item has been running since the mark
            left -= min(self.clock() - self.mark, self._expected_s(self.next))
        return max(0.0, left)

    def fraction(self) -> float:
        costs = [i.cost_s for i in self.items]
        return min(1.0, sum(costs[: self.done]) / sum(costs)) if sum(costs) > 0 else 0.0

    def elapsed_s(self) -> float:
        return self.clock() - self.t0


class RunProgress:
    """The progress line of one command run; a context manager.

        with RunProgress("diff", items) as bar:
            judge(..., progress=bar.step)          # each message starts the next item

    step(msg) starts the next item, note(msg) only changes the text, done(msg) reports one
    item finished, advance(n) finishes n items at once (questions answered in a batch),
    skip() counts an item done elsewhere.
    `extra` renders more lines under it (the per-toggle counts of `k3verify all`)."""

    def __init__(self, title: str, items: Sequence[Item], *, enabled: bool | None = None,
                 console: Console | None = None, log_prefix: str = "  ",
                 extra: Callable[[], RenderableType] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.title, self.log_prefix, self.extra = title, log_prefix, extra
        self.estimate = Estimate(items, clock)
        self.enabled = interactive() if enabled is None else enabled
        self.description = "starting"
        self.console = console or Console(file=sys.stderr, highlight=False)
        self.live = (Live(console=self.console, get_renderable=self.render, refresh_per_second=4,
                          transient=False) if self.enabled else None)

    def __enter__(self) -> "RunProgress":
        if self.live:
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.estimate.finish()
        if self.live:
            self.live.stop()                       # leaves the last frame: what ran, in how long

    # -- what commands call ---------------------------------------------------------------
    def step(self, message: str) -> None:
        self.estimate.begin()
        self._say(message, self.log_prefix)

    def note(self, message: str) -> None:
        """A message within the current item: it does not advance."""
        self._say(message, self.log_prefix)

    def done(self, message: str) -> None:
        """For callbacks that report an item after it finished (needle cases)."""
        self.estimate.complete(1)
        self._say(message, self.log_prefix)

    def advance(self, n: int = 1) -> None:
        self.estimate.complete(n)
        self._refresh()

    def finish(self) -> None:
        self.estimate.finish()
        self._refresh()

    def skip(self) -> None:
        self.estimate.skip()
        self._refresh()

    def counting(self, generate_fn: Callable) -> Callable:
        """generate_fn(prompts, ...) that advances one item per prompt answered (gsm8k's batches)."""
        def generate(prompts, *a, **kw):
            out = generate_fn(prompts, *a, **kw)
            self.advance(len(prompts))
            return out
        return generate

    def _say(self, message: str, prefix: str) -> None:
        if self.live:
            self.description = message.strip()
            self._refresh()
        else:
            print(f"{prefix}{message}", file=sys.stderr, flush=True)

    def _refresh(self) -> None:
        if self.live:
            self.live.refresh()

    # -- drawing --------------------------------------------------------------------------
    def status(self) -> str:
        """`3/10  elapsed 0:01:02  ETA 0:04:10`: the words of the line, without the bar."""
        e = self.estimate
        left = "done" if e.done >= e.total else f"ETA {clock_text(e.remaining_s())}"
        return f"{e.done}/{e.total}  elapsed {clock_text(e.elapsed_s())}  {left}"

    def render(self) -> RenderableType:
        status, bar_width = self.status(), 16
        numbers = max(len(status), len("999/999  elapsed 0:00:00  ETA 0:00:00"))  # steady columns, frame to frame
        name_width = max(8, min(60, self.console.width - bar_width - numbers - 3))  # the name gives way
        grid = Table.grid(padding=(0, 1))
        grid.add_column(no_wrap=True, width=name_width)
        grid.add_column(no_wrap=True, width=bar_width)
        grid.add_column(no_wrap=True)
        grid.add_row(Text(f"{self.title}: {self.description}", overflow="ellipsis", no_wrap=True),
                     ProgressBar(total=1.0, completed=self.estimate.fraction(), width=bar_width), Text(status))
        return Group(grid, self.extra()) if self.extra else grid
