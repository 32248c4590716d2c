#!/usr/bin/env bash
# The drafter's device command (issue 28 item 2) on an nvidia-h200 (carry .whl: fla-core):
#   run(command="bash scripts/gpu_drafter_bench.sh", carry=[".whl"], timeout_s=600)
# Under 10 minutes; results in $OUT: drafter_b1.json, drafter_b8.json, drafter_b64.json (the bench's
# JSON per batch size), drafter_bench.log (the tables), gpu_exactness_spec_model.json and its lane
# log (the draft model's toggles and mutant judged bitwise on the GPU reference), env.log.
#   foreground: python -m k3verify.perf.drafter_bench on the GPU profile (k3-mini, bf16), gsm8k-synth
#     and agentic, no speculation vs prompt lookup vs the draft model (ReplaySSM, k=3), at
#     B = max_num_seqs 1 (16 prompts), 8 (32 prompts), 64 (64 prompts), 64 new tokens each;
#   background: k3verify.perf.gpu_exactness on spec_model_copy_states / spec_model_replay_ssm and
#     their mutant.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/k3-drafter-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -f /tmp/site/.k3-installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.k3-installed
fi
export PYTHONPATH=/tmp/site:$PWD
{
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, fla; print("torch", torch.__version__, "triton", triton.__version__, "fla", fla.__version__, torch.cuda.get_device_name(0))'
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
(timeout 420 python3 -m k3verify.perf.gpu_exactness --out "$OUT" --budget-s 400 --tag spec_model \
   --sections exact,mutants --only spec_model_copy_states,spec_model_replay_ssm > "$OUT/lane_spec_model.log" 2>&1;
 echo "lane rc=$?" >> "$OUT/lane_spec_model.log") &
for spec in "1 16 ${B1_TIMEOUT_S:-200}" "8 32 ${B8_TIMEOUT_S:-150}" "64 64 ${B64_TIMEOUT_S:-120}"; do
  set -- $spec
  timeout "$3" python3 -m k3verify.perf.drafter_bench --device cuda --dtype bfloat16 --batch "$1" --prompts "$2" \
    --max-new 64 --k 3 --out "$OUT/drafter_b$1.json" 2>&1 | tee -a "$OUT/drafter_bench.log" | grep -v '^{'
  echo "B=$1 rc=${PIPESTATUS[0]}" | tee -a "$OUT/drafter_bench.log"
done
wait
grep -h "exact \|exact_mutants \|rc=" "$OUT"/lane_*.log 2>/dev/null | cut -c1-220
ls -la "$OUT"
