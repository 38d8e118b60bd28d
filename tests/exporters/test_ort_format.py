"""`export --ort-format`: the ONNX Runtime format (.ort) and its required-operators config beside the graph, for ONNX
Runtime's minimal builds. The .ort runs through TxlRuntime and gives the .onnx's log-probs bit for bit (tolerance 0:
the same kernels run the same fused graph) on a multi-segment stream; nothing is overwritten without --force; a
damaged or foreign .ort is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.streams import split_pass

from txl_deploy.errors import CheckpointError, ExportError, OutputExistsError
from txl_deploy.exporters.onnx import ort_format
from txl_deploy.exporters.onnx.ort_format import ort_format_paths, write_ort_format
from txl_deploy.runtimes import TxlRuntime


@pytest.fixture(scope="module")
def exported(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint exported by the command line with --ort-format (the .onnx's PyTorch check skipped: the
    ONNX export tests run it; the .ort's check against the .onnx always runs)."""
    out = tmp_path_factory.mktemp("ort") / "tiny.onnx"
    result = cli("export", tiny_ckpt, "-o", out, "--max-segment", 16, "--no-verify", "--ort-format")
    assert result.exit_code == 0, result.output
    return out


def test_cli_writes_the_ort_and_its_config(exported):
    ort_path, config = ort_format_paths(exported)
    assert ort_path.name == "tiny.ort" and config.name == "tiny.required_operators.config"
    assert ort_path.is_file() and config.is_file()
    # The .ort is the main graph only; the adaptive softmax's head and tail graphs the export wrote stay beside the
    # .onnx (the .onnx's lazy decoding reads them). No temporary file is left.
    parts = ["tiny.head.onnx", "tiny.tail1.onnx", "tiny.tail2.onnx"]
    assert sorted(p.name for p in exported.parent.iterdir()) == sorted(["tiny.onnx", "tiny.ort", config.name, *parts])
    # The config a custom build takes (--include_ops_by_config): domain;opset;operators, one line per opset.
    rows = [line.split(";") for line in config.read_text().splitlines() if not line.startswith("#")]
    ops = {op for domain, _, names in rows for op in names.split(",")}
    assert {"MatMul", "LogSoftmax", "GatherElements"} <= ops
    assert all(domain in ("ai.onnx", "com.microsoft") for domain, _, _ in rows)


def test_ort_gives_the_onnx_log_probs_exactly(exported):
    ort_path, _ = ort_format_paths(exported)
    tokens = np.random.default_rng(5).integers(0, 58, size=(2, 30))
    cuts = [3, 4, 5, 14, 28, 29]  # prefill, decode steps, prefills; 30 tokens > mem_len 12: the ring wraps
    with TxlRuntime.load(exported) as onnx_rt, TxlRuntime.load(ort_path) as ort_rt:
        assert ort_rt.backend.name == "onnxruntime"
        assert ort_rt.config == onnx_rt.config and ort_rt.vocab.to_json() == onnx_rt.vocab.to_json()
        assert ort_rt.mem_len == onnx_rt.mem_len == 12 and ort_rt.backend.max_segment == 16
        assert np.array_equal(split_pass(onnx_rt, tokens, cuts), split_pass(ort_rt, tokens, cuts))
        # The .onnx decodes lazily from its parts; the .ort computes the full distribution and never opens them.
        assert onnx_rt.backend.clusters is not None
        assert ort_rt.backend.clusters is None and ort_rt.backend.parts_error is None


def test_the_ort_runs_without_the_parts(exported, tmp_path):
    """A .ort shipped alone (what a minimal build's app carries) needs none of the .onnx's head and tail graphs."""
    ort_path, _ = ort_format_paths(exported)
    alone = tmp_path / ort_path.name
    alone.write_bytes(ort_path.read_bytes())
    tokens = np.random.default_rng(6).integers(0, 58, size=(1, 9))
    with TxlRuntime.load(alone) as lone, TxlRuntime.load(ort_path) as beside:
        assert lone.backend.clusters is None and lone.backend.parts_error is None
        assert np.array_equal(split_pass(lone, tokens, [4, 5, 6]), split_pass(beside, tokens, [4, 5, 6]))
        assert len(list(lone.generate([1, 2, 3], max_new_tokens=4, temperature=0))) == 4


def test_nothing_overwritten_without_force(exported, tiny_ckpt, tmp_path):
    ort_path, config = ort_format_paths(exported)
    before = ort_path.read_bytes(), config.read_bytes()
    # Refused before the export starts: the .ort is checked with the .onnx.
    result = cli("export", tiny_ckpt, "-o", exported, "--ort-format", "--no-verify")
    assert_one_line_error(result, "already exists", "--force")
    assert (ort_path.read_bytes(), config.read_bytes()) == before
    # The .ort alone existing is enough to refuse.
    onnx_copy = tmp_path / "copy.onnx"
    onnx_copy.write_bytes(exported.read_bytes())
    copy_ort, copy_config = ort_format_paths(onnx_copy)
    copy_ort.write_bytes(b"precious")
    with pytest.raises(OutputExistsError):
        write_ort_format(onnx_copy)
    assert copy_ort.read_bytes() == b"precious" and not copy_config.exists()
    result = write_ort_format(onnx_copy, force=True)
    assert result.verification["passed"] and result.verification["max_abs_diff"] == 0.0
    assert copy_ort.read_bytes() != b"precious" and copy_config.is_file()


def test_a_mismatching_ort_is_not_written(exported, tmp_path, monkeypatch):
    onnx_copy = tmp_path / "m.onnx"
    onnx_copy.write_bytes(exported.read_bytes())
    monkeypatch.setattr(ort_format, "compare_ort_format", lambda *a, **k: {"passed": False, "max_abs_diff": 0.5})
    with pytest.raises(ExportError, match="differ.*nothing was written"):
        write_ort_format(onnx_copy)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_damaged_or_foreign_ort_refused_in_one_line(exported, tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    ort_path, _ = ort_format_paths(exported)
    data = ort_path.read_bytes()
    at = data.index(b'{"kind"')  # the vocabulary's JSON in the metadata: a byte that is not UTF-8 (found by fuzzing)
    cases = {"truncated.ort": data[: len(data) // 2], "garbage.ort": b"\x00" * 64, "empty.ort": b"",
             "not_utf8.ort": data[:at] + b"\x80" + data[at + 1:]}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    # A well-formed .ort that txl-deploy did not write, and one whose metadata is damaged.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    for name, props in (("foreign", {}), ("bad_meta", {"txl_deploy.config": "{", "txl_deploy.export": "{}"})):
        model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]),
                                  opset_imports=[helper.make_opsetid("", 18)])
        onnx.helper.set_model_props(model, props)
        onnx.save(model, str(tmp_path / f"{name}.onnx"))
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        opts.optimized_model_filepath = str(tmp_path / f"{name}.ort")
        opts.add_session_config_entry("session.save_model_format", "ORT")
        ort.InferenceSession(str(tmp_path / f"{name}.onnx"), opts, providers=["CPUExecutionProvider"])
        cases[f"{name}.ort"] = None
    for name in cases:
        with pytest.raises(CheckpointError) as e:
            TxlRuntime.load(tmp_path / name)
        assert "\n" not in str(e.value) and name in str(e.value)
    result = cli("generate", tmp_path / "foreign.ort", "--prompt", "a", "--max-new-tokens", 2)
    assert_one_line_error(result, "foreign.ort", "not exported by txl-deploy")
