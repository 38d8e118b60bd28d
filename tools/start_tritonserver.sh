#!/usr/bin/env bash
# Serve a Triton model repository (written by `txl-deploy triton-repo`) with the tritonserver that the
# nvidia-pytriton wheel bundles (Triton 2.51, Python backend only), on 127.0.0.1, in the foreground.
#
#   tools/start_tritonserver.sh REPO [--http-port 8000] [--grpc-port 8001] [--log FILE]
#
# Installs the server files on first use, outside site-packages (the wheel pins numpy<2; we only need its binary):
#   pip install --no-deps --target "$VENV/triton" nvidia-pytriton==0.7.0
# Environment: PYTHON (default: .venv/bin/python, else python3), TXL_TRITONSERVER (another tritonserver binary).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x "$here/.venv/bin/python" ]; then PYTHON="$here/.venv/bin/python"; else PYTHON=python3; fi
fi
if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
prefix="$("$PYTHON" -c 'import sys; print(sys.prefix)')"
if [ -z "${TXL_TRITONSERVER:-}" ] && [ ! -x "$prefix/triton/pytriton/tritonserver/bin/tritonserver" ]; then
  echo "installing the bundled tritonserver into $prefix/triton ..." >&2
  "$PYTHON" -m pip install --quiet --no-deps --target "$prefix/triton" nvidia-pytriton==0.7.0
fi
exec "$PYTHON" -m txl_deploy.triton_local "$@"
