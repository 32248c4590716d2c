"""Model-side training of a K3 preset: batched training forward, masked loss, AdamW loop.

The model is `init_model(preset_config(preset), seed)` (or a checkpoint directory), the very
modules of the reference path; the trained parameters are written with `save_checkpoint`, so
they load into the reference model unchanged. Training runs a batched forward
(`train_forward`) that walks the same layers with a batch dim: per-token work reuses the
modules' own methods (KDA gates and output, MLA queries / cache rows / decompress, AttnRes
mix, norms, GLU, router), and only the sequence ops differ: a chunked KDA in plain torch (or
fla's chunk_kda) and torch SDPA. tests/test_train.py checks it against `K3Model.logits`.

This module knows nothing about tasks or data sets: `fit` takes an iterator of steps, each a
dict part name -> (ids [B, T], loss mask [B, T]). The entry point that builds the k3-mini
data (gsm8k-synth, needle) from k3verify's generators is scripts/train_k3mini.py; this
package never imports k3verify.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import file_sha256, load_weights, read_state_dict, save_checkpoint
from .config import K3Config
from .errors import CheckpointError, K3Error
from .kernels.kda.chunked import kda_chunk_torch
from .kernels.kda.fla import kda_chunk_batched
from .kernels.kda.recurrent import kda_recurrent_batched
from .kernels.mla.sdpa import sdpa_causal
from .model.attn_res import AttnResRead
from .model.model import K3Model
from .model.ops import l2_norm, rms_norm, situ, swiglu
from .presets import PAD_ID, init_model, preset_config
from .tokenizer import ByteTokenizer

OPTIM_FILE = "optim.pt"    # AdamW state next to the weights, for --init resume


@dataclass
class LoopConfig:
    """What the optimisation loop needs; a data entry point extends it with its own fields."""
    out: str
    minutes: float = 6.0
    preset: str = "k3-mini"
    seed: int = 0
    device: str = "cuda"
    lr: float = 3e-3
    min_lr_frac: float = 0.05
    warmup_steps: int = 150
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    bias_update: float = 1e-3      # aux-loss-free router balancing step
    max_steps: int = 0             # 0: until the time is up
    eval_every_s: float = 120.0    # also how often a partial checkpoint is written
    kda: str = "chunk"             # chunk (plain torch) | fla (chunk_kda) | recurrent
    amp: bool = True
    init: str = ""                 # start from this checkpoint dir (weights, and optim.pt if there)

    def __post_init__(self):
        if self.minutes <= 0 or self.lr <= 0 or self.warmup_steps < 1:
            raise K3Error(f"train config: expected positive minutes, lr and warmup_steps; "
                          f"got {self.minutes}, {self.lr}, {self.warmup_steps}")
        if self.kda not in ("chunk", "fla", "recurrent"):
            raise K3Error(f"--kda must be chunk, fla or recurrent, got {self.kda!r}")


# ---- the batched training forward -----------------------------------------------------

def _causal_conv(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over T, zero history, same tap order as kda.causal_conv. y [B, T, C]."""
    taps, t_len = weight.shape[-1], y.shape[1]
    yp = F.pad(y, (0, 0, taps - 1, 0))
    out = yp[:, 0:t_len] * weight[:, 0, 0]
    for j in range(1, taps):
        out = out + yp[:, j:j + t_len] * weight[:, 0, j]
    return out


class SeqOps:
    """The sequence ops of the batched forward: KDA scan and causal attention."""

    def __init__(self, device: str, kda: str = "chunk", amp: bool = False):
        on_gpu = torch.device(device).type == "cuda"
        self.kda_kind = kda
        self.dtype = torch.bfloat16 if (amp and on_gpu) else torch.float32
        self.loads: list[torch.Tensor] | None = None   # router loads, when balancing

    def kda(self, q, k, v, g, beta):
        if self.kda_kind == "fla":     # fla's Triton kernels: minutes of compile on a fresh box
            return kda_chunk_batched(q, k, v, g, beta, io_dtype=self.dtype)
        if self.kda_kind == "chunk":
            return kda_chunk_torch(q, k, v, g, beta)
        return kda_recurrent_batched(q, k, v, g, beta)

    def attend(self, q, k, v, scale):
        return sdpa_causal(q.to(self.dtype), k.to(self.dtype), v.to(self.dtype), scale).float()


