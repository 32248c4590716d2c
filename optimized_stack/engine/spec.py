"""Speculative decoding with exact KDA rollback: n-gram drafter (or the trained draft model of
drafter_model.py, engine option drafter="model"), greedy verification and two rollback strategies.

A decode step of a greedy request with drafts d_1..d_m runs [t_last, d_1..d_m] in one
forward (m+1 rows). By row-stability row i is bit-identical to the row a one-token decode
step would give after the same prefix, and the model's KDA state after the call equals the
state after m+1 single steps. Greedy acceptance keeps d_1..d_j while each equals the argmax
of the row before it, then emits the argmax of row j (the bonus). With e the number of
tokens emitted (cut further at a stop token or max_new_tokens), the request's state must
hold exactly the first e verified tokens: MLA rows e.. are simply never committed (the
store writes rows [start, start+e) only), and the KDA state is rolled back:

- copy_states: the recurrence keeps the state after every verified token (m+1 copies per
  layer, as the vLLM-style baseline keeps per-draft state slots); pick copy e.
- replay_ssm: one checkpoint (the state before the step: the pool slot, untouched until
  commit) plus, per verified token, the (k, u, g) the recurrence used; rebuild by
  replaying the first e tokens with the very same sequential update and the stored gates.
  Under a decode kernel (fla's fused_recurrent_kda on the GPU profile, or a kernel toggle)
  the sequential update is the kernel's own arithmetic, so both strategies verify with that
  kernel, and replay reruns it on the stored (q, k, v, g, beta) of the kept tokens: the same
  kernel on the same inputs, the stored gates reused.
Both compact the conv windows to the accepted tokens: the window after e tokens is rows
e .. e+W-2 of [old window; pre-conv inputs of the verified tokens].

Recording uses a forward pre-hook on each KDA layer (the segment's input and its state
object, so the pre-conv projections can be recomputed: the same op on the same rows gives
the same bits) and the `kda_prefill` / `kda_decode` op slots swapped for one that runs `kda_recurrent_trace` (the same
arithmetic as the reference recurrence) for the segments being verified.

Shape letters: T verified tokens (1 + drafts), H heads, K key dim, V value dim, C = H*K,
W conv taps.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..config import KDA
from ..kernels.kda.chunked import kda_chunked
from ..model import ops
from ..model.kda import KDATrace, kda_recurrent_trace, kda_replay, kda_scan
from ..model.model import K3Model, RequestState
from ..model.ops import OPS
from ..events import Events
from .drafter_model import ModelDrafter
from .options import EngineOptions
from .scheduler import Request
from .spec_sampling import verify_sampled


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the last n tokens
    (n = max_n .. min_n) and propose the tokens that followed it. No model."""

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: expected 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            tail = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):     # most recent match first
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []


