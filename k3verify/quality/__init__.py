"""Quality gates for approx toggles: paired statistics, the evals (GSM8K through lm-eval, needle,
KVV) and the gates that turn them into results."""
