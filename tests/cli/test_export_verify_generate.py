"""The command line end to end on the tiny model: `export --onnx` (and the verification report it prints), `verify`
of the graph against the checkpoint, and `generate` from the graph and from the checkpoint, which print exactly the
text `TxlRuntime.generate` makes, greedy and seeded sampling alike."""

from __future__ import annotations

import pytest
from helpers.cli import cli

PROMPT = "w1 w2"
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def exported(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint exported by `txl-deploy export --onnx`: (the .onnx, the command's output)."""
    out = tmp_path_factory.mktemp("cli") / "cli.onnx"
    result = cli("export", tiny_ckpt, "--onnx", "-o", out, "--max-segment", "16")
    assert result.exit_code == 0, result.output
    return out, result.output


def test_cli_export_prints_its_verification_and_verify_passes(tiny_ckpt, exported):
    out, report = exported
    assert "max abs difference" in report and "top-1 agreement" in report and "tolerance" in report
    r = cli("verify", out, "--against", tiny_ckpt)
    assert r.exit_code == 0 and "OK" in r.output


# The tiny random model's greedy continuation is one token repeated; a seeded sample at temperature 1 varies, so it
# also shows that each generated token reaches the memory the next one is drawn from.
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 7}], ids=["greedy", "seeded"])
def test_cli_generate_from_the_graph_and_the_checkpoint_prints_the_runtimes_text(tiny_ckpt, exported, ref_rt,
                                                                                   sampling):
    ref_rt.reset()
    prompt_ids = [int(i) for i in ref_rt.encode(PROMPT)]
    tokens = list(ref_rt.generate(prompt_ids, NEW_TOKENS, **sampling))
    ref_rt.reset()
    assert len(tokens) == NEW_TOKENS
    expected = ref_rt.decode(prompt_ids + tokens) + "\n"
    options = [arg for name, value in sampling.items() for arg in (f"--{name}", value)]
    printed = {}
    for name, model in (("onnx", exported[0]), ("checkpoint", tiny_ckpt)):
        r = cli("generate", model, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, *options)
        assert r.exit_code == 0, r.output
        printed[name] = r.stdout
    assert printed == {"onnx": expected, "checkpoint": expected}
