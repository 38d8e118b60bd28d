"""int4 weight-only graphs (ONNX Runtime MatMulNBits) against the fp32 graph, on the CPU.

Tolerances against fp32 on a multi-segment stream with the memory threaded through and the ring wrapping: mean KL
divergence <= 0.1 nats per position (STREAM_TOLERANCE, as int8) and top-1 agreement >= 0.85 on the tiny random
model (observed about 0.02 nats and 0.95); the demo model's bits per character within 2% of fp32 on the first
4,096 held-out characters (observed +0.5% on 8k). onnx's checker is run with full_check on every int4 file.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from helpers.distributions import mean_kl, top1_agreement
from helpers.streams import stream
from helpers.tiny import TINY_VOCAB, make_tiny_model
from onnx import numpy_helper

from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.errors import ExportError, InputError
from txl_deploy.exporters.precision.convert import STREAM_TOLERANCE, reduce_onnx
from txl_deploy.exporters.precision.int4 import check_int4_graph
from txl_deploy.runtimes import TxlRuntime


@pytest.fixture(scope="module")
def int4(tiny_onnx, tmp_path_factory):
    out = {}
    root = tmp_path_factory.mktemp("int4")
    for block in (32, 64):
        out[block] = root / f"int4-b{block}.onnx"
        reduce_onnx(tiny_onnx, out[block], precision="int4", int4_block_size=block)
    return out




def test_int4_matches_fp32_across_the_ring_wrap(int4, tiny_onnx):
    rng = np.random.default_rng(3)
    segs = [rng.integers(0, 60, size=(2, q)) for q in (8, 1, 5, 1, 8, 3)]  # 26 tokens > mem_len 12
    with TxlRuntime.load(int4[32]) as rt, TxlRuntime.load(tiny_onnx) as ref:
        assert rt.backend.precision == "int4"
        got, want = stream(rt, segs), stream(ref, segs)
        assert len(list(rt.generate([1, 2, 3], max_new_tokens=5, temperature=0))) == 5
        state = rt.save_state()
    assert got.dtype == np.float32 and got.shape == want.shape and np.isfinite(got).all()
    assert 0 <= mean_kl(want, got) <= STREAM_TOLERANCE["int4"]
    assert top1_agreement(want, got) >= 0.85
    assert not np.array_equal(got, want)  # it really is another graph
    assert state["mem_k.0"].dtype == np.float32  # the memory stays fp32


def test_int4_graph_structure_and_metadata(int4, tiny_onnx):
    model = onnx.load(str(int4[32]))
    onnx.checker.check_model(model, full_check=True)
    ops = [n for n in model.graph.node if n.domain == "com.microsoft"]
    nbits = [n for n in ops if n.op_type == "MatMulNBits"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nbits]
    assert nbits and all(a["bits"] == 4 and a["block_size"] == 32 and a["accuracy_level"] == 4 for a in attrs)
    # every weight MatMul is quantized, the adaptive-softmax tails and head included: no fp32 MatMul by a 2-D
    # constant is left, and no 2-D float weight matrix survives
    inits = {t.name: t for t in model.graph.initializer}
    assert not [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits
                and len(inits[n.input[1]].dims) == 2]
    scales = {n.input[2] for n in nbits}
    # ...except the embedding's projections, read as the A of `proj @ columns` (MatMulNBits quantizes a constant
    # B only): [d_model, d_emb_i] each, small beside the vocabulary
    proj_a = {n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[0] in inits}
    assert not [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT
                and len(t.dims) == 2 and min(t.dims) > 1 and t.name not in scales | proj_a]
    # the tied embedding tables read the output layer's 4-bit blocks: every embedding Gather is quantized, and the
    # packed data is the MatMulNBits weights' (no second copy of the vocabulary)
    gathers = [n for n in ops if n.op_type == "GatherBlockQuantized"]
    assert gathers and not [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits
                            and len(inits[n.input[0]].dims) == 2]
    packed = {n.input[1] for n in nbits}
    producers = {o: n for n in model.graph.node for o in n.output}

    def sources(name):  # the initializers a tensor is sliced, concatenated or reshaped from
        if name in inits:
            return {name}
        node = producers[name]
        assert node.op_type in ("Concat", "Slice", "Reshape"), node.op_type
        return set().union(*(sources(i) for i in (node.input if node.op_type == "Concat" else node.input[:1])))

    for g in gathers:
        assert sources(g.input[0]) <= packed
    # the state and the outputs keep their fp32 types
    f32 = onnx.TensorProto.FLOAT
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}
    assert types["mem_k.0"] == types["new_v.1"] == types["log_probs"] == f32
    info = read_onnx_info(int4[32])
    rep = info.export["precision_report"]
    assert info.precision == "int4" and rep["stream"]["passed"] and rep["tensorrt_ready"] is False
    method = rep["method"]
    assert method["block_size"] == 32 and method["accuracy_level"] == 4 and method["state_dtype"] == "float32"
    assert method["embedding_tied_to_output"] == method["embedding_tables"] == len(gathers)


def test_block_size_is_selectable(int4):
    model = onnx.load(str(int4[64]))
    sizes = {onnx.helper.get_attribute_value(a) for n in model.graph.node if n.domain == "com.microsoft"
             for a in n.attribute if a.name == "block_size"}
    assert sizes == {64}
    assert read_onnx_info(int4[64]).export["precision_report"]["method"]["block_size"] == 64
    # one scale per block of 64 input rows of each weight column (the last block zero-padded)
    inits = {t.name: t for t in model.graph.initializer}
    cast = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast"}  # scales stored in fp16
    for node in (n for n in model.graph.node if n.op_type == "MatMulNBits"):
        a = {x.name: x.i for x in node.attribute}
        scales = inits[cast[node.input[2]]]
        assert scales.data_type == onnx.TensorProto.FLOAT16
        assert int(np.prod(scales.dims)) == a["N"] * -(-a["K"] // 64)


def test_bad_block_size(tiny_onnx, tmp_path):
    with pytest.raises(InputError, match="int4 block size 48"):
        reduce_onnx(tiny_onnx, tmp_path / "x.onnx", precision="int4", int4_block_size=48)
    assert not (tmp_path / "x.onnx").exists()


def test_checker_blind_spot_is_covered(int4):
    """onnx's checker has no com.microsoft schemas: a MatMulNBits whose K contradicts its weights passes it,
    the int4 check refuses it."""
    model = onnx.load(str(int4[32]))
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    next(a for a in node.attribute if a.name == "K").i *= 4
    onnx.checker.check_model(model, full_check=True)  # passes: the checker does not look at contrib ops
    with pytest.raises(ExportError, match=f"MatMulNBits {node.name}.*K="):
        check_int4_graph(model)


def test_demo_model_bits_per_character_within_2_percent(tmp_path):
    from txl_deploy.assets import DEMO_DIR
    from txl_deploy.exporters.onnx.export import export_onnx

    fp32, out = tmp_path / "fp32.onnx", tmp_path / "int4.onnx"
    export_onnx(DEMO_DIR / "kjv-char", fp32, max_segment=64, verify=False)
    res = reduce_onnx(fp32, out, precision="int4", eval_data=DEMO_DIR / "heldout.txt", max_eval_tokens=4096)
    acc = res.info.export["precision_report"]["accuracy"]
    assert acc["metric"] == "bits_per_character" and acc["tokens"] == 4095
    assert abs(acc["relative_change"]) <= 0.02, acc
    assert out.stat().st_size <= fp32.stat().st_size / 4
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)


def test_build_engine_refuses_int4(int4, tmp_path):
    from txl_deploy.cli import main

    result = CliRunner().invoke(main, ["build-engine", str(int4[32]), "-o", str(tmp_path / "m.engine")])
    assert result.exit_code == 2
    assert "int4 graph" in result.output and "TensorRT cannot build" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "m.engine").exists()


def test_cli_export_int4(tiny_ckpt, tmp_path):
    from txl_deploy.cli import main

    out = tmp_path / "m.onnx"
    result = CliRunner().invoke(main, ["export", str(tiny_ckpt), "--onnx", "--precision", "int4", "--block-size",
                                       "16", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "MatMulNBits (block 16, accuracy_level 4)" in result.output and "KL divergence" in result.output
    method = read_onnx_info(out).export["precision_report"]["method"]
    assert method["block_size"] == 16
    tables = [numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer if t.name.endswith("_fp16")]
    assert tables and all(t.dtype == np.float16 for t in tables)  # positional tables stored in fp16


def test_cli_block_size_only_with_int4(tiny_ckpt, tmp_path):
    from txl_deploy.cli import main

    result = CliRunner().invoke(main, ["export", str(tiny_ckpt), "--precision", "fp16", "--block-size", "64", "-o",
                                       str(tmp_path / "m.onnx")])
    assert result.exit_code == 2 and "--block-size is for --precision int4, not fp16" in result.output
    assert not (tmp_path / "m.onnx").exists()


def test_int4_passes_the_strict_checks_and_polygraphy_lint(int4, tmp_path):
    """The strict checks of every export (node order + full_check), and `polygraphy check lint`, which runs the
    graph through ONNX Runtime and so does know the com.microsoft operators."""
    from helpers.strict_variants import polygraphy_lint

    from txl_deploy.exporters.graph_checks import check_strict

    for path in int4.values():
        check_strict(path, "int4 graph")
    lint = polygraphy_lint(list(int4.values()), tmp_path, processes=1)
    for path, result in lint.items():
        assert result["status"] == 0 and result["errors"] == [], (path, result)


def test_untied_embedding_gets_its_own_4bit_table(tmp_path):
    """Without tie_weight the embedding tables are quantized on their own (GatherBlockQuantized, no fp32 copy)."""
    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.vocab import Vocab

    ckpt, fp32, out = tmp_path / "ckpt", tmp_path / "fp32.onnx", tmp_path / "int4.onnx"
    save_checkpoint(ckpt, make_tiny_model(seed=1, tie_weight=False, tie_projs=[False, False, False]),
                    Vocab(TINY_VOCAB))
    export_onnx(ckpt, fp32, max_segment=16)
    res = reduce_onnx(fp32, out, precision="int4")
    method = res.info.export["precision_report"]["method"]
    assert method["embedding_tables"] >= 1 and method["embedding_tied_to_output"] == 0
    model = onnx.load(str(out))
    inits = {t.name for t in model.graph.initializer}
    assert not [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in inits]
    rng = np.random.default_rng(5)
    segs = [rng.integers(0, 60, size=(1, q)) for q in (8, 1, 8, 3)]
    with TxlRuntime.load(out) as rt, TxlRuntime.load(fp32) as ref:
        got, want = stream(rt, segs), stream(ref, segs)
    assert 0 <= mean_kl(want, got) <= STREAM_TOLERANCE["int4"] and top1_agreement(want, got) >= 0.85


def test_full_state_layout(tiny_onnx_full, tmp_path):
    out = tmp_path / "int4-full.onnx"
    reduce_onnx(tiny_onnx_full, out, precision="int4")
    rng = np.random.default_rng(4)
    segs = [rng.integers(0, 60, size=(2, q)) for q in (8, 1, 5, 1, 8, 3)]
    with TxlRuntime.load(out) as rt, TxlRuntime.load(tiny_onnx_full) as ref:
        assert rt.backend.spec.state == "full" and rt.backend.precision == "int4"
        got, want = stream(rt, segs), stream(ref, segs)
    assert 0 <= mean_kl(want, got) <= STREAM_TOLERANCE["int4"]


def test_int4_softmax_parts_give_lazy_generate_the_full_tokens(int4, tiny_onnx):
    """An int4 graph of a model with an adaptive softmax gets int4 head and tail graphs beside it (listed in its
    metadata, checked against it at export), so `generate` runs lazily on int4: the same tokens as the full int4
    graph, greedy and sampled (T=1, seeded), over 50 tokens that fill and wrap the memory."""
    from txl_deploy.contract import parts as contract

    info = read_onnx_info(int4[32])
    entry = info.export["parts"]
    assert entry["precision"] == "int4" and entry["verification"]["passed"]
    parts = contract.Parts.from_export(info.export, info.config, int4[32])
    paths = parts.files(int4[32])  # beside the int4 graph, the digests it lists, not the fp32 graph's parts
    assert [p.name for p in paths] == ["int4-b32.head.onnx", "int4-b32.tail1.onnx", "int4-b32.tail2.onnx"]
    ops = [[n.op_type for n in onnx.load(str(path)).graph.node] for path in paths]
    assert all("MatMulNBits" in o for o in ops)  # the body and head, and every tail, in 4-bit weights
    assert all("MatMul" not in o for o in ops[1:])  # a tail's only products are its weights'
    with TxlRuntime.load(int4[32]) as lazy, TxlRuntime.load(int4[32], lazy=False) as full:
        assert lazy.backend.clusters is not None and lazy.backend.parts_error is None
        heads = []
        run_head = lazy.backend.run_head
        lazy.backend.run_head = lambda *a: heads.append(1) or run_head(*a)
        for temperature in (0.0, 1.0):
            lazy.reset(), full.reset()
            got = list(lazy.generate([1, 2, 3], max_new_tokens=50, temperature=temperature, seed=11))
            want = list(full.generate([1, 2, 3], max_new_tokens=50, temperature=temperature, seed=11))
            assert len(got) == 50 and got == want, temperature
        assert len(heads) >= 100  # the lazy path ran: the head graph fed every token


def test_int4_graph_and_parts_keep_external_data_over_the_limit(tiny_onnx, tmp_path, monkeypatch):
    """The int4 graph and its softmax parts are written by the rule every exported file follows: over protobuf's
    size limit (lowered here so the tiny model crosses it) each keeps its weights in `<file name>.data` beside it
    (tensors under 1 kB, shape constants, stay in the graph), and the runtime opens them, parts included."""
    from txl_deploy.contract.onnx_file import external_data
    from txl_deploy.exporters.onnx import writing

    monkeypatch.setattr(writing, "EXTERNAL_DATA_BYTES", 0)
    out = tmp_path / "big4.onnx"
    reduce_onnx(tiny_onnx, out, precision="int4", int4_block_size=32)
    graphs = ["big4.onnx", "big4.head.onnx", "big4.tail1.onnx", "big4.tail2.onnx"]
    assert set(graphs) <= {p.name for p in tmp_path.iterdir()} <= set(graphs + [g + ".data" for g in graphs])
    for g in graphs:
        assert {ref.path.name for ref in external_data(tmp_path / g)} <= {g + ".data"}
        inline = onnx.load(str(tmp_path / g), load_external_data=False).graph.initializer
        assert all(len(t.raw_data) < 1024 for t in inline), g  # every weight of size is in the data file
    assert {"big4.onnx.data", "big4.head.onnx.data"} <= {p.name for p in tmp_path.iterdir()}
    assert read_onnx_info(out).export["parts"]["verification"]["passed"]
    with TxlRuntime.load(out) as rt:
        assert rt.backend.clusters is not None, rt.backend.parts_error
        assert len(list(rt.generate([1, 2, 3], max_new_tokens=5, temperature=0.0))) == 5
