"""Scoring: `TxlRuntime.score` tokens/s on ONNX Runtime against PyTorch eager of the same model, HuggingFace's
TransfoXL with its mems and the machine's own matrix products of the same shapes (the compute floor); n-best
rescoring on a shared context read once and forked, against re-reading it per hypothesis; beam search against
HuggingFace's. Method: docs/benchmarks.md ("Scoring, rescoring and beam search")."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.peer_huggingface import HuggingFaceBackend, transformers_on_current_torch, with_generate
from txl_deploy.assets import DEMO_DIR
from txl_deploy.bench.bandwidth_floor import blas_threads
from txl_deploy.bench.eager_baseline import EagerAtPositions
from txl_deploy.bench.random_weights import standin_onnx
from txl_deploy.bench.runners import torch_threads
from txl_deploy.checkpoints import load_model
from txl_deploy.contract.clusters import pieces
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

SEGMENT = 64  # every side reads a text in segments of this many tokens (the demo model's training length)
SIDES = {"onnxruntime": "ONNX Runtime", "eager": "PyTorch eager", "transformers": "HuggingFace TransfoXL (mems)",
         "floor": "matmul floor"}
BEAM_SIDES = {"txl-deploy": "`TxlRuntime.beam_search` (ONNX Runtime)",
              "transformers": "HuggingFace `generate(num_beams, do_sample=False)`"}
TITLE = "Scoring, rescoring and beam search"
BEAM_PROMPT = 32  # tokens of the context that beam search starts from
QUICK = {"batch": [1, 2], "length": 80, "rounds": 1, "context": 40, "hypotheses": 3, "hypothesis_len": 5,
         "beam_tokens": 4}


def matmul_shapes(cfg, batch: int, length: int, segment: int) -> list[tuple[int, int, int, int]]:
    """(stack, m, k, n) of every matrix product the exported graph computes to score `length` tokens in each of
    `batch` rows, segment by segment with the memory threaded (which products: docs/benchmarks.md)."""
    D, H, Dh = cfg.d_model, cfg.n_head, cfg.d_head
    out = []
    for start in range(0, length, segment):
        q = min(segment, length - start)
        keys, rows = q + min(start, cfg.mem_len), batch * q
        out += [(1, rows, D, 3 * H * Dh), (batch * H, q, Dh, keys), (batch * H, q, Dh, keys),
                (batch * H, q, keys, Dh), (1, rows, H * Dh, D), (1, rows, D, cfg.d_inner),
                (1, rows, cfg.d_inner, D)] * cfg.n_layer
        for i, (lo, hi) in enumerate(pieces(cfg.cutoffs, cfg.n_token)):
            d_i = cfg.d_embed // cfg.div_val**i if cfg.div_val > 1 else cfg.d_embed
            if d_i != D:
                out.append((1, rows, D, d_i))
            out.append((1, rows, d_i, hi - lo + (len(cfg.cutoffs) if i == 0 else 0)))  # the head's cluster rows
    return out


def matmul_floor(shapes, threads: int):
    """(FLOPs, a side running every product of `shapes` in numpy, float32, on `threads` BLAS threads)."""
    rng = np.random.default_rng(0)
    operands = {s: (rng.standard_normal(s[:3], np.float32), rng.standard_normal((s[0], s[2], s[3]), np.float32))
                for s in set(shapes)}

    def run():
        with blas_threads(threads):
            for s in shapes:
                np.matmul(*operands[s])
    return sum(2 * s * m * k * n for s, m, k, n in shapes), run


def timed(fn):
    """A side of `harness.interleaved`: (seconds, what `fn()` returned)."""
    def side(_):
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out
    return side


def fork(rt, context, hypotheses):
    """The context read once, its memory copied into one row per hypothesis, the hypotheses scored as a batch."""
    rt.reset()
    rt.prefill(context[None, :-1])
    rt.select_rows([0] * len(hypotheses))
    return rt.score(np.stack([np.r_[context[-1], h] for h in hypotheses]))


def reread(rt, context, hypotheses):
    """The context read again before each hypothesis (the same segments as `fork`)."""
    out = []
    for h in hypotheses:
        rt.reset()
        rt.prefill(context[None, :-1])
        out.append(rt.score(np.r_[context[-1], h][None])[0])
    return np.stack(out)


def beam_sides(rt, hf, prompt, num_beams: int, tokens: int) -> dict:
    """`tokens` steps of `TxlRuntime.beam_search` and of HuggingFace's `generate(num_beams, do_sample=False)` from
    `prompt` and HuggingFace's first memory (zero vectors); each side gives its best hypothesis."""
    import torch  # optional (the torch extra): HuggingFace's side is a PyTorch model

    def ours():
        rt.start_from_zero_memory()
        return rt.beam_search(prompt, num_beams=num_beams, max_new_tokens=tokens)[0].tokens

    def theirs():
        with torch.no_grad(), transformers_on_current_torch():
            out = hf.generate(torch.tensor([prompt]), num_beams=num_beams, do_sample=False, max_new_tokens=tokens,
                              pad_token_id=hf.config.vocab_size - 1)
        return out[0, len(prompt):].tolist()
    return {"txl-deploy": timed(ours), "transformers": timed(theirs)}


