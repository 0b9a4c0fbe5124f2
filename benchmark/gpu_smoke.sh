#!/usr/bin/env bash
# GPU smoke test: the first run on a GPU, in about 14 minutes (details: benchmark/gpu_smoke.py, docs/benchmarks.md).
#   bash benchmark/gpu_smoke.sh                 # one GPU: Pythia-160m DPO/RLOO/PPO, Qwen2.5-0.5B GRPO on GSM8K
#   PYTHIA=/models/pythia-160m QWEN=/models/Qwen2.5-0.5B-Instruct PYTHIA_BIG=/models/pythia-2.8b GSM8K=/data/gsm8k \
#     bash benchmark/gpu_smoke.sh               # offline (of PYTHIA_BIG only config.json is read)
#   bash benchmark/gpu_smoke.sh --only torch    # the part that needs only torch and transformers (no vLLM)
#   bash benchmark/gpu_smoke.sh --only torch --random-weights   # that part from configs it writes: no hub, no files
#   bash benchmark/gpu_smoke.sh --cpu           # on CPU with tiny models built on the fly (tests/test_gpu_smoke.py)
# Prints PASS/FAIL per check and a table; exits non-zero if any check fails.
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/gpu_smoke.py" "$@"