def _kda_layer(attn, x: torch.Tensor, b: int, t: int, ops: SeqOps) -> torch.Tensor:
    cfg = attn.cfg
    h, kd = cfg.kda_num_heads, cfg.kda_head_dim

    def branch(proj, conv):
        y = _causal_conv(F.linear(x, proj.weight).view(b, t, -1), conv.weight)
        return F.silu(y).view(b, t, h, kd)

    q = l2_norm(branch(attn.q_proj, attn.q_conv1d).float()) * kd ** -0.5
    k = l2_norm(branch(attn.k_proj, attn.k_conv1d).float())
    v = branch(attn.v_proj, attn.v_conv1d).float()
    g, beta = attn.gates(x)                                   # per token: [N, H, K], [N, H]
    o = ops.kda(q, k, v, g.view(b, t, h, kd), beta.view(b, t, h))
    return attn.output(x, o.reshape(b * t, h, -1))


def _mla_layer(attn, x: torch.Tensor, b: int, t: int, ops: SeqOps) -> torch.Tensor:
    cfg = attn.cfg
    h, c, vd = cfg.num_heads, cfg.qk_head_dim, cfg.v_head_dim
    q = attn.queries(x).view(b, t, h, c)
    k, v = attn.decompress(attn.cache_rows(x).float())
    o = ops.attend(q, k.view(b, t, h, c), v.view(b, t, h, vd), c ** -0.5).reshape(b * t, h, vd)
    if cfg.mla_output_gate:
        o = o * torch.sigmoid(F.linear(x, attn.g_proj.weight).float()).view_as(o)
    return F.linear(o.reshape(b * t, -1).to(x.dtype), attn.o_proj.weight)


def _moe_dense(moe, x: torch.Tensor, ops: SeqOps) -> torch.Tensor:
    """MoE with every expert run on every row and unselected weights 0: the same sum as the
    reference's sparse loop (zero weight, zero gradient), without per-expert gathers."""
    cfg = moe.cfg
    with torch.autocast(x.device.type, enabled=False):
        idx, w = moe.gate(x.float())                           # router in fp32, as reference
    if ops.loads is not None:
        ops.loads.append(torch.bincount(idx.flatten(), minlength=cfg.num_experts))
    dense_w = torch.zeros(x.shape[0], cfg.num_experts, device=x.device).scatter(1, idx, w)
    latent = cfg.routed_expert_hidden_size is not None
    hid = F.linear(x, moe.routed_expert_down_proj.weight) if latent else x
    w1 = torch.stack([e.w1.weight for e in moe.experts])      # [E, M, De]
    w3 = torch.stack([e.w3.weight for e in moe.experts])
    w2 = torch.stack([e.w2.weight for e in moe.experts])      # [E, De, M]
    gate, up = torch.einsum("nd,emd->nem", hid, w1), torch.einsum("nd,emd->nem", hid, w3)
    act = (situ(gate, up, cfg.situ_beta, cfg.situ_linear_beta) if cfg.activation == "situ"
           else swiglu(gate, up))
    out = torch.einsum("nem,edm->ned", act, w2)
    y = (dense_w.unsqueeze(-1) * out.float()).sum(1).to(x.dtype)
    if latent:
        y = F.linear(rms_norm(y, moe.routed_expert_norm.weight, cfg.rms_norm_eps),
                     moe.routed_expert_up_proj.weight)
    if cfg.num_shared_experts:
        y = y + moe.shared_experts(x)
    return y


def train_forward(model, ids: torch.Tensor, ops: SeqOps) -> torch.Tensor:
    """ids [B, T] -> logits [B, T, V] fp32, each row a fresh request (grad enabled)."""
    cfg, m = model.config, model.model
    b, t = ids.shape
    eps, mix = cfg.rms_norm_eps, AttnResRead.mix
    x = m.embed_tokens(ids).reshape(b * t, -1)

    def mixer(layer, inp):
        fn = _kda_layer if layer.kind == "kda" else _mla_layer
        return fn(layer.self_attn, inp, b, t, ops)

    def ffn(layer, inp):
        if hasattr(layer, "block_sparse_moe"):
            return _moe_dense(layer.block_sparse_moe, inp, ops)
        return layer.mlp(inp)

    if cfg.attn_res_block_size is None:               # Kimi Linear: plain residual stream
        h = x
        for layer in m.layers:
            h = h + mixer(layer, layer.input_layernorm(h))
            h = h + ffn(layer, layer.post_attention_layernorm(h))
    else:                                             # the walk of K3Model._attn_res_stack
        snapshots, partial = [], x
        for layer in m.layers:
            h = (mix(snapshots + [partial], layer.self_attention_res_norm.weight,
                     layer.self_attention_res_proj.weight, eps) if snapshots else partial)
            if layer.index % cfg.attn_res_block_size == 0:
                snapshots.append(partial)
                partial = None
            a = mixer(layer, layer.input_layernorm(h))
            partial = a if partial is None else partial + a
            h = mix(snapshots + [partial], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps)
            partial = partial + ffn(layer, layer.post_attention_layernorm(h))
        h = mix(snapshots + [partial], m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, eps)
    h = m.norm(h)
    return F.linear(h, model.lm_head.weight).float().view(b, t, -1)