def turns(sides: dict, rounds: int, slower: str, faster: str) -> tuple[dict, dict]:
    """`sides` interleaved for `rounds` after a warm-up round: ({"seconds", "speedup": `faster` over `slower`, the
    median of the rounds' ratios}, each side's output in the warm-up round)."""
    out = harness.interleaved(sides, rounds + 1)
    seconds = {name: [s for s, _ in r[1:]] for name, r in out.items()}
    return ({"seconds": seconds, "speedup": harness.median(np.divide(seconds[slower], seconds[faster]))},
            {name: r[0][1] for name, r in out.items()})


def summary(rounds: dict, tokens: int) -> dict:
    """Per side its seconds and median tokens/s; ONNX Runtime's speed over each side's and its time over the
    floor's, medians of the rounds' ratios; each side's largest NLL difference from ONNX Runtime's (first round)."""
    seconds = {name: [s for s, _ in r] for name, r in rounds.items()}
    ort_s, ort_nll = seconds["onnxruntime"], rounds["onnxruntime"][0][1]
    return {"seconds": seconds, "tokens_per_s": {k: tokens / harness.median(v) for k, v in seconds.items()},
            "onnxruntime_speedup": {k: harness.median(np.divide(v, ort_s)) for k, v in seconds.items()},
            "onnxruntime_over_floor": harness.median(np.divide(ort_s, seconds["floor"])),
            "max_abs_nll_diff": {k: float(np.max(np.abs(r[0][1] - ort_nll))) for k, r in rounds.items()
                                 if r[0][1] is not None}}


def measure(args, command):
    load_start = harness.load_average()
    checkpoint, _ = harness.checkpoint_of(args.model, args.cache_dir)
    cfg = load_model(checkpoint).config
    torch_threads(args.threads)
    onnx = standin_onnx(checkpoint, args.cache_dir, cfg.mem_len, max_segment=SEGMENT)
    runtimes = {"onnxruntime": TxlRuntime(OrtBackend(onnx, providers=["cpu"], intra_op_threads=args.threads)),
                "eager": TxlRuntime(EagerAtPositions.from_checkpoint(checkpoint, max_segment=SEGMENT)),
                "transformers": TxlRuntime(HuggingFaceBackend.from_checkpoint(checkpoint, max_segment=SEGMENT))}
    rng = np.random.default_rng(args.seed)
    throughput = {}
    for batch in args.batch:
        text = rng.integers(0, cfg.n_token, (batch, args.length))
        flops, floor = matmul_floor(matmul_shapes(cfg, batch, args.length, SEGMENT), args.threads)
        sides = {name: timed(lambda rt=rt, text=text: (rt.reset(), rt.score(text))[1]) for name, rt in runtimes.items()}
        sides["floor"] = timed(floor)
        for side in sides.values():
            side(None)  # first-run allocations
        throughput[batch] = {"flops": flops, **summary(harness.interleaved(sides, args.rounds),
                                                       batch * (args.length - 1))}
    context = rng.integers(0, cfg.n_token, args.context)
    hypotheses = rng.integers(0, cfg.n_token, (args.hypotheses, args.hypothesis_len))
    rt = runtimes["onnxruntime"]
    rescoring, nll = turns({"fork": timed(lambda: fork(rt, context, hypotheses)),
                            "re-read": timed(lambda: reread(rt, context, hypotheses))}, args.rounds, "re-read", "fork")
    rescoring["max_abs_nll_diff"] = float(np.max(np.abs(nll["fork"] - nll["re-read"])))
    prompt = [int(t) for t in context[:BEAM_PROMPT]]
    hf = with_generate(runtimes["transformers"].backend.hf)
    beam, best = turns(beam_sides(rt, hf, prompt, args.num_beams, args.beam_tokens), args.rounds, "transformers",
                       "txl-deploy")
    beam.update(num_beams=args.num_beams, tokens=args.beam_tokens, prompt=BEAM_PROMPT,
                same_best=list(map(int, best["txl-deploy"])) == best["transformers"])
    for rt in runtimes.values():
        rt.close()
    model = Path(args.model).name if Path(args.model).exists() else args.model
    raw = {"command": command, "load_start": load_start, "load_end": harness.load_average(), "model": model,
           "config": cfg.to_dict(), "segment": SEGMENT, "throughput": throughput, "rescoring": rescoring, "beam": beam,
           **{k: getattr(args, k) for k in ("threads", "rounds", "length", "context", "hypotheses", "hypothesis_len")}}
    return harness.results_markdown(TITLE, markdown(raw), command), raw, 0


