"""The output layer held once in the layout its consumer reads: OutputLayer against the reference modules."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers.tiny import make_tiny_model

torch = pytest.importorskip("torch")

from txl_deploy.errors import InputError  # noqa: E402
from txl_deploy.model.output_layer import OutputLayer  # noqa: E402

# (div_val, d_embed, cutoffs, tie_projs): adaptive with and without projections, div_val 1 and > 1, no clusters.
SHAPES = {
    "div1-noproj": (1, 32, [10, 30], [False, False, False]),
    "div1-proj": (1, 24, [10, 30], [False, True, False]),
    "div1-proj-untied-projs": (1, 24, [10, 30], [False, False, False]),
    "div2-proj": (2, 32, [10, 30], [False, True, True]),
    "div2-proj-untied-projs": (2, 32, [10, 30], [False, False, False]),
    "no-clusters": (1, 32, [], [False]),
    "no-clusters-proj": (1, 24, [], [True]),
}


@pytest.mark.parametrize("shape,tie_weight", list(itertools.product(SHAPES, [True, False])))
def test_same_numbers_as_the_reference_embedding_and_softmax(shape, tie_weight):
    div_val, d_embed, cutoffs, tie_projs = SHAPES[shape]
    model = make_tiny_model(seed=3, div_val=div_val, d_embed=d_embed, cutoffs=cutoffs, tie_projs=tie_projs,
                            tie_weight=tie_weight)
    layer = OutputLayer(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.cfg.n_token, (3, 7), generator=g)
    tokens[0, :4] = torch.tensor([0, 9, 10, 59])  # every cluster's first and last token
    hidden = torch.randn(3, 5, model.cfg.d_model, generator=g)
    with torch.no_grad():
        assert (layer.embed(tokens) - model.word_emb(tokens)).abs().max() <= 1e-5
        full = layer(hidden)
        assert (full - model.crit(hidden)).abs().max() <= 1e-5
        head = layer.head(hidden)
        layout = layer.layout
        if layout is None:  # a plain softmax: the head is the whole distribution
            assert torch.equal(head, full)
        else:
            assert head.shape[-1] == layout.head_size
            tails = [layer.tail(i, hidden, head) for i in range(1, layout.n_clusters + 1)]
            # the parts compose the layer, bit for bit
            assert torch.equal(torch.cat([head[..., : layout.shortlist], *tails], dim=-1), full)
    # The log-probs are a distribution over the whole vocabulary.
    assert torch.allclose(full.exp().sum(-1), torch.ones(3, 5), atol=1e-5)


def test_bounds_and_head_columns_follow_the_stored_cluster_order():
    model = make_tiny_model()  # cutoffs [10, 30], n_token 60
    layer = OutputLayer(model)
    layout = layer.layout
    assert layout.shortlist == 10
    assert layout.bounds == ((10, 30), (30, 60))
    assert [layout.head_column(i) for i in (1, 2)] == [11, 10]  # tail cluster i reads head column -i
    with pytest.raises(InputError):
        layout.head_column(0)
    plain = OutputLayer(make_tiny_model(cutoffs=[], tie_projs=[False], div_val=1))
    assert plain.layout is None


def test_tied_weights_are_held_once_in_the_matmul_layout():
    model = make_tiny_model(div_val=1, d_embed=24, cutoffs=[10, 30], tie_projs=[False, True, True])
    layer = OutputLayer(model)
    names = dict(layer.named_buffers())
    # No separate embedding table: the embedding reads the output weights, [d_emb, cluster rows (+ cluster logits)].
    assert not any(n.startswith("emb_weight") for n in names)
    assert [tuple(names[f"out_weight_{i}"].shape) for i in range(3)] == [(24, 12), (24, 20), (24, 30)]
    # The tied projections and the embedding's are one tensor; the head's own projection is another.
    assert sorted(n for n in names if n.startswith("proj_")) == ["proj_0", "proj_1"]
    assert layer.out_proj_names[1] == layer.out_proj_names[2] == layer.emb_proj_name


def _weights(graph):
    """Float initializers of two or more dimensions: the model's weights, not shapes or axes."""
    return {i.name: i for i in graph.initializer if len(i.dims) >= 2 and i.data_type == 1}


def test_the_exported_graph_reads_every_weight_as_stored(tiny_onnx):
    onnx = pytest.importorskip("onnx")
    graph = onnx.load(tiny_onnx).graph
    weights = _weights(graph)
    for node in graph.node:
        read = [name for name in node.input if name in weights]
        if not read:
            continue
        # A weight feeds a MatMul, a Gemm, a bias Add or the embedding's Gather directly: nothing to slice, transpose
        # or fold into a second copy at load.
        assert node.op_type in ("MatMul", "Gemm", "Add", "Gather"), (node.op_type, read)
        if node.op_type == "Gather":
            assert [a.i for a in node.attribute if a.name == "axis"] == [1]
        weight = weights.get(node.input[1]) if node.op_type in ("MatMul", "Gemm") else None
        if weight is not None and len(weight.dims) == 2 and not weight.name.startswith("crit."):
            # The layers' weights are stored in the layout a one-token product streams fastest: [in, out] for a
            # product that widens, [out, in] read with transB for one that narrows. (The output layer's layout is
            # the one the tied embedding also reads, checked below; a real vocabulary's products all widen.)
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            rows, cols = weight.dims
            n_in, n_out = (cols, rows) if trans_b else (rows, cols)
            assert trans_b == (n_out < n_in), (node.name, n_in, n_out, trans_b)
    # The tiny model ties its weights: the output weights are the only embedding tables.
    out_weights = sorted(n for n in weights if "out_weight" in n)
    gathered = sorted(n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in weights)
    assert out_weights and gathered == out_weights


def test_onnx_runtime_adds_no_weight_copies_at_load(tiny_onnx, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(tiny_onnx), options, providers=["CPUExecutionProvider"])

    def weight_values(path):
        return sum(int(np.prod(i.dims)) for i in _weights(onnx.load(path).graph).values())

    assert weight_values(tmp_path / "optimized.onnx") == weight_values(tiny_onnx)
