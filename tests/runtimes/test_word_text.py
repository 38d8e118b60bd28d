"""A WikiText-103-style word model's text: `<unk>` can be kept out of sampled text, where the model would write it
(`ban_unk` in the API, `--no-unk` on `txl-deploy generate`).

The model is `helpers.word_models`: the tiny random model over WikiText-103's kind of symbols; seeded sampling at a
high temperature writes every kind of symbol."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.cli import cli
from helpers.word_models import NATURAL_LINE, save_wikitext_model

from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.sampling import Sampler, SamplingParams
from txl_deploy.vocab import Vocab

pytest.importorskip("torch")

SEEDS = range(8)
N = 40


@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):
    """(checkpoint folder, its ONNX export) of the tiny WikiText-103-style model."""
    from txl_deploy.exporters.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("wikitext")
    ckpt = save_wikitext_model(root / "wt")
    export_onnx(ckpt, root / "wt.onnx", max_segment=16, verify=False)
    return ckpt, root / "wt.onnx"


@pytest.fixture(scope="module")
def rt(wikitext):
    with TxlRuntime.load(wikitext[1], threads=1) as runtime:
        yield runtime


def _sample(rt, prompt, seed, **controls):
    rt.reset()
    ids = list(rt.generate(prompt, N, temperature=1.5, seed=seed, **controls))
    rt.reset()
    return ids


def test_ban_unk_never_samples_unk_where_the_model_would(rt):
    unk = rt.vocab.index["<unk>"]
    prompt_ids = rt.encode(NATURAL_LINE)
    # pushed towards <unk>, greedy writes nothing else; banned, it writes the best other token at each step
    rt.reset()
    assert list(rt.generate(NATURAL_LINE, 12, temperature=0, logit_bias={unk: 100})) == [unk] * 12
    rt.reset()
    banned = list(rt.generate(NATURAL_LINE, 12, temperature=0, logit_bias={unk: 100}, ban_unk=True))
    rt.reset()
    want, log_probs = [], rt.prefill(prompt_ids[None])[0]
    for _ in range(12):
        scores = np.array(log_probs, dtype=np.float64)
        scores[unk] = -np.inf
        want.append(int(np.argmax(scores)))
        log_probs = rt.prefill(np.array([[want[-1]]]))[0]
    rt.reset()
    assert banned == want and unk not in banned
    # sampled: with <unk> a little more likely it appears, banned it never does (and the text never shows it)
    free = [t for seed in SEEDS for t in _sample(rt, NATURAL_LINE, seed, logit_bias={unk: 2.0})]
    assert free.count(unk) >= 5
    for seed in SEEDS:
        ids = _sample(rt, NATURAL_LINE, seed, logit_bias={unk: 2.0}, ban_unk=True)
        assert unk not in ids and "<unk>" not in rt.decode(ids)
        text = "".join(rt.generate_text(NATURAL_LINE, N, temperature=1.5, seed=seed, ban_unk=True))
        rt.reset()
        assert "<unk>" not in text
    # the same through one SamplingParams
    rt.reset()
    assert list(rt.generate(NATURAL_LINE, params=SamplingParams(max_tokens=12, temperature=0, logit_bias={unk: 100},
                                                                ban_unk=True))) == want
    rt.reset()


def test_ban_unk_is_checked():
    with pytest.raises(InputError, match="ban_unk must be true or false"):
        SamplingParams(ban_unk="yes")
    with pytest.raises(InputError, match="ban_unk needs the model's vocabulary"):
        Sampler(SamplingParams(ban_unk=True), 60)
    # a vocabulary without <unk> never produces one: nothing to ban
    plain = Vocab(["a", "b", "c"])
    sampler = Sampler(SamplingParams(ban_unk=True, temperature=0), 3, vocab=plain)
    assert sampler.choose(np.log(np.array([0.2, 0.5, 0.3]))) == 1


# -- the command line ----------------------------------------------------------------------------------------------
def test_generate_prints_detokenized_text_and_no_unk_keeps_it_out(rt, wikitext):
    unk = rt.vocab.index["<unk>"]
    unbanned = []
    for seed in SEEDS[:3]:
        args = ["generate", wikitext[1], "--prompt", NATURAL_LINE, "--max-new-tokens", N, "--temperature", 1.5,
                "--seed", seed, "--logit-bias", f"{unk}=2", "--threads", 1]
        free = cli(*args)
        assert free.exit_code == 0, free.output
        want = "".join(rt.generate_text(NATURAL_LINE, N, temperature=1.5, seed=seed, logit_bias={unk: 2.0}))
        rt.reset()
        assert free.stdout == NATURAL_LINE + want + "\n"
        unbanned.append(free.stdout)
        banned = cli(*args, "--no-unk")
        assert banned.exit_code == 0, banned.output
        want = "".join(rt.generate_text(NATURAL_LINE, N, temperature=1.5, seed=seed, logit_bias={unk: 2.0},
                                        ban_unk=True))
        rt.reset()
        assert banned.stdout == NATURAL_LINE + want + "\n" and "<unk>" not in banned.stdout
    assert any("<unk>" in text for text in unbanned)  # the seeds tried do write <unk> when it is not banned
