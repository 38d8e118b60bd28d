"""REMI (Pop Music Transformer) checkpoint folders, written by TensorFlow's own Saver with REMI's variable names, Adam
slots and global_step, read without flags and checked against an independent numpy reference of REMI's model
(tests/helpers/remi.py) on a multi-segment stream at batch 2 whose memory fills and wraps.

Tolerances: the PyTorch reference and the ONNX graph against the numpy reference within 1e-5 in log-probs (float32
against float64; observed ~1e-6). Each of REMI's differences from the paper's model (the second feed-forward ReLU,
epsilon 1e-3, the attended zero memory) moves the log-probs of these small models by more than 1e-3, so a model
missing any one fails the same check.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

# The oracle that writes the fixtures (tensorflow-cpu is in the test extra: a missing install fails, never skips).
import tensorflow as tf
from helpers.cli import assert_one_line_error, cli
from helpers.file_reads import count_reads
from helpers.remi import SCOPE, keras_norm, remi_stream, remi_variables
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.tensorflow.remi import is_remi_checkpoint, remi_architecture
from txl_deploy.errors import CheckpointError

DIMS = dict(n_token=21, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=24)
MEM_LEN, SEG = 5, 3  # 6 segments of 3 into a 5-slot memory: it fills in the second and wraps from the third
TOL = 1e-5


def write_remi_folder(folder: Path, weights: dict, dictionary=True) -> Path:
    """A folder as REMI's training leaves it: Saver V2 files under the prefix `model`, `checkpoint`, `model.meta`,
    Adam's two slots for every weight, its beta powers, global_step, and dictionary.pkl."""
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        var_list = {}
        for n, (name, value) in enumerate(weights.items()):
            var_list[name] = tf.compat.v1.Variable(value, name=f"w{n}")
            var_list[name + "/Adam"] = tf.compat.v1.Variable(np.zeros_like(value), name=f"a{n}")
            var_list[name + "/Adam_1"] = tf.compat.v1.Variable(np.zeros_like(value), name=f"b{n}")
        var_list["global_step"] = tf.compat.v1.Variable(np.int64(1000), name="step")
        var_list["beta1_power"] = tf.compat.v1.Variable(np.float32(0.9), name="p1")
        var_list["beta2_power"] = tf.compat.v1.Variable(np.float32(0.999), name="p2")
        sess.run(tf.compat.v1.variables_initializer(list(var_list.values())))
        saver = tf.compat.v1.train.Saver(var_list=var_list, write_version=tf.compat.v1.train.SaverDef.V2)
        folder.mkdir(parents=True, exist_ok=True)
        saver.save(sess, str(folder / "model"))
    if dictionary:
        n_token = weights[SCOPE + "normal_embed/lookup_table"].shape[0]
        events = ["Bar_None"] + [f"Position_{k}/16" for k in range(1, 5)] + \
                 [f"Note On_{60 + k}" for k in range(n_token - 5)]
        (folder / "dictionary.pkl").write_bytes(pickle.dumps(({e: i for i, e in enumerate(events)},
                                                              dict(enumerate(events)))))
    return folder


@pytest.fixture(scope="module")
def remi(tmp_path_factory):
    weights = remi_variables(**DIMS)
    return write_remi_folder(tmp_path_factory.mktemp("remi") / "REMI-tempo-checkpoint", weights), weights


def _stream(batch=2, n_segments=6, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, DIMS["n_token"], (batch, n_segments * SEG)).astype(np.int64)


def _reference(weights, tokens, **differences):
    return remi_stream(weights, tokens, SEG, MEM_LEN, DIMS["n_head"], DIMS["d_head"], **differences)


def _ours(model, tokens):
    import torch

    mems, out = None, []
    with torch.no_grad():
        for start in range(0, tokens.shape[1], SEG):
            lp, mems = model(torch.from_numpy(tokens[:, start:start + SEG]), mems)
            out.append(lp.numpy())
    return np.concatenate(out, 1)


def test_folder_is_read_without_flags(remi):
    folder, _ = remi
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint", "dictionary.pkl", "model.data-00000-of-00001",
                                                        "model.index", "model.meta"]
    assert is_remi_checkpoint(folder) and is_remi_checkpoint(folder / "model.index")
    loaded = load_model(folder)
    c = loaded.config
    assert loaded.source_format == "remi"
    assert (c.n_token, c.n_layer, c.d_model, c.n_head, c.d_head, c.d_inner) == tuple(DIMS.values())
    # what REMI's model.py hard-codes, and what it computes differently from the paper
    assert (c.mem_len, c.tgt_len, c.clamp_len, c.same_length, c.untie_r, c.cutoffs, c.tie_weight) == \
           (512, 512, -1, False, False, [], True)
    assert (c.layer_norm_epsilon, c.ff_out_relu, c.mem_init) == (1e-3, True, "zeros")
    assert loaded.value_sources["ff_out_relu"].startswith("REMI's modules.py")
    # its vocabulary is the dictionary.pkl beside it: events kept whole, told as REMI's
    assert loaded.vocab.kind == "events" and loaded.vocab.representation == "remi"
    assert loaded.vocab.symbols[:2] == ["Bar_None", "Position_1/16"] and "Note On_60" in loaded.vocab.symbols


