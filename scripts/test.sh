#!/usr/bin/env bash
# The test command from the README: sets up everything from nothing (Python 3.11, pip, gcc) and runs the suite.
# Creates ./.venv on first use and reuses it afterwards. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
exec .venv/bin/python -m pytest -q "$@"
