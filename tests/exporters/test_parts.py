"""The adaptive softmax's head and tails as graphs of their own beside the model (exporters/onnx/parts.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from helpers.cli import cli

from txl_deploy.contract import parts as contract
from txl_deploy.contract.clusters import Clusters
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.errors import CheckpointError
from txl_deploy.exporters.onnx.parts import run_tails

ort = pytest.importorskip("onnxruntime")


def _sessions(folder, parts):
    return (ort.InferenceSession(str(folder / parts.head.file), providers=["CPUExecutionProvider"]),
            [ort.InferenceSession(str(folder / t.file), providers=["CPUExecutionProvider"]) for t in parts.tails])


def test_export_lists_the_parts_with_their_digests(tiny_onnx):
    info = read_onnx_info(tiny_onnx)
    parts = contract.Parts.from_export(info.export, info.config, tiny_onnx)
    assert parts is not None and parts.layout.n_clusters == len(parts.tails) == info.config.n_clusters == 2
    assert parts.head.file == "tiny.head.onnx" and [t.file for t in parts.tails] == ["tiny.tail1.onnx",
                                                                                    "tiny.tail2.onnx"]
    assert parts.layout == Clusters(10, ((10, 30), (30, info.config.n_token))) == Clusters.of(info.config)
    assert info.export["parts"]["verification"]["passed"]
    paths = parts.files(tiny_onnx)  # present, in the folder, digests as listed
    for path in paths:
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    head = onnx.load(str(paths[0]), load_external_data=False)
    assert [o.name for o in head.graph.output][:2] == ["hidden", "head_log_probs"]
    assert [i.name for i in head.graph.input] == info.spec().input_names()


def test_parts_assembled_equal_the_full_graph(tiny_onnx):
    """Head + every tail, combined as the contract says, give the main graph's log-probs and state outputs over a
    stream that fills and wraps the memory."""
    info = read_onnx_info(tiny_onnx)
    spec, cfg = info.spec(), info.config
    parts = contract.Parts.from_export(info.export, cfg, tiny_onnx)
    full = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    head, tails = _sessions(tiny_onnx.parent, parts)
    rng = np.random.default_rng(0)
    state = {s.name: np.zeros(s.shape_for(2), np.int64 if s.dtype == "int64" else np.float32)
             for s in spec.state_inputs()}
    from txl_deploy.contract.ring import write_segment

    mems = [n for i in range(spec.n_layer) for n in (f"mem_k.{i}", f"mem_v.{i}")]
    for q in (4, 1, 15, 1):
        feeds = dict(state, tokens=rng.integers(0, cfg.n_token, (2, q)),
                     out_positions=np.tile(np.arange(q), (2, 1)))
        want, *want_state = full.run(None, feeds)
        hidden, head_lp, *got_state = head.run(None, feeds)
        assert hidden.shape == (2, q, cfg.d_model) and head_lp.shape == (2, q, cfg.cutoffs[0] + 2)
        layout = parts.layout
        tails_lp = run_tails(tails, hidden, head_lp, layout)
        assert [t.shape[-1] for t in tails_lp] == [hi - lo for lo, hi in layout.bounds]
        np.testing.assert_allclose(layout.compose(head_lp, tails_lp), want, atol=1e-5, rtol=1e-5)
        for a, b in zip(got_state, want_state):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)
        # Each cluster's probability sits in its head column, in the original code's reversed order.
        for i, (lo, hi) in enumerate(layout.bounds, start=1):
            mass = np.logaddexp.reduce(want[..., lo:hi], axis=-1)
            np.testing.assert_allclose(mass, head_lp[..., layout.head_column(i)], atol=1e-5)
        derived = np.stack([layout.head_from_full(row) for row in want.reshape(-1, cfg.n_token)])
        np.testing.assert_allclose(derived, head_lp.reshape(derived.shape), atol=1e-5)
        write_segment([state[n] for n in mems], want_state, state["mem_count"], spec.mem_len)


def test_parts_that_do_not_belong_are_refused(tiny_onnx, tmp_path):
    assert "present and matching" in cli("info", tiny_onnx).output
    for f in tiny_onnx.parent.glob("tiny*.onnx"):
        shutil.copy(f, tmp_path / f.name)
    model = tmp_path / "tiny.onnx"
    info = read_onnx_info(model)
    parts = contract.Parts.from_export(info.export, info.config, model)
    tail = tmp_path / "tiny.tail2.onnx"
    data = bytearray(tail.read_bytes())
    data[-1] ^= 1
    tail.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not belong") as e:
        parts.files(model)
    assert "\n" not in str(e.value)
    shown = cli("info", model)
    assert shown.exit_code == 0 and "tail 2:    tiny.tail2.onnx, tokens [30, 60), head column 10" in shown.output
    assert "softmax parts: tiny.head.onnx" in shown.output and "refused: " in shown.output
    tail.unlink()
    with pytest.raises(CheckpointError, match="not found"):
        parts.files(model)
    shutil.copy(tmp_path / "tiny.tail1.onnx", tail)  # another part of the same model under this name
    with pytest.raises(CheckpointError, match="does not belong"):
        parts.files(model)


@pytest.mark.parametrize("name", ["../x.onnx", "/etc/passwd", "sub/x.onnx", ".."])
def test_part_names_outside_the_folder_are_refused(tiny_onnx, name):
    info = read_onnx_info(tiny_onnx)
    export = json.loads(json.dumps(info.export))
    export["parts"]["tails"][0]["file"] = name
    with pytest.raises(CheckpointError, match="model's folder"):
        contract.Parts.from_export(export, info.config, tiny_onnx)


def test_each_tail_holds_only_its_own_clusters_weights(tiny_onnx):
    """A tail graph stores its cluster's output weight, bias and projection and nothing else of the output layer
    (the parts are traced from the main graph's tensors, not from a slice of a larger one)."""
    from onnx import numpy_helper

    info = read_onnx_info(tiny_onnx)
    cfg = info.config
    parts = contract.Parts.from_export(info.export, cfg, tiny_onnx)
    main = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tiny_onnx)).graph.initializer}
    for i, (path, (lo, hi)) in enumerate(zip(parts.files(tiny_onnx)[1:], parts.layout.bounds), start=1):
        d_emb = cfg.d_embed // cfg.div_val**i
        weights = [numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer if len(t.dims) >= 1]
        big = sorted(w.shape for w in weights if w.size > 1)
        assert big == sorted([(d_emb, hi - lo), (cfg.d_model, d_emb), (hi - lo,)]), (path.name, big)
        # the very values of the main graph's cluster weight
        weight = next(w for w in weights if w.shape == (d_emb, hi - lo))
        assert any(v.shape == weight.shape and np.array_equal(v, weight) for v in main.values())


def test_a_part_onnx_runtime_cannot_load_ends_the_export_in_one_line(tiny_ckpt, tmp_path, monkeypatch):
    """A part ONNX Runtime cannot parse (a body + head graph written as one protobuf over 2 GB was one) ends the
    export with a one-line error naming the part, not a traceback out of ONNX Runtime, and nothing is written."""
    from txl_deploy.exporters.onnx import parts

    save = parts._save

    def unparsable_head(program, path):
        save(program, path)
        if path.name.endswith(".head.onnx"):
            path.write_bytes(b"\x0a\xff\xff\xff\xff\x0f")  # a graph field claiming 4 GB: protobuf refuses it

    monkeypatch.setattr(parts, "_save", unparsable_head)
    out = tmp_path / "out" / "m.onnx"
    result = cli("export", str(tiny_ckpt), "--onnx", "-o", str(out), "--max-segment", "16")
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    message = result.output.strip().splitlines()[-1]  # after the progress lines
    assert message.startswith("error: ") and "softmax parts" in message and "m.head.onnx" in message, message
    assert not out.parent.exists() or list(out.parent.iterdir()) == []
