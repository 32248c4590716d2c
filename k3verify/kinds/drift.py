"""Check kind `drift`: approx toggles only, each against its drift budget (teacher-forced KL,
top-1 agreement, ULP, final KDA state drift): the diff kind restricted to approx contracts, so
a suite that says `kind = "drift"` cannot quietly judge an exact toggle by a budget."""
from __future__ import annotations

from . import diff
from .base import OptionError

NAME = "drift"
OPTIONS = {**diff.OPTIONS, "toggles": "all-approx"}
plan, run, cost_s = diff.plan, diff.run, diff.cost_s


def validate(o: dict) -> None:
    if o["backend"] != "embedded":
        raise OptionError("backend", f"must be 'embedded' for a drift budget (vLLM settings are judged bitwise), "
                                     f"got {o['backend']!r}")
    diff.validate(o, approx_only=True)
