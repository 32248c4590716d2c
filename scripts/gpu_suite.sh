#!/usr/bin/env bash
# The one device command for the GPU path (issue 8) and tensor parallelism over NCCL
# (issue 10), on an nvidia-h200-x2 (a single H200 runs everything but the TP lane):
#   bash scripts/gpu_suite.sh          # carry .whl (fla-core) ; results land in $OUT
# Lane A (GPU 1): CUDA toggle verdicts + fla split invariance, then, alone on the machine,
# the k3-small benchmarks (counted only for toggles whose verdict passed in lane A).
# Lane B (GPUs 0+1, while lane A judges): W=2 TP over NCCL, then the gpu-marked pytest tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-gpu-out}
mkdir -p "$OUT"
# NVLink multicast stays off (device README): a program using it can take the host's GPUs down
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/gpu_env.sh     # carried wheels (.whl/) and PYTHONPATH
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader || true
n_gpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
bench_gpu=$(( n_gpu > 1 ? 1 : 0 ))
(
  if [ "$n_gpu" -ge 2 ]; then
    timeout 240 python3 -m k3verify.perf.gpu_suite --out "$OUT" --sections tp --budget-s 200 > "$OUT/lane_tp.log" 2>&1
  fi
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m pytest -m gpu tests/test_cuda_toggles.py -q -p no:cacheprovider \
    > "$OUT/pytest_gpu.log" 2>&1
) &
CUDA_VISIBLE_DEVICES=$bench_gpu timeout 260 python3 -m k3verify.perf.gpu_suite --out "$OUT" --sections verdicts,split --budget-s 230
wait
tail -5 "$OUT/pytest_gpu.log" "$OUT/lane_tp.log" 2>/dev/null
CUDA_VISIBLE_DEVICES=$bench_gpu K3VERIFY_GPU_VERDICTS="$OUT/gpu_verdicts_split.json" \
  timeout "${BENCH_TIMEOUT_S:-250}" python3 -m k3verify.perf.gpu_suite --out "$OUT" --sections bench --budget-s "${BENCH_BUDGET_S:-230}"
# the device returns at most 8 files: the Markdown and logs travel as one tar
(cd "$OUT" && tar -cf text.tar ./*.md ./*.log && rm -f ./*.md ./*.log)
ls -la "$OUT"
