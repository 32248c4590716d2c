"""Training on the CPU: the batched training forward (optimized_stack/train.py) is the
reference model's math, a few AdamW steps lower the loss, the saved checkpoint loads and
runs, --init resumes weights and optimizer state, and the data entry point
(scripts/train_k3mini.py) renders gsm8k-synth / needle rows as the evals read them."""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

from optimized_stack import load_model
from optimized_stack import train as tr
from optimized_stack.checkpoint import save_checkpoint
from optimized_stack.kernels.kda.chunked import kda_chunk_torch
from optimized_stack.kernels.kda.recurrent import kda_recurrent_batched
from optimized_stack.model.ops import override, plain_linear
from optimized_stack.presets import init_model, preset_config
from optimized_stack.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("train_k3mini", ROOT / "scripts" / "train_k3mini.py")
script = importlib.util.module_from_spec(_spec)
sys.modules["train_k3mini"] = script      # dataclasses look their module up by name
_spec.loader.exec_module(script)


@pytest.fixture(autouse=True)
def _one_thread():
    # the dev box has 2 cores shared with other jobs; one thread is faster and steadier here
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_cfg():
    """k3-mini's shape at a quarter of the width: same layer kinds, MoE, AttnRes."""
    return dataclasses.replace(preset_config("k3-mini"), hidden_size=32, num_layers=4,
                               layer_kinds=("kda", "kda", "kda", "mla"), intermediate_size=32,
                               moe_intermediate_size=16, routed_expert_hidden_size=16,
                               attn_res_block_size=2)


def _model(seed=0, cfg=None):
    m = init_model(cfg or preset_config("k3-mini"), seed=seed)
    with torch.no_grad():   # non-uniform AttnRes mixing, so the walk is really exercised
        for name, p in m.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    return m


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kda", ["chunk", "recurrent"])
def test_train_forward_matches_reference_logits(kda):
    m = _model(3)
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), override(linear=plain_linear):
        logits = tr.train_forward(m, ids, tr.SeqOps("cpu", kda))
    # fp32 through 8 layers of a random model amplifies rounding: measured 4e-6 .. 1.2e-4 of
    # max|logit| across MKL code branches (NOTES.md, 2026-12-01); the control below misses by > 1e-3
    for row in range(2):
        assert _rel(logits[row], m.logits(ids[row])) < 4e-4


def test_train_forward_check_can_fail():
    """Negative control: a model whose AttnRes mixing differs by a little is caught."""
    m, other = _model(3), _model(3)
    with torch.no_grad():
        other.model.layers[5].mlp_res_proj.weight.add_(0.5)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), override(linear=plain_linear):
        logits = tr.train_forward(other, ids, tr.SeqOps("cpu"))
    assert _rel(logits[0], m.logits(ids[0])) > 1e-3


@pytest.mark.parametrize("t_len", [16, 50, 97], ids=lambda t: f"T{t}")
def test_chunked_kda_matches_recurrence_and_gradients(t_len):
    g = torch.Generator().manual_seed(t_len)

    def rnd(*s):
        return torch.randn(*s, generator=g)

    q = torch.nn.functional.normalize(rnd(2, t_len, 3, 8), dim=-1) * 8 ** -0.5
    k = torch.nn.functional.normalize(rnd(2, t_len, 3, 8), dim=-1)
    v, gate, beta = rnd(2, t_len, 3, 8), -5 * torch.sigmoid(rnd(2, t_len, 3, 8)), torch.sigmoid(rnd(2, t_len, 3))
    outs = []
    for fn in (kda_recurrent_batched, kda_chunk_torch):
        ins = [x.clone().requires_grad_(True) for x in (q, k, v, gate, beta)]
        o = fn(*ins)
        (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum().backward()
        outs.append((o.detach(), [x.grad for x in ins]))
    (o_ref, g_ref), (o_chk, g_chk) = outs
    assert _rel(o_chk, o_ref) < 1e-5
    for a, b in zip(g_chk, g_ref):
        assert _rel(a, b) < 1e-4


def test_loss_decreases_on_a_fixed_batch_and_checkpoint_loads(tmp_path):
    cfg = _tiny_cfg()
    model = _model(0, cfg).train()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 64)
    opt = torch.optim.AdamW(tr._param_groups(model, 0.0), lr=1e-2)
    ops = tr.SeqOps("cpu")
    losses = []
    with override(linear=plain_linear):
        for _ in range(8):
            loss, _ = tr.masked_loss(tr.train_forward(model, ids, ops), ids, mask)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    save_checkpoint(model, tmp_path)
    ByteTokenizer().save(tmp_path)
    loaded = load_model(tmp_path)
    logits = loaded.logits(ids[0, :20])
    assert logits.shape == (20, cfg.vocab_size) and torch.isfinite(logits).all()
    with torch.no_grad(), override(linear=plain_linear):
        assert _rel(tr.train_forward(model.eval(), ids[:1, :20], ops)[0], logits) < 1e-4


