"""k3verify: the correctness and numerics gate for Kimi K3 inference."""
__version__ = "0.1.0"