@dataclass
class SpecStats:
    verify_steps: int = 0            # request-steps that verified at least one draft
    drafted: int = 0                 # draft tokens scored
    accepted: int = 0                # draft tokens accepted (the bonus token not counted)
    emitted: int = 0                 # tokens emitted by verification steps (accepted + bonus)
    rollbacks: int = 0               # verifications that kept fewer tokens than they ran
    partial_rollbacks: int = 0       # ... and kept at least one draft (rollback past t_last)

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per verification step."""
        return self.accepted / self.verify_steps if self.verify_steps else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted + bonus)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0


@dataclass
class _Layer:
    """What one KDA layer recorded for one request during a verification forward."""

    checkpoint: torch.Tensor                       # recurrent state before the step [H, K, V]
    windows: tuple[torch.Tensor, ...]              # conv windows before the step, 3 x [W-1, C]
    inputs: tuple[torch.Tensor, ...]               # pre-conv q, k, v projections, 3 x [T, C]
    x: torch.Tensor | None = None                  # the layer input (gate-recompute mutant only)
    qvb: tuple[torch.Tensor, ...] = ()             # q, v, beta (closed-form mutant only)
    trace: KDATrace | None = None
    window_copies: tuple[torch.Tensor, ...] = ()   # copy_states: 3 x [T, W-1, C]
    decode: object = None                          # the decode kernel verified with (None: the CPU recurrence)


@dataclass
class Record:
    layers: dict[int, _Layer] = field(default_factory=dict)


class Speculator:
    def __init__(self, model: K3Model, opts: EngineOptions, events: Events | None = None):
        assert opts.speculative is not None
        self.model, self.opts = model, opts
        self.events = events if events is not None else Events()
        self.strategy = opts.speculative
        self.k = opts.num_draft_tokens
        self.faults = opts.faults
        self.drafter = (ModelDrafter.for_target(model, opts.drafter_checkpoint, self.events, faults=opts.faults)
                        if opts.drafter == "model" else NgramDrafter())
        self.stats = SpecStats()
        self.kda_layers = {layer.index: layer.self_attn for layer in model.model.layers if layer.kind == KDA}
        self._credit: dict[str, float] = {}        # forced acceptance: fractional tokens owed

    # ---- drafting ---------------------------------------------------------------------
    def propose(self, requests: list[Request]) -> None:
        """Set req.draft for every greedy request about to decode; clear it for the rest."""
        if isinstance(self.drafter, ModelDrafter):
            self._propose_with_model(requests)
            return
        for req in requests:
            req.draft = self._draft(req) if self._eligible(req) else []

    def _propose_with_model(self, requests: list[Request]) -> None:
        """The draft model drafts every eligible request in one batch (one small forward per draft)."""
        assert isinstance(self.drafter, ModelDrafter)
        self.drafter.forget_except({req.request_id for req in requests})
        ready = [req for req in requests if self._eligible(req)]
        for req in requests:
            req.draft = []
        drafts = self.drafter.propose_many([(req.request_id, req.tokens, self._room(req)) for req in ready])
        for req, draft in zip(ready, drafts):
            req.draft = self._filled(req, draft, self._room(req))

    def watching(self, segments: list[tuple[Request, int, int]]):
        """Context for one forward over segments (request, start, end): the draft model keeps the
        final-norm rows it drafts from (nothing for prompt lookup), of the requests that may still
        draft after this forward: greedy (or sampled, with spec_sampled), with room for a draft after the
        token it emits."""
        if not isinstance(self.drafter, ModelDrafter):
            return contextlib.nullcontext()
        wanted = {req.request_id for req, _, _ in segments
                  if (req.params.temperature == 0 or self.opts.spec_sampled)
                  and req.params.max_new_tokens - len(req.generated) >= 3}
        return self.drafter.watching([(req.request_id, a, b) for req, a, b in segments], self.k + 2, wanted)

    def _room(self, req: Request) -> int:
        # never verify past max_new_tokens: a step emits at most len(draft) + 1 tokens
        return min(self.k, req.params.max_new_tokens - len(req.generated) - 1)

    def _filled(self, req: Request, draft: list[int], k: int) -> list[int]:
        if self.opts.forced_acceptance is not None and k > 0:
            # timing mode: always score k drafts (the filler only has to be a valid id)
            draft = draft + [req.tokens[-1]] * (k - len(draft))
        return draft

    def _eligible(self, req: Request) -> bool:
        return (req.status == "running" and req.pending == 1 and not req.skip_generated
                and (req.params.temperature == 0 or self.opts.spec_sampled))

    def _draft(self, req: Request) -> list[int]:
        k = self._room(req)
        if k <= 0:
            return []
        return self._filled(req, self.drafter.propose(req.tokens, k), k)

    # ---- recording ----------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, batch: list[tuple[Request, RequestState]]) -> Iterator[dict[Request, Record]]:
        """During one forward_batch: record, for every segment whose request verifies drafts,
        each KDA layer's checkpoint, conv inputs and recurrence trace."""
        owner = {id(kst): (req, layer) for req, st in batch if req.draft for layer, kst in st.kda.items()}
        records: dict[Request, Record] = {req: Record() for req, _ in batch if req.draft}
        if not records:
            yield records
            return
        keep_states = self.strategy == "copy_states"
        keep_x = "mut_spec_gate_recompute" in self.faults
        keep_qvb = "mut_spec_replay_closed_form" in self.faults
        current: list[_Layer | None] = [None]
        # unrecorded segments keep whatever the op table held (a prefill or decode kernel toggle)
        outer = {1: OPS.kda_decode, 0: OPS.kda_prefill}

        def passthrough(q, k, v, g, beta, state):
            return (outer[int(q.shape[0] == 1)] or kda_scan)(q, k, v, g, beta, state)

        def pre_hook(module, args):
            x, kst = args
            current[0] = None
            hit = owner.get(id(kst))
            if hit is None:
                return
            req, layer = hit
            lin = OPS.linear          # the same op and rows as KDAttention.qkv: the same bits
            inputs = tuple(lin(x, w) for w in (module.q_proj.weight, module.k_proj.weight, module.v_proj.weight))
            rec = _Layer(kst.recurrent, (kst.conv_q, kst.conv_k, kst.conv_v), inputs, x if keep_x else None)
            if keep_states:
                rec.window_copies = tuple(_windows_after_each(w, i) for w, i in zip(rec.windows, inputs))
            records[req].layers[layer] = rec
            current[0] = rec

        def scan(q, k, v, g, beta, state):
            rec, current[0] = current[0], None
            if rec is None:
                return passthrough(q, k, v, g, beta, state)
            decode = outer[1]
            if decode is None and not q.is_cuda:
                # the reference decode is the CPU recurrence: trace it (k, u, g per token)
                o, final, rec.trace = kda_recurrent_trace(q, k, v, g, beta, state, keep_states=keep_states)
                if keep_qvb:
                    rec.qvb = (q, v, beta)
                return o, final
            # a decode kernel (fla's on the GPU profile): verify with that very kernel, one
            # token per call for copy_states (the state after each), one call for replay (fla:
            # T tokens in one call == T one-token calls); replay reruns it on the kept inputs
            rec.decode = decode or kda_scan
            rec.qvb = (q, v, beta)
            if keep_states:
                outs, states, st = [], [], state
                for t in range(q.shape[0]):
                    o_t, st = rec.decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], st)
                    outs.append(o_t)
                    states.append(st.clone())
                rec.trace = KDATrace(k, torch.empty(0), g, torch.stack(states))
                return torch.cat(outs), st
            o, final = rec.decode(q, k, v, g, beta, state)
            rec.trace = KDATrace(k, torch.empty(0), g)
            return o, final

        handles = [m.register_forward_pre_hook(pre_hook) for m in self.kda_layers.values()]
        try:
            # the pre-hooks record each segment's own KDA call: no KDA layer over all segments at once
            with ops.override(kda_prefill=scan, kda_decode=scan, kda_segments=None):
                yield records
        finally:
            for h in handles:
                h.remove()

    # ---- verification -------------------------------------------------------------------
    def accept(self, req: Request, rows: torch.Tensor) -> list[int]:
        """rows [1 + len(draft), V] -> the tokens this step emits (accepted drafts + bonus),
        before any stop / length cut. A sampled request (spec_sampled) is verified by rejection
        sampling (spec_sampling.py): distributed as plain sampling, not bit-identical to it."""
        draft = req.draft
        if req.params.temperature > 0:
            # rejection sampling against a point-mass q (the prompt-lookup drafter is deterministic)
            m, emitted = verify_sampled(rows, draft, req.params.temperature, req.sampler.generator,
                                        faults=self.faults)
            self.events.fire("spec_sampled_accept_all" if m == len(draft) else
                             "spec_sampled_reject_all" if m == 0 else "spec_sampled_accept_partial")
            self._count(len(draft), m)
            return emitted
        target = [req.sampler.sample(rows[i]) for i in range(rows.shape[0])]
        if self.opts.forced_acceptance is not None:
            credit = self._credit.get(req.request_id, 0.0) + self.opts.forced_acceptance - 1
            m = min(int(credit), len(draft))
            self._credit[req.request_id] = credit - m
        else:
            m = 0
            while m < len(draft) and draft[m] == target[m]:
                m += 1
            if draft:                        # what verification found (before any seeded fault)
                self.events.fire("spec_accept_all" if m == len(draft) else
                                 "spec_reject_all" if m == 0 else "spec_accept_partial")
            if "mut_spec_accept_off_by_one" in self.faults and m < len(draft):
                m += 1                       # the first rejected draft is kept too
        self._count(len(draft), m)
        if "mut_spec_bonus_off_by_one" in self.faults and draft and m == len(draft):
            return draft[:m] + [target[m - 1]]      # the bonus read from the row before the last
        return draft[:m] + [target[m]]

    def _count(self, drafted: int, accepted: int) -> None:
        self.stats.verify_steps += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.emitted += accepted + 1

    def rollback(self, req: Request, st: RequestState, record: Record, kept: int) -> None:
        """Leave in st.kda the state after the first `kept` verified tokens (1 <= kept <= T)."""
        t_len = 1 + len(req.draft)
        assert 1 <= kept <= t_len, f"rollback to {kept} of {t_len} verified tokens"
        if kept == t_len:
            return                              # everything verified was accepted: state is final
        self.stats.rollbacks += 1
        self.stats.partial_rollbacks += int(kept > 1)
        for layer, kst in st.kda.items():
            rec = record.layers[layer]
            assert rec.trace is not None, f"KDA layer {layer} ran without the recording scan"
            if self.strategy == "copy_states":
                assert rec.trace.states is not None
                kst.recurrent = rec.trace.states[kept - 1]
                windows = tuple(c[kept - 1] for c in rec.window_copies)
            else:
                kst.recurrent = self._replay(layer, rec, kept)
                windows = tuple(_compact(w, i, kept) for w, i in zip(rec.windows, rec.inputs))
            if "mut_spec_conv_not_compacted" not in self.faults:
                kst.conv_q, kst.conv_k, kst.conv_v = windows

    def _replay(self, layer: int, rec: _Layer, kept: int) -> torch.Tensor:
        tr = rec.trace
        assert tr is not None
        k, u, g = tr.k[:kept], tr.u[:kept], tr.g[:kept]
        if "mut_spec_gate_recompute" in self.faults:
            # the seeded fault: recompute the gate from the layer input on torch's plain fp32
            # GEMM over the whole verify batch instead of reusing the stored values (fp32 out,
            # not rounded to the activations' dtype: on the bf16 GPU profile a rounded recompute
            # would hit the same bits and the fault would be void, as measured on the H200)
            assert rec.x is not None
            with ops.override(linear=_fp32_linear):
                g, _ = self.kda_layers[layer].gates(rec.x)
            g = g[:kept]
        if "mut_spec_replay_closed_form" in self.faults:
            # the seeded fault: the chunked closed form (cumulative gates, one triangular
            # solve) over the accepted tokens, equal to the recurrence only to rounding
            q, v, beta = (t[:kept] for t in rec.qvb)
            return kda_chunked(q, k, v, g, beta, rec.checkpoint)[1]
        if rec.decode is not None:              # a decode kernel: rerun it on the kept inputs
            q, v, beta = (t[:kept] for t in rec.qvb)
            return rec.decode(q, k, v, g, beta, rec.checkpoint)[1]
        return kda_replay(rec.checkpoint, k, u, g)


