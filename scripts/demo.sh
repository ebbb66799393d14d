#!/usr/bin/env bash
# Install logdiff (not the test tools), build the bundled demo model, and scan HF (training) against vLLM (inference).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# A fixed step count makes the demo model the same on every machine of this kind (~90 s of CPU).
[ -f demo/qwen3/config.json ] || .venv/bin/logdiff demo-model demo/qwen3 --arch qwen3 --max-steps 280
.venv/bin/logdiff scan demo/qwen3 --out demo/scan   # default: vLLM, --depth modules (where and why)
echo "wrote demo/scan/result.json and demo/scan/report.html"
