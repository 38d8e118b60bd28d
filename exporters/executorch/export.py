"""ExecuTorch export: the cached step as a `.pte` program delegated to XNNPACK, for phones (Android, iOS).

The program has the ONNX graph's memory contract (`io_spec`: the same input and output names and order, the
incremental layout, a fixed `mem_len` ring buffer kept by the runtime), a dynamic batch (1 to MAX_BATCH) and a
dynamic segment (1 to `max_segment`). It is traced from `LinearCachedTxl`, whose weights are all `nn.Linear`
modules, so torchao's `quantize_` reaches every weight matrix and `torch.export` finds no tensor made in `forward`.
Config, vocabulary and export settings go into the sidecar `<name>.pte.json` (`contract.pte_file`).

Before anything is written, the program runs as users run it (`TxlRuntime` on the ExecuTorch backend) on
multi-segment streams at several batch and segment shapes against the PyTorch reference (fp32: numpy.allclose's
rule with atol 1e-4, rtol 1e-5, as the ONNX export; int8 and int4: the mean KL divergence from fp32, and bits per
character on held-out text within 2%).
"""

from __future__ import annotations

import datetime
import importlib.util
import logging
import os
import time
import warnings
from importlib import metadata as importlib_metadata
from pathlib import Path

import numpy as np

from txl_deploy import __version__
from txl_deploy.checkpoints import LoadedModel, load_model
from txl_deploy.contract.io_spec import r_table_size
from txl_deploy.contract.metadata import ExportInfo
from txl_deploy.contract.pte_file import sidecar_path, write_sidecar
from txl_deploy.errors import ExportError, InputError, TxlError, install_hint
from txl_deploy.exporters.onnx.export import DEFAULT_MAX_SEGMENT, ExportResult, export_mem_len
from txl_deploy.exporters.onnx.stream import verification_segments
from txl_deploy.exporters.onnx.verify import REDUCED_KL, ReferenceStream, describe, judge
from txl_deploy.exporters.precision.report import accuracy_report
from txl_deploy.exporters.precision.token_data import check_long_enough, ids_from
from txl_deploy.files import atomic_path, check_writable
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.executorch import ExecuTorchBackend
from txl_deploy.runtimes.backends.pytorch import TorchCachedBackend
from txl_deploy.runtimes.evaluation import streaming_eval

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "int8", "int4")
MAX_BATCH = 64  # rows one call takes; a phone app runs one or a few
INT4_GROUP = 32  # weights per int4 scale (ExecuTorch's Llama recipe uses 32 for 8da4w)
MAX_ACCURACY_CHANGE = 0.02  # the reduced-precision gate: held-out bits per character (perplexity) within 2% of fp32
MAX_EVAL_TOKENS = 20_000  # held-out tokens evaluated by both sides
RUNTIME = "TxlRuntime on ExecuTorch (Python runtime, XNNPACK)"  # what the verification ran, as recorded


def quantize_method(precision: str) -> dict | None:
    """What `precision` does to the weights, as recorded in the sidecar."""
    if precision == "int4":
        return {"scheme": "8da4w", "weights": f"int4, symmetric, groups of {INT4_GROUP} along the input",
                "activations": "int8, dynamic, per token", "ops": "every Linear whose input size is a multiple of "
                f"{INT4_GROUP} (attention, feed-forward, projections, output layer)", "library": "torchao"}
    if precision == "int8":
        # 8da8w, not int8 weight-only: XNNPACK's dynamically quantized fully-connected kernels take int8 and int4
        # weights alike, so int8 runs the same delegated path as 8da4w; a weight-only int8 Linear is lowered as a
        # dequantize feeding an fp32 Linear, which costs the fp32 weights' bandwidth again on every call.
        return {"scheme": "8da8w", "weights": "int8, symmetric, one scale per output channel",
                "activations": "int8, dynamic, per token", "ops": "every Linear (attention, feed-forward, "
                "projections, output layer)", "library": "torchao"}
    return None


def _quantize(step, precision: str) -> list[str]:
    """torchao's quantize_ on `step`'s Linears, in place; returns the Linears left in fp32."""
    import torch  # optional (the executorch extra): the quantizer works on torch modules
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_  # optional: executorch extra
    from torchao.quantization.granularity import PerAxis, PerGroup  # optional: the executorch extra

    if precision == "int4":
        config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(INT4_GROUP))
    else:
        config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    left = [name for name, m in step.named_modules() if isinstance(m, torch.nn.Linear)
            and precision == "int4" and m.in_features % INT4_GROUP]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_(step, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn not in left)
    return left


