"""`k3verify generate`: greedy decoding on the reference path, as a smoke test and a speed reading.

Prefill the whole prompt with one model.forward, then one token per forward, stopping
at the end-of-sequence token (and <|im_end|> in chat mode) or after --max-tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.table import Table

from k3verify.commands import add_device_flag, add_json_flag, add_model_flag, device_load_options, console, emit_json, model_load_options
from k3verify.errors import CheckFailed, UsageError

NAME = "generate"
HELP = "greedy-decode a prompt on the reference path and report tokens/s"


def add_arguments(parser) -> None:
    parser.add_argument("--prompt", required=True, help="prompt text (bytes of UTF-8; special-token strings stay text)")
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N", help="most tokens to generate (default 64)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    add_model_flag(parser)
    add_device_flag(parser)
    add_json_flag(parser)


def run(args) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:   # argv bytes that are not UTF-8 arrive as surrogate escapes
        raw = args.prompt.encode("utf-8", "surrogateescape")
        at = len(args.prompt[:exc.start].encode("utf-8", "surrogateescape"))
        raise UsageError(f"--prompt must be UTF-8 text; byte 0x{raw[at]:02x} at offset {at} is not UTF-8") from None

    import torch

    from optimized_stack import load_model
    from optimized_stack.tokenizer import IncrementalDecoder, load_tokenizer

    model = load_model(args.model, **device_load_options(args), **model_load_options(args))
    # A checkpoint directory may carry its own tokenizer_config.json (checked on load); else the byte tokenizer.
    tok_dir = Path(args.model) if args.model is not None and (Path(args.model) / "tokenizer_config.json").is_file() else None
    tok = load_tokenizer(tok_dir)
    vocab = model.config.vocab_size
    if vocab != tok.vocab_size:
        raise UsageError(f"generate needs a model with the byte tokenizer's vocab ({tok.vocab_size}), got vocab_size {vocab}")

    if args.chat:
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        stop_ids = {tok.eos_id, tok.im_end_id}
    else:
        prompt_ids = tok.encode(args.prompt, add_bos=True)
        stop_ids = {tok.eos_id}
    stop_ids.add(model.config.eos_token_id)

    generated: list[int] = []
    stop_reason = "max_tokens"
    decoder = IncrementalDecoder(tok, skip_special=True)
    text_parts: list[str] = []
    decode_forwards = 0  # forwards after prefill; the first token comes from the prefill logits
    with torch.inference_mode():
        state = model.new_state()
        t0 = time.perf_counter()
        logits = model.forward(torch.tensor(prompt_ids, dtype=torch.long), state)  # [T, vocab]
        t_prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        while True:
            _refuse_nonfinite(logits, state.num_tokens - logits.shape[0])
            next_id = int(torch.argmax(logits[-1]))  # greedy; argmax takes the first of tied maxima
            if next_id in stop_ids:
                stop_reason = "eos"
                break
            generated.append(next_id)
            text_parts.append(decoder.feed(next_id))
            if len(generated) >= args.max_tokens:
                break
            logits = model.forward(torch.tensor([next_id], dtype=torch.long), state)  # [1, vocab]
            decode_forwards += 1
        t_decode = time.perf_counter() - t1
    text_parts.append(decoder.flush())
    text = "".join(text_parts)

    decode_tps = decode_forwards / t_decode if t_decode > 0 and decode_forwards else 0.0
    prefill_tps = len(prompt_ids) / t_prefill if t_prefill > 0 else 0.0

    out = console()
    out.print(text, markup=False, highlight=False)
    t = Table(title="generate (greedy, reference path)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("prompt tokens", str(len(prompt_ids)))
    t.add_row("generated tokens", str(len(generated)))
    t.add_row("stop", stop_reason)
    t.add_row("prefill", f"{t_prefill * 1e3:.1f} ms ({prefill_tps:.1f} tok/s)")
    t.add_row("decode", f"{decode_tps:.2f} tok/s")
    out.print(t)
    out.print(f"{len(generated)} tokens, {decode_tps:.2f} tokens/s decode, {prefill_tps:.1f} tokens/s prefill", markup=False)
    if args.json:
        emit_json(
            {
                "command": NAME,
                "model": args.model,
                "chat": args.chat,
                "prompt_tokens": len(prompt_ids),
                "token_ids": generated,
                "text": text,
                "stop": stop_reason,
                "prefill_s": t_prefill,
                "decode_s": t_decode,
                "decode_tokens_per_s": decode_tps,
            }
        )
    return 0


def _refuse_nonfinite(logits, start: int) -> None:
    """A NaN / inf logit fails the run (exit 1) with its location; argmax would pick it."""
    from k3verify.capture.nonfinite import first_nonfinite
    nf = first_nonfinite(logits)                     # logits [T, vocab] for positions start..
    if nf is not None:
        raise CheckFailed(f"non-finite ({nf.kind}) in logits at position {start + nf.index_tuple[0]}, "
                          f"vocab index {nf.index_tuple[1]}")
    last = logits[-1]
    if logits.shape[-1] > 1 and bool((last == last[0]).all()):
        # argmax of a constant row is token 0 (a NUL byte) every step: the model is broken, and
        # printing what it "generates" would hide that (issue 29)
        raise CheckFailed(f"the model is degenerate: logits constant over the vocabulary at position "
                          f"{start + logits.shape[0] - 1} (every entry {float(last[0]):g}); nothing generated")
