"""Lazy against full adaptive-softmax generation on the WikiText-103 base shape, at a trained model's tail rates.

    .venv/bin/python benchmarks/lazy_decode.py [--work benchmarks/.cache] [--rounds 7] [--tokens 32]
        [--batch-tokens 12] [--out benchmarks/results_lazy_decode.md]

Both sides are the same ONNX Runtime session set (CPU, one intra-op thread) on one export of a WikiText-103 base
stand-in (267,735 words, cutoffs 20000/40000/200000, 16 x 410, memory full at mem_len 640), with the same seed:

- lazy: each fed token runs the head graph (the model body, the shortlist and the cluster logits), and a decision
  runs a tail graph only when its sampler asks for it (batch 1: `TxlRuntime.generate`; batch 8: the head graph on
  every row, then `lazy_decode.decide`, each asked tail once per round on the rows that ask);
- full: the same runtime with `lazy` off: each fed token runs the main graph (the body and the whole 267,735-word
  distribution), and the sampler makes the same cluster-factored decision from it (`Sampler.choose`).

The rates at which a tail is needed come from a trained model: the KJV word model (tests/data/kjv-words, three
tail clusters) generates --trained-tokens tokens per mode in the same run, and the stand-in's head is fitted to its
greedy and T=1 rates before export (txl_deploy/bench/lazy_decode.py says how); the rates the stand-in shows while
timed are reported beside them. Rounds interleave the sides (lazy, full; then full, lazy), each side starting from
the same saved memory and prompt token; tokens/s are medians over rounds, speed-ups the median of the rounds'
full/lazy time ratios. Writes a Markdown file and the raw numbers as JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np

from txl_deploy.bench import lazy_decode as ld
from txl_deploy.bench.random_weights import shape_config, standin_onnx

logger = logging.getLogger("lazy_decode")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRAINED = ROOT / "tests" / "data" / "kjv-words" / "model"
TRAINED_PROMPT = "And God said unto Moses,"
SHAPE = "wt103-base"
TARGET = 2.0  # lazy / full tokens per second at batch 1, greedy and T=1
TARGET_MODES = ("greedy", "T=1")
PART_REPS = 3  # head, tails and full step timed alone, per batch-1 round


def fractions_cells(fr) -> str:
    return " / ".join(f"{100 * f:.1f}%" for f in fr)


def report(args, argv, trained, fit, results, parts, load_start, load_end, clusters) -> str:
    from txl_deploy.bench.benchmark import machine_info, versions
    from txl_deploy.bench.report import command_line, results_markdown

    m, v = machine_info(), versions()
    sizes = [hi - lo for lo, hi in clusters.bounds]
    lines = [
        f"- machine: {m['cpu']}, {m['cores']} cores, shared with other jobs (load average over 1 minute "
        f"{load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end); {m['platform']}",
        f"- versions: python {v['python']}, numpy {v['numpy']}, onnxruntime {v['onnxruntime']}, "
        f"txl-deploy {v['txl_deploy']}",
        "- model: a random-weight stand-in of the WikiText-103 base shape (267,735 words; shortlist 20,000, tail "
        f"clusters of {', '.join(f'{s:,}' for s in sizes)} words; 16 layers, d_model 410), ONNX fp32 with the "
        "adaptive softmax's head and tail graphs, ONNX Runtime CPU, 1 intra-op thread, the memory full at mem_len "
        "640 before every timed call",
        "- lazy: each fed token runs the head graph (body, shortlist, cluster logits); a decision runs a tail graph "
        "only when its sampler asks for it. Batch 1 is `TxlRuntime.generate` (which, when the call ends, also "
        "assembles the last position's full distribution once: included in its time); batch 8 feeds every row "
        "through the head graph, then `lazy_decode.decide` runs each asked tail once per round on the rows that "
        "ask",
        "- full: the same runtime with `lazy=False`: each fed token runs the main graph (body and the whole "
        "distribution), and the sampler makes the same cluster-factored decision from it",
        f"- {args.rounds} rounds, sides interleaved (lazy then full, full then lazy); a round generates "
        f"{args.tokens} tokens at batch 1, {args.batch_tokens} steps x 8 rows at batch 8, both sides from the same "
        "saved memory and prompt token with the same seed (a new seed and prompt token each round); tokens/s are "
        "medians over rounds, the speed-up the median of the rounds' full/lazy time ratios (range in brackets)",
        "",
        "## Tail rates: the trained model's, and the stand-in's while timed",
        "",
        f"The trained model is the KJV word model (tests/data/kjv-words: 16,579 words, cutoffs 500/2000/6000), "
        f"{args.trained_tokens} tokens per mode generated lazily from \"{TRAINED_PROMPT}\" with seed "
        f"{args.seed} in this run. The stand-in's head was fitted to its greedy and T=1 rates on "
        f"{ld.CALIBRATION_TOKENS} hidden states of the stand-in (the fit's own rates: greedy "
        f"{fractions_cells(fit['greedy'])}, T=1 {fractions_cells(fit['sampled'])}); top-k 40 is not fitted.",
        "",
        "| mode | trained model: tail 1 / 2 / 3 | stand-in, batch 1 | stand-in, batch 8 |",
        "|---|---|---|---|",
    ]
    for mode in ld.MODES:
        lines.append(f"| {mode} | {fractions_cells(trained[mode]['fractions'])} | "
                     f"{fractions_cells(results[mode]['1']['tail_fractions'])} | "
                     f"{fractions_cells(results[mode]['8']['tail_fractions'])} |")
    lines += [
        "",
        f"## Generated tokens per second (target: lazy at least {TARGET:g}x full at batch 1, greedy and T=1)",
        "",
        "| mode | batch | lazy tokens/s | full tokens/s | lazy / full | tokens identical | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in ld.MODES:
        for batch in ("1", "8"):
            r = results[mode][batch]
            lo, hi = r["speedup_range"]
            target = ("yes" if r["speedup"] >= TARGET else "NO") if batch == "1" and mode in TARGET_MODES else ""
            lines.append(f"| {mode} | {batch} | {r['lazy_tokens_per_s']:.2f} | {r['full_tokens_per_s']:.2f} | "
                         f"{r['speedup']:.2f}x ({lo:.2f} to {hi:.2f}) | "
                         f"{'yes' if r['tokens_identical'] else 'NO'} | {target} |")
    tails = " / ".join(f"{t:.1f}" for t in parts["tail_ms"])
    lines += ["", "tokens identical: whether in every round the lazy side generated exactly the full side's tokens "
              "(same seed, same memory)."]
    differ = [(mode, batch, d) for mode in ld.MODES for batch in ("1", "8") for d in results[mode][batch]["differ"]]
    if differ:
        pairs = {(m, b) for m, b, _ in differ}
        decisions = sum(results[m][b]["rounds"] * results[m][b]["tokens_per_round"] for m, b in pairs)
        lines += ["", f"Streams that differ ({len(differ)}, in modes and batches that made {decisions} decisions in "
                  "all), at their first differing token: " + "; ".join(
                      f"{m}, batch {b}, round {d['round']} row {d['row']} step {d['step']}: lazy {d['lazy']}, full "
                      f"{d['full']}" for m, b, d in differ) + ". "
                  + ("Adjacent ids are a draw that fell within rounding of the boundary between two tokens' "
                     "cumulative weights: the lazy side decides on the head graph's cluster log-probs, the full "
                     "side on those `Clusters.head_from_full` derives from the main graph's float32 distribution, "
                     "and the two differ in their last bits." if all(abs(d["lazy"] - d["full"]) == 1
                                                                      for _, _, d in differ) else "")]
    lines += [
        "",
        f"What lazy saves is the tails' share of a step times the fraction of decisions that do not need them; with "
        f"no tail ever computed, a batch-1 step would take the head graph's time: the graphs alone give at most "
        f"full / head = {parts['full_ms'] / parts['head_ms']:.2f}x (times below). The full side's decisions also "
        "derive the head from the 267,735 log-probs (float64), which the lazy side's do not.",
        "",
        "## Batch 1 at the trained model's tail rates",
        "",
        f"Where the stand-in's rates differ from the trained model's, the measured lazy time is moved by the "
        f"difference: each graph alone, timed at batch 1 in the same rounds ({PART_REPS} turns per round, medians), "
        f"takes {parts['head_ms']:.1f} ms for a step through the head graph, {tails} ms for tail 1 / 2 / 3 on its "
        f"hidden state, and {parts['full_ms']:.1f} ms for a step through the main graph (head and every tail: "
        f"{parts['head_ms'] + sum(parts['tail_ms']):.1f} ms). Each round's lazy seconds per token plus, per tail, "
        "(trained rate - the stand-in's rate) x that tail's time:",
        "",
        "| mode | lazy tokens/s at the trained rates | full tokens/s (measured) | lazy / full | target | "
        "MB a lazy token reads | bound from the bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in ld.MODES:
        r = results[mode]["1"]
        est, bound = r["at_trained_rates"], r["byte_bound"]
        target = ("yes" if est["speedup"] >= TARGET else "NO") if mode in TARGET_MODES else ""
        lines.append(f"| {mode} | {est['lazy_tokens_per_s']:.2f} | {r['full_tokens_per_s']:.2f} | "
                     f"{est['speedup']:.2f}x | {target} | {bound['lazy_mb']:.0f} | {bound['bound']:.2f}x |")
    tail_mb = " / ".join(f"{t:.1f}" for t in next(iter(results.values()))["1"]["byte_bound"]["tail_mb"])
    full_mb = next(iter(results.values()))["1"]["byte_bound"]["full_mb"]
    lines += [
        "",
        f"Bound from the bytes: a full step reads {full_mb:.0f} MB (weights, positional tables, memory), tails 1 / 2 / "
        f"3 {tail_mb} MB of it; a lazy token reads the full step's bytes less the tails', plus each tail's bytes "
        "times the trained rate it is needed at. Reading fewer bytes is all a lazy token does, so read at the same "
        "rate as the full step's it gains at most full MB / lazy MB, whatever the implementation; a measured "
        "speed-up above that bound comes from the full side's extra work per token (its sampler derives the head "
        "from the 267,735 log-probs).",
    ]
    return results_markdown("Lazy adaptive-softmax generation against full, WikiText-103 base shape",
                            "\n".join(lines), command_line("benchmarks/lazy_decode.py", argv))


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.runtimes.backends.onnxruntime import OrtBackend
    from txl_deploy.runtimes.sampling import Clusters

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(HERE / ".cache"), help="where the stand-in and the exports are cached")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per mode and batch (default 7)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens a batch-1 round generates (default 32)")
    ap.add_argument("--batch-tokens", type=int, default=12, help="steps a batch-8 round decodes (default 12)")
    ap.add_argument("--trained-tokens", type=int, default=1024, help="tokens per mode on the trained model")
    ap.add_argument("--seed", type=int, default=7, help="sampling seed of the trained model's run and round 0")
    ap.add_argument("--out", default=str(HERE / "results_lazy_decode.md"))
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()

    trained_config = json.loads((TRAINED / "config.json").read_text(encoding="utf-8"))["config"]
    trained_onnx = standin_onnx(TRAINED, work, trained_config["mem_len"], max_segment=16)
    with TxlRuntime.load(trained_onnx, threads=1) as rt:
        prompt = rt.vocab.encode(TRAINED_PROMPT, add_eos=False)
        trained = ld.trained_fractions(rt, prompt, ld.MODES, args.trained_tokens, args.seed)
    logger.info(f"trained model's tail rates: {json.dumps(trained)}")

    ckpt, fit = ld.calibrated_standin(SHAPE, work, trained["greedy"]["fractions"], trained["T=1"]["fractions"])
    mem_len = shape_config(SHAPE).mem_len
    path = standin_onnx(ckpt, work, mem_len, max_segment=64)
    rt = TxlRuntime(OrtBackend(path, providers=["cpu"], intra_op_threads=1))
    if rt.backend.clusters is None:
        raise SystemExit(f"{path}: the adaptive softmax's parts were not opened ({rt.backend.parts_error})")
    clusters = Clusters.of(rt.config)
    rng = np.random.default_rng(0)
    saved = {}
    for batch in (1, 8):
        rt.reset()
        rt.prefill(rng.integers(0, rt.n_token, size=(batch, mem_len)))  # every timed step attends to mem_len
        saved[batch] = rt.save_state()
    arrays1, arrays8 = ({k: v for k, v in saved[b].items() if not k.startswith("__")} for b in (1, 8))
    prompts = rng.integers(0, clusters.shortlist, size=(args.rounds, 8))

    results, parts_rounds = {}, []
    for mode, controls in ld.MODES.items():
        results[mode] = {}
        logger.info(f"{mode}: batch 1")
        sides = {side: (lambda r, lazy=(side == "lazy"), controls=controls: ld.time_generate(
            rt, saved[1], int(prompts[r, 0]), args.tokens, args.seed + r, controls, lazy)) for side in ("lazy", "full")}
        sides["parts"] = lambda r: ld.time_parts(rt.backend, arrays1, int(prompts[r, 0]), PART_REPS)
        out = ld.interleaved(sides, args.rounds)
        results[mode]["1"] = ld.summarize(out["lazy"], out["full"], args.tokens, 1)
        parts_rounds += out["parts"]
        logger.info(f"{mode}: batch 8")
        sides = {side: (lambda r, lazy=(side == "lazy"), controls=controls: ld.time_batched(
            rt.backend, arrays8, prompts[r], args.batch_tokens, args.seed + 100 * r, controls, lazy))
            for side in ("lazy", "full")}
        out = ld.interleaved(sides, args.rounds)
        results[mode]["8"] = ld.summarize(out["lazy"], out["full"], args.batch_tokens, 8)
        logger.info(json.dumps({b: {k: v for k, v in r.items() if "seconds" not in k}
                                 for b, r in results[mode].items()}))
    rt.close()
    load_end = os.getloadavg()
    parts = {"head_ms": float(np.median([p["head_ms"] for p in parts_rounds])),
             "tail_ms": np.median([p["tail_ms"] for p in parts_rounds], axis=0).tolist(),
             "full_ms": float(np.median([p["full_ms"] for p in parts_rounds])), "rounds": parts_rounds}
    for mode in ld.MODES:
        results[mode]["1"]["at_trained_rates"] = ld.at_rates(results[mode]["1"], parts, trained[mode]["fractions"])
        results[mode]["1"]["byte_bound"] = ld.byte_bound(path, trained[mode]["fractions"])

    text = report(args, argv, trained, fit, results, parts, load_start, load_end, clusters)
    Path(args.out).write_text(text, encoding="utf-8")
    from txl_deploy.bench.report import command_line

    raw = {"command": command_line("benchmarks/lazy_decode.py", argv), "load_start": load_start,
           "load_end": load_end, "shape": SHAPE, "export": Path(path).name, "trained": trained, "fit": fit,
           "settings": {k: getattr(args, k) for k in ("rounds", "tokens", "batch_tokens", "trained_tokens", "seed")},
           "decorrelate": ld.DECORRELATE, "results": results, "parts": parts, "target": TARGET}
    Path(args.out).with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
