"""The browser page and word models: a vocabulary read with the Moses tokenizer (WikiText-103's, One Billion
Word's) is refused by the page's txl.js with a one-line reason (the page has no Moses); a whitespace word model
runs, and its page keeps `<unk>` out of sampled text as the Python sampler does.

The page tests drive headless Chromium (tests/helpers/browser.py): they need chromium and the pinned onnxruntime-web,
and skip without them unless TXL_WEB_TESTS=required."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers.browser import Browser, SiteServer, chromium, ort_web
from helpers.word_models import export_wikitext_onnx

from txl_deploy.exporters.web.site import write_site
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.sampling import Sampler, SamplingParams

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def page(tiny_onnx, tmp_path_factory):
    """The page of the tiny whitespace word model (its vocabulary has <unk>)."""
    exe = chromium()
    site = write_site(tiny_onnx, tmp_path_factory.mktemp("site") / "tiny", ort_web=ort_web(), prompt="w1 w2")
    server = SiteServer(site)
    try:
        browser = Browser(exe)
        try:
            browser.open(server.url + "index.html?ep=wasm")
            browser.evaluate("txlDemo.ready")
            yield browser
        finally:
            browser.close()
    finally:
        server.stop()


def test_the_page_refuses_a_vocabulary_read_with_moses(page):
    refusal = page.evaluate("""import('./txl.js').then((m) => {
        const symbols = ['<eos>', '<unk>', 'the', '@-@'];
        const made = (tokenizer) => {
            try { new m.Vocab({ kind: 'word', symbols, tokenizer }); return null; } catch (e) { return e.message; }
        };
        return [made('wikitext'), made('lm1b'), made('whitespace'), made(undefined)]; })""")
    assert refusal[2:] == [None, None]
    for name, message in zip(("wikitext", "lm1b"), refusal[:2]):
        assert message is not None and f"the {name} tokenizer (Moses)" in message and "\n" not in message


def test_the_page_bans_unk_as_the_python_sampler_does(page, tiny_onnx):
    with TxlRuntime.load(tiny_onnx) as rt:
        vocab = rt.vocab
        rows = rt.step(rt.encode("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16")[None])[0]
    unk = vocab.index["<unk>"]
    for fields in (dict(temperature=0, logit_bias={str(unk): 100.0}), dict(temperature=1.3, seed=4,
                                                                           logit_bias={str(unk): 6.0})):
        camel = {"logitBias" if k == "logit_bias" else k: v for k, v in fields.items()}
        on_page = {ban: page.evaluate(f"txlDemo.sampleRows({json.dumps(rows.tolist())}, "
                                      f"{json.dumps({**camel, 'banUnk': ban, 'maxTokens': 100})})")
                   for ban in (False, True)}
        for ban, tokens in on_page.items():
            sampler = Sampler(SamplingParams(**fields, ban_unk=ban, max_tokens=100), len(vocab), vocab=vocab)
            assert tokens == [sampler.choose(np.asarray(r, dtype=np.float32)) for r in rows], (fields, ban)
        assert unk in on_page[False] and unk not in on_page[True]
    message = page.evaluate("""import('./txl.js').then((m) => {
        try { new m.Sampler(new m.SamplingParams({ banUnk: true }), 60); return null; } catch (e) { return e.message; }
    })""")
    assert "ban_unk needs the model's vocabulary" in message


def test_the_page_of_an_exported_wikitext_model_says_why_it_refuses_it(tmp_path):
    """A real export: the tokenizer travels in the site's vocab.json, and the page says in its status line why it
    cannot run the model, instead of splitting text on whitespace into other words."""
    exe = chromium()
    site = write_site(export_wikitext_onnx(tmp_path), tmp_path / "site", ort_web=ort_web())
    assert json.loads((site / "vocab.json").read_text(encoding="utf-8"))["tokenizer"] == "wikitext"
    server = SiteServer(site)
    try:
        browser = Browser(exe)
        try:
            # not Browser.open: it waits for txlDemo.ready, which this page rejects
            browser.send("Page.navigate", url=server.url + "index.html?ep=wasm")
            end = time.monotonic() + 120
            while not _evaluated(browser, "document.body.dataset.state === 'error'"):
                assert time.monotonic() < end, "the page did not refuse the model"
                time.sleep(0.2)
            status = browser.evaluate("document.getElementById('status').textContent")
            assert status.startswith("error: ") and "the wikitext tokenizer (Moses)" in status
            assert browser.evaluate("document.getElementById('generate').disabled") is True
        finally:
            browser.close()
    finally:
        server.stop()


def _evaluated(browser, expression):
    """The expression's value, or None while the navigation replaces the document ("context destroyed")."""
    try:
        return browser.evaluate(expression)
    except RuntimeError:
        return None
