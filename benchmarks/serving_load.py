"""What the serving load benchmarks (`serve_load`: HTTP, `triton_load`: Triton's gRPC) share: the model served and
its prompts, the batched in-process yardstick, the summaries of timed streams (tokens/s per round, percentiles of
the gaps between tokens), the ratios to the yardstick and the machine they ran on. Method: docs/benchmarks.md
("Serving")."""

from __future__ import annotations

import logging
import os
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from txl_deploy.assets import DEMO_DIR
from txl_deploy.bench.benchmark import machine_info
from txl_deploy.bench.random_weights import is_shape_name, standin_checkpoint, standin_onnx
from txl_deploy.checkpoints import save_checkpoint
from txl_deploy.config import TxlConfig
from txl_deploy.errors import CheckpointError
from txl_deploy.exporters.onnx.export import export_onnx
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.vocab import Vocab

logger = logging.getLogger(__name__)

DEFAULT_SHAPE_MEM_LEN = 512
EXPORT_MAX_SEGMENT = 64  # requests are 1 token (decode) or a prompt piece; a short graph exports and loads fast
DEMO_SHAPE = {"n_layer": 4, "n_head": 4, "d_model": 192, "d_head": 48, "d_inner": 768, "tgt_len": 64, "mem_len": 128}


# -- the model and its prompts ------------------------------------------------------------------------------------
def _random_demo_shaped(folder: Path) -> Path:
    """A random-weight checkpoint of the demo model's shape, vocabulary = the held-out text's characters."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model.mem_transformer import MemTransformerLM  # imports torch

    heldout = DEMO_DIR / "heldout.txt"
    if heldout.is_file():
        symbols = sorted(set(heldout.read_text(encoding="utf-8")))
    else:
        symbols = [chr(c) for c in range(32, 127)]
    vocab = Vocab(symbols, kind="char")
    torch.manual_seed(0)
    model = MemTransformerLM(TxlConfig(n_token=len(vocab), **DEMO_SHAPE)).eval()
    path = folder / "random-demo-shape"
    save_checkpoint(path, model, vocab)
    logger.info(f"no demo model at {DEMO_DIR / 'kjv-char'}: using a random model of its shape ({len(vocab)} characters)")
    return path


def prepare_model(model, workdir: Path, mem_len: int = DEFAULT_SHAPE_MEM_LEN,
                  cache_dir=None) -> tuple[Path, str]:
    """The ONNX (or engine) file to serve and a description. Checkpoints are exported (fp32, incremental state);
    a published shape name becomes a random-weight stand-in with `mem_len`."""
    if model is not None and is_shape_name(str(model)):
        cache = Path(cache_dir) if cache_dir else workdir
        ckpt = standin_checkpoint(str(model), cache, mem_len=mem_len)
        logger.info(f"a random-weight stand-in of {model} (mem_len {mem_len}) as ONNX (exported once per cache) ...")
        return standin_onnx(ckpt, cache, mem_len, max_segment=EXPORT_MAX_SEGMENT), \
            f"{model} shape, random weights"
    if model is None:
        demo = DEMO_DIR / "kjv-char"
        random = not demo.exists()
        source = _random_demo_shaped(workdir) if random else demo
        label = "random weights, demo shape" if random else "demo kjv-char"
    else:
        source = Path(model)
        if not source.exists():
            raise CheckpointError(source, "file not found")
        label, random = source.name, False
    if source.suffix.lower() in (".onnx", ".engine", ".plan", ".trt"):
        return source, label

    out = workdir / "model.onnx"
    logger.info(f"exporting {source} to ONNX (max_segment {EXPORT_MAX_SEGMENT}) ...")
    # Random weights give large activations, where ONNX and PyTorch differ by more than the export's 1e-4 check;
    # the benchmark compares the served ONNX with the same ONNX in-process, so that check is not what matters here.
    export_onnx(source, out, max_segment=EXPORT_MAX_SEGMENT, verify=not random)
    return out, label


def make_prompts(vocab, n_token: int, count: int, length: int, seed: int = 0) -> tuple[list[np.ndarray], str]:
    """`count` different prompts of `length` tokens and what they are: held-out lines for a character model whose
    vocabulary covers them, else seeded random ids."""
    heldout = DEMO_DIR / "heldout.txt"
    if vocab is not None and vocab.kind == "char" and heldout.is_file():
        lines = [ln for ln in heldout.read_text(encoding="utf-8").splitlines() if len(ln) >= length]
        lines = [ln for ln in lines if all(ch in vocab.index for ch in ln[:length])]
        if len(lines) >= count:
            step = len(lines) // count  # spread over the text: different books, different contexts
            return [vocab.encode(lines[i * step][:length]) for i in range(count)], "held-out lines"
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_token, size=length, dtype=np.int64) for _ in range(count)], "random ids"



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
    toks = np.stack(toks, axis=1)
    return [(t0, stamps, [int(t) for t in row]) for row in toks]



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
           "tokens_per_s": float(np.median(rates)), "tokens_per_s_rounds": rates, "wall_s_rounds": walls,
           "p50_ms": float(np.percentile(gaps, 50)), "p99_ms": float(np.percentile(gaps, 99)),
           "mean_ms": float(gaps.mean()), "latency_samples": int(gaps.size),
           "first_token_p50_ms": float(np.percentile(first, 50)),
           "first_token_p99_ms": float(np.percentile(first, 99)),
           "tokens": tokens, "tokens_same_every_round": all([r[2] for r in rnd] == tokens for rnd in rounds)}
    if batched_rounds is not None:
        ratios = [rate(s, n_tokens) / rate(b, n_tokens) for s, b in zip(rounds, batched_rounds)]
        out["ratio_to_batched"], out["ratio_to_batched_rounds"] = float(np.median(ratios)), ratios
    return out


def rate_cells(r: dict) -> list[str]:
    """A row's tokens/s (the slowest and fastest round in brackets) and its share of the batched yardstick."""
    rates = r["tokens_per_s_rounds"]
    spread = f" ({min(rates):.0f}-{max(rates):.0f})" if len(rates) > 1 else ""
    ratio = f"{100 * r['ratio_to_batched']:.0f}%" if "ratio_to_batched" in r else "-"
    return [f"{r['tokens_per_s']:.0f}{spread}", ratio]


def round_line(what: str, r: int, runs, n_tokens: int) -> str:
    """A round's progress line: tokens/s, and the median and mean gap between tokens."""
    gaps = np.concatenate([np.diff(x[1]) for x in runs]) * 1e3
    return (f"  round {r + 1}  {what:>20}  C={len(runs):>3}  {rate(runs, n_tokens):8.1f} tok/s  "
            f"p50 {np.percentile(gaps, 50):7.2f} ms  mean {gaps.mean():7.2f} ms")


def spread(values, pct: bool = False) -> str:
    """min / median / max of a configuration's rounds."""
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.0f}")
    return f"{f(min(values))} / {f(float(np.median(values)))} / {f(max(values))}"


# -- where it ran ---------------------------------------------------------------------------------------------------
def versions(server_version: str | None = None) -> dict:
    out = {"python": platform.python_version(), "tritonserver": server_version}
    for dist in ("txl-deploy", "tritonclient", "onnxruntime", "numpy", "grpcio"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


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
    return (f"{m['label']} ({m['n_layer']} layers, d_model {m['d_model']}, mem_len {m['mem_len']}, "
            f"{m['n_token']} tokens, ONNX Runtime CPU fp32")
