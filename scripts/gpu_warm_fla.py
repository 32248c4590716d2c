"""Compile fla-core's KDA kernels for a head size (Triton's disk cache keeps them), so a later
process on the same machine does not spend its time budget compiling: python3 scripts/gpu_warm_fla.py 128 [HEADS]
(with TRITON_CACHE_AUTOTUNING=1, scripts/gpu_env.sh, the tuned choice is kept on disk too)"""
import sys
import time

import torch

from optimized_stack.kernels.kda.fla import fla_chunk, fla_recurrent

if __name__ == "__main__":
    dim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    heads = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    for t_len in (1, 64, 512):
        x = torch.randn(t_len, heads, dim, device="cuda")
        q = torch.nn.functional.normalize(x, dim=-1) * dim ** -0.5
        k = torch.nn.functional.normalize(x.flip(0), dim=-1)
        g, beta = -torch.rand_like(x), torch.rand(t_len, heads, device="cuda")
        s0 = torch.zeros(heads, dim, dim, device="cuda")
        for fn in (fla_chunk, fla_recurrent):
            t0 = time.time()
            fn(q, k, x, g, beta, s0)
            torch.cuda.synchronize()
            print(f"warm {fn.__name__} T={t_len} H={heads} K={dim}: {time.time() - t0:.1f} s", flush=True)