def masked_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor):
    """Mean CE over target positions (mask[t] = 1: token t is predicted from t-1);
    also per-row 'all targets argmax-correct' (teacher-forced = greedy exact match)."""
    lg, tgt, m = logits[:, :-1], ids[:, 1:], mask[:, 1:]
    ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1), reduction="none")
    loss = (ce.view_as(m) * m).sum() / m.sum().clamp(min=1)
    wrong = ((lg.argmax(-1) != tgt) & (m > 0)).sum(1)
    return loss, wrong == 0


def pad_batch(rows: list[tuple[list[int], list[float]]], length: int):
    """(ids, mask) rows -> ids [B, length] (PAD filled), mask [B, length]; longer rows are cut."""
    ids = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    for i, (r, m) in enumerate(rows):
        r, m = r[:length], m[:length]
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(m)] = torch.tensor(m)
    return ids, mask


# ---- model, optimizer, checkpoints ----------------------------------------------------

def build_model(cfg: LoopConfig) -> K3Model:
    """The preset's seeded init, or the checkpoint in cfg.init (its own config.json)."""
    if not cfg.init:
        return init_model(preset_config(cfg.preset), seed=cfg.seed)
    model = K3Model(K3Config.from_file(Path(cfg.init)))
    load_weights(model, read_state_dict(cfg.init))
    return model


def _param_groups(model, wd: float):
    decay, plain = [], []
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.requires_grad_(False)                  # selection only: balanced by loads instead
            continue
        matrix = p.ndim >= 2 and "embed" not in name and "_res_proj" not in name
        (decay if matrix else plain).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}]


def make_optimizer(model, cfg: LoopConfig) -> torch.optim.AdamW:
    """AdamW over _param_groups; with cfg.init holding optim.pt, its moments and step counts
    are restored (a resumed run continues the same optimizer, not a cold one)."""
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=torch.device(cfg.device).type == "cuda")
    path = Path(cfg.init) / OPTIM_FILE if cfg.init else None
    if path is not None and path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            opt.load_state_dict(state)
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{path}: expected the AdamW state of this model's parameter "
                                  f"groups, got one that does not fit ({exc})") from None
    return opt


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_model_dir(model, out: Path, run_config: dict, log_lines: list[str], metrics: dict,
                    provenance: dict, opt: torch.optim.Optimizer | None = None) -> dict:
    """config, safetensors, tokenizer, train config, log, metrics, manifest (sha256 of each
    listed file) and, with opt, optim.pt (not in the manifest: resume state, not the model)."""
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, out)                       # copies parameters to the CPU itself
    ByteTokenizer().save(out)
    _write(out / "train_config.json", json.dumps(run_config, indent=2) + "\n")
    _write(out / "train_log.txt", "\n".join(log_lines) + "\n")
    _write(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    if opt is not None:
        tmp = out / (OPTIM_FILE + ".tmp")
        torch.save(opt.state_dict(), tmp)
        os.replace(tmp, out / OPTIM_FILE)
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.suffix in (".json", ".txt", ".safetensors")
                   and p.name != "manifest.json")
    manifest = {"name": run_config.get("preset", out.name),
                "files": {f: file_sha256(out / f) for f in files}, "provenance": provenance}
    _write(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return manifest


@torch.no_grad()
def teacher_forced_eval(model, ops: SeqOps, batches) -> float:
    """Fraction of rows whose every target token is the argmax (= greedy reproduces it)."""
    hits, total = 0, 0
    for ids, mask in batches:
        ids, mask = ids.to(model.lm_head.weight.device), mask.to(model.lm_head.weight.device)
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ops.dtype == torch.bfloat16):
            _, ok = masked_loss(train_forward(model, ids, ops), ids, mask)
        hits, total = hits + int(ok.sum()), total + ok.numel()
    return hits / max(1, total)


# ---- the loop -------------------------------------------------------------------------

Step = dict[str, tuple[torch.Tensor, torch.Tensor]]


