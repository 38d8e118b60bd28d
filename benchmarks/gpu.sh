#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: run the GPU tests, then benchmark every backend present there against the
# PyTorch eager reference on CUDA, and print one table.
#
#   benchmarks/gpu.sh [SHAPE_OR_CHECKPOINT] [MEM_LEN]        (default: enwik8-base 2100)
#
# Backends: torch-fast on CUDA (CUDA-graph decode), ONNX Runtime CUDA (a `full`-state export, so the memory
# stays on the device with IO binding) when onnxruntime-gpu is installed, TensorRT (an engine built from the
# same full-state export) when tensorrt is importable. Results: benchmarks/results/gpu-*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CLI=${CLI:-.venv/bin/txl-deploy}
MODEL=${1:-enwik8-base}
MEM_LEN=${2:-2100}
OUT=benchmarks/results
CACHE=benchmarks/.cache/gpu
COMMON=(--batch 1,8 --prompt-len 512 --gen-len 64 --repeat 3 --device cuda
        --cache-dir "$CACHE" --quiet --force)
mkdir -p "$OUT" "$CACHE"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || {
  echo "no nvidia-smi: this script needs an NVIDIA GPU" >&2; exit 1; }

echo "== GPU tests"
"$PY" -m pytest -q tests/exporters/test_tensorrt_gpu.py tests/exporters/test_tensorrt_build.py -rs || echo "GPU TESTS FAILED" >&2

has() { "$PY" -c "$1" >/dev/null 2>&1; }
RUNS=()

echo "== torch-fast (CUDA graphs) vs eager, on CUDA"
"$CLI" bench "$MODEL" --backend torch-fast --mem-len "$MEM_LEN" "${COMMON[@]}" --json "$OUT/gpu-torch-fast.json" && RUNS+=("$OUT/gpu-torch-fast.json")

# The checkpoint behind MODEL, for the exports below (a shape name is built into the cache by the run above).
CKPT=$("$PY" - "$MODEL" "$CACHE" <<'PYEOF'
import sys
from txl_deploy.bench.random_weights import is_shape_name, standin_checkpoint
m, cache = sys.argv[1:]
print(standin_checkpoint(m, cache, log=lambda *a: None) if is_shape_name(m) else m)
PYEOF
)
FULL="$CACHE/model-m$MEM_LEN-full.onnx"
[ -f "$FULL" ] || "$CLI" export "$CKPT" -o "$FULL" --mem-len "$MEM_LEN" --state full --no-verify

if has "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()"; then
  echo "== ONNX Runtime CUDA (full state, IO binding) vs eager"
  "$CLI" bench "$FULL" --reference "$CKPT" --providers cuda "${COMMON[@]}" \
    --json "$OUT/gpu-ort-cuda.json" && RUNS+=("$OUT/gpu-ort-cuda.json")
else
  echo "-- skipped ONNX Runtime CUDA: onnxruntime-gpu with CUDAExecutionProvider is not installed"
fi

if has "import tensorrt"; then
  echo "== TensorRT vs eager"
  ENGINE="$CACHE/model-m$MEM_LEN.engine"
  [ -f "$ENGINE" ] || "$CLI" build-engine "$FULL" -o "$ENGINE" --batch 1:1:8 --timing-cache "$CACHE/timing.cache"
  "$CLI" bench "$ENGINE" --reference "$CKPT" "${COMMON[@]}" \
    --json "$OUT/gpu-tensorrt.json" && RUNS+=("$OUT/gpu-tensorrt.json")
else
  echo "-- skipped TensorRT: not importable"
fi

echo "== all backends (speedup = eager p50 / backend p50, measured interleaved in each run)"
"$PY" - "${RUNS[@]}" <<'PYEOF'
import json, sys
rows = [("backend", "mem_len", "batch", "decode p50 ms", "p99 ms", "tok/s", "prefill tok/s", "speedup", "max|dlogp|")]
eager = {}
for path in sys.argv[1:]:
    rep = json.load(open(path))
    for r in rep["results"]:
        c, b = r["sides"]["candidate"], r["sides"].get("baseline")
        if b:
            eager.setdefault((r["mem_len"], r["batch"]), []).append(b["decode_ms"]["p50"])
        rows.append((c["backend"], r["mem_len"], r["batch"], f"{c['decode_ms']['p50']:.2f}", f"{c['decode_ms']['p99']:.2f}",
                     f"{c['decode_tokens_per_s']:.0f}", f"{c['prefill_tokens_per_s']:.0f}",
                     f"{r['speedup']['decode_p50']:.1f}x" if r["speedup"] else "",
                     f"{r['parity']['max_abs_diff']:.1e}" if r["parity"] else ""))
for (m, bt), ms in sorted(eager.items()):
    ms = sorted(ms)
    rows.append(("torch eager (median of runs)", m, bt, f"{ms[len(ms) // 2]:.2f}", "", "", "", "1.0x", ""))
w = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
for r in rows:
    print("  ".join(str(c).rjust(x) for c, x in zip(r, w)))
PYEOF
