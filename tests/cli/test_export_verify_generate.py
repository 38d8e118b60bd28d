"""The command line end to end on the tiny model: `export --onnx` (and the verification report it prints), `verify`
of the graph against the checkpoint, and `generate` from the graph and from the checkpoint."""

from __future__ import annotations

from click.testing import CliRunner

from txl_deploy.cli import main


def test_cli_export_verify_generate(tiny_ckpt, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli.onnx"
    r = runner.invoke(main, ["export", str(tiny_ckpt), "--onnx", "-o", str(out), "--max-segment", "16"])
    assert r.exit_code == 0, r.output
    assert "max abs difference" in r.output and "top-1 agreement" in r.output and "tolerance" in r.output
    r = runner.invoke(main, ["verify", str(out), "--against", str(tiny_ckpt)])
    assert r.exit_code == 0 and "OK" in r.output
    r = runner.invoke(main, ["generate", str(out), "--prompt", "w1 w2", "--max-new-tokens", "5", "--temperature", "0"])
    assert r.exit_code == 0 and r.output.startswith("w1 w2") and len(r.output.split()) == 7
    r = runner.invoke(main, ["generate", str(tiny_ckpt), "--prompt", "w1 w2", "--max-new-tokens", "5",
                             "--temperature", "0"])
    assert r.exit_code == 0
