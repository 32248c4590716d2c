"""Helpers for the peer tests: build tiny, fully perturbed peer models and compare outputs.

A peer is an independent public implementation (transformers' Kimi Linear, fla's naive
KDA recurrence, the JAX port's K3 data). The helpers here only build inputs and measure;
they never import optimized_stack, so a broken engine cannot break the fixtures.

Shape letters: B batch, T tokens, H heads, K key dim, V value dim, D hidden, E experts.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

# The relative error every peer test reports: max|got - ref| / max|ref|.
# Against transformers' Kimi Linear it must stay <= PEER_LOGITS_TOL: the two sides differ in
# summation order (chunked vs recurrent KDA) and the MLA LoRA norm eps (1e-6 vs
# rms_norm_eps), ~1e-5; a structural bug is orders of magnitude above it.
PEER_LOGITS_TOL = 1e-4


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.shape != ref.shape:
        raise ValueError(f"rel_err: expected equal shapes, got {tuple(got.shape)} vs {tuple(ref.shape)}")
    got64, ref64 = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got64).all():
        return math.inf
    scale = ref64.abs().max().item()
    if scale == 0.0:
        raise ValueError("rel_err: the reference is all zeros, the relative error is undefined")
    return (got64 - ref64).abs().max().item() / scale


def describe_diff(got: torch.Tensor, ref: torch.Tensor) -> str:
    """One line for an assert message: the relative error and where the worst element is."""
    diff = (got.detach().double() - ref.detach().double()).abs()
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return (f"max|d|/max|ref| = {rel_err(got, ref):.3e}; worst |d| = {diff.max().item():.3e} at {idx} "
            f"(got {got[idx].item():.6g}, ref {ref[idx].item():.6g}); max|ref| = {ref.abs().max().item():.4g}")


# ---- fla's naive KDA recurrence ---------------------------------------------------------

def load_fla_naive_kda() -> Callable[..., Any] | None:
    """fla-core's `naive_recurrent_kda`, or None when fla-core is not installed.

    `from fla.ops.kda.naive import ...` runs fla/ops/__init__.py, which imports triton
    (absent on a CPU-only box). naive.py itself needs only torch and einops, so load the
    file directly.
    """
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.is_file():
        return None
    mod_spec = importlib.util.spec_from_file_location("_peer_fla_kda_naive", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module.naive_recurrent_kda


@dataclass(frozen=True)
class KdaInputs:
    """Random KDA inputs in the project's layout: q/k/g [T, H, K], v [T, H, V], beta [T, H]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    state: torch.Tensor | None    # [H, K, V] fp32


def random_kda_inputs(seed: int, T: int, H: int, K: int, V: int, with_state: bool) -> KdaInputs:
    """q pre-scaled by K**-0.5 and l2-normed, k l2-normed, g a log-decay in about (-5, 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, K, generator=gen)
    k = torch.randn(T, H, K, generator=gen)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v = torch.randn(T, H, V, generator=gen)
    # Spread the decay over slow and fast channels so both dominate somewhere.
    g = -5.0 * torch.sigmoid(2.0 * torch.randn(T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))
    state = torch.randn(H, K, V, generator=gen) if with_state else None
    return KdaInputs(q, k, v, g, beta, state)


# ---- transformers' Kimi Linear -----------------------------------------------------------

_TORCH_KERNEL_NAMES = (
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)


def kimi_linear_modeling():
    """transformers' modeling_kimi_linear module, or None when this transformers lacks it."""
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear
    except ImportError:
        return None
    return modeling_kimi_linear


@contextlib.contextmanager
def torch_reference_kernels() -> Iterator[None]:
    """Run transformers' Kimi Linear on its plain-PyTorch kernels, whatever is installed.

    At import, each kernel function picks hub kernel > fla / causal_conv1d > torch, once.
    The wrapper keeps the torch function as `__wrapped__`, and the layers look the names
    up as module globals, so swapping the globals forces the torch path. Always restored.
    """
    mk = kimi_linear_modeling()
    saved = {name: getattr(mk, name) for name in _TORCH_KERNEL_NAMES}
    try:
        for name, fn in saved.items():
            torch_fn = inspect.unwrap(fn)
            if torch_fn.__module__ != mk.__name__:
                raise RuntimeError(f"{name}: expected the torch reference in {mk.__name__}, "
                                   f"got {torch_fn.__module__}.{torch_fn.__qualname__}")
            setattr(mk, name, torch_fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(mk, name, fn)


@dataclass(frozen=True)
class KimiLinearSpec:
    """The knobs of a tiny Kimi Linear fixture. Layer lists are 1-INDEXED, as in the checkpoint."""

    name: str
    kda_layers: tuple[int, ...] = (1, 2, 4)
    full_attn_layers: tuple[int, ...] = (3,)
    hidden_size: int = 64
    vocab_size: int = 128
    kda_heads: int = 4
    kda_head_dim: int = 16
    mla_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    intermediate_size: int = 96
    moe_intermediate_size: int = 32
    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 1
    routed_scaling_factor: float = 2.446
    first_k_dense_replace: int = 1

    @property
    def num_layers(self) -> int:
        return len(self.kda_layers) + len(self.full_attn_layers)


def kimi_linear_config(spec: KimiLinearSpec):
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.mla_heads,
        num_key_value_heads=spec.mla_heads, q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
        num_experts=spec.num_experts, num_experts_per_token=spec.top_k,
        n_shared_experts=spec.num_shared_experts, routed_scaling_factor=spec.routed_scaling_factor,
        first_k_dense_replace=spec.first_k_dense_replace, rms_norm_eps=1e-5,
        linear_attn_config={
            "kda_layers": list(spec.kda_layers), "full_attn_layers": list(spec.full_attn_layers),
            "num_heads": spec.kda_heads, "head_dim": spec.kda_head_dim, "short_conv_kernel_size": 4,
        },
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )


def kimi_linear_config_fields(spec: KimiLinearSpec):
    """The same model as kimi_linear_config(spec), spelled with KimiLinearConfig's own field
    names: 0-indexed layer_types, mlp_layer_types, num_local_experts, linear_num_heads, ...
    Its saved config.json then has no linear_attn_config and no first_k_dense_replace."""
    from transformers import KimiLinearConfig

    full = set(spec.full_attn_layers)
    return KimiLinearConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.mla_heads,
        num_key_value_heads=spec.mla_heads, q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
        num_local_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
        n_shared_experts=spec.num_shared_experts, routed_scaling_factor=spec.routed_scaling_factor,
        rms_norm_eps=1e-5, linear_num_heads=spec.kda_heads, linear_head_dim=spec.kda_head_dim,
        linear_conv_kernel_dim=4,
        layer_types=["full_attention" if i + 1 in full else "linear_attention" for i in range(spec.num_layers)],
        mlp_layer_types=["dense" if i < spec.first_k_dense_replace else "sparse" for i in range(spec.num_layers)],
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )


SPELLINGS = {"checkpoint": kimi_linear_config, "fields": kimi_linear_config_fields}


def _is_norm_gain(name: str) -> bool:
    return name.endswith(("layernorm.weight", "norm.weight"))


@torch.no_grad()
def perturb_kimi_linear_(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter and buffer away from its init, so each one changes the logits.

    A_log = log U(1, 16); dt_bias += N(0, 0.5^2); router bias = N(0, 0.1^2);
    norm gains = 1 + N(0, 0.1^2); every other tensor = N(0, 1/fan_in) (Xavier-like scale,
    so activations stay O(1) through the layers instead of the 0.02-std init's near zero).
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name, t in sorted(tensors.items()):
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if name.endswith("A_log"):
            new = torch.rand(t.shape, generator=gen) * 15.0 + 1.0
            t.copy_(new.log())
        elif name.endswith("dt_bias"):
            t.add_(0.5 * noise)
        elif name.endswith("e_score_correction_bias"):
            t.copy_(0.1 * noise)
        elif _is_norm_gain(name):
            t.copy_(1.0 + 0.1 * noise)
        elif name.endswith("embed_tokens.weight"):
            t.copy_(noise)
        else:
            fan_in = t.shape[-1] if t.dim() >= 2 else 1
            t.copy_(noise / math.sqrt(fan_in))


def build_kimi_linear(spec: KimiLinearSpec, seed: int, spelling: str = "checkpoint"):
    """A perturbed transformers KimiLinearForCausalLM in fp32 eval mode on the CPU; its config
    spelled as Kimi checkpoints spell it ("checkpoint") or with KimiLinearConfig's field names."""
    from transformers import KimiLinearForCausalLM

    torch.manual_seed(seed)
    config = SPELLINGS[spelling](spec)
    config._attn_implementation = "eager"
    model = KimiLinearForCausalLM(config).float().eval()
    perturb_kimi_linear_(model, seed)
    return model


@torch.no_grad()
def kimi_linear_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' logits for one 1-D sequence, on the torch reference kernels: [T, vocab]."""
    with torch_reference_kernels():
        out = model(input_ids=ids[None], use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def min_routing_gap(model, ids: torch.Tensor) -> float:
    """Smallest gap between the k-th and (k+1)-th biased router score over tokens and MoE layers.

    A tiny gap means top-k selection could flip on rounding noise, which would turn a
    1e-6 difference into an O(1) one; the fixture must stay clear of that.
    """
    gaps: list[float] = []

    def hook(module, args, _out):
        x = args[0].reshape(-1, module.weight.shape[1]).float()
        scores = torch.sigmoid(x @ module.weight.float().t()) + module.e_score_correction_bias
        top = scores.topk(module.top_k + 1, dim=-1).values                    # [T, k+1]
        gaps.append((top[:, -2] - top[:, -1]).min().item())

    gates = [m for m in model.modules() if type(m).__name__ == "KimiLinearTopkRouter"]
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        kimi_linear_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return min(gaps) if gaps else math.inf


def seeded_ids(seed: int, T: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (T,), generator=torch.Generator().manual_seed(seed))