def markdown(raw: dict) -> str:
    c, r, beam = raw["config"], raw["rescoring"], raw["beam"]
    lines = [
        *harness.machine_lines(raw["load_start"], raw["load_end"]),
        f"- model: {raw['model']} ({c['n_layer']} layers, d_model {c['d_model']}, {c['n_token']} tokens), mem_len "
        f"{c['mem_len']}, every side reading segments of {raw['segment']} tokens on {raw['threads']} thread(s), fp32; "
        f"{raw['rounds']} rounds, the sides taking turns; ratios: the median of the rounds' own ratios",
        "", f"## Scoring throughput: `TxlRuntime.score` of {raw['length']} tokens per row, tokens/s", "",
        *harness.table(["batch", *SIDES.values(), "ONNX Runtime faster than eager", "than HuggingFace",
                        "ONNX Runtime time / floor", "floor GFLOP/s"],
                       [[b, *(f"{t['tokens_per_s'][k]:,.0f}" for k in SIDES),
                         *(f"{t['onnxruntime_speedup'][k]:.2f}x" for k in ("eager", "transformers")),
                         f"{t['onnxruntime_over_floor']:.2f}x",
                         f"{t['flops'] / harness.median(t['seconds']['floor']) / 1e9:.1f}"]
                        for b, t in raw["throughput"].items()], numeric_from=1),
        "", "Largest difference of a token's negative log-likelihood from ONNX Runtime's (nats): "
        + "; ".join(f"batch {b}: " + ", ".join(f"{SIDES[k]} {v:.1e}" for k, v in t["max_abs_nll_diff"].items()
                                               if k != "onnxruntime") for b, t in raw["throughput"].items()) + ".",
        "", f"## Rescoring {raw['hypotheses']} hypotheses of {raw['hypothesis_len']} tokens on a shared "
        f"{raw['context']}-token context (ONNX Runtime)", "",
        *harness.table(["path", "ms (median)", "per hypothesis ms"],
                       [[name, f"{1e3 * harness.median(s):.1f}", f"{1e3 * harness.median(s) / raw['hypotheses']:.1f}"]
                        for name, s in r["seconds"].items()], numeric_from=1),
        "", f"The fork is **{r['speedup']:.1f}x** faster than re-reading the context for each hypothesis; their "
        f"scores differ by at most {r['max_abs_nll_diff']:.1e} nats.",
        "", f"## Beam search, k = {beam['num_beams']}: {beam['tokens']} tokens from a {beam['prompt']}-token prompt",
        "", *harness.table(["path", "tokens/s", "ms per token"],
                           [[BEAM_SIDES[name], f"{beam['tokens'] / harness.median(s):.1f}",
                             f"{1e3 * harness.median(s) / beam['tokens']:.1f}"] for name, s in beam["seconds"].items()],
                           numeric_from=1),
        "", f"txl-deploy is **{beam['speedup']:.1f}x** faster; both sides return the same best hypothesis: "
        f"{'yes' if beam['same_best'] else 'NO'}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = harness.parser("scoring", __doc__, md="results_scoring.md")
    p.add_argument("--model", default=str(DEMO_DIR / "kjv-char"), help="a checkpoint or a shape name (default: "
                   "the bundled demo model)")
    p.add_argument("--batch", type=harness.int_list, default=[1, 8, 32], help="batch sizes (default 1,8,32)")
    p.add_argument("--length", type=int, default=512, help="tokens per row scored (default 512)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--context", type=int, default=500, help="tokens of the shared context (default 500)")
    p.add_argument("--hypotheses", type=int, default=10, help="hypotheses rescored on it (default 10)")
    p.add_argument("--hypothesis-len", type=int, default=16, help="tokens per hypothesis (default 16)")
    p.add_argument("--num-beams", type=int, default=4, help="beams (default 4)")
    p.add_argument("--beam-tokens", type=int, default=32, help="tokens a beam search generates (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"a run of seconds (defaults {QUICK})")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--quick" in argv:
        p.set_defaults(**QUICK)
    return harness.main("scoring", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
