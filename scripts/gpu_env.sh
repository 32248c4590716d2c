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
# A fresh machine spends ~80-120 s compiling and tuning fla's kernels. The cache a run leaves
# (triton_cache_save) comes back as $OUT/triton-cache.tar.gz; carried as .gpu-cache/ on the next
# call, it is unpacked here first, so that call reads the compiled kernels and the tuned choices
# instead of redoing them (Triton keys each entry by source, target and compile options, so a stale
# or foreign entry is a miss, never a wrong kernel).
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k3-triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .gpu-cache/triton-cache.tar.gz ] && [ ! -f "$TRITON_CACHE_DIR/.k3-restored" ]; then
  tar -xzf .gpu-cache/triton-cache.tar.gz -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.k3-restored"
  echo "triton cache restored: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files"
fi
# triton_cache_save DIR: the cache as DIR/triton-cache.tar.gz, when it fits a returned file (16 MiB).
# A cache hit reads only each kernel's cubin and its JSON (triton/compiler/compiler.py: CompiledKernel
# takes the backend's binary; the group lists absolute paths, so the directory is fixed above), so the
# intermediate stages stay behind: with them the first release call's cache packed to 37 MB.
triton_cache_save() {
  tar -czf "$1/triton-cache.tar.gz.part" -C "$TRITON_CACHE_DIR" --exclude .k3-restored \
    --exclude '*.ttir' --exclude '*.ttgir' --exclude '*.llir' --exclude '*.ptx' --exclude '*.source' . || return 1
  if [ "$(stat -c %s "$1/triton-cache.tar.gz.part")" -lt 16000000 ]; then
    mv "$1/triton-cache.tar.gz.part" "$1/triton-cache.tar.gz"
  else
    echo "triton cache: $(du -h "$1/triton-cache.tar.gz.part" | cut -f1) is over a returned file's 16 MiB; not kept"
    rm -f "$1/triton-cache.tar.gz.part"
  fi
}
# no hub on the device: lm-eval's local JSON task data and the datasets cache only
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# env_log FILE: the GPU and the versions a report names (nvidia-smi; torch, triton, and fla and
# transformers where importable), written to FILE and printed.
env_log() {
  {
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    # the host: the release units are host-bound (14 processes on 16 cores), and run 11's GSM8K units
    # were ~30% slower than run 10's on another H100 host with nothing to tell the hosts apart
    echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores"
    nvidia-smi --query-gpu=clocks.max.sm,clocks.max.mem,power.limit --format=csv,noheader || true
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
# mps_start / mps_stop: CUDA MPS for the processes this machine starts next (`all --jobs N` runs N
# CUDA contexts on one GPU, each host-bound and launching small kernels; without MPS the GPU
# time-slices between contexts, with it their kernels can run side by side). Opt-in (MPS=1 in
# gpu_all.sh), measured by scripts/gpu_mps_ab.sh before it is anyone's default. A user-space daemon:
# no clock, power, compute-mode or MIG setting is touched, and mps_stop quits it. Refused, with the
# reason, when the daemon does not start or a client cannot compute through it; the caller then
# runs without it.
mps_start() {
  command -v nvidia-cuda-mps-control >/dev/null 2>&1 || { echo "mps: nvidia-cuda-mps-control not found; off"; return 1; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/k3-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/k3-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if ! nvidia-cuda-mps-control -d; then
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    echo "mps: the control daemon did not start; off"; return 1
  fi
  if ! timeout 120 python3 -c 'import torch; x = torch.ones(1 << 20, device="cuda"); assert int(x.sum()) == 1 << 20'; then
    mps_stop; echo "mps: a client could not compute through the daemon; off"; return 1
  fi
  echo "mps: on ($CUDA_MPS_PIPE_DIRECTORY)"
}
mps_stop() {
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    sleep 1
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
