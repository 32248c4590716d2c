"""Train a K3 preset (the embedded k3-mini) on gsm8k-synth and needle retrieval.

    python -m optimized_stack.train --out DIR --minutes M [--device cuda] [...]

The model is `init_model(preset_config(preset), seed)`, the very modules of the reference
path; the trained parameters are written with `save_checkpoint`, so they load into the
reference model unchanged. Training runs a batched forward (`train_forward`) that walks the
same layers with a batch dim: per-token work reuses the modules' own methods (KDA gates and
output, MLA queries / cache rows / decompress, AttnRes mix, norms, GLU, router), and only
the sequence ops differ: a chunked KDA in plain torch (or fla's chunk_kda) and torch SDPA. tests/test_train.py checks it against `K3Model.logits`.

Data (byte tokens, built here from k3verify's generators; never the held-out splits):
- gsm8k-synth train split as lm-eval's few-shot text, "Question: q\\nAnswer: a" joined by
  "\\n\\n", as many pairs as fit one row;
- needle cases (k3verify.evals.needle.make_case) with 0-3 distractors, then one extra
  question per distractor; lengths follow a curriculum 1K-2K -> ... -> 4K-32K.
Loss only on what the model must generate at eval time: every answer, the "\\n\\nQuestion:"
after it (where generation stops), and the needle values. Question text and haystack are
context: their numbers are random, so predicting them only spends a 1M-parameter budget.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import file_sha256, load_weights, read_state_dict, save_checkpoint
from .errors import K3Error
from .kernels import gpu_train_ops as gops
from .model.attn_res import AttnResRead
from .model.ops import l2_norm, override, plain_linear, rms_norm, situ, swiglu
from .presets import PAD_ID, init_model, preset_config
from .tokenizer import ByteTokenizer

CURRICULUM = ((0.25, (1024, 2048)), (0.5, (1024, 2048, 4096, 8192)),
              (0.75, (2048, 4096, 8192, 16384)), (1.01, (4096, 8192, 16384, 32768)))
NEEDLE_TAIL = 512          # room after the prompt for the answer and distractor questions
GSM_STOP = "\n\nQuestion:"  # trained after each answer: it is where eval generation stops


@dataclass
class TrainConfig:
    out: str
    minutes: float = 6.0
    preset: str = "k3-mini"
    seed: int = 0
    data_seed: int = 1000           # eval helpers use seeds 0..; training draws from 1000+
    device: str = "cuda"
    lr: float = 3e-3
    min_lr_frac: float = 0.05
    warmup_steps: int = 150
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    gsm_batch: int = 32
    gsm_len: int = 3072
    needle_tokens: int = 65536     # needle tokens per step (rows = tokens // length)
    needle_weight: float = 1.0
    bias_update: float = 1e-3      # aux-loss-free router balancing step
    workers: int = 6
    max_steps: int = 0             # 0: until the time is up
    eval_every_s: float = 120.0
    kda: str = "chunk"             # chunk (plain torch) | fla (chunk_kda) | recurrent
    amp: bool = True
    init: str = ""                 # start from this checkpoint directory
    needle_lengths: str = ""       # comma list: fixed needle lengths instead of CURRICULUM
    eval_needle_lengths: str = "4096,16384,32768"
    eval_gsm: int = 64             # held-out gsm prompts in the periodic teacher-forced eval

    def __post_init__(self):
        if self.minutes <= 0 or self.lr <= 0 or self.gsm_batch < 1 or self.gsm_len < 256:
            raise K3Error(f"train config: expected positive minutes/lr, gsm_batch >= 1, "
                          f"gsm_len >= 256; got {self.minutes}, {self.lr}, {self.gsm_batch}, {self.gsm_len}")
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
            return gops.kda_chunk_batched(q, k, v, g, beta, io_dtype=self.dtype)
        if self.kda_kind == "chunk":
            return gops.kda_chunk_torch(q, k, v, g, beta)
        return gops.kda_recurrent_batched(q, k, v, g, beta)

    def attend(self, q, k, v, scale):
        return gops.sdpa_causal(q.to(self.dtype), k.to(self.dtype), v.to(self.dtype), scale).float()


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


# ---- data -----------------------------------------------------------------------------

def _enc(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def gsm_row(rows, length: int) -> tuple[list[int], list[float]]:
    """Few-shot text of gsm8k rows as lm-eval renders it, as many pairs as fit `length`."""
    ids, mask = [], []
    for n, row in enumerate(rows):
        prefix = ("\n\n" if n else "") + f"Question: {row['question']}\nAnswer:"
        p, a = _enc(prefix), _enc(" " + row["answer"])
        if len(ids) + len(p) + len(a) > length:
            break
        stop = len(GSM_STOP) if n else 0            # the stop after the previous answer
        ids += p + a
        mask += [1.0] * stop + [0.0] * (len(p) - stop) + [1.0] * len(a)
    return ids, mask


def gsm_prompt(shots: list[dict], row: dict) -> str:
    """lm-eval's gsm8k prompt: the shots with their answers, then the question."""
    parts = [f"Question: {s['question']}\nAnswer: {s['answer']}" for s in shots]
    return "\n\n".join(parts + [f"Question: {row['question']}\nAnswer:"])


