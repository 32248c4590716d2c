"""The fast decode path: one static-shape forward over every running request (decode_step.py),
replayed from CUDA graphs at ladder sizes (graphs.py), wired into the engine by decoder.py and
switched by the exact toggles `batched_decode` and `cuda_graphs` (toggle_defs.py). bench.py is
the GPU benchmark of the whole stack against transformers' Kimi Linear and the HBM roofline."""
