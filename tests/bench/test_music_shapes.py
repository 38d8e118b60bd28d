"""The music models' published shapes (REMI, remi-xl): `txl-deploy bench remi` runs a stand-in of exactly the model
the projects publish, so their parameters are counted against the projects' own."""

from __future__ import annotations

import pytest

from tests.helpers.remi import remi_variables
from txl_deploy.bench.random_weights import is_shape_name, shape_config
from txl_deploy.config import TxlConfig, published_config

# The remi-xl run's parameter amount (compound-word-transformer, workspace/uncond/Experiments.md): its ep_170.pth.tar.
REMI_XL_PUBLISHED_PARAMETERS = 41_291_084


def _parameters(config: TxlConfig) -> int:
    import torch  # the torch extra: the model is built on the meta device, nothing allocated

    from txl_deploy.model.mem_transformer import MemTransformerLM

    with torch.device("meta"):
        model = MemTransformerLM(config)
    return sum(p.numel() for p in model.parameters())  # a tied weight is counted once


def test_remi_xl_shape_is_the_published_checkpoint():
    cfg = published_config("remi-xl")
    assert (cfg.pre_lnorm, cfg.same_length, cfg.tie_weight, cfg.mem_init) == (True, True, False, "empty")
    assert _parameters(cfg) == REMI_XL_PUBLISHED_PARAMETERS


def test_remi_shape_has_the_values_of_a_remi_checkpoint():
    """REMI publishes no parameter count: the stand-in is counted against the variables its Saver writes (the
    TF-layout test bundle's names and shapes), at the shape's sizes."""
    cfg = published_config("remi")
    assert (cfg.ff_out_relu, cfg.mem_init, cfg.layer_norm_epsilon, cfg.pre_lnorm) == (True, "zeros", 1e-3, False)
    variables = remi_variables(n_token=cfg.n_token, n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head,
                               d_head=cfg.d_head, d_inner=cfg.d_inner)
    assert _parameters(cfg) == sum(v.size for v in variables.values()) == 41_106_736


@pytest.mark.parametrize("name", ["remi", "remi-xl"])
def test_bench_takes_the_music_shapes_and_keeps_their_settings_at_another_mem_len(name):
    assert is_shape_name(name)
    cfg = shape_config(name, mem_len=64)
    assert cfg.mem_len == 64 and cfg.replace(mem_len=512) == published_config(name)
    assert TxlConfig.from_json(cfg.to_json()) == cfg  # what the stand-in checkpoint stores