def needle_row(length: int, rng: random.Random) -> tuple[list[int], list[float]]:
    """A needle case, its answer, then one more question per distractor (all answers trained)."""
    from k3verify.evals import needle as nd

    case = nd.make_case(length, rng.random(), seed=rng.randrange(10**6, 10**9),
                        n_distractors=rng.choice((0, 0, 1, 2, 3)))
    ids, mask = _enc(case.prompt), [0.0] * len(_enc(case.prompt))
    qa = [(None, case.answer)] + [(d.key, d.value) for d in case.distractors]
    for key, value in qa:
        if key is not None:
            q = _enc(nd.QUESTION.format(key=key) + nd.ANSWER_PREFIX.format(key=key))
            ids, mask = ids + q, mask + [0.0] * len(q)
        a = _enc(f" {value}.")
        ids, mask = ids + a, mask + [1.0] * len(a)
    return ids, mask


def pad_batch(rows: list[tuple[list[int], list[float]]], length: int):
    ids = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    mask = torch.zeros(len(rows), length)
    for i, (r, m) in enumerate(rows):
        r, m = r[:length], m[:length]
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m)
    return ids, mask


class StepData(torch.utils.data.IterableDataset):
    """Endless (gsm ids, gsm mask, needle ids, needle mask) steps; the curriculum reads the
    run's progress from a shared value the training loop updates."""

    def __init__(self, cfg: TrainConfig, progress):
        self.cfg, self.progress = cfg, progress

    def __iter__(self):
        from k3verify.evals import gsm8k_synth

        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        rng = random.Random(self.cfg.data_seed * 1000 + wid)
        pool: list[dict] = []
        while True:
            rows = []
            for _ in range(self.cfg.gsm_batch):
                while len(pool) < 32:
                    diff = rng.choices((1, 2, 3), (0.15, 0.7, 0.15))[0]
                    pool += gsm8k_synth.generate("train", 64, seed=rng.randrange(self.cfg.data_seed, 2**31),
                                                 difficulty=diff)
                    rng.shuffle(pool)
                r = gsm_row(pool, self.cfg.gsm_len)
                del pool[:max(1, _pairs(r[0]))]
                rows.append(r)
            g_ids, g_mask = pad_batch(rows, self.cfg.gsm_len)
            lengths = (_ints(self.cfg.needle_lengths) or
                       next(ls for edge, ls in CURRICULUM if self.progress.value < edge))
            length = rng.choice(lengths)
            n_rows = max(1, self.cfg.needle_tokens // (length + NEEDLE_TAIL))
            n_ids, n_mask = pad_batch([needle_row(length, rng) for _ in range(n_rows)],
                                      length + NEEDLE_TAIL)
            yield g_ids, g_mask, n_ids, n_mask


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _pairs(ids: list[int]) -> int:
    """How many question/answer pairs a gsm row holds (each starts with 'Question:')."""
    return bytes(ids).count(b"Question:")


# ---- training loop --------------------------------------------------------------------

def _param_groups(model, wd: float):
    decay, plain = [], []
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.requires_grad_(False)                  # selection only: balanced by loads instead
            continue
        matrix = p.ndim >= 2 and "embed" not in name and "_res_proj" not in name
        (decay if matrix else plain).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}]


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_model_dir(model, out: Path, cfg: TrainConfig, log_lines: list[str], metrics: dict) -> dict:
    """config, safetensors, tokenizer, train config, log, metrics, manifest (sha256 of each)."""
    save_checkpoint(model, out)                       # copies parameters to the CPU itself
    ByteTokenizer().save(out)
    _write(out / "train_config.json", json.dumps(asdict(cfg), indent=2) + "\n")
    _write(out / "train_log.txt", "\n".join(log_lines) + "\n")
    _write(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.suffix in (".json", ".txt", ".safetensors")
                   and p.name != "manifest.json")
    manifest = {"name": cfg.preset, "files": {f: file_sha256(out / f) for f in files},
                "provenance": {"kind": "trained", "command": "bash scripts/gpu_train.sh",
                               "seed": cfg.seed, "data_seed": cfg.data_seed}}
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


