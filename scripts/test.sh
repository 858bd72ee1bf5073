#!/usr/bin/env bash
# Set up (idempotent) and run the test suite in the project's virtual environment.
#   scripts/test.sh                 the whole suite
#   scripts/test.sh -m "not slow"   the fast tier (no rank processes on the real model)
# Modules run on MLXCLUSTER_TEST_WORKERS (default 2, this machine's cores) pytest-xdist workers, a
# module always in one worker (--dist loadfile: its shared groups start once); 0 runs them in this
# process, one after another.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MLXCLUSTER_VENV:-.venv}
# Bytecode caches on: with PYTHONDONTWRITEBYTECODE set (as in this project's sandboxes) every test worker
# compiles the package and pytest rewrites every test module from source, and so does each of the suite's
# hundreds of rank and CLI processes: collection took ~8 s a worker, ~3 s with the caches.
unset PYTHONDONTWRITEBYTECODE
scripts/setup.sh
WORKERS=${MLXCLUSTER_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  exec "$VENV/bin/python" -m pytest -q -ra --durations=20 "$@"
fi
# --no-loadscope-reorder: the modules go to the workers longest first, as tests/conftest.py orders them
exec "$VENV/bin/python" -m pytest -q -ra --durations=20 -n "$WORKERS" --dist loadfile --no-loadscope-reorder "$@"