def test_the_checkpoint_file_and_index_are_read_once(remi, monkeypatch):
    """REMI's reader claims the folder by its index; the read reuses what the claim read."""
    reads = count_reads(monkeypatch)
    assert load_model(remi[0]).source_format == "remi"
    assert (reads["checkpoint"], reads["model.index"]) == (1, 1)


def test_converted_folder_keeps_remis_settings(remi, tmp_path):
    folder, _ = remi
    result = cli("convert", folder, "-o", tmp_path / "ours", "--no-vocab")
    assert result.exit_code == 0, result.output
    again = load_model(tmp_path / "ours")
    assert again.config == load_model(folder).config and again.source_format == "txl-deploy"


def test_model_matches_remi_on_a_wrapping_stream(remi):
    folder, weights = remi
    model = load_model(folder).build().reset_length(MEM_LEN)
    tokens = _stream()
    np.testing.assert_allclose(_ours(model, tokens), _reference(weights, tokens), atol=TOL, rtol=0)


@pytest.mark.parametrize("missing", ["ff_out_relu", "layer_norm_epsilon", "mem_init"])
def test_a_model_missing_one_difference_fails_the_check(remi, missing):
    folder, weights = remi
    loaded = load_model(folder)
    paper = {"ff_out_relu": False, "layer_norm_epsilon": 1e-5, "mem_init": "empty"}[missing]
    loaded.config = loaded.config.replace(**{missing: paper})
    tokens = _stream()
    diff = np.abs(_ours(loaded.build().reset_length(MEM_LEN), tokens) - _reference(weights, tokens)).max()
    assert diff > 100 * TOL, diff
    # and the reference without that difference is what such a model computes
    switch = {"ff_out_relu": {"ff_out_relu": False}, "layer_norm_epsilon": {"eps": 1e-5},
              "mem_init": {"zero_memory": False}}[missing]
    np.testing.assert_allclose(_ours(loaded.build().reset_length(MEM_LEN), tokens),
                               _reference(weights, tokens, **switch), atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def remi_onnx(remi, tmp_path_factory):
    from txl_deploy.exporters.onnx.export import export_onnx

    out = tmp_path_factory.mktemp("remi-onnx")
    # a plain symbol list (dictionary.pkl is the events vocabulary's), so the page can be written too
    (out / "vocab.txt").write_text("".join(f"e{i}\n" for i in range(DIMS["n_token"])))
    loaded = load_model(remi[0], vocab=out / "vocab.txt")
    path = out / "remi.onnx"
    export_onnx(loaded, path, mem_len=MEM_LEN, max_segment=4, threads=1)  # verified against PyTorch at export
    return path


def _run_stream(rt, tokens):
    return np.concatenate([rt.step(tokens[:, s:s + SEG]) for s in range(0, tokens.shape[1], SEG)], 1)


def test_onnx_export_and_runtime_match_remi(remi, remi_onnx):
    from txl_deploy.runtimes import TxlRuntime

    _, weights = remi
    rt = TxlRuntime.load(remi_onnx)
    assert rt.config.mem_init == "zeros" and rt.config.ff_out_relu and rt.config.layer_norm_epsilon == 1e-3
    tokens = _stream(seed=1)
    np.testing.assert_allclose(_run_stream(rt, tokens), _reference(weights, tokens), atol=TOL, rtol=0)
    # a reset row starts again from the zero memory, as a new stream does; the other row goes on
    rt.reset(rows=[1])
    fresh = _stream(seed=2)
    got = _run_stream(rt, fresh)
    np.testing.assert_allclose(got[1], _reference(weights, fresh[1:])[0], atol=TOL, rtol=0)
    both = np.concatenate([tokens, fresh], 1)
    np.testing.assert_allclose(got[0], _reference(weights, both[:1])[0, tokens.shape[1]:], atol=TOL, rtol=0)


def test_reduced_precision_and_executorch_keep_remis_settings(remi, remi_onnx, tmp_path):
    """The int8 graph is judged against the fp32 graph at export (its stated KL tolerance), the ExecuTorch program
    against the PyTorch reference (numpy.allclose, atol 1e-4): both start from REMI's zero memory."""
    from txl_deploy.exporters.executorch.export import export_executorch
    from txl_deploy.exporters.precision.convert import reduce_onnx
    from txl_deploy.runtimes import TxlRuntime

    _, weights = remi
    int8 = tmp_path / "remi-int8.onnx"
    reduce_onnx(remi_onnx, int8, precision="int8-dynamic", threads=1)  # refused past STREAM_TOLERANCE
    assert TxlRuntime.load(int8).config.mem_init == "zeros"
    pte = tmp_path / "remi.pte"
    export_executorch(remi[0], pte, mem_len=MEM_LEN, max_segment=4, threads=1)  # verified at export
    rt = TxlRuntime.load(pte)
    tokens = _stream(seed=3)
    np.testing.assert_allclose(_run_stream(rt, tokens), _reference(weights, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_fp16_and_int4_graphs_keep_remis_differences(remi, remi_onnx, tmp_path, precision):
    """Each reduced graph keeps both ReLUs of every feed-forward block and Keras's epsilon, and starts from the zero
    memory: the fp16 graph is within 5e-2 of the numpy reference (test_precision's fp16 bound; a model starting
    from an empty memory is off by ~4 here), the int4 graph is judged against fp32 at export (its KL tolerance)."""
    import onnx

    from txl_deploy.exporters.precision.convert import reduce_onnx
    from txl_deploy.runtimes import TxlRuntime

    _, weights = remi
    out = tmp_path / f"remi-{precision}.onnx"
    reduce_onnx(remi_onnx, out, precision=precision, threads=1)  # refused past STREAM_TOLERANCE
    nodes = onnx.load(str(out)).graph.node
    eps = [a.f for n in nodes if n.op_type == "LayerNormalization" for a in n.attribute if a.name == "epsilon"]
    assert eps == pytest.approx([1e-3] * 2 * DIMS["n_layer"])
    assert sum(n.op_type == "Relu" for n in nodes) == 2 * DIMS["n_layer"]
    rt = TxlRuntime.load(out)
    assert (rt.config.mem_init, rt.config.ff_out_relu, rt.config.layer_norm_epsilon) == ("zeros", True, 1e-3)
    if precision == "fp16":
        tokens = _stream(seed=6)
        np.testing.assert_allclose(_run_stream(rt, tokens), _reference(weights, tokens), atol=5e-2, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "torch-fast"])
def test_pytorch_backends_start_and_reset_from_the_zero_memory(remi, backend):
    from txl_deploy.runtimes import TxlRuntime

    folder, weights = remi
    rt = TxlRuntime.load(folder, backend=backend, mem_len=MEM_LEN)
    tokens, fresh = _stream(seed=4), _stream(seed=5)
    np.testing.assert_allclose(_run_stream(rt, tokens), _reference(weights, tokens), atol=TOL, rtol=0)
    rt.reset(rows=[0])
    got = _run_stream(rt, fresh)
    np.testing.assert_allclose(got[0], _reference(weights, fresh[:1])[0], atol=TOL, rtol=0)


def test_page_and_triton_start_from_the_zero_memory(remi_onnx, tmp_path):
    """The page's model.json tells txl.js the count a fresh stream starts at; Triton's all-zero initial state cannot
    say it, so only its python backend (TxlRuntime inside) serves such a model."""
    import json

    from txl_deploy.errors import ExportError
    from txl_deploy.exporters.web.site import write_site
    from txl_deploy.serving.triton.repository import write_repository

    site = write_site(remi_onnx, tmp_path / "site")
    assert json.loads((site / "model.json").read_text())["initial_mem_count"] == MEM_LEN
    with pytest.raises(ExportError, match="--backend python"):
        write_repository(remi_onnx, tmp_path / "repo")
    assert (write_repository(remi_onnx, tmp_path / "py", backend="python", name="remi") / "remi").is_dir()
    result = cli("info", remi_onnx)
    assert result.exit_code == 0 and "mem_init" in result.output and "zeros" in result.output, result.output


def test_the_page_computes_remis_model_in_the_browser(remi, remi_onnx, tmp_path):
    """In headless Chromium (onnxruntime-web, wasm) the page's stream matches the numpy reference of REMI's model
    (1e-4, the page's fp32 bound) as its memory wraps, and a reset starts again from the zero memory."""
    import json

    from helpers.browser import Browser, SiteServer, chromium, ort_web

    from txl_deploy.exporters.web.site import write_site

    exe = chromium()
    site = write_site(remi_onnx, tmp_path / "site", ort_web=ort_web())
    tokens = _stream(batch=1, seed=7)
    segments = [tokens[0, s:s + SEG].tolist() for s in range(0, tokens.shape[1], SEG)]
    server = SiteServer(site)
    try:
        browser = Browser(exe)
        try:
            browser.open(server.url + "index.html?ep=wasm")
            runs = [browser.evaluate(f"txlDemo.logProbs({json.dumps(segments)})") for _ in range(2)]  # each resets
        finally:
            browser.close()
    finally:
        server.stop()
    want = _reference(remi[1], tokens)[0]
    for run in runs:
        got = np.concatenate([np.array(a, dtype=np.float64).reshape(len(s), -1) for a, s in zip(run, segments)])
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_info_names_the_family_and_its_settings(remi):
    folder, _ = remi
    result = cli("info", folder)
    assert result.exit_code == 0, result.output
    for text in ("remi", "ff_out_relu", "mem_init", "zeros", "0.001"):
        assert text in result.output, text


def test_layer_norms_are_matched_by_scope_not_number(remi, tmp_path):
    folder, weights = remi
    # Keras numbers depend on the graph's build order: another numbering reads the same
    renumbered = {k.replace("layer_normalization_3/", "layer_normalization_17/"): v for k, v in weights.items()}
    other = write_remi_folder(tmp_path / "renumbered", renumbered, dictionary=False)
    a, b = load_model(folder).state_dict, load_model(other).state_dict
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    # two norms in one scope, or none, is refused naming the variables
    p = f"{SCOPE}layer_1/ff/"
    second = {p + "layer_normalization_9/gamma": weights[p + f"{keras_norm(1, 'ff')}/gamma"]}
    for name, weights_ in (("two", {**weights, **second}),
                           ("none", {k: v for k, v in weights.items() if not k.startswith(p + "layer_norm")})):
        bad = write_remi_folder(tmp_path / name, weights_, dictionary=False)
        with pytest.raises(CheckpointError, match=r"layer_1/ff/layer_normalization|layer_1/ff/"):
            load_model(bad)


def test_foreign_variable_and_flags_are_one_line_errors(remi, tmp_path):
    folder, weights = remi
    bad = write_remi_folder(tmp_path / "extra", {**weights, SCOPE + "layer_0/ff/layer_3/kernel": np.zeros((2, 2),
                                                                                                        np.float32)},
                            dictionary=False)
    assert_one_line_error(cli("info", bad), "layer_0/ff/layer_3/kernel")
    shape = {**weights, SCOPE + "normal_softmax/bias": np.zeros(DIMS["n_token"] + 1, np.float32)}
    wrong = write_remi_folder(tmp_path / "shape", shape, dictionary=False)
    with pytest.raises(CheckpointError, match="normal_softmax/bias"):
        load_model(wrong)
    assert_one_line_error(cli("info", folder, "--preset", "wt103-large"), "REMI")


# -- fuzz: the name and shape checks a REMI index goes through -----------------------------------------------------
_VALID_SHAPES = {name: tuple(v.shape) for name, v in remi_variables(**DIMS).items()}
_NAME_PARTS = st.sampled_from(sorted(_VALID_SHAPES) + [
    SCOPE + "layer_0/ff/layer_normalization_7/gamma", SCOPE + "layer_5/rel_attn/qkv/kernel",
    SCOPE + "adaptive_embed/lookup_table", SCOPE + "normal_embed/proj_W", SCOPE + "adaptive_softmax/cutoff_0/b",
    SCOPE + "adaptive_embed/cutoff_0/lookup_table", SCOPE + "adaptive_embed/cutoff_1/lookup_table",
    "global_step", SCOPE + "r_w_bias/Adam_1", "other/r_w_bias", SCOPE + "layer_0/rel_attn/layer_normalization"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drop=st.sets(st.sampled_from(sorted(_VALID_SHAPES))),
       add=st.dictionaries(_NAME_PARTS, st.lists(st.integers(0, 50), max_size=4).map(tuple), max_size=4),
       reshape=st.dictionaries(st.sampled_from(sorted(_VALID_SHAPES)),
                               st.lists(st.integers(0, 50), max_size=4).map(tuple), max_size=2))
def test_fuzz_names_and_shapes_give_a_model_or_a_checkpoint_error(drop, add, reshape):
    """Whatever an index claims, the checks end in an architecture REMI's model has, or a CheckpointError."""
    shapes = {**{k: v for k, v in _VALID_SHAPES.items() if k not in drop}, **add, **reshape}
    try:
        names, arch = remi_architecture(shapes, "fuzz.index")
    except CheckpointError:
        return
    assert not arch["untie_r"] and not arch["cutoffs"] and arch["d_embed"] == arch["d_model"]
    assert set(names.values()) <= set(shapes)
