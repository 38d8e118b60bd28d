"""The browser page's valid music by construction (exporters/web/static/txl.js `Grammar`, `Sampler(...,
constraint)`), run in Node.js as the other txl.js sampler tests are: from the grammar `model.json` carries
(`CompiledGrammar.to_dict`, what the exporter writes for a music vocabulary) it compiles Python's masks, and a
seeded page sampler under it chooses the tokens the Python sampler chooses, on the full row and cluster-factored."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from helpers.browser import need
from helpers.event_models import SYMBOLS
from helpers.page_modules import page_modules

from txl_deploy.contract.clusters import Clusters
from txl_deploy.music.events_to_midi import events_to_score
from txl_deploy.music.grammar import compiled, detected
from txl_deploy.runtimes.sampling import Sampler, SamplingParams
from txl_deploy.vocab import Vocab

NODE = shutil.which("node") or shutil.which("nodejs")
# pixels of the page's piano roll: note boxes (blue) and bar lines (grey)
ROLL_INK = """(() => {
  const c = document.getElementById('piano-roll');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let notes = 0, bars = 0;
  for (let i = 0; i < d.length; i += 4) {
    if (d[i + 2] > d[i] + 40) notes += 1;
    else if (d[i] === d[i + 1] && d[i] < 200) bars += 1;
  }
  return { notes, bars };
})()"""
CASES = [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_k=6, seed=4),
         dict(temperature=1.3, top_p=0.85, seed=5), dict(temperature=1.0, min_p=0.05, repetition_penalty=1.3, seed=6)]

RUNNER = """
import { Clusters, Grammar, Sampler, SamplingParams } from "./txl.js";
import { readFileSync } from "node:fs";
const { grammars, rows, cases } = JSON.parse(readFileSync(process.argv[2], "utf8"));
const masks = grammars.map((g) => new Grammar(g).masks.map((m) => Array.from(m)));
const tokens = cases.map(({ which, fields, context, clusters }) => {
  const g = new Grammar(grammars[which]);
  const r = rows[which].map((row) => Float32Array.from(row));
  const n = r[0].length;
  const sampler = new Sampler(new SamplingParams(fields), n, context, null, null,
                              clusters ? Clusters.of({ clusters, n_token: n }) : null, g.start(context));
  return r.map((row) => sampler.choose(row));
});
let refused;
try {
  new Sampler(new SamplingParams({}), 4, [], null, null, null, { allowed: () => new Uint8Array(4), advance() {} })
    .choose(Float32Array.of(-1, -2, -3, -4));
} catch (e) { refused = e.message; }
console.log(JSON.stringify({ masks, tokens, refused }));
"""


def _camel(fields: dict) -> dict:
    return {"".join(w.capitalize() if i else w for i, w in enumerate(k.split("_"))): v for k, v in fields.items()}


def _rows(n_rows, n_token, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n_rows, n_token)) * rng.uniform(0.5, 4.0, size=(n_rows, 1))
    return (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)


def test_the_exporter_writes_the_detected_grammar():
    assert detected(Vocab(SYMBOLS["remi"])).to_dict()["name"] == "remi"
    assert detected(SYMBOLS["remi-xl"]).to_dict()["name"] == "remi-xl"
    assert detected(Vocab([f"w{i}" for i in range(9)])) is None


def test_txl_js_compiles_the_masks_and_samples_as_python_does(tmp_path):
    need(NODE is not None, "no Node.js (apt-get install nodejs)")
    names = ["remi", "remi-xl"]
    grammars = [compiled(name, SYMBOLS[name]) for name in names]
    rows = [_rows(150, len(SYMBOLS[name]), seed) for seed, name in enumerate(names)]
    layouts = [Clusters.from_cutoffs([12, 40], len(SYMBOLS[name])) for name in names]
    context = [0]  # Bar_None
    cases = [dict(which=w, fields=_camel(f), context=context, clusters=c.to_dict() if c else None, python=f)
             for w in range(2) for f in CASES for c in (None, layouts[w])]
    page_modules(tmp_path)
    (tmp_path / "run.mjs").write_text(RUNNER)
    (tmp_path / "cases.json").write_text(json.dumps({"grammars": [g.to_dict() for g in grammars],
                                                     "rows": [r.tolist() for r in rows], "cases": cases}))
    r = subprocess.run([NODE, "run.mjs", "cases.json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for g, masks in zip(grammars, out["masks"]):
        assert np.array_equal(np.array(masks, dtype=bool), g.masks.reshape(-1, g.masks.shape[-1]))
    for case, got in zip(cases, out["tokens"]):
        w, fields = case["which"], case["python"]
        clusters = layouts[w] if case["clusters"] else None
        sampler = Sampler(SamplingParams(max_tokens=200, **fields), rows[w].shape[1], context, clusters=clusters,
                          constraint=grammars[w].start(context))
        want = [sampler.choose(row) for row in rows[w]]
        assert got == want, (names[w], fields, clusters is not None)
        assert grammars[w].first_error(context + got) is None
    assert out["refused"].endswith("(the constraint allows none)")


@pytest.mark.parametrize("name", ["remi", "remi-xl"])
def test_the_grammar_dict_is_plain_json(name):
    d = compiled(name, SYMBOLS[name]).to_dict()
    assert json.loads(json.dumps(d)) == d


@pytest.fixture(scope="module")
def xl_onnx(tmp_path_factory):
    """A tiny remi-xl model's ONNX export (events vocabulary, adaptive softmax)."""
    from helpers.event_models import save_event_model

    from txl_deploy.exporters.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("xl")
    onnx_path = root / "xl.onnx"
    export_onnx(save_event_model(root / "xl", "remi-xl"), onnx_path, state="full", max_segment=16, verify=False)
    return onnx_path


