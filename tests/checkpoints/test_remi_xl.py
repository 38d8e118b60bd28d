"""Compound Word Transformer's remi-xl `ep_N.pth.tar`, read with no flags, matches an independent reference of what
its model computes (tests/helpers/remi_xl.py) on a stream whose memory fills and wraps, at batch 2.

The checkpoints are built in its training code's exact layout (model_setting, train_setting, Adam's state); the
reference is float64, written from its semantics, not from our model. Tolerance 1e-5 on log-probs (fp32).
"""

from __future__ import annotations

import pickle

import pytest
import torch
from helpers import remi_xl as rx
from helpers.cli import cli

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.remi_xl import config_from_setting
from txl_deploy.errors import CheckpointError
from txl_deploy.model.weights import build_model, model_parameters

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = 1e-5
# Segment lengths of the stream: mem_len is 6, so the memory fills in the second segment and wraps from the third;
# the single tokens are the generation loop's steps.
LENGTHS = [4, 4, 3, 5, 1, 1, 2]


def stream(seed=0, batch=2):
    ids = torch.randint(0, rx.SETTING["n_token"], (batch, sum(LENGTHS)), generator=torch.Generator().manual_seed(seed))
    return list(torch.split(ids, LENGTHS, dim=1))


def worst_vs_reference(model, sd, segments, setting=rx.SETTING) -> float:
    """The largest log-prob difference between `model` and the reference over the stream, memory threaded."""
    reference = rx.reference_log_probs(sd, setting, segments)
    worst, mems = 0.0, None
    with torch.no_grad():
        for seg, ref in zip(segments, reference):
            got, mems = model(seg, mems)
            worst = max(worst, float((got.double() - ref).abs().max()))
    return worst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    sd = rx.state_dict(seed=1)
    path = rx.save_pth_tar(tmp_path_factory.mktemp("run") / "ep_170.pth.tar", sd)
    return path, sd


def test_pth_tar_matches_the_reference_as_the_memory_fills_and_wraps(ckpt):
    path, sd = ckpt
    loaded = load_model(path)
    cfg = loaded.config
    assert loaded.source_format == "remi-xl"
    assert (cfg.pre_lnorm, cfg.same_length, cfg.clamp_len, cfg.tie_weight, cfg.d_head, cfg.mem_len) == (
        True, True, -1, False, 8, 6)
    assert "saved after epoch 170 of training" in loaded.notes
    assert worst_vs_reference(loaded.build(), sd, stream()) <= TOL


def test_the_parity_check_fails_for_a_tied_or_unbiased_output(ckpt):
    """A reader that ties the output layer to the embedding, or drops its bias, is caught by the same check."""
    path, sd = ckpt
    loaded = load_model(path)
    state = dict(loaded.state_dict)
    weight = state.pop("crit.out_layers.0.weight")
    tied = build_model(loaded.config.replace(tie_weight=True), state, path)
    unbiased = build_model(loaded.config, {**state, "crit.out_layers.0.weight": weight,
                                           "crit.out_layers.0.bias": torch.zeros_like(state["crit.out_layers.0.bias"])})
    segments = stream(seed=2)
    assert worst_vs_reference(tied, sd, segments) > 100 * TOL
    assert worst_vs_reference(unbiased, sd, segments) > 100 * TOL


def test_config_yml_beside_it_when_model_setting_is_absent(tmp_path):
    sd = rx.state_dict(seed=3)
    path = rx.save_pth_tar(tmp_path / "ep_10.pth.tar", sd, with_model_setting=False)
    with pytest.raises(CheckpointError, match="holds no model_setting: it needs its run's config.yml beside it"):
        load_model(path)
    rx.write_config_yml(tmp_path)
    loaded = load_model(path)
    assert loaded.source_format == "remi-xl" and loaded.config.mem_len == rx.SETTING["mem_len"]
    assert f"config from {tmp_path / 'config.yml'}" in loaded.notes
    assert worst_vs_reference(loaded.build(), sd, stream(seed=3)) <= TOL
    # --config names another file; with model_setting in the file, --config is refused
    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "config.yml").rename(other / "run.yml")
    assert load_model(path, config=other / "run.yml").config.n_layer == rx.SETTING["n_layer"]
    with_setting = rx.save_pth_tar(tmp_path / "ep_20.pth.tar", sd)
    with pytest.raises(CheckpointError, match="carries its own config"):
        load_model(with_setting, config=other / "run.yml")


@pytest.mark.parametrize("text, problem", [
    ("MODEL: [1, 2", "not a readable YAML config"),
    ("MODEL: !!python/object/apply:os.system ['true']", "not a readable YAML config"),
    ("- 1\n- 2\n", "config must be a mapping"),
    ("MODEL: {n_layer: 2}", "config lacks n_token"),
    ("MODEL: {n_token: 30, n_layer: '2', n_head: 2, d_model: 16, d_inner: 24, mem_len: 6, clamp_len: -1, "
     "pre_lnorm: true, same_length: true}", "n_layer is '2', not an integer"),
    ("MODEL: {n_token: 30, n_layer: 2, n_head: 2, d_model: 16, d_inner: 24, mem_len: 6, clamp_len: -1, "
     "pre_lnorm: 1, same_length: true}", "pre_lnorm is 1, not true or false"),
    ("MODEL: {n_token: 30, n_layer: 2, n_head: 32, d_model: 16, d_inner: 24, mem_len: 6, clamp_len: -1, "
     "pre_lnorm: true, same_length: true}", "d_head must be a positive integer"),
    ("MODEL: {n_token: 30, n_layer: 2, n_head: 2, d_model: 16, d_inner: 24, mem_len: 6, clamp_len: -1, "
     "pre_lnorm: true, same_length: true, ext_len: 3}", "ext_len 3 is not supported"),
])
def test_a_bad_config_yml_is_a_one_line_error(tmp_path, text, problem):
    path = rx.save_pth_tar(tmp_path / "ep_10.pth.tar", rx.state_dict(seed=4), with_model_setting=False)
    (tmp_path / "config.yml").write_text(text)
    with pytest.raises(CheckpointError, match=problem) as e:
        load_model(path)
    assert "\n" not in str(e.value)


def test_a_hostile_pth_tar_runs_nothing(tmp_path):
    """A pickle that would run code when loaded (here: create a file) is refused before anything runs."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    state = {"epoch": 1, "model_setting": dict(rx.SETTING), "state_dict": rx.state_dict(), "optimizer": Payload()}
    path = tmp_path / "ep_1.pth.tar"
    torch.save(state, path, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(CheckpointError, match="refused to unpickle io.open") as e:
        load_model(path)
    assert "nothing from the file was run" in str(e.value)
    assert not marker.exists()


def test_the_published_shape_has_the_published_parameter_count():
    """The published run's MODEL section gives the 41,291,084 parameters its ep_170.pth.tar holds."""
    cfg = config_from_setting(rx.PUBLISHED_SETTING, "config.yml")
    assert (cfg.n_layer, cfg.d_model, cfg.d_head, cfg.mem_len, cfg.d_embed) == (12, 512, 64, 512, 512)
    from txl_deploy.model.mem_transformer import MemTransformerLM

    with torch.device("meta"):
        assert model_parameters(MemTransformerLM(cfg)) == rx.PUBLISHED_PARAMETERS


def test_info_names_the_family(ckpt):
    result = cli("info", ckpt[0])
    assert result.exit_code == 0, result.output
    assert "format:      remi-xl (Compound Word Transformer's remi-xl" in result.output
