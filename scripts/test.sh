#!/usr/bin/env bash
# Run the test suite with the project's virtualenv. Create it first with scripts/install.sh; this adds the
# test tools (install.sh --dev, which only checks once they are installed), then runs pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "test.sh: no .venv here: run 'bash scripts/install.sh' first, then this again" >&2
  exit 2
fi
bash scripts/install.sh --dev || exit $?
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure here, the suite must run" >&2
  exit 1
fi
exit "$rc"