def _lower(step, max_segment: int):
    """torch.export with dynamic batch, segment and positions -> XNNPACK-delegated ExecuTorch program."""
    import torch  # optional (the executorch extra): only code that runs a PyTorch model gets here
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner  # optional extra
    from executorch.exir import to_edge_transform_and_lower  # optional (the executorch extra)

    state = step.empty_state(2)
    # torch.export specialises any dimension whose example size is 0 or 1, so every example size is >= 2.
    args = (torch.zeros(2, min(3, max_segment) if max_segment >= 2 else 2, dtype=torch.long),
            torch.zeros(2, 2, dtype=torch.long), *state)
    b = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    q = torch.export.Dim("segment", min=1, max=max(2, max_segment))
    pos = torch.export.Dim("positions", min=1, max=max(2, max_segment))
    dynamic = ({0: b, 1: q}, {0: b, 1: pos}, tuple({0: b} for _ in state))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(step, args, dynamic_shapes=dynamic, strict=False)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    graph = edge.exported_program().graph_module.graph
    # Operators left to ExecuTorch's portable kernels (shape arithmetic on symbolic sizes aside).
    portable = sorted({_op_name(n.target) for n in graph.nodes if n.op == "call_function"
                       and not any(skip in str(n.target) for skip in ("call_delegate", "getitem", "built-in", "sym_"))})
    delegates = sum(1 for n in graph.nodes if n.op == "call_function" and "call_delegate" in str(n.target))
    return edge.to_executorch().buffer, {"delegate": "XNNPACK", "xnnpack_partitions": delegates,
                                        "portable_ops": portable}


def _op_name(target) -> str:
    """`aten._log_softmax.default` -> `_log_softmax`, `aten.add.Tensor` -> `add.Tensor` (edge ops wrap an aten op)."""
    schema = getattr(getattr(target, "_op", target), "_schema", None)
    if schema is None:
        return str(target)
    name = schema.name.split("::")[-1]
    return f"{name}.{schema.overload_name}" if schema.overload_name else name


def _program_runtime(path, info: ExportInfo) -> TxlRuntime:
    """The program at `path` as users run it: TxlRuntime on the ExecuTorch backend, which reads the sidecar beside
    it (written here without a verification; the one that ships is written once the checks pass)."""
    write_sidecar(info, path, sidecar_path(path))
    return TxlRuntime(ExecuTorchBackend(path))


def check_shapes(mem_len: int, max_segment: int) -> list[tuple[int, list[int]]]:
    """(batch, segments) of the streams the fp32 check feeds: batch 2 over the verification stream (empty memory,
    decode, prefill, the ring wrapping), one row decoding token by token, three rows in prefills of 5."""
    return [(2, verification_segments(mem_len, max_segment)), (1, [1] * 6),
            (3, [min(5, max_segment)] * 3 + [min(8, max_segment)])]


def _verify_fp32(runtime, model, mem_len, max_segment, tolerance) -> dict:
    reports = []
    for seed, (batch, segments) in enumerate(check_shapes(mem_len, max_segment)):
        reference = ReferenceStream(model, segments, batch, seed)
        runtime.reset()
        report = judge(reference.compare(runtime.step), "fp32", tolerance)
        logger.info("  " + describe(report))
        reports.append(report)
    worst = max(reports, key=lambda r: r["tolerance_used"])
    return {**worst, "passed": all(r["passed"] for r in reports),
            "shapes": [{"batch": r["batch"], "segments": r["segments"], "max_abs_diff": r["max_abs_diff"]}
                       for r in reports], "runtime": RUNTIME}