def test_a_music_page_starts_from_a_bar(xl_onnx, tmp_path):
    """Written without --prompt, a music model's page opens with the prompt a piece starts with (a text model's
    default words are not events, so its prompt box would be empty and Generate refused)."""
    from txl_deploy.exporters.web.site import write_site

    page = (write_site(xl_onnx, tmp_path / "site") / "index.html").read_text()
    assert '<textarea id="prompt" rows="2">Bar_None</textarea>' in page


def test_a_music_page_generates_what_txlruntime_generates_under_the_grammar(xl_onnx, tmp_path):
    """End to end in the browser: a tiny remi-xl model's page samples under the grammar its model.json carries,
    and chooses the tokens TxlRuntime.generate(grammar="remi-xl") chooses on the same graph with the same seed;
    it places the events as the notes events_to_midi places, draws them on its piano roll, and Play schedules
    every one of them on a WebAudio context."""
    from helpers.browser import Browser, SiteServer, chromium, ort_web

    from txl_deploy.exporters.web.site import write_site
    from txl_deploy.runtimes import TxlRuntime

    exe = chromium()
    onnx_path = xl_onnx
    site = write_site(onnx_path, tmp_path / "site", ort_web=ort_web())  # its default prompt, as a user gets it
    assert json.loads((site / "model.json").read_text())["grammar"]["name"] == "remi-xl"
    fields = dict(temperature=1.1, top_k=12, seed=8, max_tokens=60)
    server = SiteServer(site)
    try:
        browser = Browser(exe)
        try:
            browser.open(server.url + "index.html?ep=wasm")
            prompt = browser.evaluate("document.getElementById('prompt').value")
            ids, _ = browser.evaluate(f"txlDemo.ready.then(() => txlDemo.generate({json.dumps(prompt)}, "
                                      f"{json.dumps(_camel(fields))}))")
            notes = browser.evaluate("txlNotes.map((n) => [n.start, n.end, n.pitch, n.velocity])")
            shown = browser.evaluate("!document.getElementById('music').hidden")
            status = browser.evaluate("document.getElementById('music-status').textContent")
            ink = browser.evaluate(ROLL_INK)
            played = browser.evaluate("txlDemo.play()")
            scheduled = browser.evaluate("txlAudio.scheduled")
        finally:
            browser.close()
    finally:
        server.stop()
    assert prompt == "Bar_None"
    placed = events_to_score([SYMBOLS["remi-xl"][i] for i in [0, *ids]], "remi-xl").notes
    assert len(placed) > 0
    assert notes == [[n.start, n.end, n.pitch, n.velocity] for n in placed]
    assert shown and status.startswith(f"{len(placed)} notes, ")
    assert ink["notes"] >= 12 and ink["bars"] > 0  # note boxes (one at least 3 x 4 pixels) and bar lines drawn
    assert played["scheduled"] == scheduled == len(placed)
    assert played["state"] in ("running", "suspended")
    with TxlRuntime.load(onnx_path, lazy=False) as rt:
        want = list(rt.generate("Bar_None", max_new_tokens=60, temperature=1.1, top_k=12, seed=8, grammar="remi-xl"))
    assert ids == want
    assert compiled("remi-xl", SYMBOLS["remi-xl"]).first_error([0] + ids) is None
