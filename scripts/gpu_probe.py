"""One-off probe of the H200 for issue 8 planning: HBM copy rate, fla import and compile time,
k3-small reference prefill/decode timings on CUDA. Writes $OUT/probe.json."""
import json, os, subprocess, sys, time
import torch

OUT = os.environ.get("OUT", "/tmp/probe")
res = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}


def t_cuda(fn, n=5):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


x = torch.empty(2 ** 32, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
s = t_cuda(lambda: y.copy_(x), 10)
res["hbm_copy_TBps"] = 2 * x.numel() / s / 1e12
del x, y
print(res, flush=True)
code = r"""
import time, torch, fla, fla.ops.kda as m
print('fla', fla.__version__, [n for n in dir(m) if not n.startswith('_')], flush=True)
from fla.ops.kda import chunk_kda
for T in (256, 4096):
    H, K = 8, 128
    g = torch.Generator(device='cuda').manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device='cuda', generator=g), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device='cuda', generator=g), dim=-1)
    v = torch.randn(1, T, H, K, device='cuda', generator=g)
    gg = -torch.rand(1, T, H, K, device='cuda', generator=g)
    b = torch.rand(1, T, H, device='cuda', generator=g)
    t0 = time.time()
    o, s = chunk_kda(q=q, k=k, v=v, g=gg, beta=b, scale=1.0, initial_state=None, output_final_state=True)
    torch.cuda.synchronize(); print('chunk_kda T', T, 'first call s', round(time.time() - t0, 1), flush=True)
    t0 = time.time()
    o2, s2 = chunk_kda(q=q, k=k, v=v, g=gg, beta=b, scale=1.0, initial_state=None, output_final_state=True)
    torch.cuda.synchronize(); print('second call s', round(time.time() - t0, 4), 'same', bool(torch.equal(o, o2) and torch.equal(s, s2)), flush=True)
try:
    from fla.ops.kda import fused_recurrent_kda
    import inspect; print('fused_recurrent_kda', inspect.signature(fused_recurrent_kda), flush=True)
except Exception as e:
    print('no fused_recurrent_kda', e, flush=True)
"""
t0 = time.time()
try:
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    res["fla_out"] = (p.stdout + p.stderr)[-3000:]
except subprocess.TimeoutExpired as e:
    res["fla_out"] = f"TIMEOUT after 240 s: {(e.stdout or b'')[-2000:]!r}"
res["fla_wall_s"] = time.time() - t0
print(res["fla_out"], flush=True)

from optimized_stack.presets import preset_config, init_model
from optimized_stack.model.ops import override
from optimized_stack.kernels.gpu_train_ops import sdpa_mla_attention
model = init_model(preset_config("k3-small"), seed=0).cuda()
ids = torch.randint(0, 32768, (512,), generator=torch.Generator().manual_seed(0))
for name, ov in (("reference", {}), ("sdpa_mla", {"mla_attention": sdpa_mla_attention})):
    with override(**ov):
        t0 = time.time(); a = model.logits(ids); torch.cuda.synchronize(); t1 = time.time()
        b = model.logits(ids); torch.cuda.synchronize(); t2 = time.time()
        res[f"small_prefill512_{name}_s"] = [t1 - t0, t2 - t1]
        res[f"small_prefill512_{name}_deterministic"] = bool(torch.equal(a, b))
        st = model.new_state(); model.forward(ids[:64], st)
        torch.cuda.synchronize(); t0 = time.time()
        for i in range(8):
            model.forward(ids[64 + i:65 + i], st)
        torch.cuda.synchronize(); res[f"small_decode_step_{name}_ms"] = (time.time() - t0) / 8 * 1e3
        print(name, {k: v for k, v in res.items() if name in k}, flush=True)
res["n_params"] = sum(p.numel() for p in model.parameters())
os.makedirs(OUT, exist_ok=True)
json.dump(res, open(os.path.join(OUT, "probe.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "fla_out"}), flush=True)