def _verify_reduced(runtime, model, vocab, precision, max_segment, eval_ids, seg, vocab_kind, tolerance,
                    max_eval_tokens) -> dict:
    segments = verification_segments(runtime.mem_len, max_segment)
    report = ReferenceStream(model, segments).compare(runtime.step)
    report.pop("tolerance_used")  # fp32's own rule: a reduced program is judged by the KL divergence
    limit = REDUCED_KL[precision] if tolerance is None else tolerance
    report.update(tolerance=limit, precision=precision, passed=bool(report["kl_divergence"] <= limit),
                  criterion=f"mean KL divergence <= {limit:g} nats", reference="fp32 PyTorch reference",
                  runtime=RUNTIME)
    logger.info("  " + describe(report))
    accuracy = None
    if eval_ids is not None:
        ids, name = eval_ids[0][:max_eval_tokens], Path(eval_ids[1]).name
        results, argmax = {}, {}
        # fp32: the reference model through the torch-fast backend (the same cached step, unquantized)
        fp32 = TxlRuntime(TorchCachedBackend.from_model(model, vocab, max_segment))
        for key, rt in (("fp32", fp32), ("reduced", runtime)):
            rt.reset()

            def step(tokens, rt=rt, key=key):
                lp = rt.step(tokens)
                argmax.setdefault(key, []).append(lp[0].argmax(-1))
                return lp

            results[key] = streaming_eval(ids, step, seg)
        fp32.close()
        agree = float(np.mean(np.concatenate(argmax["reduced"]) == np.concatenate(argmax["fp32"])))
        accuracy = accuracy_report({**results, "top1_agreement": agree}, vocab_kind)
        accuracy.update(data=name, limit=MAX_ACCURACY_CHANGE,
                        passed=bool(accuracy["relative_change"] <= MAX_ACCURACY_CHANGE))
        logger.info(f"  {accuracy['metric'].replace('_', ' ')} on {accuracy['tokens']} held-out tokens: fp32 "
                    f"{accuracy['fp32']:.4f}, {precision} {accuracy['reduced']:.4f} "
                    f"({100 * accuracy['relative_change']:+.3f}%, limit +{100 * MAX_ACCURACY_CHANGE:g}%)")
    report["accuracy"] = accuracy
    return report


def _require_executorch() -> None:
    missing = [name for name in ("executorch", "torchao") if importlib.util.find_spec(name) is None]
    if missing:
        raise ExportError(f"the ExecuTorch export needs {' and '.join(missing)}: "
                          f"{install_hint('executorch')}")


