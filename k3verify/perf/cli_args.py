"""Argument types the benches share."""
from __future__ import annotations

import argparse
from typing import Callable


def int_list(minimum: int, what: str) -> Callable[[str], list[int]]:
    """An argparse type: a comma list of integers, each >= `minimum` (`what` names them in the
    error, e.g. "positive integers")."""
    def parse(s: str) -> list[int]:
        try:
            out = [int(x) for x in s.split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {s!r}") from None
        if not out or any(v < minimum for v in out):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return out
    return parse
