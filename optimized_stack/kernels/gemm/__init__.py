"""Forms of the projection GEMM y = x @ W.T (the `linear` op slot): the reference is
model/ops.py row_linear (row-stable 8-row tiles); per_shape.py picks an implementation by shape."""
