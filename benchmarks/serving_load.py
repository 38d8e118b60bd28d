"""The serving load driver (`serve_load`: HTTP, `triton_load`: Triton's gRPC; `serve_chaos` starts its server
here too): the model served and its prompts, the servers each script starts, every side's rounds interleaved
against the batched in-process yardstick, the summaries of the timed streams. Method: docs/benchmarks.md
("Serving")."""

from __future__ import annotations

import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np

from benchmarks import harness
from txl_deploy.assets import DEMO_DIR
from txl_deploy.bench.benchmark import machine_info
from txl_deploy.bench.random_weights import is_shape_name, standin_checkpoint, standin_onnx
from txl_deploy.errors import CheckpointError, InputError, TxlError
from txl_deploy.exporters.onnx.export import export_onnx
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.serving.ports import free_port
from txl_deploy.serving.triton.local_server import find_tritonserver

logger = logging.getLogger(__name__)

DEFAULT_SHAPE_MEM_LEN = 512
EXPORT_MAX_SEGMENT = 64  # requests are 1 token (decode) or a prompt piece; a short graph exports and loads fast
TIMEOUT = 600.0  # seconds for a server to start or a request to finish


# -- the model and its prompts ------------------------------------------------------------------------------------
def prepare_model(model, workdir: Path, mem_len: int = DEFAULT_SHAPE_MEM_LEN, cache_dir=None) -> tuple[Path, str]:
    """The ONNX (or engine) file to serve and a description. Checkpoints are exported (fp32, incremental state);
    a published shape name becomes a random-weight stand-in with `mem_len`."""
    if model is not None and is_shape_name(str(model)):
        cache = Path(cache_dir) if cache_dir else workdir
        ckpt = standin_checkpoint(str(model), cache, mem_len=mem_len)
        logger.info(f"a random-weight stand-in of {model} (mem_len {mem_len}) as ONNX (exported once per cache) ...")
        return standin_onnx(ckpt, cache, mem_len, max_segment=EXPORT_MAX_SEGMENT), f"{model} shape, random weights"
    source, label = (DEMO_DIR / "kjv-char", "demo kjv-char") if model is None else (Path(model), Path(model).name)
    if not source.exists():
        raise CheckpointError(source, "file not found")
    if source.suffix.lower() in (".onnx", ".engine", ".plan", ".trt"):
        return source, label
    logger.info(f"exporting {source} to ONNX (max_segment {EXPORT_MAX_SEGMENT}) ...")
    export_onnx(source, workdir / "model.onnx", max_segment=EXPORT_MAX_SEGMENT)
    return workdir / "model.onnx", label


def make_prompts(vocab, n_token: int, count: int, length: int, seed: int = 0) -> tuple[list[np.ndarray], str]:
    """`count` different prompts of `length` tokens and what they are: held-out lines for a character model whose
    vocabulary covers them, else seeded random ids."""
    heldout = DEMO_DIR / "heldout.txt"
    if vocab is not None and vocab.kind == "char":
        lines = [ln for ln in heldout.read_text(encoding="utf-8").splitlines()
                 if len(ln) >= length and all(ch in vocab.index for ch in ln[:length])]
        if len(lines) >= count:
            step = len(lines) // count  # spread over the text: different books, different contexts
            return [vocab.encode(lines[i * step][:length]) for i in range(count)], "held-out lines"
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_token, size=length, dtype=np.int64) for _ in range(count)], "random ids"


class ServeProcess:
    """`txl-deploy serve ARGS` in its own process on 127.0.0.1 at a free port; SIGTERM on close."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("txl-deploy")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "txl_deploy.cli"]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([*cmd, "serve", *args, "--port", str(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = TIMEOUT) -> ServeProcess:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise TxlError(f"txl-deploy serve exited while starting: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TxlError(f"txl-deploy serve did not become ready in {timeout:g} s")

    def close(self):
        """SIGTERM, then the exit status; killed (and said so) if it has not exited 60 s later."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            return "none: still running 60 s after SIGTERM (killed)"


# -- the run: every side's rounds interleaved ----------------------------------------------------------------------
def check_settings(tokens: int, **positive):
    """A one-line error before anything starts: per-token latency needs two tokens; counts must be positive."""
    if tokens < 2:
        raise InputError("--tokens must be at least 2 (per-token latency is the gap between two tokens)")
    bad = [k for k, v in positive.items() if v is not None and (not np.size(v) or np.min(v) < 1)]
    if bad:
        raise InputError(", ".join(f"--{k.replace('_', '-')}" for k in bad) + " must be positive")


