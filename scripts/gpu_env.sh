# Sourced by every scripts/gpu_*.sh, from the repository root: the carried wheels (.whl/: fla-core,
# and whatever else the device image lacks) go to /tmp/site once per machine (a second script on
# the same warm machine reuses them), and PYTHONPATH puts them and this checkout first.
if [ -d .whl ] && [ ! -f /tmp/site/.k3-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.k3-installed
fi
export PYTHONPATH=/tmp/site:$PWD
# Triton keeps each autotuned kernel's chosen config on disk (~/.triton/cache): the first process
# tunes (fla's KDA kernels: ~80-95 s per head size), every later process on this machine reads the
# choice, so `all --jobs N` workers neither re-tune nor pick different tiles from one another.
export TRITON_CACHE_AUTOTUNING=1
# no hub on the device: lm-eval's local JSON task data and the datasets cache only
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# env_log FILE: the GPU and the versions a report names (nvidia-smi; torch, triton, and fla and
# transformers where importable), written to FILE and printed.
env_log() {
  {
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    python3 - <<'PY'
import importlib
parts = []
for name in ("torch", "triton", "fla", "transformers"):
    try:
        parts.append(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        parts.append(f"{name} absent")
print(" ".join(parts))
PY
  } > "$1" 2>&1
  cat "$1"
}
