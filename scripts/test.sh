#!/usr/bin/env bash
# The test command from the README: sets up everything from nothing (Python 3.11, pip, gcc) and runs the suite.
# Creates ./.venv on first use and reuses it afterwards. Extra arguments go to pytest.
# The suite runs in pytest-xdist workers, one per CPU core up to 4 (each holds torch, TensorFlow and ONNX Runtime),
# each taking a whole test file at a time, so a module's fixtures are built once. TXL_TEST_WORKERS=N sets the
# number (0: no workers, all in pytest's own process). TXL_TEST_STEP=setup only sets up; =run only runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STEP=${TXL_TEST_STEP:-all}
case "$STEP" in all|setup|run) ;; *) echo "error: TXL_TEST_STEP is all, setup or run, not '$STEP'" >&2; exit 2 ;; esac
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# The browser tests (tests/helpers/browser.py): Debian's chromium, node/npm, and an npm install of the pinned
# onnxruntime-web kept outside the clone so reruns are fast. On CI, and wherever this script can install them (root
# with apt), they are required: a missing or other-version install fails those tests instead of skipping them. Elsewhere
# they are required where already present, and skip, saying what is missing, where not.
can_install=false
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then can_install=true; fi
on_ci=false
case "${CI:-}" in ""|false|0) ;; *) on_ci=true ;; esac
export TXL_NPM_CACHE=${TXL_NPM_CACHE:-$HOME/.cache/txl-deploy/npm}
ort_web_pinned() {
    grep -qs "\"version\": \"$ORT_WEB\"" "$TXL_NPM_CACHE/node_modules/onnxruntime-web/package.json"
}

if [ "$STEP" != run ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
    # Triton's server binary (with its Python backend) for the serving tests. It goes beside the venv, not into it:
    # nvidia-pytriton pins numpy < 2, and only its bundled tritonserver is needed (see
    # txl_deploy/serving/triton/local_server.py).
    [ -d .venv/triton/pytriton ] || .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
        --target .venv/triton nvidia-pytriton==0.7.0
    if $can_install && { ! command -v chromium >/dev/null || ! command -v npm >/dev/null; }; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            chromium fonts-dejavu-core $(command -v npm >/dev/null || echo nodejs npm) >/dev/null
    fi
fi
ORT_WEB=$(.venv/bin/python -c "from txl_deploy.exporters.web.site import ORT_WEB_VERSION; print(ORT_WEB_VERSION)")
if [ "$STEP" != run ] && command -v npm >/dev/null && ! ort_web_pinned; then
    npm install --prefix "$TXL_NPM_CACHE" --no-audit --no-fund --save-exact --loglevel=error "onnxruntime-web@$ORT_WEB"
fi
[ "$STEP" != setup ] || exit 0

if $on_ci || $can_install || { command -v chromium >/dev/null && ort_web_pinned; }; then
    export TXL_WEB_TESTS=${TXL_WEB_TESTS:-required}
fi
WORKERS=${TXL_TEST_WORKERS:-$(nproc)}
[ "$WORKERS" -le 4 ] || WORKERS=4
# torch's and the BLAS's threads: the cores shared among the workers, so that they do not wait on each other
[ "$WORKERS" -le 1 ] || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / WORKERS > 1 ? $(nproc) / WORKERS : 1 ))}
exec .venv/bin/python -m pytest -q -n "$WORKERS" --dist loadfile "$@"
