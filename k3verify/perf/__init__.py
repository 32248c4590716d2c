"""Speed: interleaved A/B timing with one statistic (geometric mean of per-pair ratios with a
t-interval), counted only after the contract held; the GPU run; the engine benchmark."""
