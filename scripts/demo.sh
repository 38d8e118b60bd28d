#!/usr/bin/env bash
# The main job from the README: installs txl-deploy (CPU) into ./.venv and runs the whole pipeline on the bundled
# demo model: export to ONNX, verify, generate, evaluate on held-out text, and a short benchmark against eager.
# Extra arguments go to `txl-deploy demo` (e.g. --out DIR --force).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[cpu,torch]' 'torch==2.13.0'
exec .venv/bin/txl-deploy demo "$@"
