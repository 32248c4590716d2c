"""Stage 3, capture: what a run produced, as hashes (tensors when asked), with the first
non-finite element beside every hash."""
