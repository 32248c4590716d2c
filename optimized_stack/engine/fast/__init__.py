"""The fast decode path: one static-shape forward over every running request (decode_step.py),
replayed from CUDA graphs at ladder sizes (graphs.py), wired into the engine by decoder.py and
switched by the exact toggles `batched_decode` and `cuda_graphs` (toggle_defs.py).
Its benchmark against transformers' Kimi Linear and the HBM roofline is k3verify/perf/fast_bench.py."""
