"""`txl-deploy generate --grammar`: a music model generates only what its representation's grammar allows; a model
whose vocabulary is not that representation's events is refused in one line."""

from __future__ import annotations

import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.event_models import SYMBOLS, save_event_model

from txl_deploy.music.grammar import compiled
from txl_deploy.runtimes import TxlRuntime

pytest.importorskip("torch")


def test_generate_with_a_grammar_prints_what_generate_samples(tmp_path):
    model = save_event_model(tmp_path / "remi-xl", "remi-xl")
    r = cli("generate", model, "--prompt", "Bar_None", "--max-new-tokens", 40, "--seed", 3, "--grammar", "remi-xl")
    assert r.exit_code == 0, r.output
    with TxlRuntime.load(model) as rt:
        want = list(rt.generate("Bar_None", max_new_tokens=40, seed=3, grammar="remi-xl"))
    assert compiled("remi-xl", SYMBOLS["remi-xl"]).first_error([0] + want) is None
    assert r.output.split() == ["Bar_None"] + [SYMBOLS["remi-xl"][t] for t in want]


def test_a_grammar_the_vocabulary_cannot_follow_is_one_line(tiny_ckpt):
    r = cli("generate", tiny_ckpt, "--prompt", "w1", "--grammar", "remi")
    assert_one_line_error(r, "needs a vocabulary of remi events")
    r = cli("generate", tiny_ckpt, "--prompt", "w1", "--grammar", "midi")
    assert r.exit_code != 0 and "'midi' is not one of 'remi', 'remi-xl'" in r.output
