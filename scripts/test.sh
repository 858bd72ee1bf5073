#!/usr/bin/env bash
# Set up (idempotent) and run the test suite in the project's virtual environment.
#   scripts/test.sh                 the whole suite
#   scripts/test.sh -m "not slow"   the fast tier (no rank processes on the real model)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MLXCLUSTER_VENV:-.venv}
scripts/setup.sh
exec "$VENV/bin/python" -m pytest -q -ra "$@"