def run(model, start, *, prompts: int, prompt_len: int, repeat: int, threads, mem_len: int, cache_dir,
        triton: bool = True, **settings) -> tuple[dict, dict]:
    """The model prepared and loaded in-process, `prompts` prompts, the sides `start(ctx)` returns ({name: fn(r)},
    its servers started on ctx.stack and warmed up), every side's rounds interleaved with the machine's load
    average. Returns the result (settings, model, prompt kind, machine, versions) and each side's rounds."""
    if triton:
        find_tritonserver()  # fail before the export if there is no server
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
              "prompt_len": prompt_len, "repeat": repeat, "threads": threads, **settings}
    with tempfile.TemporaryDirectory(prefix="txl-serving-load-") as tmp, ExitStack() as stack:
        model_file, label = prepare_model(model, Path(tmp), mem_len=mem_len, cache_dir=cache_dir)
        onnx = model_file.suffix.lower() == ".onnx"  # the server's ONNX Runtime threads in-process too
        rt = TxlRuntime.load(model_file, providers=["cpu"], threads=threads) if onnx else TxlRuntime.load(model_file)
        stack.callback(rt.close)
        result["model"] = model_fields(label, model_file, rt)
        ctx = SimpleNamespace(stack=stack, tmp=Path(tmp), model_file=model_file, rt=rt, result=result)
        ctx.prompts, result["prompt_kind"] = make_prompts(rt.vocab, rt.n_token, prompts, prompt_len)
        sides = start(ctx)
        batched_round(rt, ctx.prompts[:2], 4)  # warm-up
        rounds = harness.interleaved({"load": lambda r: harness.load_average(), **sides}, repeat)
    result["load_average_rounds"] = rounds.pop("load")  # the machine's other load, round by round
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["versions"] = versions(result.pop("tritonserver", None))
    return result, rounds


def timed(what: str, fn, n_tokens: int):
    """A side that logs each round's tokens/s and median and mean gap; `fn()` returns the streams, or (streams, more)."""
    def side(r):
        out = fn()
        runs = out[0] if isinstance(out, tuple) else out
        gaps = np.concatenate([np.diff(x[1]) for x in runs]) * 1e3
        logger.info(f"  round {r + 1}  {what:>20}  C={len(runs):>3}  {rate(runs, n_tokens):8.1f} tok/s  "
                    f"p50 {np.percentile(gaps, 50):7.2f} ms  mean {gaps.mean():7.2f} ms")
        return out
    return side


# -- measuring: a stream is (its start, the time of each token, its tokens) -------------------------------------
def batched_round(shared, prompts, n_tokens: int):
    """The same conversations as the C rows of ONE TxlRuntime: one ONNX Runtime run per token for all of them.
    What serving in-process can do when it batches; every conversation receives each token at the same time."""
    rt = TxlRuntime(shared.backend)
    t0 = time.perf_counter()
    log_probs = rt.prefill(np.stack(prompts))  # the prompts all have the same length
    stamps, toks = [], []
    for n in range(n_tokens):
        step = np.argmax(log_probs, axis=-1)  # greedy, as sample(temperature=0)
        stamps.append(time.perf_counter())
        toks.append(step)
        if n + 1 < n_tokens:
            log_probs = rt.prefill(step[:, None].astype(np.int64))
    return [(t0, stamps, [int(t) for t in row]) for row in np.stack(toks, axis=1)]


def runtime_reference(make_runtime: Callable) -> Callable:
    """The golden sessions' reference on a fresh runtime from `make_runtime()` per conversation: each segment feeds
    its prompt (if any), then n greedy tokens, each fed too, as a session's turn does."""
    def reference(segments):
        rt, out, lp = make_runtime(), [], None
        try:
            for prompt, n in segments:
                lp = rt.prefill(np.asarray(prompt, dtype=np.int64)[None])[0] if len(prompt) else lp
                toks, lps = [], []
                for _ in range(n):
                    toks.append(int(np.argmax(lp)))
                    lps.append(float(lp[toks[-1]]))
                    lp = rt.prefill(np.array([[toks[-1]]], dtype=np.int64))[0]
                out.append((toks, lps))
            return out
        finally:
            rt.close()
    return reference


def rate(runs, n_tokens: int) -> float:
    """Tokens/s of one round: every stream's tokens over the round's wall time."""
    return len(runs) * n_tokens / (max(r[1][-1] for r in runs) - min(r[0] for r in runs))


def summarise(rounds, n_tokens: int, batched_rounds=None) -> dict:
    """Latencies pooled over the repeated rounds; tokens/s of each round (the median is the headline); with
    `batched_rounds`, the ratio to them round by round (neighbours in time), and its median."""
    runs = [run for rnd in rounds for run in rnd]
    gaps = np.concatenate([np.diff(r[1]) for r in runs]) * 1e3
    first = np.array([r[1][0] - r[0] for r in runs]) * 1e3
    walls = [max(r[1][-1] for r in rnd) - min(r[0] for r in rnd) for rnd in rounds]
    rates = [len(rnd) * n_tokens / w for rnd, w in zip(rounds, walls)]
    tokens = [r[2] for r in rounds[0]]
    out = {"concurrency": len(rounds[0]), "tokens_per_conversation": n_tokens, "rounds": len(rounds),
           "tokens_per_s": harness.median(rates), "tokens_per_s_rounds": rates, "wall_s_rounds": walls,
           "p50_ms": float(np.percentile(gaps, 50)), "p99_ms": float(np.percentile(gaps, 99)),
           "mean_ms": float(gaps.mean()), "latency_samples": int(gaps.size),
           "first_token_p50_ms": float(np.percentile(first, 50)),
           "first_token_p99_ms": float(np.percentile(first, 99)),
           "tokens": tokens, "tokens_same_every_round": all([r[2] for r in rnd] == tokens for rnd in rounds)}
    if batched_rounds is not None:
        ratios = [rate(s, n_tokens) / rate(b, n_tokens) for s, b in zip(rounds, batched_rounds)]
        out["ratio_to_batched"], out["ratio_to_batched_rounds"] = harness.median(ratios), ratios
    return out


