#!/usr/bin/env bash
# Install everything, build the bundled demo model, and scan HF (training) against vLLM (inference).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
[ -f demo/qwen3/config.json ] || .venv/bin/logdiff demo-model demo/qwen3 --arch qwen3
.venv/bin/logdiff scan demo/qwen3 --infer vllm --out demo/scan
echo "wrote demo/scan/result.json and demo/scan/report.html"
