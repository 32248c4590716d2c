"""Tell "this machine computes differently" from "the reference drifted".

Golden hashes are bits of the reference path on the machine that recorded them. When a
check on another machine finds different bits, two causes look alike: the code or the
model changed (a drift: fail), or the machine's math libraries give other bits for the
same operation (another environment: not comparable). This module separates them.

At record time the reference runs once under a dispatch mode that lists every rounding
primitive it calls (GEMMs, reductions, transcendentals; `PRIMITIVES`) by signature: op,
shapes, strides, dtypes and the non-tensor arguments. Each distinct signature is then
replayed on seeded inputs and its output hashed. At check time the *recorded* signatures
(not the current code's) are replayed here: if one gives other bits from the same inputs,
this machine computes that primitive differently and the golden file does not apply (the
check is a skip naming the op); if every primitive agrees, a capture mismatch can only come
from the code or the model, and stays a failure.

Exact operations (copies, views, indexing, comparisons, +, -, *, /, casts) are correctly
rounded or bit-moving everywhere and are not listed.
"""
from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

# aten op names (OpOverload._opname) whose bits can depend on the library or machine
PRIMITIVES = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addmv", "mv", "dot", "_convolution", "convolution",
    "sum", "mean", "prod", "cumsum", "cumprod", "var", "std", "var_mean", "norm", "linalg_vector_norm",
    "logsumexp", "_softmax", "_log_softmax",
    "exp", "exp2", "expm1", "log", "log1p", "log2", "sigmoid", "tanh", "silu", "softplus", "gelu", "erf",
    "rsqrt", "sqrt", "pow", "sin", "cos", "linalg_solve_triangular", "triangular_solve",
})
# inputs in (0.1, 4) where the op needs positive values to take its usual path
_POSITIVE = frozenset({"rsqrt", "sqrt", "log", "log1p", "log2", "pow"})


class PrimitiveRecorder(TorchDispatchMode):
    """Collects the distinct signatures of PRIMITIVES called inside `with recorder:`."""

    def __init__(self) -> None:
        super().__init__()
        self.signatures: dict[str, dict[str, Any]] = {}
        self.unsupported: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._opname in PRIMITIVES:
            sig = _signature(func, args, kwargs)
            if sig is None:
                self.unsupported.add(str(func))
            else:
                self.signatures.setdefault(json.dumps(sig, sort_keys=True), sig)
        return out


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return {"tensor": [list(x.shape), list(x.stride()), x.storage_offset(), str(x.dtype).removeprefix("torch."),
                           x.device.type]}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(type(x).__name__)


def _signature(func, args, kwargs) -> dict[str, Any] | None:
    leaves, spec = tree_flatten((list(args), dict(kwargs)))
    try:
        return {"op": str(func), "leaves": [_leaf(x) for x in leaves], "spec": treespec_dumps(spec)}
    except (TypeError, ValueError):
        return None


def record(fn: Callable[[], Any]) -> tuple[Any, list[dict[str, Any]]]:
    """(fn(), the distinct primitive signatures it called, each with its replay digest)."""
    rec = PrimitiveRecorder()
    with rec:
        result = fn()
    sigs = [dict(s, digest=replay_one(s)) for _, s in sorted(rec.signatures.items())]
    return result, sigs


def _op(name: str):
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def _input(spec: list, op: str, gen: torch.Generator) -> torch.Tensor:
    shape, stride, offset, dtype_name, device = spec
    dtype = getattr(torch, dtype_name)
    need = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else offset
    if dtype.is_floating_point:
        lo, hi = (0.1, 4.0) if op in _POSITIVE else (-2.0, 2.0)
        base = torch.rand(max(need, 1), generator=gen, dtype=torch.float64) * (hi - lo) + lo
    else:
        base = torch.randint(0, 8, (max(need, 1),), generator=gen)
    return base.to(dtype).to(device).as_strided(shape, stride, offset)


def replay_one(sig: dict[str, Any]) -> str:
    """Run one recorded signature on inputs seeded by the signature itself; hash the outputs."""
    text = json.dumps({k: sig[k] for k in ("op", "leaves", "spec")}, sort_keys=True)
    gen = torch.Generator().manual_seed(zlib.crc32(text.encode()))
    opname = sig["op"].split(".")[1]
    leaves = []
    for leaf in sig["leaves"]:
        if isinstance(leaf, dict) and "tensor" in leaf:
            leaves.append(_input(leaf["tensor"], opname, gen))
        elif isinstance(leaf, dict) and "dtype" in leaf:
            leaves.append(getattr(torch, leaf["dtype"]))
        else:
            leaves.append(leaf)
    args, kwargs = tree_unflatten(leaves, treespec_loads(sig["spec"]))
    out = _op(sig["op"])(*args, **kwargs)
    h = hashlib.sha256()
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            t = t.detach().contiguous().cpu()
            h.update(f"{str(t.dtype)}{list(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def describe(sig: dict[str, Any]) -> str:
    """'aten.bmm.default float32[7, 8, 128] x float32[7, 128, 64]'."""
    shapes = [f"{leaf['tensor'][3]}{leaf['tensor'][0]}" for leaf in sig["leaves"]
              if isinstance(leaf, dict) and "tensor" in leaf]
    return f"{sig['op']} " + " x ".join(shapes)


def first_difference(recorded: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, int]:
    """(the first recorded primitive whose bits differ here, how many differ); (None, 0) when all agree."""
    differing = [s for s in recorded if replay_one(s) != s["digest"]]
    return (differing[0] if differing else None), len(differing)
