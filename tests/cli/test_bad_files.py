"""A damaged .onnx gets one line that says what is wrong with it: one cut short (a copy or download that stopped
early) says so, and a file that is not protobuf at all is not mistaken for one."""

from __future__ import annotations

import pytest
from helpers.cli import assert_one_line_error, cli


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_a_truncated_model_looks_cut_short(tiny_onnx, tmp_path, keep):
    data = tiny_onnx.read_bytes()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[:int(len(data) * keep)])
    for command in (["info", cut], ["generate", cut, "--prompt", "w1"]):
        assert_one_line_error(cli(*command), "cut.onnx", "looks cut short")


def test_a_file_of_something_else_is_not_called_cut_short(tmp_path):
    other = tmp_path / "notes.onnx"
    other.write_text("These are my notes, not a model.\n" * 20, encoding="utf-8")
    message = assert_one_line_error(cli("info", other), "not a readable ONNX model")
    assert "cut short" not in message
