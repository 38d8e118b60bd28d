"""`txl-deploy generate --num-beams`: prints what `TxlRuntime.beam_search` returns, best first, one beam a line
(score, tab, prompt and continuation); beam options without --num-beams, and sampling options with it, are refused."""

from __future__ import annotations

import pytest
from helpers.cli import assert_one_line_error, cli

from txl_deploy.runtimes import TxlRuntime

PROMPT = "w1 w2 w7"


def test_generate_num_beams_prints_the_runtimes_beams(tiny_onnx):
    args = {"num_beams": 3, "max_new_tokens": 6, "length_penalty": 0.5, "early_stopping": "never",
            "num_return_sequences": 3}
    with TxlRuntime.load(tiny_onnx) as rt:
        beams = rt.beam_search(PROMPT, stop=[3], **args)
        texts = [PROMPT + " " + rt.decode(b.tokens) for b in beams]
    r = cli("generate", tiny_onnx, "--prompt", PROMPT, "--num-beams", 3, "--max-new-tokens", 6, "--length-penalty",
            0.5, "--early-stopping", "never", "--num-return-sequences", 3, "--stop-token-id", 3)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == [f"{b.score:.4f}\t{t}" for b, t in zip(beams, texts)]


@pytest.mark.parametrize("args,fragment", [
    (("--num-return-sequences", 2), "need --num-beams"),
    (("--length-penalty", 2), "need --num-beams"),
    (("--num-beams", 2, "--temperature", 0), "drop --temperature"),
    (("--num-beams", 2, "--seed", 1, "--top-k", 3), "drop --top-k, --seed"),
    (("--num-beams", 1), "--num-beams"),
])
def test_generate_refuses_beam_options_that_do_not_fit(tiny_onnx, args, fragment):
    r = cli("generate", tiny_onnx, "--prompt", PROMPT, *args)
    assert r.exit_code == 2 and "Traceback" not in r.output and fragment in r.output, r.output


def test_more_return_sequences_than_beams_is_a_one_line_error(tiny_onnx):
    r = cli("generate", tiny_onnx, "--prompt", PROMPT, "--num-beams", 2, "--num-return-sequences", 3)
    assert_one_line_error(r, "num_return_sequences (3) must be at most num_beams (2)")
