"""Which per-row ops are batch-invariant on this GPU? Each op on rows [:m] vs the same rows
inside a 256-row call (bitwise). Prints one line per op."""
import torch

from optimized_stack.model import ops

if __name__ == "__main__":
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 768, generator=gen).cuda()
    w = torch.randn(768, generator=gen).cuda()
    cases = {
        "rms_norm": lambda t: ops.rms_norm(t, w, 1e-6),
        "l2_norm": lambda t: ops.l2_norm(t),
        "sum(-1)": lambda t: t.sum(-1),
        "softmax(-1)": lambda t: t.softmax(-1),
        "sigmoid": lambda t: ops.sigmoid(t),
        "topk(8)": lambda t: torch.topk(t, 8, dim=-1).values,
        "tiled_row_linear": lambda t: ops.tiled_row_linear(t, x[:64]),
        "bmm [E,rows,D]": lambda t: torch.bmm(t.view(1, -1, 768), x[:64].t().unsqueeze(0))[0],
    }
    for name, fn in cases.items():
        full = fn(x)
        res = {m: bool(torch.equal(fn(x[:m]), full[:m])) for m in (1, 3, 8, 13, 64, 100)}
        print(f"{name:18s} {res}", flush=True)
