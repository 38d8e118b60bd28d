#!/usr/bin/env bash
# The test command from the README: sets up everything from nothing (Python 3.11, pip, gcc) and runs the suite.
# Creates ./.venv on first use and reuses it afterwards. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
# Triton's server binary (with its Python backend) for the serving tests. It goes beside the venv, not into it:
# nvidia-pytriton pins numpy < 2, and only its bundled tritonserver is needed (see txl_deploy/triton_local.py).
[ -d .venv/triton/pytriton ] || .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    --target .venv/triton nvidia-pytriton==0.7.0
exec .venv/bin/python -m pytest -q "$@"