def _fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch's GEMM in fp32, output not rounded back (the gate-recompute fault's linear)."""
    return torch.nn.functional.linear(x.float(), weight.float())


def _compact(window: torch.Tensor, inputs: torch.Tensor, kept: int) -> torch.Tensor:
    """Conv window [W-1, C] after the first `kept` of the inputs [T, C] (causal_conv keeps
    the last W-1 rows of [window; inputs])."""
    taps_1 = window.shape[0]
    xs = torch.cat([window.to(inputs.dtype), inputs], 0)           # [W-1+T, C]
    return xs[kept:kept + taps_1].clone()


def _windows_after_each(window: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """copy_states: the conv window after every verified token -> [T, W-1, C]."""
    return torch.stack([_compact(window, inputs, t + 1) for t in range(inputs.shape[0])])


def kda_state_bytes(num_layers: int, heads: int, head_dim: int, conv_taps: int, k: int | None,
                    strategy: str | None) -> int:
    """fp32 KDA bytes per request: the live state plus what the strategy keeps for a step
    of k drafts (T = k + 1 verified tokens). Per layer: recurrent H*K*V, conv 3*(W-1)*H*K.
    - None (no speculation): the live state.
    - copy_states: T states (recurrent + conv windows), one per verified position; the
      picked copy becomes the live state.
    - replay_ssm: the live state, one checkpoint (recurrent + conv windows), and per
      verified token k [H, K], u [H, V], g [H, K] and the 3 pre-conv inputs [C] each."""
    c = heads * head_dim
    state = heads * head_dim * head_dim + 3 * (conv_taps - 1) * c
    if strategy is None:
        per_layer = state
    else:
        assert k is not None
        t = k + 1
        if strategy == "copy_states":
            per_layer = t * state
        elif strategy == "replay_ssm":
            per_layer = 2 * state + t * (3 * c + 3 * c)
        else:
            raise ValueError(f"strategy: expected None, 'copy_states' or 'replay_ssm', got {strategy!r}")
    return 4 * num_layers * per_layer
