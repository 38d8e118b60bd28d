"""The three sides of the aarch64 check run by tests/arm64/run.sh.

    check.py reference WORK [--eval-chars N]   this machine (torch available): export the demo model to
                                               WORK/model.onnx and record what ONNX Runtime computes here
    check.py guest WORK CPU                    under qemu-aarch64, without torch: the same stream and prompt
                                               through TxlRuntime on the wheel installed for aarch64
    check.py report WORK CPU...                this machine: judge every guest against the reference

What must hold on every emulated CPU: the log-probs of a multi-segment batch-2 stream that wraps the memory's ring
buffer within the export tolerance (exporters/verify.py's fp32 rule), the same greedy continuation token for token,
and the same `txl-deploy eval` bits per character on a slice of the held-out text.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

PROMPT = "And God said"
GREEDY_TOKENS = 48
BATCH, SEED = 2, 0
# Guest CPU as /proc/cpuinfo reports it ("CPU part", Arm's part numbers): proves QEMU emulated the requested model.
CPU_PARTS = {"cortex-a53": "0xd03", "cortex-a55": "0xd05", "cortex-a57": "0xd07", "cortex-a72": "0xd08",
             "cortex-a76": "0xd0b", "neoverse-n1": "0xd0c", "neoverse-v1": "0xd40", "neoverse-n2": "0xd49"}


def stream_tokens(n_token: int, segments, batch: int = BATCH, seed: int = SEED) -> np.ndarray:
    # the same draw as exporters/verify.compare_steps, so its replay below sees exactly these tokens
    return np.random.default_rng(seed).integers(0, n_token, size=(batch, sum(segments)), dtype=np.int64)


def run_stream(rt, segments) -> tuple[np.ndarray, np.ndarray]:
    tokens = stream_tokens(rt.config.n_token, segments)
    rt.reset()
    out, pos = [], 0
    for q in segments:
        out.append(np.asarray(rt.step(tokens[:, pos:pos + q]), dtype=np.float32))
        pos += q
    rt.reset()
    return tokens, np.concatenate(out, axis=1)


def greedy(rt) -> list[int]:
    rt.reset()
    ids = [int(t) for t in rt.generate(PROMPT, max_new_tokens=GREEDY_TOKENS, temperature=0)]
    rt.reset()
    return ids


def open_runtime(model):
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

    # one intra-op thread on both sides: same reduction order, and QEMU's threads would share two busy cores
    return TxlRuntime(OrtBackend(model, providers=["cpu"], intra_op_threads=1))


def reference(work: Path, eval_chars: int):
    import subprocess

    import onnxruntime

    from txl_deploy.assets import demo_heldout_path, demo_model_path
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.exporters.onnx.verify import verification_segments

    model = work / "model.onnx"
    export_onnx(demo_model_path(), model)
    text = demo_heldout_path().read_text(encoding="utf-8")[:eval_chars]
    (work / "heldout.txt").write_text(text, encoding="utf-8")
    with open_runtime(model) as rt:
        segments = verification_segments(rt.mem_len, rt.backend.max_segment)
        tokens, log_probs = run_stream(rt, segments)
        ids = greedy(rt)
        sample = rt.decode(ids)
    np.savez(work / "reference.npz", tokens=tokens, log_probs=log_probs, segments=np.array(segments),
             greedy=np.array(ids))
    cli = Path(sys.executable).with_name("txl-deploy")
    done = subprocess.run([str(cli), "eval", str(model), "--threads", "1", "--text", str(work / "heldout.txt"),
                           "--json", str(work / "eval-x86_64.json")], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: txl-deploy eval failed on this machine:\n{done.stdout}{done.stderr}")
    meta = {"machine": platform.machine(), "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
            "sample": PROMPT + sample}
    (work / "reference.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"  x86 reference: {len(segments)} segments {segments} (batch {BATCH}), greedy: {meta['sample']!r}")


def cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo (None when absent, as in an x86 one)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in info.splitlines():
        if line.split(":", 1)[0].strip() == field:
            return line.split(":", 1)[1].strip()
    return None


def guest(work: Path, cpu: str):
    import importlib.util

    if platform.machine() != "aarch64":
        sys.exit(f"error: the guest runs on {platform.machine()}, expected aarch64 (is it running under QEMU?)")
    part = cpuinfo("CPU part")
    if part is None:
        # Older QEMU (Debian bookworm's 7.2) passes the host's x86 /proc/cpuinfo through; onnxruntime's CPU
        # detection then dies of a segmentation fault on import instead of reporting anything
        sys.exit("error: the guest's /proc/cpuinfo is not an ARM one (this QEMU passes the host's through, and "
                 "onnxruntime would crash on import); use a newer QEMU, e.g. Debian bookworm-backports' qemu-user 10")
    if cpu in CPU_PARTS and part != CPU_PARTS[cpu]:
        sys.exit(f"error: asked QEMU for {cpu} (CPU part {CPU_PARTS[cpu]}), the guest reports CPU part {part}")
    if importlib.util.find_spec("torch") is not None:
        sys.exit("error: torch is importable in the guest; the edge runtime must be proven without it")
    started = time.perf_counter()
    import onnxruntime

    import txl_deploy

    imported = time.perf_counter() - started
    ref = np.load(work / "reference.npz")
    segments = [int(s) for s in ref["segments"]]
    with open_runtime(work / "model.onnx") as rt:
        t0 = time.perf_counter()
        tokens, log_probs = run_stream(rt, segments)
        t1 = time.perf_counter()
        ids = greedy(rt)
        t2 = time.perf_counter()
        sample = rt.decode(ids)
    if "torch" in sys.modules:
        sys.exit("error: running the ONNX model imported torch")
    np.savez(work / f"guest-{cpu}.npz", tokens=tokens, log_probs=log_probs, greedy=np.array(ids))
    meta = {"cpu": cpu, "cpu_part": part, "features": cpuinfo("Features"), "machine": platform.machine(),
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "numpy": np.__version__,
            "txl_deploy": txl_deploy.__file__,
            "import_seconds": imported, "stream_seconds": t1 - t0, "greedy_seconds": t2 - t1,
            "sample": PROMPT + sample}
    (work / f"guest-{cpu}.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"  {cpu} (CPU part {part}; features {meta['features']})")
    print(f"  {cpu}: onnxruntime {meta['onnxruntime']}, numpy {meta['numpy']}: imports "
          f"{imported:.1f} s, stream {t1 - t0:.1f} s, {GREEDY_TOKENS} greedy tokens {t2 - t1:.1f} s")


def judge_outputs(work: Path, cpu: str, ref, stem: str = "guest") -> tuple[bool, list[str], dict]:
    """The guest's stream log-probs against the reference's (the fp32 export tolerance) and its greedy tokens
    (identical), read from WORK/<stem>-<cpu>.{json,npz}: (passed, one line each, the guest's metadata)."""
    from txl_deploy.exporters.onnx.verify import compare_steps, describe, judge

    lines, ok = [], True
    meta = json.loads((work / f"{stem}-{cpu}.json").read_text())
    got = np.load(work / f"{stem}-{cpu}.npz")
    if meta["machine"] != "aarch64" or not meta["txl_deploy"].startswith(str(work / "own")):
        where = f"{meta['machine']}, {meta['txl_deploy']}"
        return False, [f"{cpu}: the guest did not run our wheel on aarch64 ({where})"], meta
    if not np.array_equal(got["tokens"], ref["tokens"]):
        return False, [f"{cpu}: the guest fed a different token stream"], meta
    segments = [int(s) for s in ref["segments"]]

    def replay(log_probs):
        pos = [0]

        def step(seg):
            q = seg.shape[1]
            assert np.array_equal(seg, ref["tokens"][:, pos[0]:pos[0] + q]), "compare_steps drew another stream"
            out = log_probs[:, pos[0]:pos[0] + q]
            pos[0] += q
            return out
        return step

    n_token = ref["log_probs"].shape[-1]
    report = judge(compare_steps(replay(got["log_probs"]), replay(ref["log_probs"]), n_token, segments, BATCH, SEED),
                   "fp32")
    ok &= report["passed"]
    lines.append(f"{cpu}: log-probs vs x86: {describe(report)}")

    same = np.array_equal(got["greedy"], ref["greedy"])
    ok &= same
    first = next((i for i, (a, b) in enumerate(zip(got["greedy"], ref["greedy"])) if a != b), None)
    lines.append(f"{cpu}: greedy {len(got['greedy'])} tokens {'identical' if same else f'differ from token {first}'}"
                 f": {meta['sample']!r}")
    return bool(ok), lines, meta


def judge_guest(work: Path, cpu: str, ref, ref_eval: dict) -> tuple[bool, list[str]]:
    from txl_deploy.exporters.onnx.verify import FP32_ATOL, FP32_RTOL

    ok, lines, _ = judge_outputs(work, cpu, ref)
    if len(lines) < 2:  # not our wheel on aarch64, or another stream: nothing more to compare
        return False, lines
    path = work / f"eval-{cpu}.json"
    if not path.exists():
        return False, lines + [f"{cpu}: txl-deploy eval wrote no result"]
    arm = json.loads(path.read_text())
    # Every log-prob within atol + rtol |log-prob| bounds the mean loss difference by atol + rtol x loss (nats).
    tol = (FP32_ATOL + FP32_RTOL * ref_eval["loss"]) / math.log(2)
    diff = abs(arm["bits_per_token"] - ref_eval["bits_per_token"])
    same_eval = arm["n_tokens"] == ref_eval["n_tokens"] and diff <= tol
    ok &= same_eval
    verdict = "OK" if same_eval else "MISMATCH"
    lines.append(f"{cpu}: txl-deploy eval on {arm['n_tokens']} characters: {arm['bits_per_token']:.6f} bpc vs x86 "
                 f"{ref_eval['bits_per_token']:.6f} (|diff| {diff:.2g} <= {tol:.2g}: {verdict}), {arm['seconds']:.1f} s")
    return bool(ok), lines


def report(work: Path, cpus):
    ref = np.load(work / "reference.npz")
    ref_eval = json.loads((work / "eval-x86_64.json").read_text())
    failed = []
    for cpu in cpus:
        ok, lines = judge_guest(work, cpu, ref, ref_eval)
        print("\n".join("  " + line for line in lines))
        if not ok:
            failed.append(cpu)
    if failed:
        sys.exit(f"error: aarch64 ({', '.join(failed)}) does not match x86")
    print(f"  aarch64 matches x86 on {', '.join(cpus)}")


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("work", type=Path)
    r.add_argument("--eval-chars", type=int, default=256)
    g = sub.add_parser("guest")
    g.add_argument("work", type=Path)
    g.add_argument("cpu")
    s = sub.add_parser("report")
    s.add_argument("work", type=Path)
    s.add_argument("cpus", nargs="+")
    a = p.parse_args()
    if a.cmd == "reference":
        reference(a.work, a.eval_chars)
    elif a.cmd == "guest":
        guest(a.work, a.cpu)
    else:
        report(a.work, a.cpus)


if __name__ == "__main__":
    main()
