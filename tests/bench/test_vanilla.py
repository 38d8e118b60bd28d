"""The vanilla Transformer of the paper's Table 9 computes what it claims: a causal language model with absolute
positions whose per-window answer is the next-token distribution after the window's last token, the same as a plain
full forward over that window, in PyTorch and in its ONNX export alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.paper_table9 import INPUT, OUTPUT, export_vanilla
from txl_deploy.model.vanilla import VanillaConfig, VanillaTransformerLM, random_vanilla

CFG = VanillaConfig(n_token=50, n_layer=3, n_head=2, d_model=16, d_head=8, d_inner=32)


@pytest.fixture(scope="module")
def model():
    m = random_vanilla(CFG, seed=1)
    with torch.no_grad():  # larger weights than the stand-ins' 0.02: differences between positions must show
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.mul_(20)
    return m


def test_the_window_answer_is_the_full_forward_at_its_last_position(model):
    """The shortcuts (only the last position's distribution; a last block that attends from it alone) change no
    number: the answer equals the plain causal forward over the same window, at its last position."""
    tokens = torch.randint(0, CFG.n_token, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for length in (1, 2, 9, 17):
            window = tokens[:, :length]
            np.testing.assert_allclose(model(window).numpy(), model.forward_all(window)[:, -1].numpy(), atol=1e-5)


def test_causal_and_absolute_each_position_sees_only_its_prefix(model):
    """Position i of a long forward equals a window of the first i + 1 tokens (nothing later leaks in), while a
    window that starts later is a different context (positions are absolute, counted from the window's start)."""
    tokens = torch.randint(0, CFG.n_token, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.forward_all(tokens)
        for i in (0, 4, 11):
            np.testing.assert_allclose(full[:, i].numpy(), model(tokens[:, :i + 1]).numpy(), atol=1e-5)
        later = model(tokens[:, 1:12])  # the same last token, one token less of context, positions shifted
    assert np.abs(later.numpy() - full[:, 11].numpy()).max() > 1e-3


def test_same_size_as_the_transformer_xl_shape_without_its_relative_position_weights():
    """The enwik8 base vanilla model has every parameter of Transformer-XL's, bar r_net and the r-biases."""
    from txl_deploy.config import published_config
    from txl_deploy.model.mem_transformer import MemTransformerLM

    txl_cfg = published_config("enwik8-base")
    with torch.device("meta"):
        txl, vanilla = MemTransformerLM(txl_cfg), VanillaTransformerLM(VanillaConfig.like(txl_cfg))
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    relative = sum(p.numel() for n, p in txl.named_parameters() if "r_net" in n or n.endswith(("r_w_bias", "r_r_bias")))
    assert count(vanilla) == count(txl) - relative
    assert (vanilla.cfg.n_layer, vanilla.cfg.d_model, vanilla.cfg.n_head, vanilla.cfg.d_head, vanilla.cfg.d_inner) \
        == (12, 512, 8, 64, 2048)


def test_onnx_export_computes_the_same_at_any_window_and_batch(model, tmp_path):
    import onnxruntime as ort  # heavy: only this test runs the export outside TxlRuntime
    path = export_vanilla(model, tmp_path / "vanilla.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    for batch, length in ((1, 2), (3, 5), (2, 40)):  # 40: longer than the export's example window
        tokens = rng.integers(0, CFG.n_token, (batch, length))
        got = session.run([OUTPUT], {INPUT: tokens})[0]
        with torch.no_grad():
            want = model(torch.from_numpy(tokens)).numpy()
        assert got.shape == (batch, CFG.n_token)
        np.testing.assert_allclose(got, want, atol=1e-4)  # fp32, 3 layers: measured 1e-6
