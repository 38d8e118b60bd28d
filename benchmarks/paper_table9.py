"""The paper's Table 9 on the deployed runtime: Transformer-XL's evaluation against a vanilla Transformer of the
same size that recomputes its whole window for every token (Dai et al., 2019: 363x to 1,874x at L = 800 to 3,800).
What each side computes: docs/benchmarks.md ("The paper's Table 9")."""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks import harness
from txl_deploy.bench.benchmark import report_header, versions_text
from txl_deploy.bench.random_weights import standin_onnx
from txl_deploy.bench.report import pyplot, save_figure
from txl_deploy.checkpoints import load_model
from txl_deploy.errors import InputError
from txl_deploy.exporters.onnx.trace import onnx_program
from txl_deploy.files import atomic_path
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

logger = logging.getLogger(__name__)

SCHEMA = "txl-deploy-table9/1"
# Dai et al. (2019), Table 9: how much slower the vanilla model evaluates than Transformer-XL, by attention length.
PAPER_SLOWDOWN = {3800: 1874, 2800: 1409, 1800: 773, 800: 363}
DEFAULT_LENGTHS = (800, 1800, 2800, 3800)
DEFAULT_SHAPE = "enwik8-base"
DEFAULT_SEGMENT = 80  # enwik8 base's evaluation segment (tgt_len 80)
INPUT, OUTPUT = "tokens", "log_probs"  # the vanilla graph's input and output


@dataclass
class Inputs:
    fill: np.ndarray  # [1, L]: the memory's tokens, fed before anything is timed
    segment: np.ndarray  # [1, segment]: Transformer-XL's measured tokens, stream positions L .. L + segment - 1
    windows: list  # vanilla window r: [1, L], the L tokens ending at stream position L + r


def inputs(stream: np.ndarray, length: int, segment: int, windows: int) -> Inputs:
    """The tokens each side reads from one stream (at least length + segment tokens long)."""
    if windows > segment:
        raise InputError(f"{windows} vanilla windows need a segment of at least as many tokens, got {segment}")
    if stream.shape[-1] < length + segment:
        raise InputError(f"the stream needs {length + segment} tokens, got {stream.shape[-1]}")
    s = stream.reshape(1, -1)
    return Inputs(s[:, :length], s[:, length:length + segment],
                  [s[:, r + 1:length + r + 1] for r in range(windows)])


