"""Run a scenario under tensor parallelism (world size W) and capture it on rank 0.

The same observer calls as the sequential runner (run/sequential.py): every request alone in
arrival order, whole-prompt prefill, one token per step, greedy or seeded sampling,
teacher forcing with `force`. Every rank runs the loop; rank 0 samples and broadcasts
the token (what a TP engine's driver does, so ranks can never part), gathers the KDA
head shards to full [H, K, V] states and conv windows, and the MLA rows (DCP shards
re-interleaved), and feeds its Capture. The capture records non-finite items like the
sequential runner's; a row the sampler refuses (NaN / +inf) stops the run on every rank
at the same point (the logits are all-gathered, so every rank's sampler sees the same row
before the broadcast), and rank 0's capture says so in `stopped`.

    with TPRunner(model, world_size=2) as tp:          # W ranks, started once
        ref = tp.run(scenario, ())                        # TP without toggles
        cand = tp.run(scenario, ("tp_dedup_router",))
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from k3verify.capture.capture import Capture
from k3verify.run.sequential import generate
from optimized_stack import toggles as toggle_registry
from optimized_stack.engine.sampler import NonFiniteLogits
from optimized_stack.errors import K3Error
from optimized_stack.parallel import RankContext, RankPool, TPModel, TPOptions


@dataclass
class _Result:
    prompt_ids: list[int]
    tokens: list[int]
    finish_reason: str


def _init(ctx: RankContext, model) -> None:
    if isinstance(model, str):          # a preset or directory: each rank loads its own copy
        from optimized_stack import load_model
        model = load_model(model)
    ctx.state["model"] = model.to(ctx.device)


def _job(ctx: RankContext, scenario, toggle_names: tuple[str, ...], keep: bool,
         force: dict[str, list[int]] | None) -> Capture | None:
    """On every rank: apply the toggles, run the scenario; rank 0 returns the capture."""
    with toggle_registry.applied(list(toggle_names)) as applied:
        if applied.engine:
            raise K3Error(f"toggles {', '.join(toggle_names)} set engine options; the TP runner "
                          "runs the reference loop only")
        tp = TPModel(ctx.state["model"], ctx.comm, TPOptions.from_runner(applied.runner), ctx.device)
        cap = Capture(keep=keep, label="+".join(toggle_names) or f"tp{ctx.world_size}-reference")
        observers = [cap] if ctx.rank == 0 else []
        try:
            _run(tp, scenario, observers, force)
        except NonFiniteLogits as exc:       # raised on every rank before any collective
            cap.stopped = str(exc)
        cap.events = dict(tp.events + applied.events)
    return cap if ctx.rank == 0 else None


def _emit_state(tp: TPModel, observers, rid: str, st) -> None:
    full = tp.gather_kda(st)                    # a collective: every rank, every time
    for layer, kst in full.items():
        for ob in observers:
            ob.on_kda_state(rid, st.num_tokens, layer, kst)


def _run(tp: TPModel, scenario, observers, force) -> None:
    eos = tp.config.eos_token_id
    ordered = sorted(scenario.requests, key=lambda r: (r.arrival_step, scenario.requests.index(r)))
    for req in ordered:
        rid, prompt = req.request_id, list(req.prompt_ids)
        for ob in observers:
            ob.on_request(rid, len(prompt))
        st = tp.new_state()
        rows = tp.forward(torch.tensor(prompt, dtype=torch.long), st)
        for ob in observers:
            ob.on_logits(rid, 0, rows.cpu())
        last = rows[-1].cpu()
        _emit_state(tp, observers, rid, st)
        def step(tok: int) -> torch.Tensor:
            rows = tp.forward(torch.tensor([tok]), st)
            for ob in observers:
                ob.on_logits(rid, st.num_tokens - 1, rows.cpu())
            _emit_state(tp, observers, rid, st)
            return rows[-1].cpu()

        def agree(tok: int) -> int:         # rank 0's choice, so every rank feeds the same token
            return int(tp.comm.broadcast(torch.tensor([tok], device=tp.device))[0])
        tokens, reason = generate(req, last, step, eos, (force or {}).get(rid), agree)
        mla = {i: t.cpu() for i, t in tp.gather_mla(st).items()}
        for ob in observers:
            ob.on_finish(rid, _Result(prompt, tokens, reason), mla)


class TPRunner:
    """W ranks holding the model, started once; `run` captures one scenario on them.

    `model` is a K3Model (sent to the ranks) or a preset / directory each rank loads. The
    ranks are spawned: a script that starts them needs the `if __name__ == "__main__":`
    guard, or every rank re-runs it.
    """

    def __init__(self, model, world_size: int, *, backend: str = "gloo"):
        self.world_size = world_size
        self.pool = RankPool(world_size, init=_init, init_args=(model,), backend=backend)

    def run(self, scenario, toggle_names: tuple[str, ...] | list[str] = (), *, keep: bool = False,
            force: dict[str, list[int]] | None = None) -> Capture:
        for name in toggle_names:
            t = toggle_registry.get(name)
            if self.world_size not in t.world_sizes:
                raise K3Error(f"toggle {name!r} runs at world sizes {t.world_sizes}, not {self.world_size}")
        return self.pool.run(_job, scenario, tuple(toggle_names), keep, force)

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> "TPRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_scenario_tp(model, scenario, toggle_names: tuple[str, ...] | list[str] = (), *, world_size: int = 2,
                    keep: bool = False, force: dict[str, list[int]] | None = None,
                    backend: str = "gloo") -> Capture:
    """One scenario on W fresh ranks (starts and stops them: use TPRunner for several)."""
    with TPRunner(model, world_size, backend=backend) as tp:
        return tp.run(scenario, toggle_names, keep=keep, force=force)