def lr_at(cfg: LoopConfig, step: int, frac: float) -> float:
    """Linear warmup over warmup_steps, then cosine to min_lr_frac * lr over the time budget."""
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * (
        cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def fit(model, opt: torch.optim.Optimizer, steps: Iterable[Step], cfg: LoopConfig, *,
        weights: dict[str, float] | None = None,
        on_progress: Callable[[float], None] | None = None,
        evaluate: Callable[[object, SeqOps], dict] | None = None,
        checkpoint: Callable[[dict], None] | None = None,
        say: Callable[[str], None] = print) -> dict:
    """Train until cfg.minutes (or cfg.max_steps) are spent; returns the final metrics.

    Each step's parts are forwarded and backpropagated one after another (the loss of part
    p scaled by weights[p], default 1), then one clipped AdamW step. on_progress(frac) gets
    the schedule's elapsed fraction (a curriculum reads it); evaluate(model, ops) runs every
    cfg.eval_every_s and at the end, each time followed by checkpoint(metrics).

    The run stops cfg.minutes after it starts, but the cosine, the curriculum and the evals'
    clock start after the first step: that step compiles the kernels (fla's chunk_kda with its
    backward: 272 s of a 450 s run on a fresh H100, 2026-12-07, whose cosine had decayed the
    peak rate to a third before the second step). The warmup counts steps, as before.
    """
    weights = weights or {}
    model.to(cfg.device).train()
    ops = SeqOps(cfg.device, cfg.kda, cfg.amp)
    ops.loads = [] if cfg.bias_update > 0 else None
    biases = [mod.gate.e_score_correction_bias for mod in model.modules() if hasattr(mod, "gate")
              and hasattr(mod.gate, "e_score_correction_bias")]
    amp = torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=ops.dtype == torch.bfloat16)
    budget = cfg.minutes * 60.0
    start = last_eval = time.time()
    deadline = start + budget
    schedule_start = None                   # set after the first step: its compile is not training
    tokens = step = 0
    window = (start, 0)

    def schedule_frac() -> float:
        if schedule_start is None:
            return 0.0
        return (time.time() - schedule_start) / max(1e-9, deadline - schedule_start)

    def run_eval() -> dict:
        model.eval()
        metrics = dict(evaluate(model, ops) if evaluate else {}, steps=step, tokens=tokens)
        say(f"eval step {step} " + " ".join(f"{k} {v:.3f}" for k, v in metrics.items()
                                            if isinstance(v, float)))
        model.train()
        return metrics

    for parts in steps:
        if time.time() >= deadline or (cfg.max_steps and step >= cfg.max_steps):
            break
        frac = schedule_frac()
        if on_progress:
            on_progress(frac)
        lr = lr_at(cfg, step, frac)
        for group in opt.param_groups:
            group["lr"] = lr
        losses, lengths = {}, {}
        for name, (ids, mask) in parts.items():
            with amp:
                ids = ids.to(cfg.device, non_blocking=True)
                mask = mask.to(cfg.device, non_blocking=True)
                loss, _ = masked_loss(train_forward(model, ids, ops), ids, mask)
            (weights.get(name, 1.0) * loss).backward()   # per part: frees its graph early
            losses[name], lengths[name] = loss.detach(), ids.shape[1]
            tokens += ids.numel()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ops.loads:
            with torch.no_grad():                    # aux-loss-free balancing (DeepSeek-V3 style)
                for bias, load in zip(biases, ops.loads):
                    bias += cfg.bias_update * torch.sign(load.float().mean() - load.float())
            ops.loads.clear()
        step += 1
        if step == 1:
            schedule_start = last_eval = time.time()     # no eval of a one-step model for the compile's sake
            say(f"first step (compile included) {schedule_start - start:.0f}s; the schedule spans the "
                f"{max(0.0, deadline - schedule_start):.0f}s left")
        if step % 50 == 0 or step == 1:
            now = time.time()
            tps = (tokens - window[1]) / max(1e-9, now - window[0])
            window = (now, tokens)
            say(f"step {step} t {now - start:.0f}s lr {lr:.2e} "
                + " ".join(f"loss_{n} {v.item():.4f}" for n, v in losses.items())
                + " " + " ".join(f"len_{n} {t}" for n, t in lengths.items())
                + f" gnorm {gnorm.item():.2f} tok/s {tps:.0f}")
        if time.time() - last_eval > cfg.eval_every_s:
            metrics = run_eval()
            if checkpoint:
                checkpoint(metrics)                  # partial result, in case the run is cut
            last_eval = time.time()
    total = time.time() - start
    metrics = run_eval()
    metrics.update(seconds=round(total, 1), tokens_per_s=round(tokens / max(total, 1e-9)))
    say(f"done steps {step} tokens {tokens} seconds {total:.0f} tok/s {tokens / max(total, 1e-9):.0f}")
    if checkpoint:
        checkpoint(metrics)
    return metrics