def eval_sets(lengths=(4096, 16384, 32768), n_gsm: int = 64, n_needle: int = 4):
    """Held-out monitors: gsm8k-synth test questions (5 shots from train seed 0, as the eval)
    and needle cases at the eval's seeds. Never trained on."""
    from k3verify.evals import gsm8k_synth
    from k3verify.evals import needle as nd

    shots_pool = gsm8k_synth.generate("train", 200, seed=0)
    rng = random.Random(1234)
    rows = []
    for row in gsm8k_synth.generate("test", n_gsm, seed=0):  # n_gsm 0: no gsm monitor
        p, a = _enc(gsm_prompt(rng.sample(shots_pool, 5), row)), _enc(" " + row["answer"] + "\n")
        rows.append((p + a, [0.0] * len(p) + [1.0] * len(a)))
    length = max((len(r) for r, _ in rows), default=0)
    gsm = [pad_batch(rows[i:i + 16], length) for i in range(0, len(rows), 16)]
    needles = {}
    for L in lengths:
        cases = [nd.make_case(L, d, seed=0) for d in [i / max(1, n_needle - 1) for i in range(n_needle)]]
        rs = [(_enc(c.prompt) + _enc(f" {c.answer}."), [0.0] * len(_enc(c.prompt)) + [1.0] * 9) for c in cases]
        needles[L] = [pad_batch(rs[i:i + max(1, 65536 // L)], L + 64) for i in range(0, len(rs), max(1, 65536 // L))]
    return gsm, needles


def train(cfg: TrainConfig) -> dict:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = init_model(preset_config(cfg.preset), seed=cfg.seed)
    if cfg.init:
        load_weights(model, read_state_dict(cfg.init))
    progress = mp.Value("d", 0.0)
    loader = torch.utils.data.DataLoader(StepData(cfg, progress), batch_size=None,
                                         num_workers=cfg.workers, prefetch_factor=4 if cfg.workers else None,
                                         pin_memory=cfg.device.startswith("cuda"))
    model.to(cfg.device).train()
    ops = SeqOps(cfg.device, cfg.kda, cfg.amp)
    ops.loads = [] if cfg.bias_update > 0 else None
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95),
                            eps=1e-8, fused=cfg.device.startswith("cuda"))
    biases = [mod.gate.e_score_correction_bias for mod in model.modules() if hasattr(mod, "gate")
              and hasattr(mod.gate, "e_score_correction_bias")]
    amp = torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16, enabled=ops.dtype == torch.bfloat16)
    budget = cfg.minutes * 60.0
    log: list[str] = [f"config {json.dumps(asdict(cfg))}"]

    def say(line: str) -> None:
        log.append(line)
        print(line, flush=True)

    gsm_eval, needle_eval = eval_sets(_ints(cfg.eval_needle_lengths), cfg.eval_gsm)
    say(f"params {sum(p.numel() for p in model.parameters())} device {cfg.device} kda {ops.kda_kind}")
    start, last_eval, tokens, step = time.time(), time.time(), 0, 0
    window = (time.time(), 0)
    metrics: dict = {}
    for g_ids, g_mask, n_ids, n_mask in loader:
        elapsed = time.time() - start
        frac = elapsed / budget
        if frac >= 1.0 or (cfg.max_steps and step >= cfg.max_steps):
            break
        progress.value = frac
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * (
            cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        dev = cfg.device
        with amp:
            g_ids, g_mask = g_ids.to(dev, non_blocking=True), g_mask.to(dev, non_blocking=True)
            loss_g, _ = masked_loss(train_forward(model, g_ids, ops), g_ids, g_mask)
        loss_g.backward()
        with amp:
            n_ids, n_mask = n_ids.to(dev, non_blocking=True), n_mask.to(dev, non_blocking=True)
            loss_n, _ = masked_loss(train_forward(model, n_ids, ops), n_ids, n_mask)
        (cfg.needle_weight * loss_n).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ops.loads:
            with torch.no_grad():                    # aux-loss-free balancing (DeepSeek-V3 style)
                for bias, load in zip(biases, ops.loads):
                    bias += cfg.bias_update * torch.sign(load.float().mean() - load.float())
            ops.loads.clear()
        step += 1
        tokens += g_ids.numel() + n_ids.numel()
        if step % 50 == 0 or step == 1:
            now = time.time()
            tps = (tokens - window[1]) / max(1e-9, now - window[0])
            window = (now, tokens)
            say(f"step {step} t {now - start:.0f}s lr {lr:.2e} loss_gsm {loss_g.item():.4f} "
                f"loss_needle {loss_n.item():.4f} needle_len {n_ids.shape[1]} gnorm {gnorm.item():.2f} "
                f"tok/s {tps:.0f}")
        if time.time() - last_eval > cfg.eval_every_s:
            last_eval = time.time()
            metrics = _evaluate(model, ops, gsm_eval, needle_eval, say, step)
            write_model_dir(model, out, cfg, log, dict(metrics, steps=step))   # partial result
            model.train()
    total = time.time() - start
    metrics = _evaluate(model, ops, gsm_eval, needle_eval, say, step)
    metrics.update(steps=step, tokens=tokens, seconds=round(total, 1),
                   tokens_per_s=round(tokens / max(total, 1e-9)))
    say(f"done steps {step} tokens {tokens} seconds {total:.0f} tok/s {tokens / max(total, 1e-9):.0f}")
    torch.save(opt.state_dict(), out / "optim.pt")
    write_model_dir(model, out, cfg, log, metrics)
    return metrics


def _evaluate(model, ops, gsm_eval, needle_eval, say, step) -> dict:
    model.eval()
    m = {"gsm_tf_exact": teacher_forced_eval(model, ops, gsm_eval)} if gsm_eval else {}
    for L, batches in needle_eval.items():
        m[f"needle_tf_{L}"] = teacher_forced_eval(model, ops, batches)
    say(f"eval step {step} " + " ".join(f"{k} {v:.3f}" for k, v in m.items()))
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m optimized_stack.train", description=__doc__.split("\n")[0])
    for f in TrainConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        if f.name == "out":
            ap.add_argument(flag, required=True)
        elif f.type == "bool":
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            ap.add_argument(flag, type={"int": int, "float": float}.get(f.type, str), default=f.default)
    args = ap.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
    except K3Error as exc:
        ap.error(str(exc))
    if not cfg.device.startswith("cuda"):
        with override(linear=plain_linear):          # row-stable tiles are for inference
            metrics = train(cfg)
    else:
        metrics = train(cfg)
    print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
