"""The ExecuTorch program (.pte, XNNPACK) and the step it is traced from.

Tolerances: the Linear form of the cached step against CachedTxl and the reference within 1e-5 (float32 rounding of
the same products in another order; observed about 2e-6). The fp32 program against PyTorch: numpy.allclose's
rule, atol 1e-4 and rtol 1e-5, as the ONNX export (observed about 3e-6 at batch 2, 1 and 3). The program and the
ONNX graph of the same checkpoint agree within the same rule. int4 (8da4w) on the demo model: bits per character
on the first 4,096 held-out characters within 2% of fp32 and mean KL from fp32 <= 0.1 nats on the random stream.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers.tiny import make_tiny_model

from txl_deploy.contract import pte_file
from txl_deploy.errors import CheckpointError, InputError, OutputExistsError

torch = pytest.importorskip("torch")


def _random_state(step, batch, counts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = step.empty_state(batch)
    for t in state[:-1]:
        t.copy_(torch.randn(t.shape, generator=gen))
    state[-1][:] = torch.tensor(counts)
    return state


@pytest.mark.parametrize("overrides", [{}, {"div_val": 1, "d_embed": 16}, {"cutoffs": [], "div_val": 1, "tie_projs": [False]},
                                       {"pre_lnorm": True, "same_length": False},
                                       # REMI's: the second feed-forward ReLU, Keras's epsilon, the zero memory
                                       {"cutoffs": [], "div_val": 1, "tie_projs": [False], "same_length": False,
                                        "ff_out_relu": True, "layer_norm_epsilon": 1e-3, "mem_init": "zeros"}])
def test_linear_step_computes_what_the_cached_step_does(overrides):
    from txl_deploy.model.cached_step import CachedTxl
    from txl_deploy.model.linear_step import LinearCachedTxl

    model = make_tiny_model(**overrides)
    cached, linear = CachedTxl(model, 12, max_segment=16).eval(), LinearCachedTxl(model, 12, max_segment=16).eval()
    for batch, q, counts in ((2, 4, [5, 20]), (1, 1, [0]), (3, 16, [0, 11, 40])):
        state = _random_state(cached, batch, counts)
        tokens = torch.randint(0, model.cfg.n_token, (batch, q))
        positions = torch.arange(q).repeat(batch, 1)
        with torch.no_grad():
            for got, want in zip(linear(tokens, positions, *state), cached(tokens, positions, *state)):
                assert got.shape == want.shape
                assert float((got - want).abs().max()) < 1e-5


def test_linear_step_leaves_the_reference_alone_and_quantizes_every_linear():
    from txl_deploy.exporters.executorch.export import _quantize
    from txl_deploy.model.linear_step import LinearCachedTxl

    model = make_tiny_model(d_model=64, d_embed=64, d_inner=64, d_head=16, div_val=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = LinearCachedTxl(model, 12, max_segment=16).eval()
    linears = [m for m in step.modules() if isinstance(m, torch.nn.Linear)]
    # 2 layers x (qkv, o_net, 2 feed-forward) + the output layer's head and two tails (d_embed = d_model: no projections)
    assert len(linears) == 2 * 4 + 3
    assert _quantize(step, "int4") == []  # every input size here is a multiple of 32: nothing left in fp32
    assert all(type(m.weight).__name__ != "Parameter" for m in linears)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # tied weights untouched


def test_pte_matches_pytorch_and_carries_its_sidecar(tiny_pte):
    info = pte_file.read_pte_info(tiny_pte)
    assert info.export["format"] == "executorch" and info.precision == "fp32" and info.mem_len == 12
    assert info.max_segment == 16 and info.export["max_batch"] == 64 and info.state == "incremental"
    assert info.export["io"]["inputs"] == info.spec().input_names()
    assert info.export["io"]["outputs"] == info.spec().output_names()
    assert info.vocab is not None and info.vocab.kind == "word"
    v = info.verification
    assert v["passed"] and v["tolerance"] == 1e-4 and v["max_abs_diff"] < 1e-4
    assert v["runtime"].startswith("TxlRuntime on ExecuTorch")  # checked as users run it, not by a path of its own
    assert [(s["batch"], max(s["segments"])) for s in v["shapes"]] == [(2, 14), (1, 1), (3, 8)]
    assert info.export["xnnpack_partitions"] >= 1
    assert "_log_softmax" in info.export["portable_ops"]  # recorded by name: what runs outside XNNPACK


def test_pte_gives_the_onnx_graphs_log_probs(tiny_pte, tiny_onnx):
    """The same stream through the .pte (ExecuTorch, with the ring buffer kept outside) and the .onnx (ONNX Runtime)."""
    from txl_deploy.runtimes import TxlRuntime

    tokens = np.random.default_rng(7).integers(0, 60, size=(4, 40))
    with TxlRuntime.load(tiny_pte) as pte, TxlRuntime.load(tiny_onnx) as rt:
        for lo, hi in ((0, 16), (16, 17), (17, 30), (30, 31), (31, 40)):  # past mem_len 12: the ring wraps
            got, want = pte.step(tokens[:, lo:hi]), rt.step(tokens[:, lo:hi])
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-5)


def test_sidecar_that_does_not_belong_to_the_program_is_refused(tiny_pte, tmp_path):
    pte = tmp_path / "m.pte"
    shutil.copy(tiny_pte, pte)
    with pytest.raises(CheckpointError, match="no sidecar m.pte.json"):
        pte_file.read_pte_info(pte)
    shutil.copy(pte_file.sidecar_path(tiny_pte), pte_file.sidecar_path(pte))
    assert pte_file.read_pte_info(pte).mem_len == 12
    data = bytearray(pte.read_bytes())
    data[-1] ^= 1  # same size, other bytes
    pte.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256 differs"):
        pte_file.read_pte_info(pte)
    pte.write_bytes(bytes(data) + b"\0")
    with pytest.raises(CheckpointError, match="does not match its sidecar"):
        pte_file.read_pte_info(pte, check_hash=False)


def test_sidecar_contents_are_validated(tiny_pte, tmp_path):
    pte = tmp_path / "m.pte"
    shutil.copy(tiny_pte, pte)
    good = json.loads(pte_file.sidecar_path(tiny_pte).read_text())
    side = pte_file.sidecar_path(pte)
    bad = [({**good, "format": "other"}, "not a txl-deploy .pte sidecar"),
           ({**good, "export": {**good["export"], "mem_len": 10**9}}, "export.mem_len"),
           ({**good, "export": {**good["export"], "max_segment": "16"}}, "export.max_segment"),
           ({**good, "export": {**good["export"], "precision": "int2"}}, "unknown precision"),
           ({**good, "config": [1]}, "\"config\" missing"),
           ({**good, "pte": {"size": True, "sha256": "0" * 64}}, "integer size"),
           ({**good, "config": {**good["config"], "n_layer": "two"}}, "corrupt txl-deploy metadata")]
    for doc, message in bad:
        side.write_text(json.dumps(doc))
        with pytest.raises(CheckpointError, match=message):
            pte_file.read_pte_info(pte)
    side.write_bytes(b"\xff{")
    with pytest.raises(CheckpointError, match="not a readable sidecar"):
        pte_file.read_pte_info(pte)


def test_export_refuses_overwrite_and_unknown_precision(tiny_ckpt, tiny_pte, tmp_path):
    from txl_deploy.exporters.executorch.export import export_executorch

    before = tiny_pte.read_bytes()
    with pytest.raises(OutputExistsError):
        export_executorch(tiny_ckpt, tiny_pte)
    assert tiny_pte.read_bytes() == before
    with pytest.raises(InputError, match="choose fp32, int8, int4"):
        export_executorch(tiny_ckpt, tmp_path / "x.pte", precision="fp16")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exporter", ["onnx", "executorch"])
def test_both_exporters_refuse_a_memory_of_no_slots_in_one_line(tiny_ckpt, tmp_path, exporter):
    from txl_deploy.errors import ExportError
    from txl_deploy.exporters.executorch.export import export_executorch
    from txl_deploy.exporters.onnx.export import export_onnx

    export = export_onnx if exporter == "onnx" else export_executorch
    with pytest.raises(ExportError, match=r"the model has mem_len \d+; pass --mem-len N \(N >= 1\)") as e:
        export(tiny_ckpt, tmp_path / f"x.{exporter}", mem_len=0)
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_demo_model_int4_program_within_2_percent_bits_per_character(tmp_path, tiny_pte):
    from txl_deploy.assets import DEMO_DIR
    from txl_deploy.exporters.executorch.export import export_executorch

    out = tmp_path / "demo-int4.pte"
    result = export_executorch(DEMO_DIR / "kjv-char", out, precision="int4", max_segment=64,
                               eval_text=DEMO_DIR / "heldout.txt", max_eval_tokens=4096, threads=1)
    info = pte_file.read_pte_info(out)
    report = info.export["precision_report"]
    assert report["method"]["scheme"] == "8da4w" and report["method"]["fp32_linears"] == []
    accuracy = report["accuracy"]
    assert accuracy["metric"] == "bits_per_character" and accuracy["tokens"] == 4095
    assert accuracy["relative_change"] <= 0.02 and accuracy["passed"]
    assert 1.0 < accuracy["fp32"] < 3.0  # the demo model's bits per character, not a degenerate score
    assert report["stream"]["kl_divergence"] <= 0.1 and result.verification["passed"]
    # 4-bit weights: far smaller than the fp32 weights (1.94M parameters, 7.8 MB in fp32)
    assert out.stat().st_size < 0.45 * 1_938_313 * 4


def test_info_describes_the_program_from_its_sidecar(tiny_pte, tmp_path):
    from helpers.cli import assert_one_line_error, cli

    result = cli("info", tiny_pte, "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    assert d["format"] == "executorch (fp32, XNNPACK, batch up to 64)" and d["max_segment"] == 16
    assert d["vocab_size"] == 60 and d["vocab_source"] == "the sidecar tiny.pte.json"
    assert d["memory_bytes_per_stream"]["mem_len"] == 12
    lonely = tmp_path / "lonely.pte"
    shutil.copy(tiny_pte, lonely)
    assert_one_line_error(cli("info", lonely), "no sidecar lonely.pte.json")


@pytest.mark.parametrize("extra, fragment", [(["--state", "full"], "incremental layout only"),
                                             (["--ort-format"], "--ort-format is for ONNX graphs"),
                                             (["--precision", "fp16"], "--precision fp16 is not available"),
                                             (["--opset", "17"], "--opset is for ONNX graphs")])
def test_export_command_refuses_onnx_only_options_with_executorch(tiny_ckpt, tmp_path, extra, fragment):
    from helpers.cli import assert_one_line_error, cli

    assert_one_line_error(cli("export", tiny_ckpt, "--executorch", "-o", tmp_path / "x.pte", *extra), fragment)
    assert list(tmp_path.iterdir()) == []


def test_export_command_writes_a_verified_program_that_generates(tiny_ckpt, tiny_pte, tmp_path):
    from helpers.cli import cli

    out = tmp_path / "cli.pte"
    result = cli("export", tiny_ckpt, "--executorch", "--max-segment", "16", "--threads", "1", "-o", out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli.pte", "cli.pte.json"]
    info = pte_file.read_pte_info(out)
    assert info.verification["passed"] and info.precision == "fp32" and info.max_segment == 16
    # the same program as the API export of the same checkpoint: the command adds nothing of its own
    assert info.export["weights_sha256"] == pte_file.read_pte_info(tiny_pte).export["weights_sha256"]
    result = cli("generate", out, "--prompt", "a", "--max-new-tokens", "5", "--temperature", "0")
    assert result.exit_code == 0, result.output