def test_masked_loss_counts_only_targets_and_exact_match():
    ids = torch.tensor([[1, 2, 3, 4]])
    logits = torch.full((1, 4, 5), -10.0)
    logits[0, 0, 2] = 10.0            # predicts ids[1] = 2: right
    logits[0, 1, 0] = 10.0            # predicts 0 where 3 comes: wrong, but not a target
    logits[0, 2, 4] = 10.0            # predicts ids[3] = 4: right
    mask = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    loss, ok = tr.masked_loss(logits, ids, mask)
    assert loss.item() < 1e-3 and ok.tolist() == [True]
    loss, ok = tr.masked_loss(logits, ids, torch.ones(1, 4))   # negative control
    assert loss.item() > 1.0 and ok.tolist() == [False]


def test_gsm_row_is_lm_eval_fewshot_text_with_answers_as_targets():
    rows = [{"question": "Q1?", "answer": "1 + 1 = 2\n#### 2"},
            {"question": "Q2?", "answer": "#### 5"}, {"question": "Q3 long" * 50, "answer": "#### 9"}]
    ids, mask = script.gsm_row(rows, 80)
    assert bytes(ids).decode() == "Question: Q1?\nAnswer: 1 + 1 = 2\n#### 2\n\nQuestion: Q2?\nAnswer: #### 5"
    targets = bytes(i for i, m in zip(ids, mask) if m).decode()
    assert targets == " 1 + 1 = 2\n#### 2\n\nQuestion: #### 5"
    assert script.gsm_prompt(rows[:1], rows[1]) == "Question: Q1?\nAnswer: 1 + 1 = 2\n#### 2\n\nQuestion: Q2?\nAnswer:"


def test_needle_row_trains_every_value():
    ids, mask = script.needle_row(1500, random.Random(3))
    targets = bytes(i for i, m in zip(ids, mask) if m).decode()
    assert targets.startswith(" ") and targets.count(".") >= 1
    digits = targets.replace(" ", "").split(".")[:-1]
    assert all(len(d) == 7 and d.isdigit() for d in digits)
    assert bytes(ids).decode().count(targets.split(".")[0].strip()) == 2   # the needle and the answer


def test_bad_train_config_is_one_line():
    with pytest.raises(Exception, match="--kda must be chunk, fla or recurrent"):
        tr.LoopConfig(out="x", kda="fast")
    with pytest.raises(Exception, match="--gsm-difficulty: expected 3 non-negative weights"):
        script.TrainConfig(out="x", gsm_difficulty="1,2")


