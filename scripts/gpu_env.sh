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
