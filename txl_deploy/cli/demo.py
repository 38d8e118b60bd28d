"""`demo`: the whole pipeline on the bundled model, in about a minute on two CPU cores."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import click

from txl_deploy.assets import demo_heldout_path, demo_model_path, demo_training_record
from txl_deploy.bench.benchmark import run_benchmark
from txl_deploy.bench.report import table, write_json
from txl_deploy.cli.options import threads_option
from txl_deploy.errors import OutputExistsError
from txl_deploy.exporters.onnx.export import export_onnx
from txl_deploy.files import atomic_path
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.evaluation import evaluate_text


def _stage(title):
    click.secho(f"\n== {title}", bold=True)


@click.command("demo")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Folder for the artefacts [default: txl-demo/run-<timestamp>, a new folder every run].")
@click.option("--model", type=click.Path(exists=True), help="Checkpoint to use [default: the bundled demo model].")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False),
              help="Held-out text to evaluate on [default: the bundled held-out text].")
@click.option("--prompt", default="And God said", show_default=True, help="Prompt for the generated sample.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (temperature 0.8, top-k 20).")
@click.option("--eval-chars", type=click.IntRange(min=0), default=0, show_default=True,
              help="Evaluate ONNX Runtime on the first N characters of the held-out text (0 = all of it).")
@click.option("--parity-chars", type=click.IntRange(min=2), default=2048, show_default=True,
              help="Characters on which ONNX Runtime and the (slow) PyTorch eager reference are both evaluated.")
@click.option("--bench/--no-bench", default=True, show_default=True, help="Run the short benchmark against eager.")
@click.option("--force", is_flag=True, help="Allow writing into an existing --out folder (files are replaced).")
@threads_option
def demo_cmd(out_dir, model, text_file, prompt, max_new_tokens, seed, eval_chars, parity_chars, bench, force,
             threads):
    """Take the bundled demo model (a small character-level Transformer-XL trained on the King James Bible)
    through the whole pipeline: export to ONNX, verify against PyTorch, generate a sample, evaluate bits per
    character on the held-out text (and on its start with both backends), and a short decode benchmark against
    PyTorch eager.
    Prints where each artefact went."""
    t0 = time.perf_counter()
    ckpt = Path(model) if model else demo_model_path()
    text_path = Path(text_file) if text_file else demo_heldout_path()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(out_dir) if out_dir else Path("txl-demo") / f"run-{stamp}"
    if out.exists() and any(out.iterdir()) and not force:
        raise OutputExistsError(out)
    out.mkdir(parents=True, exist_ok=True)
    artefacts, summary = {}, {"checkpoint": str(ckpt), "date": stamp}

    _stage(f"1/5 export {ckpt} to ONNX (verified against the PyTorch reference)")
    onnx_path = out / "model.onnx"
    if threads:
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        torch.set_num_threads(threads)  # the export and the PyTorch reference, before anything runs
    result = export_onnx(ckpt, onnx_path, force=True, threads=threads)
    artefacts["ONNX model"] = onnx_path
    summary["verification"] = result.verification

    with TxlRuntime.load(onnx_path, threads=threads) as rt:
        _stage(f"2/5 generate with ONNX Runtime (temperature 0.8, top-k 20, seed {seed})")
        click.echo(prompt, nl=False)
        pieces = []
        for piece in rt.generate_text(prompt, max_new_tokens, temperature=0.8, top_k=20, seed=seed):
            pieces.append(piece)
            click.echo(piece, nl=False)
        click.echo()
        sample = prompt + "".join(pieces)
        with atomic_path(out / "sample.txt", force=True) as tmp:
            tmp.write_text(sample + "\n", encoding="utf-8")
        artefacts["generated sample"] = out / "sample.txt"

        full_text = text_path.read_text(encoding="utf-8")
        text = full_text[:eval_chars] if eval_chars else full_text
        parity_text = full_text[:parity_chars]
        tgt_len = rt.config.tgt_len
        _stage(f"3/5 streaming evaluation (tgt_len {tgt_len}, mem_len {rt.mem_len}) on held-out {text_path.name}")
        ort_eval = evaluate_text(rt, text, tgt_len)
        ort_parity = evaluate_text(rt, parity_text, tgt_len, progress=False)
    with TxlRuntime.load(ckpt, threads=threads) as ref:
        ref_parity = evaluate_text(ref, parity_text, tgt_len)
    unit = ort_eval["unit"]
    click.echo(f"{'backend':<14} {'characters':>10} {unit:>8} {'tokens/s':>10}")
    for name, r, n in (("onnxruntime", ort_eval, len(text)), ("onnxruntime", ort_parity, len(parity_text)),
                       ("torch (eager)", ref_parity, len(parity_text))):
        click.echo(f"{name:<14} {n:>10,} {r['score']:>8.4f} {r['tokens_per_second']:>10,.0f}")
    summary["eval"] = {"text": str(text_path), "chars": len(text), "tgt_len": tgt_len, "unit": unit,
                       "onnxruntime": ort_eval["score"], "parity_chars": len(parity_text),
                       "parity": {"onnxruntime": ort_parity["score"], "torch": ref_parity["score"]}}
    if not model and not eval_chars:
        try:
            recorded = demo_training_record()["heldout"]["bpc"]
            click.echo(f"recorded when the model was trained (whole held-out text): {recorded:.4f} bpc")
            summary["eval"]["recorded"] = recorded
        except (KeyError, TypeError, ValueError):  # the record is informative only
            pass

    if bench:
        _stage("4/5 decode benchmark against PyTorch eager (batch 1, full memory)")

        report = run_benchmark(str(onnx_path), backend="onnxruntime", reference=str(ckpt), batches=(1,),
                               prompt_len=128, gen_len=32, warmup=1, repeat=3, floor=False, threads=threads)
        click.echo(table(report))
        write_json(report, out / "bench.json", force=True)
        artefacts["benchmark (JSON)"] = out / "bench.json"
        summary["bench"] = [{"mem_len": r["mem_len"], "batch": r["batch"], "speedup": r["speedup"]}
                            for r in report["results"]]
    else:
        _stage("4/5 benchmark skipped (--no-bench)")

    _stage("5/5 artefacts")
    with atomic_path(out / "summary.json", force=True) as tmp:
        tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    artefacts["summary (JSON)"] = out / "summary.json"
    width = max(len(k) for k in artefacts)
    for name, path in artefacts.items():
        click.echo(f"{name:<{width}}  {path}")
    click.echo(f"\ndone in {time.perf_counter() - t0:.0f} s. Next: txl-deploy generate {onnx_path} --prompt \"...\"")


COMMANDS = [demo_cmd]
