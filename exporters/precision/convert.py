"""The entry points of reduced precision: `reduce_onnx` (an fp32 graph -> fp16, int8, int8-dynamic or int4, checked
against fp32 before it is written) and `export_reduced` (a checkpoint straight to a reduced graph)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx

from txl_deploy.checkpoints import LoadedModel, load_model
from txl_deploy.contract import parts as parts_contract
from txl_deploy.contract.metadata import read_onnx_info, set_onnx_props
from txl_deploy.contract.onnx_file import external_data
from txl_deploy.errors import ExportError, InputError, TxlError
from txl_deploy.exporters.graph_checks import toposort
from txl_deploy.exporters.onnx.export import ExportResult, export_onnx
from txl_deploy.exporters.onnx.parts import move_parts
from txl_deploy.exporters.onnx.verify import REDUCED_KL
from txl_deploy.exporters.onnx.writing import place_external_data, save_checked
from txl_deploy.exporters.precision.folding import fold_weight_subgraphs
from txl_deploy.exporters.precision.fp16 import FP16_KEEP_FP32_OPS, convert_fp16
from txl_deploy.exporters.precision.int4 import (
    INT4_ACCURACY_LEVEL,
    INT4_BLOCK_SIZES,
    INT4_DEFAULT_BLOCK,
    check_int4_graph,
    quantize_int4,
)
from txl_deploy.exporters.precision.int4_parts import check_parts_int4, quantize_parts_int4
from txl_deploy.exporters.precision.int8 import quantize_int8, quantize_int8_dynamic
from txl_deploy.exporters.precision.report import accuracy_report, compare_to_fp32, evaluate_against_fp32
from txl_deploy.exporters.precision.token_data import check_long_enough, ids_from, read_token_ids, segment_len
from txl_deploy.exporters.tensorrt.compat import check_tensorrt_compat
from txl_deploy.files import atomic_path, check_writable
from txl_deploy.runtimes import TxlRuntime

logger = logging.getLogger(__name__)

DEFAULT_MAX_CALIB_TOKENS = 32768
DEFAULT_MAX_EVAL_TOKENS = 200_000
PRECISIONS = ("fp16", "int8", "int8-dynamic", "int4")


# Tolerances of the stream comparison against the fp32 graph: the mean KL divergence KL(fp32 || reduced) in nats
# per position. Not the max abs log-prob difference: over a 267k-word vocabulary the log-probs of words with
# negligible probability move by whole units under int8 while the distribution barely changes (measured on the
# WikiText-103 base shape with random weights: int8-dynamic max abs difference 20, KL 0.07 nats, top-1 agreement
# 0.93; a trained char model: KL 5e-5). The max abs difference is recorded as well.
# Accuracy on real text is judged by the held-out evaluation, not by these.
STREAM_TOLERANCE = REDUCED_KL  # one table for export-time checks and `txl-deploy verify`


def reduce_onnx(fp32_path, out_path, *, precision: str, calib=None, eval_data=None, verify: bool = True,
                force: bool = False, max_calib_tokens: int = DEFAULT_MAX_CALIB_TOKENS,
                max_eval_tokens: int = DEFAULT_MAX_EVAL_TOKENS, keep_fp32_ops=FP16_KEEP_FP32_OPS,
                dynamic_per_channel: bool = False, int4_block_size: int = INT4_DEFAULT_BLOCK,
                int4_accuracy_level: int = INT4_ACCURACY_LEVEL, threads: int | None = None):
    """Convert a txl-deploy fp32 ONNX file to `precision`, check it against the fp32 graph, write it atomically.

    calib: calibration data for int8 (a text file, a .npy of token ids, or an array of ids).
    eval_data: held-out data for the accuracy change (same kinds) [default: the calibration data];
    without either, only the random-stream comparison is made (and recorded).
    verify: refuse the result (write nothing) when the stream comparison exceeds STREAM_TOLERANCE.
    threads: ONNX Runtime's CPU threads for the calibration reader and the checks (quantize_static's calibrator
    opens its own session, at ONNX Runtime's default threads: its API takes no session options).
    int4_block_size, int4_accuracy_level: MatMulNBits settings of --precision int4 (see quantize_int4).
    Returns the ExportResult of the written file.
    """
    out_path = Path(out_path)
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    check_writable(out_path, force)
    if precision == "int4" and int4_block_size not in INT4_BLOCK_SIZES:
        raise InputError(f"int4 block size {int4_block_size}: expected one of "
                         f"{', '.join(map(str, INT4_BLOCK_SIZES))}")
    info = read_onnx_info(fp32_path)
    external_data(fp32_path)  # onnx.load and the calibration session read the data files: only the folder's own
    if info.precision != "fp32":
        raise ExportError(f"{fp32_path}: is a {info.precision} graph; reduced precision starts from an fp32 export")
    seg = segment_len(info)
    calib_ids = ids_from(calib, info, "calibration data")
    if precision == "int8":
        if calib_ids is None:
            raise InputError("--precision int8 needs calibration data: pass --calib FILE (text in the model's "
                             "vocabulary, or a .npy of token ids) that the model will read with its memory")
        check_long_enough(calib_ids[0], seg, calib_ids[1], "calibration data")
    eval_ids = ids_from(eval_data, info, "evaluation text") if eval_data is not None else calib_ids
    if eval_ids is not None:
        check_long_enough(eval_ids[0], seg, eval_ids[1], "evaluation text")

    with tempfile.TemporaryDirectory(prefix="txl-precision-") as work:
        work = Path(work)
        # Named as the output: a part that keeps external data names its data file after itself.
        converted = work / out_path.name
        source, int4_method, int4_parts = fp32_path, None, None
        if precision in ("int8", "int8-dynamic"):
            model = onnx.load(str(fp32_path))
            if fold_weight_subgraphs(model):  # quantize the adaptive-softmax head too
                source = work / "folded.onnx"
                onnx.save_model(model, str(source), save_as_external_data=model.ByteSize() > 2**31 - 2**26)
            del model
        logger.info(f"converting to {precision} ...")
        try:
            if precision == "fp16":
                model = onnx.load(str(fp32_path))
                model = convert_fp16(model, keep_fp32_ops)
                onnx.save_model(model, str(converted))
            elif precision == "int8":
                quantize_int8(source, converted, calib_ids[0][:max_calib_tokens], seg, threads=threads)
            elif precision == "int4":
                model = onnx.load(str(fp32_path))
                fold_weight_subgraphs(model)  # the adaptive-softmax head weight becomes a constant to quantize
                int4_method = quantize_int4(model, int4_block_size, int4_accuracy_level)
                check_int4_graph(model)
                onnx.save_model(model, str(converted))
                # the adaptive softmax's head and tails, quantized as the model: generate runs lazily on int4
                int4_parts = quantize_parts_int4(fp32_path, info, converted, int4_block_size, int4_accuracy_level)
            else:
                quantize_int8_dynamic(source, converted, per_channel=dynamic_per_channel)
        except TxlError:
            raise
        except Exception as e:
            raise ExportError(f"{precision} conversion failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e

        model = onnx.load(str(converted))
        toposort(model.graph)  # TensorRT's parser reads nodes in file order; conversion passes may append nodes
        info.export = {**info.export, "precision": precision}
        if int4_parts is not None:
            info.export[parts_contract.KEY] = int4_parts
        trt = check_tensorrt_compat(model)
        if precision == "int8":
            trt.raise_if_failed()  # the static int8 graph exists for TensorRT: refuse one it cannot build
        set_onnx_props(model, info)
        onnx.save_model(model, str(converted))

        with TxlRuntime.load(converted, providers=["cpu"], threads=threads) as rt, \
                TxlRuntime.load(fp32_path, providers=["cpu"], threads=threads) as r32:
            logger.info("comparing with the fp32 graph on a multi-segment stream ...")
            stream = compare_to_fp32(rt, r32)
            tol = STREAM_TOLERANCE[precision]
            stream.update(tolerance=tol, precision=precision, passed=bool(stream["kl_divergence"] <= tol))
            logger.info(f"  KL divergence from fp32 {stream['kl_divergence']:.3g} nats/position (tolerance {tol:g}), max abs "
                        f"log-prob difference {stream['max_abs_diff']:.3g}, top-1 agreement "
                        f"{stream['top1_agreement']:.4f} over {stream['tokens']} positions -> "
                        f"{'OK' if stream['passed'] else 'MISMATCH'}")
            if int4_parts is not None:
                int4_parts["verification"] = check_parts_int4(rt)
            accuracy = None
            if eval_ids is not None:
                ids = eval_ids[0][:max_eval_tokens]
                accuracy = accuracy_report(evaluate_against_fp32(rt, r32, ids, seg),
                                           info.vocab.kind if info.vocab is not None else "word")
                accuracy["data"] = Path(eval_ids[1]).name
                name = accuracy["metric"].replace("_", " ")
                logger.info(f"  {name} on {accuracy['tokens']} held-out tokens: fp32 {accuracy['fp32']:.4f}, {precision} "
                            f"{accuracy['reduced']:.4f} ({100 * accuracy['relative_change']:+.3f}%), top-1 agreement "
                            f"{accuracy['top1_agreement']:.4f}")
        if verify and not stream["passed"]:
            raise ExportError(
                f"{precision} graph disagrees with fp32: KL divergence {stream['kl_divergence']:.3g} nats/position > "
                f"{stream['tolerance']:g} (top-1 agreement {stream['top1_agreement']:.4f}); nothing was written")

        report = {"precision": precision, "stream": stream, "accuracy": accuracy,
                  "tensorrt_ready": trt.ok,
                  "tensorrt_problems": [str(p) for p in trt.problems[:5]],
                  "method": int4_method or _method(precision, keep_fp32_ops, calib_ids, max_calib_tokens, seg,
                                                   dynamic_per_channel)}
        if not trt.ok:
            logger.info(f"  not TensorRT-ready ({len(trt.problems)} problem(s), e.g. {trt.problems[0]}): "
                        f"{'ONNX Runtime only' if precision in ('int8-dynamic', 'int4') else 'see the report'}")
        info.export["precision_report"] = report
        if int4_parts is not None:  # named after the file written, not the working copy
            int4_parts["head"]["file"] = parts_contract.head_name(out_path)
            for i, tail in enumerate(int4_parts["tails"], start=1):
                tail["file"] = parts_contract.tail_name(out_path, i)
        info.verification = stream
        set_onnx_props(model, info)
        with atomic_path(out_path, force=force) as tmp:
            save_checked(model, tmp, f"the {precision} graph")  # last: refuses what a strict consumer refuses
            place_external_data(tmp, out_path, force)
            if int4_parts is not None:
                move_parts(converted, out_path, force)
    logger.info(f"wrote {out_path}")
    return ExportResult(out_path, info, stream)


def _method(precision, keep_fp32_ops, calib_ids, max_calib_tokens, seg, per_channel) -> dict:
    if precision == "fp16":
        return {"fp32_ops": list(keep_fp32_ops), "state_dtype": "float16", "log_probs_dtype": "float32"}
    if precision == "int8":
        return {"format": "QDQ", "symmetric": True, "per_channel_weights": True, "calibration": "MinMax",
                "ops": "weight MatMuls", "calibration_tokens": int(min(calib_ids[0].size, max_calib_tokens)),
                "calibration_data": Path(calib_ids[1]).name, "segment": seg, "memory_threaded": True}
    return {"format": "dynamic (MatMulInteger)", "ops": "weight MatMuls", "per_channel_weights": per_channel}


def export_reduced(source, out_path, *, precision: str, calib=None, eval_text=None, mem_len=None, opset: int = 18,
                   state: str = "incremental", max_segment: int = 512, verify: bool = True, force: bool = False, clamp_len=None, same_length=None, consume: bool = False, **options):
    """`txl-deploy export --precision fp16|int8|int8-dynamic`: export fp32 (verified against PyTorch if `verify`),
    convert, check against fp32, write `out_path` atomically. `source`: a checkpoint path or a LoadedModel
    (`consume`: as in export_onnx)."""
    out_path = Path(out_path)
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)} (or fp32)")
    check_writable(out_path, force)
    loaded = source if isinstance(source, LoadedModel) else load_model(source)
    # Check the user's data before the (minutes-long for big models) fp32 export.
    cfg = loaded.config
    seg = max(1, min(int(cfg.tgt_len or 1), max_segment))
    if precision == "int8" and calib is None:
        raise InputError("--precision int8 needs calibration data: pass --calib FILE (text in the model's "
                         "vocabulary, or a .npy of token ids) that the model will read with its memory")
    for data, what in ((calib, "calibration data"), (eval_text, "evaluation text")):
        if isinstance(data, (str, Path)):
            check_long_enough(read_token_ids(data, loaded.vocab, cfg.n_token, what), seg, str(data), what)
    with tempfile.TemporaryDirectory(prefix="txl-export-", dir=out_path.parent if out_path.parent.exists() else None) \
            as work:
        fp32 = Path(work) / "fp32.onnx"
        export_onnx(loaded, fp32, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length, opset=opset,
                    state=state, max_segment=max_segment, verify=verify, force=True,
                    threads=options.get("threads"), consume=consume or not isinstance(source, LoadedModel),
                    intermediate=True)
        return reduce_onnx(fp32, out_path, precision=precision, calib=calib, eval_data=eval_text, verify=verify,
                           force=force, **options)
