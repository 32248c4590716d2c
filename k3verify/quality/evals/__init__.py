"""Quality gates: GSM8K through lm-eval (gsm8k.py over lm_eval_model.py), the synthetic
GSM8K-format generator (gsm8k_synth.py), RULER-style needle recall (needle.py) and the
Kimi Vendor Verifier checks (kvv.py).

Nothing is imported here, so needle and gsm8k_synth work without lm-eval installed.
"""
