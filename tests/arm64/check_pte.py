"""The three sides of the aarch64 ExecuTorch check run by `tests/arm64/run.sh --executorch`.

    check_pte.py reference WORK        this machine: export the demo model to WORK/model.pte (XNNPACK, fp32) and
                                       record what ExecuTorch computes here with it
    check_pte.py guest WORK CPU        under qemu-aarch64: the same stream and prompt through TxlRuntime on the
                                       wheel installed for aarch64, with PyPI's aarch64 torch and executorch
    check_pte.py report WORK CPU...    this machine: judge every guest against the reference

What must hold on every emulated CPU: the log-probs of a multi-segment batch-2 stream that wraps the memory's ring
buffer within the fp32 export tolerance of the same program on x86 (|arm - x86| <= 1e-4 + 1e-5 |x86|, the rule
both exporters verify with), and the same greedy continuation token for token. The stream, the prompt and the
judging are check.py's (the ONNX Runtime check), so both checks hold the two programs to the same standard.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import platform
import sys
import time
from pathlib import Path

import numpy as np

# check.py is a script beside this one, not a package module: loaded by path, as its own test loads it
_spec = importlib.util.spec_from_file_location("arm64_check", Path(__file__).with_name("check.py"))
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

STEM = "guest-pte"
MODEL = "model.pte"


def open_runtime(model):
    from txl_deploy.runtimes import TxlRuntime

    # one thread on both sides: the same reduction order, and QEMU's threads would share two busy cores
    return TxlRuntime.load(model, threads=1)


def record(rt) -> dict:
    """The stream's log-probs and the greedy tokens, with the seconds each took."""
    segments = stream_segments(rt)
    t0 = time.perf_counter()
    tokens, log_probs = check.run_stream(rt, segments)
    t1 = time.perf_counter()
    ids = check.greedy(rt)
    t2 = time.perf_counter()
    return {"segments": segments, "tokens": tokens, "log_probs": log_probs, "greedy": ids,
            "sample": check.PROMPT + rt.decode(ids), "stream_seconds": t1 - t0, "greedy_seconds": t2 - t1}


def stream_segments(rt) -> list[int]:
    """The segment lengths of the stream: the ONNX exporter's verification stream, which wraps the ring buffer."""
    from txl_deploy.exporters.onnx.verify import verification_segments

    return verification_segments(rt.mem_len, rt.backend.max_segment)


def reference(work: Path):
    import executorch
    import torch

    from txl_deploy.assets import demo_model_path
    from txl_deploy.exporters.executorch.export import export_executorch

    t0 = time.perf_counter()
    export_executorch(demo_model_path(), work / MODEL)
    exported = time.perf_counter() - t0
    with open_runtime(work / MODEL) as rt:
        out = record(rt)
    np.savez(work / "reference.npz", tokens=out["tokens"], log_probs=out["log_probs"],
             segments=np.array(out["segments"]), greedy=np.array(out["greedy"]))
    meta = {"machine": platform.machine(), "torch": torch.__version__, "executorch": _version(executorch),
            "numpy": np.__version__, "sample": out["sample"], "export_seconds": exported,
            "stream_seconds": out["stream_seconds"], "greedy_seconds": out["greedy_seconds"],
            "pte_bytes": (work / MODEL).stat().st_size}
    (work / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"  x86 reference: {MODEL} ({meta['pte_bytes'] / 1e6:.1f} MB, exported and verified in {exported:.0f} s), "
          f"{len(out['segments'])} segments {out['segments']} (batch {check.BATCH}) in {out['stream_seconds']:.2f} s, "
          f"{check.GREEDY_TOKENS} greedy tokens in {out['greedy_seconds']:.2f} s: {meta['sample']!r}")


def _version(module) -> str:
    from importlib.metadata import version

    return version(module.__name__)


def guest(work: Path, cpu: str):
    if platform.machine() != "aarch64":
        sys.exit(f"error: the guest runs on {platform.machine()}, expected aarch64 (is it running under QEMU?)")
    part = check.cpuinfo("CPU part")
    if cpu in check.CPU_PARTS and part != check.CPU_PARTS[cpu]:
        sys.exit(f"error: asked QEMU for {cpu} (CPU part {check.CPU_PARTS[cpu]}), the guest reports CPU part {part}")
    started = time.perf_counter()
    import executorch
    import torch
    from executorch.runtime import Runtime

    import txl_deploy

    imported = time.perf_counter() - started
    ref = np.load(work / "reference.npz")
    with open_runtime(work / MODEL) as rt:
        if [int(s) for s in ref["segments"]] != stream_segments(rt):
            sys.exit("error: the guest's runtime reads another mem_len or max_segment from the program's sidecar")
        out = record(rt)
    np.savez(work / f"{STEM}-{cpu}.npz", tokens=out["tokens"], log_probs=out["log_probs"],
             greedy=np.array(out["greedy"]))
    backends = sorted(Runtime.get().backend_registry.registered_backend_names)
    meta = {"cpu": cpu, "cpu_part": part, "features": check.cpuinfo("Features"), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "executorch": _version(executorch),
            "backends": backends, "numpy": np.__version__, "txl_deploy": txl_deploy.__file__,
            "import_seconds": imported, "stream_seconds": out["stream_seconds"],
            "greedy_seconds": out["greedy_seconds"], "sample": out["sample"]}
    (work / f"{STEM}-{cpu}.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"  {cpu} (CPU part {part}; features {meta['features']})")
    print(f"  {cpu}: torch {meta['torch']}, executorch {meta['executorch']} (backends {', '.join(backends)}): "
          f"imports {imported:.1f} s, stream {out['stream_seconds']:.1f} s, {check.GREEDY_TOKENS} greedy tokens "
          f"{out['greedy_seconds']:.1f} s")


def judge_guest(work: Path, cpu: str, ref) -> tuple[bool, list[str]]:
    ok, lines, meta = check.judge_outputs(work, cpu, ref, stem=STEM)
    if ok and "XnnpackBackend" not in meta.get("backends", []):
        return False, lines + [f"{cpu}: the guest's ExecuTorch has no XNNPACK backend ({meta.get('backends')})"]
    return ok, lines


def report(work: Path, cpus):
    ref = np.load(work / "reference.npz")
    failed = []
    for cpu in cpus:
        ok, lines = judge_guest(work, cpu, ref)
        print("\n".join("  " + line for line in lines))
        if not ok:
            failed.append(cpu)
    if failed:
        sys.exit(f"error: the .pte on aarch64 ({', '.join(failed)}) does not match x86")
    print(f"  the .pte on aarch64 matches x86 on {', '.join(cpus)}")


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("work", type=Path)
    g = sub.add_parser("guest")
    g.add_argument("work", type=Path)
    g.add_argument("cpu")
    s = sub.add_parser("report")
    s.add_argument("work", type=Path)
    s.add_argument("cpus", nargs="+")
    a = p.parse_args()
    if a.cmd == "reference":
        reference(a.work)
    elif a.cmd == "guest":
        guest(a.work, a.cpu)
    else:
        report(a.work, a.cpus)


if __name__ == "__main__":
    main()
