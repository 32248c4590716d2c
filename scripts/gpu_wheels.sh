#!/usr/bin/env bash
# Fill .whl/ (gitignored) with the wheels a GPU run carries: the device image has torch, triton,
# transformers, pandas, pyarrow, scikit-learn and sacrebleu, but no fla-core, lm-eval or fastapi.
# Run here (the registry is reachable), then pass carry=[".whl"] to the device; scripts/gpu_env.sh
# installs them with --no-deps. Pinned to what the CPU venv runs, for the device's Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${DEVICE_PYTHON:-3.12}
pip_download() {
  "${PIP:-.venv/bin/pip}" download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}
pip_download fla-core==0.6.0
# lm-eval's gsm8k path imports these and nothing else the image lacks (measured: sys.modules after a run)
pip_download lm_eval==0.4.13 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
  more-itertools==11.2.1 evaluate==0.4.6 pytz==2026.6
# the served stack (`k3verify serve`, the KVV check): the image has anyio, click and h11 but no
# fastapi/uvicorn (the first release run's KVV unit: "No module named 'fastapi'")
pip_download fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 uvicorn==0.54.0 \
  annotated-types==0.8.0 typing-inspection==0.4.5
# fastapi 0.165 imports opentelemetry-api and annotated-doc at start-up (the third release run's KVV
# unit: "No module named 'opentelemetry'"; this list was checked against sys.modules on the CPU only)
pip_download opentelemetry-api==1.45.2 annotated-doc==0.0.7
# the served app validates json_schema response formats and tool declarations with jsonschema,
# imported at request time, not at start-up (the fourth release run's KVV unit: HTTP 500 on every
# json_schema and tool_choice request, "No module named 'jsonschema'" in the worker log); the
# modules it pulls in, from sys.modules after `import jsonschema` on the CPU
pip_download jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  attrs==26.1.0
# sdist-only and pure Python: build the wheel here
"${PIP:-.venv/bin/pip}" wheel -q --no-deps -w .whl word2number==1.1 sqlitedict==2.1.0
du -sh .whl
ls .whl
