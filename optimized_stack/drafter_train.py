"""Distil a draft head (engine/drafter_model.py) from a frozen target: teacher pass, loop, metric.

    teacher = teacher_pass(target, rows)               # ids [N, T] -> hidden, logits, ids
    head = fit_head(target, teacher, DrafterLoop(...), say=print)
    expected_acceptance(head, target, held_out, k=3)   # teacher-forced proxy of acceptance length

The data (which text) is the caller's (scripts/train_drafter.py): optimized_stack never
imports k3verify. The loop trains exactly what the engine runs (drafter_model.rollout): k
steps, each fed the head's own predicted state (not the target's), so the errors of draft 1
are in the input of draft 2 during training as they are in service. Loss per step: KL from
the target's next-token distribution to the head's (the target's lm_head over the predicted
state), plus a small smooth-L1 pull of the predicted state toward the target's state.

Shape letters: N rows, T positions, D hidden, V vocab, B sampled start positions.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .engine.drafter_model import DraftHead, DrafterConfig
from .errors import K3Error
from .train import SeqOps, train_forward


@dataclass
class DrafterLoop:
    k: int = 3                     # drafts unrolled per sample (the engine's num_draft_tokens)
    inner_size: int = 512
    steps: int = 1500
    batch: int = 512               # start positions per step
    lr: float = 2e-3
    weight_decay: float = 0.01
    feature_weight: float = 0.1    # smooth-L1 on the predicted state, beside the KL
    decay: float = 0.8             # loss weight of draft j+1 relative to draft j
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 1 or self.steps < 1 or self.batch < 1 or self.inner_size < 1 or not self.lr > 0:
            raise K3Error(f"drafter loop: expected k, steps, batch, inner_size >= 1 and lr > 0, got {self}")


@dataclass
class Teacher:
    ids: torch.Tensor              # [N, T] token ids
    valid: torch.Tensor            # [N, T] bool: a real token (not padding)
    hidden: torch.Tensor           # [N, T, D] the target's final-norm state at each position
    logits: torch.Tensor           # [N, T, V] the target's logits at each position (row t predicts t+1)


@torch.no_grad()
def teacher_pass(target, ids: torch.Tensor, valid: torch.Tensor, chunk_rows: int = 8) -> Teacher:
    """The target's final-norm states and logits over ids [N, T] (teacher-forced, batched)."""
    ops = SeqOps("cpu", kda="chunk")
    hidden, logits = [], []
    seen: list[torch.Tensor] = []
    handle = target.model.norm.register_forward_hook(lambda m, i, out: seen.append(out))
    try:
        for a in range(0, ids.shape[0], chunk_rows):
            part = ids[a:a + chunk_rows]
            seen.clear()
            lg = train_forward(target, part, ops)                        # [n, T, V]
            hidden.append(seen[-1].view(part.shape[0], part.shape[1], -1).float())
            logits.append(lg.float())
    finally:
        handle.remove()
    return Teacher(ids, valid, torch.cat(hidden), torch.cat(logits))


def _starts(teacher: Teacher, k: int) -> torch.Tensor:
    """Every (row, t) with real tokens at t .. t+k: a start h_t and k drafts to score -> [M, 2]."""
    v = teacher.valid
    ok = v[:, :v.shape[1] - k].clone()
    for j in range(1, k + 1):
        ok &= v[:, j:v.shape[1] - k + j]
    return ok.nonzero()


def _unroll(head: DraftHead, target, teacher: Teacher, at: torch.Tensor, k: int):
    """Predicted states and draft logits for k steps from the starts `at` [B, 2]."""
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    r, t = at[:, 0], at[:, 1]
    h = teacher.hidden[r, t]                                              # [B, D]
    out = []
    for j in range(1, k + 1):
        h = head(h, F.embedding(teacher.ids[r, t + j], embed))            # state at t+j
        out.append((h, F.linear(h, lm_head), teacher.hidden[r, t + j], teacher.logits[r, t + j]))
    return out


def fit_head(target, teacher: Teacher, loop: DrafterLoop, say: Callable[[str], None] = print) -> DraftHead:
    torch.manual_seed(loop.seed)
    cfg = DrafterConfig(target.config.hidden_size, target.config.vocab_size, loop.inner_size)
    head = DraftHead(cfg)
    for p in target.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=loop.lr, weight_decay=loop.weight_decay)
    starts = _starts(teacher, loop.k)
    if starts.shape[0] == 0:
        raise K3Error(f"drafter training: no row holds {loop.k + 1} real tokens in a row")
    gen = torch.Generator().manual_seed(loop.seed)
    t0 = time.monotonic()
    for step in range(loop.steps):
        lr = loop.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / loop.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        at = starts[torch.randint(starts.shape[0], (loop.batch,), generator=gen)]
        loss, hits = torch.zeros(()), []
        for j, (h, row, h_ref, row_ref) in enumerate(_unroll(head, target, teacher, at, loop.k)):
            kl = F.kl_div(F.log_softmax(row, -1), F.log_softmax(row_ref, -1), log_target=True,
                          reduction="batchmean")
            feat = F.smooth_l1_loss(h, h_ref)
            loss = loss + loop.decay ** j * (kl + loop.feature_weight * feat)
            hits.append((row.argmax(-1) == row_ref.argmax(-1)).float().mean().item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == loop.steps - 1:
            say(f"step {step:5d} loss {loss.item():.4f} top1 per draft "
                + " ".join(f"{x:.3f}" for x in hits) + f" lr {lr:.2e} {time.monotonic() - t0:.0f}s")
    return head.eval()


@torch.no_grad()
def expected_acceptance(head: DraftHead, target, teacher: Teacher, k: int) -> dict[str, float]:
    """Teacher-forced proxy of the engine's acceptance length on held-out rows: 1 + sum over j of
    P(drafts 1..j all equal the target's argmax), with the head's own states fed back (its tokens
    are the text's, not its drafts: a proxy, the engine measures the real thing)."""
    at = _starts(teacher, k)
    steps = _unroll(head, target, teacher, at, k)
    alive = torch.ones(at.shape[0], dtype=torch.bool)
    per_draft, length = [], 1.0
    for h, row, _, row_ref in steps:
        same = row.argmax(-1) == row_ref.argmax(-1)
        per_draft.append(same.float().mean().item())
        alive &= same
        length += alive.float().mean().item()
    return {"positions": int(at.shape[0]), "acceptance_length_tf": length,
            **{f"top1_draft{j + 1}": x for j, x in enumerate(per_draft)}}
