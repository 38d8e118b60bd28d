"""A WikiText-103-style word model's text: natural text in (Moses-tokenized as WikiText-103 was), natural text out
(detokenized: numbers and dashes joined again, punctuation against its word), streamed pieces that join to exactly
the whole decode, a continuation that joins its prompt with the right spaces, and `<unk>` kept out of sampled text
where the model would write it (`ban_unk` in the API, `--no-unk` on `txl-deploy generate`).

The model is `helpers.word_models`: the tiny random model over WikiText-103's kind of symbols; seeded sampling at a
high temperature writes every kind of symbol."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.cli import cli
from helpers.word_models import NATURAL_LINE, TOKENIZED_LINE

from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.sampling import Sampler, SamplingParams
from txl_deploy.vocab import Vocab

pytest.importorskip("torch")

SEEDS = range(8)
N = 40


@pytest.fixture(scope="module")
def wikitext(wikitext_onnx):
    """(checkpoint folder, its ONNX export) of the tiny WikiText-103-style model."""
    return wikitext_onnx.parent / "wt", wikitext_onnx


@pytest.fixture(scope="module")
def rt(wikitext):
    with TxlRuntime.load(wikitext[1], threads=1) as runtime:
        yield runtime


def _sample(rt, prompt, seed, **controls):
    rt.reset()
    ids = list(rt.generate(prompt, N, temperature=1.5, seed=seed, **controls))
    rt.reset()
    return ids


def test_natural_text_in_and_out(rt):
    vocab = rt.vocab
    assert vocab.tokenizer == "wikitext"  # detected from the symbols (@-@, @,@), carried by the ONNX metadata
    assert [vocab.symbols[i] for i in rt.encode(NATURAL_LINE)] == TOKENIZED_LINE.split()
    assert rt.decode(rt.encode(NATURAL_LINE)) == NATURAL_LINE
    hyphen = "the well-known film sold 1,000 copies ( in 2004 )."
    assert "@" not in rt.decode(rt.encode(hyphen))


def test_generated_text_is_the_detokenized_tokens_and_continues_the_prompt(rt):
    vocab, prompt_ids = rt.vocab, [int(i) for i in rt.encode(NATURAL_LINE)]
    symbols, exact = set(), 0
    for seed in SEEDS:
        ids = _sample(rt, NATURAL_LINE, seed)
        symbols.update(vocab.symbols[i] for i in ids)
        pieces = list(rt.generate_text(NATURAL_LINE, N, temperature=1.5, seed=seed))
        rt.reset()
        # the pieces continue the prompt: joined to it, they are the whole decode, with the right spaces between
        whole = rt.decode(prompt_ids + ids)
        assert "".join(pieces) == continuation(NATURAL_LINE, whole)
        exact += whole.startswith(NATURAL_LINE)  # the prompt's text is the start of the whole
        assert all(pieces)
        # a stream started empty joins to exactly decode; the same ids as a prompt of ids continue it alike
        assert "".join(rt.stream_decoder().pieces(ids)) == rt.decode(ids)
        by_ids = "".join(rt.generate_text(prompt_ids, N, temperature=1.5, seed=seed))
        rt.reset()
        assert by_ids == "".join(pieces)
    assert exact >= len(SEEDS) // 2
    assert {"@-@", "@,@", "@.@", ",", ".", "(", ")", "\""} <= symbols  # what the detokenizer has to join was written


def continuation(prompt: str, whole: str) -> str:
    """What a stream continuing `prompt` prints, given the whole text's decode: the rest of it. Where the stream
    changes the prompt's own last word (a "@-@" right after "year." makes Moses read ".-@,@" as one word), what the
    prompt printed stays: the rest after the text they share."""
    shared = 0
    while shared < min(len(prompt), len(whole)) and prompt[shared] == whole[shared]:
        shared += 1
    return whole[shared:]


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
