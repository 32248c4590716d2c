"""A tiny random Llama checkpoint in Hugging Face layout, for driving vLLM offline.

vLLM cannot load the K3 architecture on CPU, so the vLLM backend is exercised on
a model it does support: LlamaForCausalLM, 2 layers, hidden 128, vocab 272 (the
256 bytes + 16 specials of optimized_stack.tokenizer, so the same prompt ids
work on both backends).

Weights come from one seeded torch.Generator and are written with safetensors,
not through `LlamaForCausalLM(config).save_pretrained`: transformers' init code
changes between releases, and a model hash that moves with the transformers
version would make golden captures useless. transformers loads the result as a
regular checkpoint (the test checks that when transformers is importable).

    python -m k3verify.serving.backends.tiny_hf_model OUT_DIR [--seed 0] [--perturb-ulps 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import torch

NUM_BYTES = 256
SPECIAL_TOKENS = (
    "<|pad|>", "<|bos|>", "<|eos|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
    "<|im_middle|>", "<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>",
)
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)  # 272
PAD_ID, BOS_ID, EOS_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2

# head_dim 64: vLLM's CPU attention accepts head sizes 32, 64, 80, ... only.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,  # GQA, so the KV cache layout is not the trivial one
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "torch_dtype": "float32",
}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """Seeded fp32 weights; scales chosen so next-token distributions are peaked, not flat.

    A near-uniform distribution would make greedy argmax a coin toss on 1-ULP noise,
    which hides real divergences behind tie-breaking.
    """
    g = torch.Generator().manual_seed(seed)
    h, f, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    n_q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    n_kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=torch.float32) * std

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((v, h), 1.0)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1.0 + normal((h,), 0.1)
        w[p + "self_attn.q_proj.weight"] = normal((n_q, h), 1.0 / math.sqrt(h))
        w[p + "self_attn.k_proj.weight"] = normal((n_kv, h), 1.0 / math.sqrt(h))
        w[p + "self_attn.v_proj.weight"] = normal((n_kv, h), 1.0 / math.sqrt(h))
        w[p + "self_attn.o_proj.weight"] = normal((h, n_q), 0.5 / math.sqrt(n_q))
        w[p + "post_attention_layernorm.weight"] = 1.0 + normal((h,), 0.1)
        w[p + "mlp.gate_proj.weight"] = normal((f, h), 1.0 / math.sqrt(h))
        w[p + "mlp.up_proj.weight"] = normal((f, h), 1.0 / math.sqrt(h))
        w[p + "mlp.down_proj.weight"] = normal((h, f), 0.5 / math.sqrt(f))
    w["model.norm.weight"] = 1.0 + normal((h,), 0.1)
    w["lm_head.weight"] = normal((v, h), 3.0 / math.sqrt(h))  # logit std ~3 nats
    return w


def _nudge(t: torch.Tensor, ulps: int) -> torch.Tensor:
    """Move element 0 of t by `ulps` float32 steps (the smallest change the model can see)."""
    out = t.clone()
    x = out.view(-1)[:1]
    direction = torch.tensor([math.inf if ulps > 0 else -math.inf], dtype=torch.float32)
    for _ in range(abs(ulps)):
        x.copy_(torch.nextafter(x, direction))
    return out


def _tokenizer_json() -> dict:
    """A byte-level tokenizer.json: ids 0..255 are bytes, no merges, specials after them.

    Built as data rather than through the `tokenizers` trainer so the file is the
    same on every install; `tokenizers` and PreTrainedTokenizerFast read it as is.
    """
    # GPT-2's printable stand-ins for the 256 bytes: the ByteLevel pre-tokenizer's alphabet.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    stand_in, extra = {}, 0
    for b in range(256):
        if b in printable:
            stand_in[b] = chr(b)
        else:
            stand_in[b] = chr(256 + extra)
            extra += 1
    vocab = {stand_in[b]: b for b in range(256)}
    added = [{"id": NUM_BYTES + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(SPECIAL_TOKENS)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }


# Kimi-style chat rendering, the same ids as optimized_stack.tokenizer.ByteTokenizer's
# apply_chat_template for text turns, tool declarations and assistant tool calls, so
# `vllm serve` on this model answers /v1/chat/completions (without a template it refuses
# every chat request with 400). Text parts of list content are joined, as there.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(call_idx=0) -%}"
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.content is string -%}{%- set text = m.content -%}"
    "{%- elif m.content -%}{%- set text = m.content | map(attribute='text') | join('') -%}"
    "{%- else -%}{%- set text = '' -%}{%- endif -%}"
    "{%- if m.role == 'tool' -%}"
    "<|im_system|>tool<|im_middle|>{% if m.tool_call_id %}## Return of {{ m.tool_call_id }}\n{% endif %}{{ text }}"
    "{%- else -%}"
    "{{ {'system': '<|im_system|>', 'user': '<|im_user|>', 'assistant': '<|im_assistant|>'}[m.role] }}"
    "{{ m.name or m.role }}<|im_middle|>{{ text }}"
    "{%- endif -%}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>"
    "{%- for c in m.tool_calls -%}{%- set fn = c.function or c -%}"
    "{%- set args = fn.arguments if fn.arguments is string else (fn.arguments or {}) | tojson(separators=(',', ':')) -%}"
    "<|tool_call_begin|>{{ c.id if (c.id or '').startswith('functions.') else 'functions.' ~ fn.name ~ ':' ~ ns.call_idx }}"
    "<|tool_call_argument_begin|>{{ args }}<|tool_call_end|>"
    "{%- set ns.call_idx = ns.call_idx + 1 -%}"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def make_tiny_llama(out_dir: str | Path, seed: int = 0, perturb_ulps: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json into out_dir.

    perturb_ulps != 0 moves one element of the final norm weight by that many ULPs:
    a model that differs from the seed's in the last bits of every logit, for
    negative controls.
    """
    from safetensors.torch import save_file

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = _weights(seed)
    if perturb_ulps:
        weights["model.norm.weight"] = _nudge(weights["model.norm.weight"], perturb_ulps)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json(), ensure_ascii=False) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2) + "\n")
    return out


def model_hash(model_dir: str | Path) -> str:
    """blake2b over the checkpoint files, so a capture records exactly which model it ran."""
    h = hashlib.blake2b(digest_size=16)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        h.update(name.encode())
        h.update((Path(model_dir) / name).read_bytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--perturb-ulps", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tiny_llama(args.out_dir, seed=args.seed, perturb_ulps=args.perturb_ulps)
    print(f"{out} {model_hash(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
