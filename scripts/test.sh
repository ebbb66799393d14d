#!/usr/bin/env bash
# Run the test suite with the project's virtualenv (create it first with scripts/install.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests: that is a failure here, the suite must run" >&2
  exit 1
fi
exit "$rc"
