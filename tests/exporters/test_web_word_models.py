"""The browser page and word models: a vocabulary read with the Moses tokenizer (WikiText-103's, One Billion
Word's) is refused by the page's txl.js with a one-line reason (the page has no Moses); a whitespace word model
runs, and its page keeps `<unk>` out of sampled text as the Python sampler does. A word model's adaptive softmax is
sampled by txl.js cluster by cluster, as the Python sampler samples it: the same tokens from the same seed and
log-probs (under Node.js, on recorded and synthetic rows, every control), and a seeded page generates
TxlRuntime.generate's tokens.

The page tests drive headless Chromium (tests/helpers/browser.py): they need chromium and the pinned onnxruntime-web,
and skip without them unless TXL_WEB_TESTS=required. The Node.js tests need `node` (the same rule)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import numpy as np
import pytest
from helpers.browser import Browser, SiteServer, chromium, need, ort_web
from helpers.page_modules import page_modules

from txl_deploy.contract.clusters import Clusters
from txl_deploy.exporters.web.site import write_site
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.sampling import Sampler, SamplingParams

pytest.importorskip("torch")

NODE = shutil.which("node") or shutil.which("nodejs")
TINY_CLUSTERS = Clusters(shortlist=10, bounds=((10, 30), (30, 60)))  # the tiny model's cutoffs [10, 30]


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
            sampler = Sampler(SamplingParams(**fields, ban_unk=ban, max_tokens=100), len(vocab), vocab=vocab,
                              clusters=TINY_CLUSTERS)
            assert tokens == [sampler.choose(np.asarray(r, dtype=np.float32)) for r in rows], (fields, ban)
        assert unk in on_page[False] and unk not in on_page[True]
    message = page.evaluate("""import('./txl.js').then((m) => {
        try { new m.Sampler(new m.SamplingParams({ banUnk: true }), 60); return null; } catch (e) { return e.message; }
    })""")
    assert "ban_unk needs the model's vocabulary" in message


def test_the_page_of_an_exported_wikitext_model_says_why_it_refuses_it(wikitext_onnx, tmp_path):
    """A real export: the tokenizer travels in the site's vocab.json, and the page says in its status line why it
    cannot run the model, instead of splitting text on whitespace into other words."""
    exe = chromium()
    site = write_site(wikitext_onnx, tmp_path / "site", ort_web=ort_web())
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


# -- the cluster-factored sampler of txl.js against runtimes/sampling.py ------------------------------------------
FACTORED_CASES = [
    dict(temperature=0),
    dict(temperature=0, repetition_penalty=1.6, no_repeat_ngram_size=2, logit_bias={"3": 2.5, "12": -100.0}),
    dict(temperature=1.0, seed=3),
    dict(temperature=0.7, top_k=5, seed=4),
    dict(temperature=1.4, top_p=0.8, seed=5),
    dict(temperature=0.8, min_p=0.1, seed=6),
    dict(temperature=1.2, top_k=30, top_p=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.5,
         frequency_penalty=0.4, no_repeat_ngram_size=3, logit_bias={"2": -100.0, "41": 3.0}, seed=7),
    dict(temperature=1.0, seed=2**53 - 1, min_tokens=40, stop_token_ids=[1, 45], presence_penalty=-1.0, max_tokens=60),
]

RUNNER = """
import { Clusters, Sampler, SamplingParams } from "./txl.js";
import { readFileSync } from "node:fs";
const { tables, cases } = JSON.parse(readFileSync(process.argv[2], "utf8"));
const rows = tables.map(({ rows }) => rows.map((r) => Float32Array.from(r)));
console.log(JSON.stringify(cases.map(({ table, fields, context }) => {
  const { clusters, nToken } = tables[table];
  const sampler = new Sampler(new SamplingParams(fields), nToken, context, null, null,
                              Clusters.of({ clusters, n_token: nToken }));
  return rows[table].map((row) => sampler.choose(row));
})));
"""


def _camel(fields: dict) -> dict:
    return {"".join(w.capitalize() if i else w for i, w in enumerate(k.split("_"))): v for k, v in fields.items()}


def _synthetic_rows(n_rows=300, cutoffs=(20, 60, 100), n_token=400, seed=0):
    """Log-probs [n_rows, n_token] whose clusters' head mass and peakedness vary row by row: some decisions are
    made on the head alone, others need one tail or several (the last cluster, 300 tokens, takes numpy's pairwise
    sum past one block of 128)."""
    rng = np.random.default_rng(seed)
    ends = [0, *cutoffs, n_token]
    logits = rng.normal(size=(n_rows, n_token)) * rng.uniform(0.5, 6.0, size=(n_rows, 1))
    for lo, hi in zip(ends[:-1], ends[1:]):
        logits[:, lo:hi] += rng.normal(0, 3, size=(n_rows, 1)) - np.log(hi - lo)
    return (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)


def test_txl_js_samples_an_adaptive_softmax_as_the_python_sampler_does(tiny_onnx, tmp_path):
    """Every control, greedy and seeded: the same tokens over 300 decisions on the tiny model's own log-probs and on
    synthetic rows with a 4-cluster layout. On the synthetic rows the seeded Python sampler skips tails in some
    decisions and needs them in others, and without top-k or top-p (which reveal every cluster they keep, so the
    draw is the token-by-token one) its tokens differ from its token-by-token ones: a page sampling token by token
    would fail here."""
    need(NODE is not None, "no Node.js (apt-get install nodejs)")
    with TxlRuntime.load(tiny_onnx) as rt:
        stream = np.random.default_rng(1).integers(0, 58, size=300)
        tiny_rows = np.concatenate([rt.step(stream[None, i:i + 16])[0] for i in range(0, 300, 16)])
    tables = [(tiny_rows, [10, 30]), (_synthetic_rows(), [20, 60, 100])]
    context = np.random.default_rng(2).integers(0, 60, size=12).tolist()
    cases = [dict(table=t, fields=_camel(f), context=context) for t in range(len(tables)) for f in FACTORED_CASES]
    page_modules(tmp_path)
    (tmp_path / "run.mjs").write_text(RUNNER)
    (tmp_path / "cases.json").write_text(json.dumps({
        "tables": [{"rows": rows.tolist(), "clusters": Clusters.from_cutoffs(cutoffs, rows.shape[1]).to_dict(),
                    "nToken": rows.shape[1]} for rows, cutoffs in tables],
        "cases": cases}))
    r = subprocess.run([NODE, "run.mjs", "cases.json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    on_js = json.loads(r.stdout)
    differ, tails = [], []
    for case, got in zip(cases, on_js):
        rows, cutoffs = tables[case["table"]]
        fields = _python_fields(case["fields"])
        clusters = Clusters.from_cutoffs(cutoffs, rows.shape[1])
        factored = Sampler(SamplingParams(**{"max_tokens": 60, **fields}), rows.shape[1], context, clusters=clusters)
        plain = Sampler(SamplingParams(**{"max_tokens": 60, **fields}), rows.shape[1], context)
        want = [factored.choose(row) for row in rows]
        assert got == want, (case["table"], fields, next(i for i, (a, b) in enumerate(zip(got, want)) if a != b))
        if case["table"] == 1 and fields["temperature"] > 0:
            tails.append(factored.tail_fractions())
            if "top_k" not in fields and "top_p" not in fields:  # (those reveal every cluster they keep)
                differ.append(want != [plain.choose(row) for row in rows])
    assert len(differ) == 3 and all(differ), differ  # a draw that hits a hidden cluster's block draws again
    assert all(0 < f.min() and f.max() < 1 for f in tails), tails  # some decisions need a tail, others none


def _python_fields(camel: dict) -> dict:
    return {"".join("_" + c.lower() if c.isupper() else c for c in k): v for k, v in camel.items()}


def test_a_seeded_page_generates_txlruntimes_tokens_on_an_adaptive_model(page, tiny_onnx):
    """End to end: the page (onnxruntime-web, its own log-probs) and TxlRuntime.generate on the full graph, the
    same prompt, seed and controls, give the same tokens: the page samples the tiny model's clusters as Python."""
    listed = page.evaluate("fetch('model.json').then((r) => r.json()).then((s) => s.clusters)")
    assert listed == TINY_CLUSTERS.to_dict() == {"shortlist": 10, "bounds": [[10, 30], [30, 60]],
                                                 "head_columns": [11, 10]}
    # the page reads the layout the exporter wrote, head columns included, and refuses one that is not a layout
    bad = [dict(listed, bounds=[[10, 30], [31, 60]]), dict(listed, bounds=[[10, 60], [60, 60]]),
           dict(listed, head_columns=[11, 11]), dict(listed, head_columns=[11, 12]), dict(listed, shortlist=1.5),
           dict(listed, bounds=[[10, 30], [30, 59]]), "x"]
    read = page.evaluate(f"""import('./txl.js').then((m) => [{json.dumps(dict(listed, head_columns=[10, 11]))},
        ...{json.dumps(bad)}].map((clusters) => {{
            try {{ const c = m.Clusters.of({{ clusters, n_token: 60 }}); return [c.bounds, c.headColumn(1)]; }}
            catch (e) {{ return e.message; }}
        }}))""")
    assert read[0] == [[[10, 30], [30, 60]], 10]  # a head column is the metadata's, not recomputed on the page
    for layout, message in zip(bad, read[1:]):
        assert message.startswith("model.json's clusters are not an adaptive softmax's layout of 60 tokens: "), layout
    fields = dict(temperature=0.9, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3, seed=11, max_tokens=80)
    ids, _ = page.evaluate(f"txlDemo.generate('w1 w2', {json.dumps(_camel(fields))})")
    with TxlRuntime.load(tiny_onnx, lazy=False) as rt:
        want = list(rt.generate("w1 w2", max_new_tokens=80, temperature=0.9, min_p=0.05, seed=11,
                                repetition_penalty=1.2, frequency_penalty=0.3))
        assert ids == want
        rt.reset()  # and the token-by-token draws would have been others
        plain = Sampler(SamplingParams(**fields), 60, context=rt.encode("w1 w2"))
        lp = rt.prefill(rt.encode("w1 w2")[None])[0]
        other = []
        for tok in want:
            other.append(plain.choose(lp))
            lp = rt.prefill(np.array([[tok]]))[0]
        assert other != want
