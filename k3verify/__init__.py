"""k3verify: the correctness and numerics gate for Kimi K3 inference."""
from pathlib import Path

__version__ = "0.1.0"
REPO_ROOT = Path(__file__).resolve().parent.parent    # checks/, golden/, reports/ live here
