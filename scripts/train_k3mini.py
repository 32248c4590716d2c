"""Train the embedded k3-mini on gsm8k-synth and needle retrieval (issue 7).

    python scripts/train_k3mini.py --out DIR --minutes M [--device cuda] [--init DIR] [...]

The entry point and the data: everything task-specific lives here, so optimized_stack (the
model side: training forward, loss, AdamW loop in optimized_stack/train.py) never imports
k3verify. --init DIR resumes: the weights, and DIR/optim.pt (AdamW moments) when present.

Data (byte tokens, from k3verify's generators; never the held-out splits):
- gsm8k-synth train split as lm-eval's few-shot text, "Question: q\\nAnswer: a" joined by
  "\\n\\n", as many pairs as fit one row;
- needle cases (k3verify.quality.evals.needle.make_case) with 0-3 distractors, then one extra
  question per distractor; lengths follow a curriculum 1K-2K -> ... -> 4K-32K, or the fixed
  list --needle-lengths.
Loss only on what the model must generate at eval time: every answer, the "\\n\\nQuestion:"
after it (where generation stops), and the needle values. Question text and haystack are
context: their numbers are random, so predicting them only spends a 1M-parameter budget.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from k3verify.quality.evals import gsm8k_synth  # noqa: E402
from k3verify.quality.evals import needle as nd  # noqa: E402
from optimized_stack import train as tr  # noqa: E402
from optimized_stack.errors import K3Error  # noqa: E402
from optimized_stack.model.ops import override, plain_linear  # noqa: E402

CURRICULUM = ((0.25, (1024, 2048)), (0.5, (1024, 2048, 4096, 8192)),
              (0.75, (2048, 4096, 8192, 16384)), (1.01, (4096, 8192, 16384, 32768)))
NEEDLE_TAIL = 512          # room after the prompt for the answer and distractor questions
GSM_STOP = "\n\nQuestion:"  # trained after each answer: it is where eval generation stops


@dataclass
class TrainConfig(tr.LoopConfig):
    data_seed: int = 1000           # eval helpers use seeds 0..; training draws from 1000+
    gsm_batch: int = 32
    gsm_len: int = 3072
    gsm_difficulty: str = "0.15,0.7,0.15"   # draw weights of gsm8k-synth difficulty 1,2,3
    needle_tokens: int = 65536     # needle tokens per step (rows = tokens // length)
    needle_weight: float = 1.0
    workers: int = 6
    needle_lengths: str = ""       # comma list: fixed needle lengths instead of CURRICULUM
    eval_needle_lengths: str = "4096,16384,32768"
    eval_gsm: int = 64             # held-out gsm prompts in the periodic teacher-forced eval

    def __post_init__(self):
        super().__post_init__()
        if self.gsm_batch < 1 or self.gsm_len < 256 or self.needle_tokens < 0:
            raise K3Error(f"train config: expected gsm_batch >= 1, gsm_len >= 256, needle_tokens >= 0; "
                          f"got {self.gsm_batch}, {self.gsm_len}, {self.needle_tokens}")
        weights = _floats(self.gsm_difficulty)
        if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
            raise K3Error(f"--gsm-difficulty: expected 3 non-negative weights like 0.15,0.7,0.15, "
                          f"got {self.gsm_difficulty!r}")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        return ()


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


def _pairs(ids: list[int]) -> int:
    """How many question/answer pairs a gsm row holds (each starts with 'Question:')."""
    return bytes(ids).count(b"Question:")


class StepData(torch.utils.data.IterableDataset):
    """Endless steps {"gsm": (ids, mask), "needle": (ids, mask)}; the curriculum reads the
    run's progress from a shared value the training loop updates."""

    def __init__(self, cfg: TrainConfig, progress):
        self.cfg, self.progress = cfg, progress

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        rng = random.Random(self.cfg.data_seed * 1000 + wid)
        difficulty = _floats(self.cfg.gsm_difficulty)
        pool: list[dict] = []
        while True:
            rows = []
            for _ in range(self.cfg.gsm_batch):
                while len(pool) < 32:
                    diff = rng.choices((1, 2, 3), difficulty)[0]
                    pool += gsm8k_synth.generate("train", 64, seed=rng.randrange(self.cfg.data_seed, 2**31),
                                                 difficulty=diff)
                    rng.shuffle(pool)
                r = gsm_row(pool, self.cfg.gsm_len)
                del pool[:max(1, _pairs(r[0]))]
                rows.append(r)
            step = {"gsm": tr.pad_batch(rows, self.cfg.gsm_len)}
            if self.cfg.needle_tokens:
                lengths = (_ints(self.cfg.needle_lengths) or
                           next(ls for edge, ls in CURRICULUM if self.progress.value < edge))
                length = rng.choice(lengths)
                n_rows = max(1, self.cfg.needle_tokens // (length + NEEDLE_TAIL))
                step["needle"] = tr.pad_batch([needle_row(length, rng) for _ in range(n_rows)],
                                              length + NEEDLE_TAIL)
            yield step


def eval_sets(lengths=(4096, 16384, 32768), n_gsm: int = 64, n_needle: int = 4):
    """Held-out monitors: gsm8k-synth test questions (5 shots from train seed 0, as the eval)
    and needle cases at the eval's seeds. Never trained on."""
    shots_pool = gsm8k_synth.generate("train", 200, seed=0)
    rng = random.Random(1234)
    rows = []
    for row in gsm8k_synth.generate("test", n_gsm, seed=0):  # n_gsm 0: no gsm monitor
        p, a = _enc(gsm_prompt(rng.sample(shots_pool, 5), row)), _enc(" " + row["answer"] + "\n")
        rows.append((p + a, [0.0] * len(p) + [1.0] * len(a)))
    length = max((len(r) for r, _ in rows), default=0)
    gsm = [tr.pad_batch(rows[i:i + 16], length) for i in range(0, len(rows), 16)]
    needles = {}
    for L in lengths:
        cases = [nd.make_case(L, d, seed=0) for d in [i / max(1, n_needle - 1) for i in range(n_needle)]]
        rs = [(_enc(c.prompt) + _enc(f" {c.answer}."), [0.0] * len(_enc(c.prompt)) + [1.0] * 9) for c in cases]
        per = max(1, 65536 // L)
        needles[L] = [tr.pad_batch(rs[i:i + per], L + 64) for i in range(0, len(rs), per)]
    return gsm, needles


def train(cfg: TrainConfig) -> dict:
    out = Path(cfg.out)
    torch.manual_seed(cfg.seed)
    model = tr.build_model(cfg)
    opt = tr.make_optimizer(model, cfg)   # before .to(device): state moves with load_state_dict
    resumed = bool(cfg.init) and (Path(cfg.init) / tr.OPTIM_FILE).is_file()
    progress = mp.Value("d", 0.0)
    loader = torch.utils.data.DataLoader(
        StepData(cfg, progress), batch_size=None, num_workers=cfg.workers,
        prefetch_factor=4 if cfg.workers else None, pin_memory=cfg.device.startswith("cuda"),
        multiprocessing_context="fork" if cfg.workers else None)
    log: list[str] = [f"config {json.dumps(asdict(cfg))}"]

    def say(line: str) -> None:
        log.append(line)
        print(line, flush=True)

    gsm_eval, needle_eval = eval_sets(_ints(cfg.eval_needle_lengths), cfg.eval_gsm)

    def evaluate(m, ops) -> dict:
        res = {"gsm_tf_exact": tr.teacher_forced_eval(m, ops, gsm_eval)} if gsm_eval else {}
        for L, batches in needle_eval.items():
            res[f"needle_tf_{L}"] = tr.teacher_forced_eval(m, ops, batches)
        return res

    provenance = {"kind": "trained", "command": "bash scripts/gpu_train.sh train ...",
                  "seed": cfg.seed, "data_seed": cfg.data_seed, "init": cfg.init or None}

    def checkpoint(metrics: dict) -> None:
        tr.write_model_dir(model, out, asdict(cfg), log, metrics, provenance, opt)

    say(f"params {sum(p.numel() for p in model.parameters())} device {cfg.device} kda {cfg.kda} "
        f"init {cfg.init or '-'} optimizer {'resumed' if resumed else 'fresh'}")
    _to_device(opt, cfg.device)
    return tr.fit(model, opt, loader, cfg, weights={"needle": cfg.needle_weight},
                  on_progress=lambda f: setattr(progress, "value", f),
                  evaluate=evaluate, checkpoint=checkpoint, say=say)


def _to_device(opt: torch.optim.Optimizer, device: str) -> None:
    """Loaded optimizer moments live on the CPU; fused AdamW wants them beside the params."""
    for state in opt.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/train_k3mini.py", description=__doc__.split("\n")[0])
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
