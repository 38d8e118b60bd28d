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
# The browser tests (tests/helpers/browser.py): Debian's chromium, node/npm, and an npm install of the pinned
# onnxruntime-web kept outside the clone so reruns are fast. On CI, and wherever this script can install them (root
# with apt), they are required: a missing or other-version install fails those tests instead of skipping them. Elsewhere
# they are required where already present, and skip, saying what is missing, where not.
can_install=false
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then can_install=true; fi
on_ci=false
case "${CI:-}" in ""|false|0) ;; *) on_ci=true ;; esac
if $can_install && { ! command -v chromium >/dev/null || ! command -v npm >/dev/null; }; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        chromium fonts-dejavu-core $(command -v npm >/dev/null || echo nodejs npm) >/dev/null
fi
ORT_WEB=$(.venv/bin/python -c "from txl_deploy.exporters.web.site import ORT_WEB_VERSION; print(ORT_WEB_VERSION)")
export TXL_NPM_CACHE=${TXL_NPM_CACHE:-$HOME/.cache/txl-deploy/npm}
ort_web_pinned() {
    grep -qs "\"version\": \"$ORT_WEB\"" "$TXL_NPM_CACHE/node_modules/onnxruntime-web/package.json"
}
if command -v npm >/dev/null && ! ort_web_pinned; then
    npm install --prefix "$TXL_NPM_CACHE" --no-audit --no-fund --save-exact --loglevel=error "onnxruntime-web@$ORT_WEB"
fi
if $on_ci || $can_install || { command -v chromium >/dev/null && ort_web_pinned; }; then
    export TXL_WEB_TESTS=${TXL_WEB_TESTS:-required}
fi
exec .venv/bin/python -m pytest -q "$@"