def export_vanilla(model, path, opset: int = 18):
    """A `VanillaTransformerLM`'s `forward` as ONNX: tokens [B, L] int64 (batch and window length dynamic) ->
    log_probs [B, n_token]."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    # torch.export specialises any dimension whose example size is 0 or 1: the example is [2, 8].
    batch = torch.export.Dim("batch", min=1, max=4096)
    window = torch.export.Dim("window", min=2, max=65536)
    example = torch.zeros(2, 8, dtype=torch.long)
    with torch.no_grad():
        program = onnx_program(model, (example,), [INPUT], [OUTPUT], ({0: batch, 1: window},), opset)
    program.save(str(path))
    return path


def vanilla_onnx(config, cache_dir, seed: int = 0, check_window: int = 64) -> tuple[Path, dict]:
    """The vanilla model of a config's size as ONNX (random weights, cached), and its check against PyTorch on
    one window of `check_window` tokens."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model import vanilla  # imports torch

    cfg = vanilla.VanillaConfig.like(config)
    key = hashlib.sha256(json.dumps([cfg.to_dict(), seed, harness.code_key(vanilla, sys.modules[__name__])])
                         .encode()).hexdigest()[:10]
    path = Path(cache_dir) / f"vanilla-{key}.onnx"
    check_path = path.with_suffix(".check.json")
    if path.exists() and check_path.exists():
        return path, json.loads(check_path.read_text())
    logger.info(f"exporting a vanilla Transformer of {cfg.n_layer} layers, d_model {cfg.d_model} to ONNX ...")
    model = vanilla.random_vanilla(cfg, seed)
    with atomic_path(path, force=True) as tmp:
        export_vanilla(model, tmp)
        window = np.random.default_rng(seed).integers(0, cfg.n_token, (1, check_window))
        got = harness.ort_session(tmp, None).run([OUTPUT], {INPUT: window})[0]
        with torch.no_grad():
            want = model(torch.from_numpy(window)).numpy()
        check = {"window": check_window, "max_abs_diff": float(np.abs(got - want).max()),
                 "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()), "config": cfg.to_dict()}
    check_path.write_text(json.dumps(check))
    return path, check


def run_table9(lengths=DEFAULT_LENGTHS, model: str = DEFAULT_SHAPE, segment: int = DEFAULT_SEGMENT,
               rounds: int = 3, decode_steps: int = 16, warmup: int = 1, threads: int | None = 1, cache_dir=None,
               seed: int = 0, progress: bool = True) -> dict:
    """Both sides at every attention length in `lengths` on `model` (a shape name or a checkpoint; the vanilla
    model takes its sizes); returns the JSON report (`SCHEMA`)."""
    lengths = [int(n) for n in lengths]
    if not lengths or min(lengths) < 2 or rounds < 1 or segment < 1 or decode_steps < 1 or warmup < 0:
        raise InputError("lengths must be >= 2; rounds, segment and decode steps >= 1; warmup >= 0")
    decode_steps = min(decode_steps, segment)
    checkpoint, source = harness.checkpoint_of(model, cache_dir)
    label = f"{model} shape, random weights" if source == "shape" else Path(model).name
    config = load_model(checkpoint).config
    vanilla_path, vanilla_check = vanilla_onnx(config, cache_dir, seed)
    graphs = {n: standin_onnx(checkpoint, cache_dir, n, max_segment=segment) for n in lengths}  # exports first
    # as a careful user opens it: its default CPU arena reuses the window's [L, L] score blocks between runs
    vanilla = harness.ort_session(vanilla_path, threads)
    rows = []
    bar = tqdm(total=len(lengths) * (rounds + warmup), desc="table 9", unit="round", disable=not progress, leave=False)
    for n in lengths:
        bar.set_postfix_str(f"L {n}")
        rt = TxlRuntime(OrtBackend(graphs[n], providers=["cpu"], intra_op_threads=threads))
        stream = np.random.default_rng(seed).integers(0, rt.n_token, n + segment)
        io = inputs(stream, n, segment, rounds + warmup)
        rt.prefill(io.fill)
        full = rt.save_state()

        def txl_segment(_):
            rt.load_state(full)
            return harness.seconds(lambda: rt.step(io.segment)) / segment

        def txl_single(_):
            rt.load_state(full)
            return [harness.seconds(lambda t=t: rt.step(io.segment[:, t:t + 1])) for t in range(decode_steps)]

        def vanilla_window(r):
            bar.update(1)
            return harness.seconds(lambda: vanilla.run(None, {INPUT: io.windows[r]}))

        out = harness.interleaved({"evaluation": txl_segment, "single": txl_single, "windows": vanilla_window},
                                  warmup + rounds)
        rt.close()
        evaluation, single, windows = (out[k][warmup:] for k in ("evaluation", "single", "windows"))
        ev_ms, one_ms, van_ms = (1e3 * float(np.median(x)) for x in (evaluation, np.concatenate(single), windows))
        rows.append({
            "length": n, "paper_slowdown": PAPER_SLOWDOWN.get(n),
            "txl_evaluation_ms_per_token": ev_ms, "txl_one_token_per_call_ms": one_ms, "vanilla_ms_per_token": van_ms,
            "slowdown_evaluation": van_ms / ev_ms, "slowdown_one_token_per_call": van_ms / one_ms,
            "slowdown_evaluation_rounds": [w / e for w, e in zip(windows, evaluation)],
            "rounds_s": {"txl_evaluation_per_token": evaluation, "txl_one_token_per_call": [list(s) for s in single],
                         "vanilla_window": windows},
        })
    bar.close()
    return {
        **report_header(SCHEMA),
        "settings": {"model": label, "lengths": lengths, "segment": segment, "rounds": rounds, "warmup": warmup,
                     "decode_steps": decode_steps, "threads": threads, "seed": seed, "batch": 1},
        "config": config.to_dict(), "vanilla_check": vanilla_check, "rows": rows,
    }


NOTE = """\
What differs from the paper: one CPU thread per side, not a GPU; random weights (values change no timing);
Transformer-XL segments of {segment} tokens. What each side computes, and the advantages the vanilla side is
given: docs/benchmarks.md ("The paper's Table 9")."""


def _x(v: float) -> str:
    return f"{v:,.0f}x" if v >= 10 else f"{v:.1f}x"


def _ms(v: float) -> str:
    return f"{v:,.1f}" if v >= 100 else f"{v:.3g}"


def markdown(result: dict) -> str:
    s, rows = result["settings"], result["rows"]
    m, v, c, vc = result["machine"], result["versions"], result["config"], result["vanilla_check"]
    threads = s["threads"] or "ONNX Runtime's default"
    lines = [
        f"Model: {s['model']} ({c['n_layer']} layers, d_model {c['d_model']}, {c['n_head']} heads of "
        f"{c['d_head']}, d_inner {c['d_inner']}, {c['n_token']} symbols), batch 1, "
        f"{threads} ONNX Runtime thread(s) per side, fp32, measured {result['date']} on {m['cpu']} "
        f"({m['cores']} cores, {m['platform']}); {versions_text(v, ('python', 'onnxruntime', 'torch', 'txl_deploy'))}.",
        "",
        *harness.table(["attention length L", "Transformer-XL ms/token, evaluation",
                        "Transformer-XL ms/token, one token per call", "vanilla ms/token", "vanilla slower, evaluation",
                        "vanilla slower, one token per call", "paper (GPU)"],
                       [[f"{r['length']:,}", *(_ms(r[k]) for k in ("txl_evaluation_ms_per_token",
                                                                   "txl_one_token_per_call_ms", "vanilla_ms_per_token")),
                         f"**{_x(r['slowdown_evaluation'])}** ({_x(min(ev))} to {_x(max(ev))})",
                         _x(r["slowdown_one_token_per_call"]),
                         f"{r['paper_slowdown']:,}x" if r.get("paper_slowdown") else "-"]
                        for r in rows for ev in [r["slowdown_evaluation_rounds"]]], numeric_from=0),
        "",
        f"What each side computes, per predicted token ({s['rounds']} measured rounds per L after {s['warmup']} "
        "unmeasured, the sides alternating; method: docs/benchmarks.md):",
        f"- Transformer-XL, evaluation: L tokens in its memory, a segment of {s['segment']} tokens in, the "
        "distribution at each position out (`TxlRuntime.step`); time / segment length. Brackets: the slowest and "
        "the fastest round's ratio.",
        f"- Transformer-XL, one token per call: the same memory, {s['decode_steps']} tokens one per call; the median.",
        "- vanilla: the same size, absolute positions, no memory (`txl_deploy/model/vanilla.py`, ONNX Runtime); per "
        "token the window of L tokens ending at it, recomputed whole; the median window. Its export matches "
        f"PyTorch within {vc['max_abs_diff']:.1e} (max abs log-prob difference, a {vc['window']}-token window).",
        "",
        NOTE.format(segment=s["segment"]),
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path, force: bool = False):
    """The measured slowdowns and the paper's against L."""
    rows = result["rows"]
    xs = [r["length"] for r in rows]
    fig, ax = pyplot().subplots(figsize=(6.5, 4))
    ax.plot(xs, [r["slowdown_evaluation"] for r in rows], marker="o", label="measured, evaluation (segments)")
    ax.plot(xs, [r["slowdown_one_token_per_call"] for r in rows], marker="s",
            label="measured, Transformer-XL one token per call")
    paper = [(r["length"], r["paper_slowdown"]) for r in rows if r.get("paper_slowdown")]
    if paper:
        ax.plot(*zip(*paper), marker="^", linestyle="--", label="paper, Table 9 (GPU)")
    ax.set(xlabel="attention length L", ylabel="vanilla time / Transformer-XL time per token", yscale="log",
           title=f"Evaluation speed: vanilla vs Transformer-XL ({result['settings']['model']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, force)


def measure(args, command):
    md = Path(args.md)
    result = run_table9(args.lengths, model=args.model, segment=args.segment, rounds=args.rounds,
                        decode_steps=args.decode_steps, threads=args.threads or None, cache_dir=args.cache_dir)
    result["command"] = command
    body = markdown(result)
    try:
        plot(result, md.with_suffix(".png"), force=args.force)
        body += f"\n![vanilla time over Transformer-XL time per token against L]({md.with_suffix('.png').name})\n"
    except InputError as e:
        logger.warning(f"no plot: {e}")
    title = "The paper's Table 9: evaluation speed against a vanilla Transformer"
    return harness.results_markdown(title, body, command), result, 0


def main(argv=None) -> int:
    p = harness.parser("paper_table9", __doc__, md="results_table9.md")
    p.add_argument("--lengths", type=harness.int_list, default=list(DEFAULT_LENGTHS),
                   help="attention lengths L, comma-separated (default: the paper's 800,1800,2800,3800)")
    p.add_argument("--model", default=DEFAULT_SHAPE, help=f"a shape name or a checkpoint (default {DEFAULT_SHAPE})")
    p.add_argument("--segment", type=int, default=DEFAULT_SEGMENT, help="Transformer-XL's evaluation segment")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per L: one vanilla window each")
    p.add_argument("--decode-steps", type=int, default=16, help="Transformer-XL one-token calls per round")
    return harness.main("paper_table9", p, measure, argv, outputs=(".json", ".png"))


if __name__ == "__main__":
    sys.exit(main())
