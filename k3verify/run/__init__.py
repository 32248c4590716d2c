"""Stage 2, run: a scenario through the embedded stack with a set of toggles (sequential reference
loop, the optimized engine, or W tensor-parallel ranks), observers attached."""
