"""transformers' KimiLinearForCausalLM at the dims of a K3 preset, the peer of the engine benchmark.

Same sizes as the preset (hidden, layers and which are MLA, KDA heads / head dim, MLA ranks and
head dims, experts, top-k, shared experts, FFN widths, vocab); Kimi Linear has no AttnRes and no
latent MoE, so its experts run at the hidden width: it is the same-dims peer the issue compares
with, not the same model. Random init (speed does not depend on the values); the KDA kernels are
whatever transformers picks at import (fla when installed: recorded in the result).

bench_kimi_linear (fast_bench's section 4): decode tok/s net of prefill: generate(B prompts of L
tokens, N new) minus generate(..., 1 new), B*(N-1) tokens over the difference, one timed call
after a 2-token warm-up, with an all-ones attention_mask. On the H200 that figure read 3-4x low
(fla tuning inside the timed call; the mask): the fair figure is fair_bench.py's, through
KimiLinearPeer below. Prefill tok/s: one forward of T tokens without a cache.
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


# ---- the fair baseline's peer (fair_baseline.py): one model, several ways to call generate() ----
# arm -> generate() keyword arguments. "dynamic" is the default call without an attention_mask
# (equal-length prompts need none); "masked" passes the all-ones mask a padded batch would;
# "static" asks for a static cache with compilation off; "static_compiled" leaves transformers'
# auto-compile on (it compiles the decode step when the cache is compileable and the device is
# CUDA). Which cache and whether a compiled step ran are recorded per arm (`evidence`).
ARMS: dict[str, dict[str, Any]] = {
    "dynamic": {},
    "masked": {"masked": True},
    "static": {"cache_implementation": "static", "disable_compile": True},
    "static_compiled": {"cache_implementation": "static"},
}
MASKED_ARM = "masked"


class TokenClock:
    """A generate() streamer that stamps when each step's tokens were ready. generate() puts the
    prompt first (skipped), then each step's tokens. On CUDA the stamps are events on the stream
    (no synchronisation inside the loop, so the call runs as it would without us); on the CPU
    perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[Any] = []
        self.prompt_seen = False
        self.t0 = self._stamp()

    def _stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.events.append(self._stamp())

    def end(self) -> None:
        pass

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [self.t0.elapsed_time(e) / 1e3 for e in self.events]
        return [e - self.t0 for e in self.events]


class KimiLinearPeer:
    """transformers' KimiLinearForCausalLM at our model's dims (or a checkpoint directory), with
    fixed seeded prompts per batch size, timed through generate() and a cache-less forward."""

    def __init__(self, cfg: K3Config | None, dtype: torch.dtype, device: str, context: int, *,
                 checkpoint: str | None = None, attn: str = "sdpa", seed: int = 0) -> None:
        import transformers
        from transformers import KimiLinearForCausalLM
        torch.manual_seed(seed)
        if checkpoint:
            model = KimiLinearForCausalLM.from_pretrained(checkpoint, attn_implementation=attn)
        else:
            config = kimi_linear_config(cfg)
            config._attn_implementation = attn
            model = KimiLinearForCausalLM(config)
        self.model = model.to(device=device, dtype=dtype).eval()
        self.device = torch.device(device)
        self.vocab = self.model.config.vocab_size
        self.pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        self.context = context
        self.seed = seed
        self._prompts: dict[int, torch.Tensor] = {}
        self.evidence: dict[str, dict[str, Any]] = {}
        self.info = {"transformers": transformers.__version__, "dtype": str(dtype).replace("torch.", ""),
                     "attn_implementation": attn, "kernels": kernels_in_force(), "checkpoint": checkpoint,
                     "params": sum(p.numel() for p in self.model.parameters())}

    def prompts(self, batch: int) -> torch.Tensor:
        if batch not in self._prompts:                                  # [B, L], the same for every arm
            gen = torch.Generator().manual_seed(self.seed * 1000 + batch)
            self._prompts[batch] = torch.randint(0, self.vocab, (batch, self.context), generator=gen).to(self.device)
        return self._prompts[batch]

    def arm(self, name: str):
        """The arm's (batch, new_tokens) -> GenerateRun callable; raises ValueError for an unknown
        name or one this device cannot run."""
        from .fair_baseline import GenerateRun
        if name not in ARMS:
            raise ValueError(f"unknown transformers arm {name!r}: expected one of {', '.join(ARMS)}")
        if name == "static_compiled" and self.device.type != "cuda":
            raise ValueError("static_compiled: transformers auto-compiles generate() on CUDA only")
        opts = dict(ARMS[name])
        masked = opts.pop("masked", False)

        @torch.no_grad()
        def run(batch: int, new_tokens: int) -> GenerateRun:
            ids = self.prompts(batch)
            extra = {"attention_mask": torch.ones_like(ids)} if masked else {}
            clock = TokenClock(self.device)
            ev = self.evidence.setdefault(name, {"cache_classes": []})
            # the hook records which cache the forward got; not on the compiled arm, where a hook
            # added and removed around each call would be a guard to recompile on
            hook = None if name == "static_compiled" else \
                self.model.register_forward_pre_hook(self._note_cache(ev), with_kwargs=True)
            try:
                _sync()
                t0 = time.perf_counter()
                out = self.model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                          do_sample=False, pad_token_id=self.pad, streamer=clock, **extra, **opts)
                _sync()
                total = time.perf_counter() - t0
            finally:
                if hook is not None:
                    hook.remove()
            if out.shape[1] != ids.shape[1] + new_tokens:
                raise RuntimeError(f"{name}: generate returned {out.shape[1] - ids.shape[1]} new tokens, "
                                   f"asked for {new_tokens}")
            stamps = clock.seconds()
            if len(stamps) != new_tokens:
                raise RuntimeError(f"{name}: the streamer saw {len(stamps)} token steps, expected {new_tokens}")
            if name == "static_compiled":
                ev["compiled_step"] = hasattr(self.model, "_compiled_call")
            return GenerateRun(total, stamps)
        return run

    @staticmethod
    def _note_cache(ev: dict[str, Any]):
        def hook(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            cls = type(cache).__name__ if cache is not None else None
            if cls not in ev["cache_classes"]:
                ev["cache_classes"].append(cls)
            # generate() may build a mask itself: what the forward got is the evidence
            mask = kwargs.get("attention_mask")
            kind = "none" if mask is None else ("all-ones" if bool((mask == 1).all()) else "padded") \
                if isinstance(mask, torch.Tensor) else type(mask).__name__
            if kind not in ev.setdefault("attention_mask", []):
                ev["attention_mask"].append(kind)
        return hook

    @torch.no_grad()
    def prefill(self, tokens: int) -> float:
        gen = torch.Generator().manual_seed(self.seed + tokens)
        ids = torch.randint(0, self.vocab, (1, tokens), generator=gen).to(self.device)
        return _timed(lambda: self.model(input_ids=ids, use_cache=False))
