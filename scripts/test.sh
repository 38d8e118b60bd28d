#!/usr/bin/env bash
# The test command from the README: sets up everything from nothing (Python 3.11, pip, gcc) and runs the suite.
# Creates ./.venv on first use and reuses it afterwards. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
# Triton's server binary (with its Python backend) for the serving tests. It goes beside the venv, not into it:
# nvidia-pytriton pins numpy < 2, and only its bundled tritonserver is needed (see txl_deploy/serving/triton/local_server.py).
[ -d .venv/triton/pytriton ] || .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
    --target .venv/triton nvidia-pytriton==0.7.0
# The browser tests (tests/exporters/test_web.py): Debian's chromium, node/npm, and an npm install of onnxruntime-web kept
# outside the clone so reruns are fast. Installed only when missing; where they are present the tests must run.
if ! command -v chromium >/dev/null || ! command -v npm >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            chromium fonts-dejavu-core $(command -v npm >/dev/null || echo nodejs npm) >/dev/null
    fi
fi
ORT_WEB=$(.venv/bin/python -c "from txl_deploy.exporters.web.site import ORT_WEB_VERSION; print(ORT_WEB_VERSION)")
export TXL_NPM_CACHE=${TXL_NPM_CACHE:-$HOME/.cache/txl-deploy/npm}
if command -v npm >/dev/null && ! grep -qs "\"version\": \"$ORT_WEB\"" \
        "$TXL_NPM_CACHE/node_modules/onnxruntime-web/package.json"; then
    npm install --prefix "$TXL_NPM_CACHE" --no-audit --no-fund --save-exact --loglevel=error "onnxruntime-web@$ORT_WEB"
fi
if command -v chromium >/dev/null && [ -d "$TXL_NPM_CACHE/node_modules/onnxruntime-web" ]; then
    export TXL_WEB_TESTS=${TXL_WEB_TESTS:-required}
fi
exec .venv/bin/python -m pytest -q "$@"