def rate_cells(r: dict) -> list[str]:
    """A row's tokens/s (the slowest and fastest round in brackets) and its share of the batched yardstick."""
    rates = r["tokens_per_s_rounds"]
    spread = f" ({min(rates):.0f}-{max(rates):.0f})" if len(rates) > 1 else ""
    ratio = f"{100 * r['ratio_to_batched']:.0f}%" if "ratio_to_batched" in r else "-"
    return [f"{r['tokens_per_s']:.0f}{spread}", ratio]


def spread(values, pct: bool = False) -> str:
    """min / median / max of a configuration's rounds."""
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.0f}")
    return f"{f(min(values))} / {f(harness.median(values))} / {f(max(values))}"


# -- where it ran, and the results file -----------------------------------------------------------------------------
def versions(server_version: str | None = None) -> dict:
    dists = ("txl-deploy", "tritonclient", "onnxruntime", "numpy", "grpcio")
    return {"python": platform.python_version(), "tritonserver": server_version,
            **{d: harness.package_version(d) for d in dists}}


def machine() -> dict:
    m = machine_info()
    return {"cpus": m["cores"], "cpu": m["cpu"], "system": f"{platform.system()} {platform.release()}",
            "load_average_start": list(os.getloadavg())}


def measured_line(date: str, mach: dict, v: dict) -> str:
    """When and where a run measured, and the versions, for the end of a results section."""
    end = f" and {mach['load_average_end'][0]:.1f} at the end" if "load_average_end" in mach else ""
    names = ("txl-deploy", "onnxruntime", "numpy", "tritonclient")
    return (f"Measured {date} on {mach['cpus']} CPU cores ({mach['cpu']}, {mach['system']}), load average "
            f"{mach['load_average_start'][0]:.1f} at the start{end}. Versions: Python {v['python']}, "
            + ", ".join(f"{name} {v[name]}" for name in names if name in v) + ".")


def model_fields(label: str, model_file: Path, rt) -> dict:
    """What the results say of the model served."""
    return {"label": label, "file": model_file.name, "n_token": rt.n_token, "n_layer": rt.config.n_layer,
            "d_model": rt.config.d_model, "mem_len": rt.mem_len, "max_segment": rt.backend.max_segment}


def model_sentence(m: dict) -> str:
    return (f"{m['label']} (`{m['file']}`: {m['n_layer']} layers, d_model {m['d_model']}, mem_len {m['mem_len']}, "
            f"{m['n_token']} tokens, max_segment {m['max_segment']}, ONNX Runtime CPU fp32)")


def results_file(title: str, results: list[dict], command: str, section, about: str = "") -> str:
    """The whole results file: how to read it, then each model's `section(result)`."""
    lines = [("Absolute speeds move with the machine's other load (each section gives it); the ratios compare paths "
              f"measured in alternating rounds of the same run, with the same ONNX Runtime threads on every side.{about}"),
             ""]
    for result in results:
        lines += [f"## {result['model']['label']}", "", *section(result)]
    return harness.results_markdown(title, "\n".join(lines), command)


def parser(name: str, doc: str, md: str, model_help: str, concurrency, repeat: int, tokens: int = 64,
           prompt_len: int = 48):
    """The options the load benchmarks share (and the harness's)."""
    p = harness.parser(name, doc, md=md)
    p.add_argument("--model", action="append", help="an .onnx file, a checkpoint or a shape name, repeatable "
                   f"(default: {model_help})")
    p.add_argument("--mem-len", type=int, default=DEFAULT_SHAPE_MEM_LEN, help="memory length of a shape stand-in")
    several = isinstance(concurrency, list)
    p.add_argument("--concurrency", type=harness.int_list if several else int, default=concurrency,
                   help="concurrent streams per round" + (", comma-separated" if several else ""))
    p.add_argument("--tokens", type=int, default=tokens, help="greedy tokens per stream")
    p.add_argument("--prompt-len", type=int, default=prompt_len, help="prompt tokens per stream")
    p.add_argument("--repeat", type=int, default=repeat, help="interleaved rounds per path")
    return p
