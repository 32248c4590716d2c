"""CUDA graphs of the batched decode step, one per ladder size (batch.py LADDER).

A size is captured on first use (CudaCapture): the step runs eagerly twice on a side stream with
every row a padding row (they touch only the spare slot and block; Triton compiles, cuBLAS picks
its kernels), then once under torch.cuda.graph into a memory pool shared by all sizes. A replay
copies the step's [4, Bp] inputs into the graph's static input tensor and replays; the outputs
are the graph's static tensors (valid until the next replay). A graph is kept per (size, op-table
fingerprint, whether an observer's digests ride in the step): under other ops or GPU-profile choices
the step would dispatch differently, so it is captured again. With the step's digests on
(step_digests.py) the graph also holds their launches and a static words tensor.

Exact by construction when replay == eager: the same kernels on the same shapes and the same
buffers (the property tests/test_fast_gpu.py checks bit for bit; on the CPU the padding side of
it is checked: eager at the padded size == eager unpadded, tests/test_fast_decode.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .decode_step import DecodeStep, op_fingerprint


@dataclass
class _Graph:
    replay: Callable[[], None]
    meta: torch.Tensor               # [4, Bp] int64, the static input
    logits: torch.Tensor             # [Bp, V] fp32, static outputs
    sampled: torch.Tensor            # [2, Bp] int64
    words: torch.Tensor | None       # [entries, Bp, W] int64: the observer's words of the step, or None
    replays: int = 0


Outputs = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


class CudaCapture:
    """Capture `fn` as a CUDA graph: (replay, its static outputs). Warm-up first on a side stream
    (Triton compiles, cuBLAS picks its kernels), then the capture into one pool shared by every
    graph of the runner."""

    def __init__(self) -> None:
        self.pool = None

    def __call__(self, fn: Callable[[], Outputs], device: torch.device) -> tuple[Callable[[], None], Outputs]:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn()
        return graph.replay, outputs


class GraphRunner:
    """`capture` is CudaCapture on a GPU; tests on a CPU hand in a stand-in with the same contract
    (fn runs on the static input at each replay), which exercises everything here but the graph."""

    def __init__(self, step: DecodeStep, *, stale_input: bool = False,
                 capture: Callable[..., tuple[Callable[[], None], Outputs]] | None = None):
        self.step = step
        self.stale_input = stale_input          # the seeded fault (options.FAULTS mut_graph_stale_input)
        self.capture = capture or CudaCapture()
        self.graphs: dict[tuple, _Graph] = {}
        self.captures = 0
        self.replays = 0
        self.first_replay = False               # whether the last run was its graph's first replay

    def _capture(self, size: int, key: tuple) -> _Graph:
        from .batch import build_meta
        device = self.step.model.device
        # the static input starts as all padding rows: warm-up and capture touch only the spare slot
        meta = build_meta([], [], [], self.step.spare_slot, size, pin=False).meta.to(device)
        if self.step.digests is not None:
            fn = lambda: self.step.forward_words(meta)                        # noqa: E731
        else:
            fn = lambda: (*self.step.forward(meta), None)                     # noqa: E731
        replay, (logits, sampled, words) = self.capture(fn, device)
        self.captures += 1
        entry = _Graph(replay, meta, logits, sampled, words)
        self.graphs[key] = entry
        return entry

    def _key(self, size: int) -> tuple:
        return size, op_fingerprint(), self.step.digests is not None

    def has(self, size: int) -> bool:
        """Whether a graph of this size is captured for the dispatch in force now."""
        return self._key(size) in self.graphs

    def run(self, meta_host: torch.Tensor) -> Outputs:
        """meta_host [4, Bp] int64 (pinned) -> (logits [Bp, V], sampled [2, Bp], words or None) of the
        replay; `first_replay` says whether it was this graph's first (its words are checked then)."""
        size = meta_host.shape[1]
        key = self._key(size)
        entry = self.graphs.get(key) or self._capture(size, key)
        if self.stale_input and entry.replays:
            entry.meta[1:].copy_(meta_host[1:], non_blocking=True)      # the fault: ids left stale
        else:
            entry.meta.copy_(meta_host, non_blocking=True)
        entry.replay()
        self.first_replay = entry.replays == 0
        entry.replays += 1
        self.replays += 1
        return entry.logits, entry.sampled, entry.words
