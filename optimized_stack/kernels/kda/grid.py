"""KDA on a 64-token grid: chunked kernel for the aligned part of a call, recurrence for the rest.

fla's chunk_kda is bitwise across prefill splits at multiples of 64 (64 + 64 tokens with
the state carried == 128 at once), but not across other splits, and a prefill of 128 then one
recurrent decode differs from a prefill of 129 (measured on the H200, NOTES.md). The GPU
reference therefore computes KDA on a grid (design.md, "One reference per device"):

    a call of n tokens: the first n - n % 64 through the chunked kernel, the rest through the
    recurrent kernel (fused_recurrent_kda: n tokens in one call == n one-token calls)

so a whole-prompt prefill of P tokens chunks A = P - P % 64 tokens and recurs the tail, and
every decode step recurs. An engine stays bit-identical to that only if it cuts its calls on
the same grid (`grid_end`): below A a call starts and ends on the grid (or ends in the tail,
at or before P), at or above A a call is shorter than 64. The engine also reuses KDA
checkpoints and MLA blocks only where they were computed on the chunked path (positions up to
A of the request that computed them): engine/store.py.

`cpu_grid_kda` is the same rule on the CPU (kernels/kda/chunked.py for the aligned part, the
reference recurrence for the tail): the CPU twin of the GPU profile that lets the engine's grid
rules be tested bit for bit without a GPU.

Shape letters: T tokens, H heads, K key dim, V value dim.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...model.kda import kda_recurrent
from .chunked import kda_chunked

GRID = 64

KDAOp = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class GridKDA:
    """(q, k, v, g, beta, state) -> (o, state): `chunk` on the 64-aligned head of the call,
    `recurrent` on the remaining T mod 64 tokens. `kda_grid` tells the engine to cut on it."""

    kda_grid = GRID

    def __init__(self, chunk: KDAOp, recurrent: KDAOp, name: str):
        self.chunk, self.recurrent, self.__name__ = chunk, recurrent, name

    def __call__(self, q, k, v, g, beta, initial_state=None):
        t_len = q.shape[0]
        head = t_len - t_len % GRID
        if head == 0:
            return self.recurrent(q, k, v, g, beta, initial_state)
        o_head, state = self.chunk(q[:head], k[:head], v[:head], g[:head], beta[:head], initial_state)
        if head == t_len:
            return o_head, state
        o_tail, state = self.recurrent(q[head:], k[head:], v[head:], g[head:], beta[head:], state)
        return torch.cat([o_head, o_tail]), state

    def __repr__(self) -> str:
        return f"GridKDA({self.__name__})"


cpu_grid_kda = GridKDA(kda_chunked, kda_recurrent, "cpu_grid_kda")


def grid_end(start: int, end: int, prompt_len: int, grid: int = GRID) -> int:
    """The furthest stop <= end for a call over [start, end) that computes what the grid
    reference computes (module docstring); returns `start` when no tokens can be taken without
    passing `end` (the caller then takes grid_end(start, start + grid, ...) and overruns).

    A = prompt_len - prompt_len % grid is where the reference leaves the chunked path."""
    aligned = prompt_len - prompt_len % grid
    if start >= aligned:                        # the recurrent region: calls shorter than the grid
        return min(end, start + grid - 1)
    if start % grid:
        raise ValueError(f"a KDA call below the aligned prompt ({aligned}) must start on the {grid}-token grid, "
                         f"got {start}")
    if end <= aligned:
        return start + (end - start) // grid * grid
    return min(end, prompt_len) if prompt_len > aligned else aligned


def grid_pieces(start: int, end: int, prompt_len: int, grid: int = GRID) -> list[tuple[int, int]]:
    """[start, end) cut into calls that each satisfy grid_end."""
    pieces = []
    while start < end:
        stop = grid_end(start, end, prompt_len, grid)
        if stop == start:
            raise ValueError(f"[{start}, {end}) cannot be cut on the {grid}-token grid (prompt {prompt_len})")
        pieces.append((start, stop))
        start = stop
    return pieces


def grid_in_force(device: torch.device | str, setting: int | None = None) -> int | None:
    """The grid the engine must cut on: `setting` when given (0: none), else the grid of the
    KDA prefill op in force (a GridKDA in the op table's slot), else the GPU reference
    profile's on CUDA, else none (the CPU reference recurrence is exact under any cut)."""
    if setting is not None:
        return setting or None
    from ...model.ops import OPS
    slot_grid = getattr(OPS.kda_prefill, "kda_grid", None)
    if slot_grid is not None:
        return slot_grid
    if OPS.kda_prefill is None and torch.device(device).type == "cuda":
        import os

        from ...model.ops import GPU_PROFILE_ENV
        from ..gpu_reference import kda_choice
        if kda_choice() == "recurrent" or os.environ.get(GPU_PROFILE_ENV) == "torch":
            return None                        # every call recurs, or no invariance is claimed at all
        return GRID
    return None