def export_executorch(source, out_path, *, precision: str = "fp32", mem_len: int | None = None,
                      max_segment: int = DEFAULT_MAX_SEGMENT, clamp_len: int | None = None,
                      same_length: bool | None = None, eval_text=None, verify: bool = True, force: bool = False,
                      threads: int | None = None, tolerance: float | None = None,
                      max_eval_tokens: int = MAX_EVAL_TOKENS, consume: bool = False) -> ExportResult:
    """Export `source` (a checkpoint path or a LoadedModel) to the ExecuTorch program `out_path` (.pte) and its
    sidecar `out_path`.json, both written atomically after the checks pass.

    precision: fp32, int8 (8da8w) or int4 (8da4w), see quantize_method. eval_text: held-out text (or a .npy of
    token ids) for the reduced-precision accuracy gate (its first `max_eval_tokens`); without it only the stream KL
    is checked.
    verify: run the program in ExecuTorch's runtime against PyTorch and refuse a mismatch (write nothing).
    threads: torch's threads for the export and the reference. mem_len, max_segment, clamp_len, same_length: as for
    the ONNX export. The batch axis takes 1 to MAX_BATCH rows."""
    import torch  # optional (the executorch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model.linear_step import LinearCachedTxl  # imports torch
    from txl_deploy.model.weights import build_model, model_parameters, weights_sha256  # imports torch

    out_path = Path(out_path)
    _require_executorch()
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not available for ExecuTorch: choose {', '.join(PRECISIONS)}")
    check_writable(out_path, force)
    check_writable(sidecar_path(out_path), force)
    if max_segment < 1:
        raise ExportError("max_segment must be >= 1")
    if threads:
        torch.set_num_threads(threads)
    loaded = source if isinstance(source, LoadedModel) else load_model(source)
    config = loaded.config
    mem_len = export_mem_len(loaded, mem_len)
    # ids_from reads text through an export's vocabulary and n_token: the ones this program will carry
    source_info = ExportInfo(config, loaded.vocab, {"mem_len": mem_len, "max_segment": max_segment})
    seg = max(1, min(int(config.tgt_len or 1), max_segment))
    eval_ids = ids_from(eval_text, source_info, "evaluation text") if precision != "fp32" else None
    if eval_ids is not None:
        check_long_enough(eval_ids[0], seg, eval_ids[1], "evaluation text")

    checkpoint_settings = {"mem_len": config.mem_len, "clamp_len": config.clamp_len, "same_length": config.same_length}
    overrides = {k: v for k, v in (("clamp_len", clamp_len), ("same_length", same_length)) if v is not None}
    model = build_model(config.replace(**overrides), loaded.state_dict, loaded.path).reset_length(mem_len)
    if consume or not isinstance(source, LoadedModel):
        loaded.state_dict = {}
    config = model.cfg
    step = LinearCachedTxl(model, mem_len, max_segment=max_segment).eval()
    export_meta = {
        "format": "executorch", "mem_len": mem_len, "clamp_len": config.clamp_len, "same_length": config.same_length,
        "checkpoint_settings": checkpoint_settings, "state": "incremental", "max_segment": max_segment,
        "max_batch": MAX_BATCH, "precision": precision,
        "r_table_size": r_table_size(config.clamp_len, mem_len, max_segment),
        "source": os.path.basename(str(loaded.path).rstrip("/")), "source_format": loaded.source_format,
        "weights_sha256": weights_sha256(model.state_dict()), "parameters": model_parameters(model),
        "txl_deploy_version": __version__, "torch_version": torch.__version__,
        "executorch_version": _version("executorch"),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "io": {"inputs": step.spec.input_names(), "outputs": step.spec.output_names()},
    }
    logger.info(f"exporting to ExecuTorch ({precision}, XNNPACK, mem_len {mem_len}, clamp_len {config.clamp_len}, "
                f"same_length {config.same_length}, batch up to {MAX_BATCH}, segments up to {max_segment})")
    started = time.perf_counter()
    try:
        if precision != "fp32":
            method = quantize_method(precision)
            left = _quantize(step, precision)
            if left:
                logger.info(f"  {len(left)} Linear(s) kept in fp32 (input size not a multiple of {INT4_GROUP}): "
                            f"{', '.join(left[:4])}{' ...' if len(left) > 4 else ''}")
            export_meta["quantization"] = {**method, "fp32_linears": left}
        buffer, lowering = _lower(step, max_segment)
    except TxlError:
        raise
    except Exception as e:
        raise ExportError(f"ExecuTorch export failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
    del step
    export_meta.update(lowering, export_seconds=round(time.perf_counter() - started, 1))
    logger.info(f"  lowered in {export_meta['export_seconds']:.1f} s: {lowering['xnnpack_partitions']} XNNPACK "
                f"partition(s); outside them: {', '.join(lowering['portable_ops']) or 'nothing'}")
    info = ExportInfo(config, loaded.vocab, export_meta)
    with atomic_path(sidecar_path(out_path), force=force) as tmp_sidecar, \
            atomic_path(out_path, force=force) as tmp:
        tmp.write_bytes(buffer)
        del buffer
        if verify:
            logger.info("verifying with TxlRuntime on ExecuTorch against the PyTorch reference ...")
            runtime = _program_runtime(tmp, info)
            try:
                if precision == "fp32":
                    report = _verify_fp32(runtime, model, mem_len, max_segment, tolerance)
                else:
                    kind = loaded.vocab.kind if loaded.vocab is not None else "word"
                    report = _verify_reduced(runtime, model, loaded.vocab, precision, max_segment, eval_ids, seg,
                                             kind, tolerance, max_eval_tokens)
                    info.export["precision_report"] = {"precision": precision, "stream": {
                        k: v for k, v in report.items() if k != "accuracy"}, "accuracy": report["accuracy"],
                        "method": info.export["quantization"]}
            finally:
                runtime.close()
            info.verification = report
            _refuse_failed(report, precision)
        write_sidecar(info, tmp, tmp_sidecar)
    logger.info(f"wrote {out_path} ({out_path.stat().st_size / 2**20:.1f} MiB) and {sidecar_path(out_path).name}")
    return ExportResult(out_path, info, info.verification)


def _refuse_failed(report: dict, precision: str) -> None:
    if not report["passed"]:
        if precision == "fp32":
            raise ExportError(f"verification failed: max abs difference {report['max_abs_diff']:.3g} outside "
                              f"{report['criterion']} (top-1 agreement {report['top1_agreement']:.4f}); "
                              "nothing was written")
        raise ExportError(f"{precision} program disagrees with fp32: KL divergence {report['kl_divergence']:.3g} "
                          f"nats/position > {report['tolerance']:g} (top-1 agreement {report['top1_agreement']:.4f});"
                          " nothing was written")
    accuracy = report.get("accuracy")
    if accuracy is not None and not accuracy["passed"]:
        raise ExportError(f"{precision} program loses accuracy: {accuracy['metric'].replace('_', ' ')} "
                          f"{accuracy['reduced']:.4f} against fp32 {accuracy['fp32']:.4f} "
                          f"({100 * accuracy['relative_change']:+.2f}%, limit +{100 * MAX_ACCURACY_CHANGE:g}%); "
                          "nothing was written")


def _version(package: str) -> str:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return "unknown"
