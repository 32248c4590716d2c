"""Stage 4, compare: the one comparator (bitwise / ULP / KL findings) and the capture-level
comparisons built on it (embedded captures, vLLM logprobs, golden hashes)."""
