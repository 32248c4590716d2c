"""transformers' KimiLinearForCausalLM at the dims of a K3 preset, the peer of the engine benchmark.

Same sizes as the preset (hidden, layers and which are MLA, KDA heads / head dim, MLA ranks and
head dims, experts, top-k, shared experts, FFN widths, vocab); Kimi Linear has no AttnRes and no
latent MoE, so its experts run at the hidden width: it is the same-dims peer the issue compares
with, not the same model. Random init (speed does not depend on the values); the KDA kernels are
whatever transformers picks at import (fla when installed: recorded in the result).

Decode tok/s net of prefill: generate(B prompts of L tokens, N new) minus generate(..., 1 new),
B*(N-1) tokens over the difference. Prefill tok/s: one forward of T tokens without a cache.
The config uses the checkpoint spelling (linear_attn_config, 1-indexed layer lists), which every
transformers release with Kimi Linear reads (5.17 on the GPU image, tests/peer_fixtures.py).
"""
from __future__ import annotations

import time
from typing import Any

import torch

from optimized_stack.config import MLA, K3Config


def kimi_linear_config(cfg: K3Config):
    from transformers import KimiLinearConfig
    mla = [i + 1 for i, k in enumerate(cfg.layer_kinds) if k == MLA]
    kda = [i + 1 for i, k in enumerate(cfg.layer_kinds) if k != MLA]
    return KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, num_experts=cfg.num_experts,
        num_experts_per_token=cfg.num_experts_per_token, n_shared_experts=cfg.num_shared_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, first_k_dense_replace=cfg.first_k_dense_replace,
        rms_norm_eps=cfg.rms_norm_eps,
        linear_attn_config={"kda_layers": kda, "full_attn_layers": mla, "num_heads": cfg.kda_num_heads,
                            "head_dim": cfg.kda_head_dim, "short_conv_kernel_size": cfg.kda_conv_size},
        pad_token_id=cfg.pad_token_id, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=False)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def kernels_in_force() -> dict[str, str]:
    """Which implementation each of transformers' Kimi Linear kernel names runs: the one its
    hub-kernel wrapper chose at import (a closure cell; fla's, or the wrapped torch function)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mk
    names = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update")
    out = {}
    for n in names:
        fn = getattr(mk, n, None)
        chosen = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                  if callable(c.cell_contents) and getattr(c.cell_contents, "__module__", "") != __name__]
        impl = next((c for c in chosen if not getattr(c, "__module__", "").startswith("transformers")), fn)
        out[n] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
    return out


@torch.no_grad()
def bench_kimi_linear(cfg: K3Config, dtype: torch.dtype, *, batches: list[int], context: int, new_tokens: int,
                      prefill: list[int], device: str = "cuda", attn: str = "sdpa") -> dict[str, Any]:
    import transformers
    from transformers import KimiLinearForCausalLM
    config = kimi_linear_config(cfg)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(config).to(device=device, dtype=dtype).eval()
    out: dict[str, Any] = {"transformers": transformers.__version__, "dtype": str(dtype).replace("torch.", ""),
                           "attn_implementation": attn, "kernels": kernels_in_force(), "context": context,
                           "new_tokens": new_tokens, "decode": {}, "prefill": {}}
    gen = torch.Generator().manual_seed(3)

    def generate(ids, n):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=cfg.pad_token_id)
    for b in batches:
        try:
            ids = torch.randint(0, cfg.vocab_size, (b, context), generator=gen).to(device)
            generate(ids, 2)                                            # warm-up
            t1 = _timed(lambda: generate(ids, 1))
            tn = _timed(lambda: generate(ids, new_tokens))
            out["decode"][str(b)] = {"tok_s": b * (new_tokens - 1) / max(tn - t1, 1e-9),
                                     "generate_s": tn, "prefill_s": t1}
        except torch.cuda.OutOfMemoryError as exc:                      # pragma: no cover - GPU only
            out["decode"][str(b)] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
            torch.cuda.empty_cache()
    for t in prefill:
        try:
            ids = torch.randint(0, cfg.vocab_size, (1, t), generator=gen).to(device)
            model(input_ids=ids[:, :min(t, 1024)], use_cache=False)     # warm-up
            secs = _timed(lambda: model(input_ids=ids, use_cache=False))
            out["prefill"][str(t)] = {"tok_s": t / secs, "s": secs}
        except torch.cuda.OutOfMemoryError as exc:                      # pragma: no cover - GPU only
            out["prefill"][str(t)] = {"error": f"out of memory: {str(exc).splitlines()[0]}"}
            torch.cuda.empty_cache()
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out