def _k3verify_imports(source: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return [n for n in names if n.split(".")[0] == "k3verify"]


def test_optimized_stack_train_never_imports_k3verify():
    assert _k3verify_imports((ROOT / "optimized_stack" / "train.py").read_text()) == []
    # negative control: an import inside a function body is found too
    assert _k3verify_imports("def f():\n    from k3verify.quality.evals import needle\n") == ["k3verify.quality.evals"]


def _fixed_steps(n_steps):
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    part = (ids, torch.ones(2, 48))
    return iter([{"a": part, "b": part}] * n_steps)


def test_fit_writes_a_checkpoint_and_init_resumes_weights_and_optimizer(tmp_path):
    mcfg = _tiny_cfg()
    loop = tr.LoopConfig(out=str(tmp_path / "run1"), device="cpu", minutes=5, max_steps=3,
                         warmup_steps=1, lr=1e-2, amp=False)
    model = _model(0, mcfg)
    opt = tr.make_optimizer(model, loop)
    seen, lines = [], []

    def checkpoint(metrics):
        tr.write_model_dir(model, Path(loop.out), dataclasses.asdict(loop), lines, metrics, {"kind": "test"}, opt)

    with override(linear=plain_linear):
        metrics = tr.fit(model, opt, _fixed_steps(5), loop, weights={"b": 0.5},
                         on_progress=seen.append, checkpoint=checkpoint, say=lines.append)
    assert metrics["steps"] == 3 and metrics["tokens"] == 3 * 2 * 2 * 48 and len(seen) == 3
    assert any("loss_a" in line and "loss_b" in line for line in lines)
    run1 = Path(loop.out)
    assert (run1 / tr.OPTIM_FILE).is_file() and "optim.pt" not in (run1 / "manifest.json").read_text()
    resumed_cfg = dataclasses.replace(loop, init=str(run1))
    resumed = tr.build_model(resumed_cfg)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a.detach(), b.detach()), name
    opt2 = tr.make_optimizer(resumed, resumed_cfg)
    steps = [float(s["step"]) for s in opt2.state_dict()["state"].values()]
    assert steps and all(s == 3.0 for s in steps)
    # negative control: a weights-only dir (no optim.pt) gives a cold optimizer
    (run1 / tr.OPTIM_FILE).unlink()
    assert tr.make_optimizer(tr.build_model(resumed_cfg), resumed_cfg).state_dict()["state"] == {}


def test_init_with_a_foreign_optimizer_state_is_one_line(tmp_path):
    model = _model(0, _tiny_cfg())
    save_checkpoint(model, tmp_path)
    torch.save({"state": {}, "param_groups": [{"params": [0]}]}, tmp_path / tr.OPTIM_FILE)
    cfg = tr.LoopConfig(out="x", device="cpu", init=str(tmp_path))
    with pytest.raises(Exception, match="expected the AdamW state of this model's parameter groups"):
        tr.make_optimizer(tr.build_model(cfg), cfg)


def test_step_data_yields_gsm_and_needle_parts():
    cfg = script.TrainConfig(out="x", gsm_batch=2, gsm_len=512, needle_tokens=2048,
                             needle_lengths="1024", workers=0)
    step = next(iter(script.StepData(cfg, type("P", (), {"value": 0.0})())))
    assert set(step) == {"gsm", "needle"}
    assert step["gsm"][0].shape == (2, 512) and step["needle"][0].shape == (1, 1024 + script.NEEDLE_TAIL)
    no_needle = dataclasses.replace(cfg, needle_tokens=0)
    assert set(next(iter(script.StepData(no_needle, type("P", (), {"value": 0.0})())))) == {"gsm"}


def test_the_schedule_starts_after_the_first_step_and_the_run_still_ends_on_time():
    """The first step compiles the kernels on a fresh GPU (fla with its backward: 272 s of a 450 s
    run, 2026-12-07). The cosine, the curriculum and the evals' clock start after it: the second
    step's fraction is near 0, not the compile's share of the run (the old loop read > 0.5 there), no
    eval runs on the one-step model just because the compile outlasted eval_every_s (the old loop
    ran one), and the run still stops at cfg.minutes from its start."""
    import time
    budget_s = 6.0
    loop = tr.LoopConfig(out="x", device="cpu", minutes=budget_s / 60, warmup_steps=1, lr=1e-2, amp=False,
                         eval_every_s=0.5 * budget_s)
    model = _model(0, _tiny_cfg())
    opt = tr.make_optimizer(model, loop)
    fracs, evals = [], []
    start = time.time()

    def progress(frac):
        fracs.append(frac)
        if len(fracs) == 1:
            time.sleep(0.6 * budget_s)         # the first step's compile, past eval_every_s
    with override(linear=plain_linear):
        metrics = tr.fit(model, opt, _fixed_steps(10_000), loop, on_progress=progress, say=lambda _: None,
                         evaluate=lambda m, ops: evals.append(len(fracs)) or {})
    elapsed = time.time() - start
    assert metrics["steps"] >= 2 and len(fracs) >= 2
    assert fracs[0] == 0.0 and fracs[1] < 0.3, fracs[:3]
    assert fracs == sorted(fracs) and fracs[-1] <= 1.0
    assert len(evals) == 1, f"evals after steps {evals}: only the final one fits the time after the compile"
    assert elapsed < budget_s + 3.0, elapsed               # the deadline is the run's start + minutes
