#!/usr/bin/env bash
# The one command run on the device (H200) for issue 7: train k3-mini, write it to $OUT.
#   bash scripts/gpu_train.sh smoke [MINUTES]  # op self-check + ~1 min of training, no evals
#   bash scripts/gpu_train.sh train MINUTES [extra scripts/train_k3mini.py flags]
#   resume: ... train MINUTES --init DIR   (DIR: a model dir, plus optim.pt to keep AdamW's state)
# Both start with the op self-check (chunked KDA vs the recurrence, SDPA vs plain softmax).
# fla-core is optional (--kda fla): carry its wheel in .whl/ to use it. At K3's head dims (--preset
# k3-dims) it is needed on an 80 GB card: the plain torch chunk form ran out of memory on an H100 with
# 32,768 needle tokens a step (2026-12-07). fla compiles its forward and backward in the first step
# (272 s on a fresh H100); the schedule starts after it (optimized_stack/train.py fit), the run's
# MINUTES include it.
set -euo pipefail
mode=${1:-train}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-train-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/gpu_env.sh     # carried wheels (.whl/) and PYTHONPATH
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
python3 -c "
import json, torch, sys; sys.setrecursionlimit(10000)
from optimized_stack.train_check import self_check
print('torch', torch.__version__, 'selfcheck', json.dumps(self_check('cuda')), flush=True)"
if [ "$mode" = smoke ]; then
  python3 scripts/train_k3mini.py --out "$OUT/ckpt" --minutes "${2:-1.2}" --eval-every-s 1e9 "${@:3}"
else
  # $OUT/ckpt gets the 8 files the device tool can return: the model dir plus optim.pt,
  # rewritten at every eval (--eval-every-s), so a run cut by its time limit still returns weights
  python3 scripts/train_k3mini.py --out "$OUT/ckpt" --minutes "${2:-6}" "${@:3}"
fi
# A returned file is at most 16 MiB: k3-dims' optim.pt (32 MB) never comes back, and it took the place
# of the Triton cache, whose fla backward kernels cost the next training call its first ~270 s
# (2026-12-07). It moves out of $OUT when too large to return, and the cache is kept (carry it as
# .gpu-cache/ next time: gpu_env.sh restores it).
if [ -f "$OUT/ckpt/optim.pt" ] && [ "$(stat -c %s "$OUT/ckpt/optim.pt")" -ge 16000000 ]; then
  mv "$OUT/ckpt/optim.pt" /tmp/ && echo "optim.pt: over a returned file's 16 MiB, left on the device (/tmp/optim.pt)"
fi
triton_cache_save "$OUT"
ls -la "$OUT" "$OUT/ckpt" || true
