"""`txl-deploy web-demo`: the site it writes, and the page in a real browser (headless Chromium, onnxruntime-web).

The browser tests serve the site on 127.0.0.1 (a random port) and drive Debian's `chromium` over the Chrome
DevTools protocol (tests/helpers/browser.py); the page uses a local npm install of onnxruntime-web (`--ort-web`),
and the browser resolves no host but 127.0.0.1, so nothing comes from a CDN. They need `chromium` and an npm
install of the pinned onnxruntime-web (scripts/test.sh installs both where it can) and skip without them, unless
TXL_WEB_TESTS=required (as in CI), where a missing browser or a missing or other-version onnxruntime-web fails.

Tolerances, page (onnxruntime-web, wasm) against TxlRuntime (ONNX Runtime CPU) on the same file, on a stream
that wraps the memory ring: fp32 1e-4 absolute on every log-prob (observed 1.2e-5, both state layouts), greedy
tokens identical;
fp16 1e-2 (observed 1.6e-3) and int4 0.25 (observed 0.19) absolute, with top-1 agreement >= 0.97, and every
greedy token of the page TxlRuntime's most likely one up to that tolerance (the wasm build runs other kernels
than native x86 ONNX Runtime: sums in another order in fp16, another MatMulNBits implementation in int4).
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from helpers.browser import NPM_DIR, Browser, SiteServer, chromium, ort_web

from txl_deploy.errors import InputError, OutputExistsError
from txl_deploy.exporters.web.site import (
    ORT_MODULE,
    ORT_WASM,
    ORT_WEB_INTEGRITY,
    ORT_WEB_VERSION,
    PAGE_FILES,
    sri,
    write_site,
)
from txl_deploy.runtimes import TxlRuntime

PROMPT = "And God said"
DEMO_TITLE = "kjv-char: a character-level Transformer-XL, 4 layers, 1.94M parameters, fp32"
TOL = {"fp32": 1e-4, "fp16": 1e-2, "int4": 0.25}


# -- the site ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_exports(tmp_path_factory):
    """The demo model in fp32, fp16 and int4 (segments up to 64, so a 128-slot ring wraps inside a short stream)."""
    from txl_deploy.assets import DEMO_DIR
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.exporters.precision.convert import reduce_onnx

    root = tmp_path_factory.mktemp("web-models")
    out = {"fp32": root / "kjv.onnx"}
    export_onnx(DEMO_DIR / "kjv-char", out["fp32"], max_segment=64)
    for precision in ("fp16", "int4"):
        out[precision] = root / f"kjv-{precision}.onnx"
        reduce_onnx(out["fp32"], out[precision], precision=precision)
    out["fp32-full"] = root / "kjv-full.onnx"  # the other state layout: the driver swaps in the whole next state
    export_onnx(DEMO_DIR / "kjv-char", out["fp32-full"], max_segment=64, state="full")
    return out


def test_site_files_and_cdn_integrity(demo_exports, tmp_path):
    site = write_site(demo_exports["fp32"], tmp_path / "site")
    names = sorted(p.name for p in site.iterdir())
    assert names == sorted(PAGE_FILES + ("index.html", "model.json", "model.onnx", "vocab.json"))
    # every module a page file imports (txl.js re-exports its modules) is in the site, offline
    imported = {m for f in site.glob("*.js") for m in re.findall(r'from "\./([\w.]+)"', f.read_text())}
    assert "sampling.js" in imported and imported <= set(names)
    assert (site / "model.onnx").read_bytes() == demo_exports["fp32"].read_bytes()
    spec = json.loads((site / "model.json").read_text())
    assert spec == {"name": "kjv", "n_layer": 4, "n_head": 4, "d_head": 48, "mem_len": 128, "n_token": 73,
                    "state": "incremental", "max_segment": 64, "precision": "fp32", "float_dtype": "float32",
                    "initial_mem_count": 0, "fresh_prefill": True, "clusters": None, "grammar": None}
    vocab = json.loads((site / "vocab.json").read_text())
    assert vocab["kind"] == "char" and len(vocab["symbols"]) == 73
    page = (site / "index.html").read_text()
    cdn = f"https://cdn.jsdelivr.net/npm/onnxruntime-web@{ORT_WEB_VERSION}/dist/"
    config = json.loads(page.split('id="site-config">')[1].split("</script>")[0])["ort"]
    assert config["module"] == cdn + ORT_MODULE and config["wasm"] == cdn + ORT_WASM
    importmap = json.loads(page.split('<script type="importmap">')[1].split("</script>")[0])
    assert importmap["imports"]["onnxruntime-web"] == cdn + ORT_MODULE
    assert importmap["integrity"][cdn + ORT_MODULE] == ORT_WEB_INTEGRITY[ORT_MODULE] == config["module_integrity"]
    assert config["wasm_integrity"] == ORT_WEB_INTEGRITY[ORT_WASM]
    assert 'value="0.8"' in page and "top-k" in page and PROMPT in page and "@@" not in page
    # titled by what the model is, not by its file's name
    assert f"<title>{DEMO_TITLE}</title>" in page and f"<h1>{DEMO_TITLE}</h1>" in page


def test_pinned_hashes_are_those_of_the_npm_release():
    """The SRI hashes in the page are the sha384 of the pinned release's files (from its npm package)."""
    dist = ort_web() / "dist"
    for name in (ORT_MODULE, ORT_WASM):
        assert sri((dist / name).read_bytes()) == ORT_WEB_INTEGRITY[name]


def test_site_with_local_runtime_and_refusals(demo_exports, tmp_path):
    ort_web()
    site = write_site(demo_exports["int4"], tmp_path / "site", ort_web=NPM_DIR)  # the npm prefix is enough
    assert sorted(p.name for p in (site / "ort").iterdir()) == sorted([ORT_MODULE, ORT_WASM])
    page = (site / "index.html").read_text()
    assert "cdn.jsdelivr" not in page and f"./ort/{ORT_MODULE}" in page
    assert sri((site / "ort" / ORT_WASM).read_bytes()) in page
    assert json.loads((site / "model.json").read_text())["precision"] == "int4"
    # no overwrite without --force; nothing half-written on a refusal
    with pytest.raises(OutputExistsError):
        write_site(demo_exports["fp32"], site)
    assert json.loads((site / "model.json").read_text())["precision"] == "int4"
    write_site(demo_exports["fp32"], site, force=True)
    assert json.loads((site / "model.json").read_text())["precision"] == "fp32" and not (site / "ort").exists()
    with pytest.raises(InputError, match="no onnxruntime-web here"):
        write_site(demo_exports["fp32"], tmp_path / "other", ort_web=tmp_path)
    assert not (tmp_path / "other").exists()


def test_cli(demo_exports, tiny_onnx, tmp_path):
    from txl_deploy.cli import main

    r = CliRunner().invoke(main, ["web-demo", str(demo_exports["fp32"]), "-o", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    assert "integrity-checked" in r.output and (tmp_path / "s" / "index.html").is_file()
    assert "for a device without, write the site with a local copy: --ort-web DIR" in r.output  # where it comes from
    r = CliRunner().invoke(main, ["web-demo", str(demo_exports["fp32"]), "-o", str(tmp_path / "s")])
    assert r.exit_code == 2 and "already exists" in r.output
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    r = CliRunner().invoke(main, ["web-demo", str(bad), "-o", str(tmp_path / "t")])
    assert r.exit_code == 2 and "not a readable ONNX model" in r.output and not (tmp_path / "t").exists()


# -- the page in headless Chromium -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    exe = chromium()
    ort_web()
    b = Browser(exe)
    yield b
    b.close()
    assert b.proc.poll() is not None  # the browser this test started is gone


@pytest.fixture(scope="module")
def served(browser, demo_exports, tmp_path_factory):
    """Each precision's site (local onnxruntime-web) behind one server on 127.0.0.1."""
    root = tmp_path_factory.mktemp("sites")
    for precision, path in demo_exports.items():
        write_site(path, root / precision, ort_web=ort_web())
    server = SiteServer(root)
    yield server.url
    server.stop()
    with pytest.raises(OSError):  # the server this test started no longer answers
        urllib.request.urlopen(server.url + "fp32/index.html", timeout=5)


def test_page_without_the_cdn_says_what_failed_and_what_to_do(browser, demo_exports, tmp_path):
    """The default site loads onnxruntime-web from the CDN; where that cannot be reached (this browser resolves no
    host but 127.0.0.1, and the CDN is blocked outright too), the page says so within seconds, and how to make a
    site with its own copy, instead of loading for ever."""
    write_site(demo_exports["fp32"], tmp_path / "cdn")
    server = SiteServer(tmp_path)
    browser.send("Network.enable")
    browser.send("Network.setBlockedURLs", urls=["*cdn.jsdelivr.net*"])
    try:
        try:
            browser.evaluate("window.__txlLeft = true")
        except RuntimeError:
            pass  # nothing loaded yet
        browser.send("Page.navigate", url=server.url + "cdn/index.html")
        start, state = time.monotonic(), None
        while time.monotonic() - start < 30 and state != "error":
            time.sleep(0.2)
            try:
                state = browser.evaluate("window.__txlLeft ? null : document.body.dataset.state")
            except RuntimeError:  # the navigation replaced the document meanwhile
                pass
        waited = time.monotonic() - start
        status = browser.evaluate("document.getElementById('status').textContent")
        assert state == "error", status
        assert waited < 10, f"the page took {waited:.1f} s to say it"
        assert status.startswith("error: onnxruntime-web could not be loaded from https://cdn.jsdelivr.net/"), status
        assert "--ort-web node_modules/onnxruntime-web" in status and f"onnxruntime-web@{ORT_WEB_VERSION}" in status
        assert browser.evaluate("document.getElementById('generate').disabled")
        assert browser.evaluate("document.title") == DEMO_TITLE
    finally:
        browser.send("Network.setBlockedURLs", urls=[])
        server.stop()


def _wrap_segments(mem_len=128, seed=0, n_token=73):
    """A fixed stream that fills the memory and wraps the ring: prefill, decode, long segments, decode."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_token, size=q).tolist() for q in (3, 1, 1, 5, 64, 64, 9, 1, 2, 1)]  # 151 > 128


@pytest.mark.parametrize("variant", ["fp32", "fp32-full", "fp16", "int4"])
def test_page_log_probs_match_txlruntime_across_the_ring_wrap(served, browser, demo_exports, variant):
    precision = variant.split("-")[0]
    ready = browser.open(served + f"{variant}/index.html?ep=wasm")
    assert ready == {"precision": precision, "provider": "wasm"}
    segments = _wrap_segments()
    assert sum(map(len, segments)) > 128
    got = [np.array(a, dtype=np.float32).reshape(len(s), -1)
           for a, s in zip(browser.evaluate(f"txlDemo.logProbs({json.dumps(segments)})"), segments)]
    with TxlRuntime.load(demo_exports[variant], providers=["cpu"]) as rt:
        want = [rt.step(np.array([s]))[0] for s in segments]
    got, want = np.concatenate(got), np.concatenate(want)
    assert got.shape == want.shape == (151, 73)
    print(f"{variant}: page vs TxlRuntime max abs log-prob difference {np.abs(got - want).max():.3g}, top-1 "
          f"agreement {(got.argmax(-1) == want.argmax(-1)).mean():.4f}")
    assert np.abs(got - want).max() <= TOL[precision], np.abs(got - want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= (1.0 if precision == "fp32" else 0.97)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int4"])
def test_page_greedy_generation_equals_txlruntime(served, browser, demo_exports, precision):
    browser.open(served + f"{precision}/index.html?ep=wasm")
    n = 150  # prompt + 150 tokens: the memory of 128 wraps
    got = browser.evaluate(f"txlDemo.greedy({json.dumps(PROMPT)}, {n})")
    with TxlRuntime.load(demo_exports[precision], providers=["cpu"]) as rt:
        want = list(rt.generate(PROMPT, max_new_tokens=n, temperature=0))
    if precision == "fp32":
        assert got == want
        return
    # Reduced precision: once two tokens are nearly tied, a rounding difference picks the other one and the two
    # continuations part. So the page's tokens are checked step by step against TxlRuntime fed the page's own
    # choices: each must be TxlRuntime's most likely token up to the log-prob tolerance.
    agree = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), n)
    print(f"{precision}: page and TxlRuntime greedy tokens agree for the first {agree} of {n}")
    with TxlRuntime.load(demo_exports[precision], providers=["cpu"]) as rt:
        lp = rt.prefill(rt.encode(PROMPT)[None])[0]
        for tok in got:
            assert lp[tok] >= lp.max() - TOL[precision]
            lp = rt.prefill(np.array([[tok]]))[0]
    assert len(got) == n


def test_page_streams_text_and_screenshot_shows_it(served, browser, demo_exports, tmp_path):
    browser.open(served + "fp32/index.html?ep=wasm")
    blank = browser.screenshot()
    browser.evaluate("""(() => {
        document.getElementById('prompt').value = %s;
        document.getElementById('temperature').value = '0';
        document.getElementById('max-new').value = '60';
        document.getElementById('generate').click();
        return true; })()""" % json.dumps(PROMPT))
    browser.wait_for("document.body.dataset.state === 'done'", 120, "generation did not finish")
    with TxlRuntime.load(demo_exports["fp32"], providers=["cpu"]) as rt:
        text = rt.decode(list(rt.generate(PROMPT, max_new_tokens=60, temperature=0)))
    assert browser.evaluate("document.getElementById('prompt-echo').textContent") == PROMPT
    assert browser.evaluate("document.getElementById('generated').textContent") == text
    latency = browser.evaluate("document.getElementById('latency').textContent")
    assert latency.startswith("token 60: ") and "ms" in latency and "tokens/s" in latency
    # a text model's page has no piano roll or player
    assert browser.evaluate("document.getElementById('music').hidden && window.txlNotes === undefined")
    shot = browser.screenshot()
    (tmp_path / "page.png").write_bytes(shot)
    if os.environ.get("TXL_WEB_SCREENSHOT"):  # where to keep a copy (the README's picture)
        Path(os.environ["TXL_WEB_SCREENSHOT"]).write_bytes(shot)
    # The text is on the screenshot: count dark pixels inside the output box, before and after generating.
    ink = """(async (png) => {
        const img = new Image(); img.src = 'data:image/png;base64,' + png; await img.decode();
        const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
        const g = c.getContext('2d'); g.drawImage(img, 0, 0);
        const r = document.getElementById('output').getBoundingClientRect();
        const d = g.getImageData(r.left + 3, r.top + 3, r.width - 6, r.height - 6).data;
        let dark = 0; for (let i = 0; i < d.length; i += 4) if (d[i] + d[i + 1] + d[i + 2] < 300) dark++;
        return dark; })(%s)"""
    before = browser.evaluate(ink % json.dumps(base64.b64encode(blank).decode()))
    after = browser.evaluate(ink % json.dumps(base64.b64encode(shot).decode()))
    assert before == 0 and after > 500, (before, after)


# -- the page's sampler: the Python sampler's twin ------------------------------------------------------------------
SAMPLING_CASES = [
    dict(temperature=1.0, seed=3),
    dict(temperature=0.7, top_k=10, seed=4),
    dict(temperature=1.1, top_p=0.8, seed=5),
    dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
         frequency_penalty=0.4, no_repeat_ngram_size=2, logit_bias={"3": -100.0, "5": 4.5}, seed=6),
    dict(temperature=0, repetition_penalty=1.5, no_repeat_ngram_size=3),
    dict(temperature=1.0, seed=2**53 - 1, min_tokens=5, stop_token_ids=[1, 2], max_tokens=60),
]


def _camel(fields: dict) -> dict:
    return {"".join(w.capitalize() if i else w for i, w in enumerate(k.split("_"))): v for k, v in fields.items()}


def _python_tokens(rows, fields, context):
    from txl_deploy.runtimes.sampling import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(**{"max_tokens": 100, **fields}), len(rows[0]), context)
    return [sampler.choose(np.asarray(r, dtype=np.float32)) for r in rows]


def test_page_sampler_draws_numpys_uniforms_and_chooses_pythons_tokens(served, browser, demo_exports):
    """Equality by construction: the page's Pcg64 is numpy's default_rng (SeedSequence + PCG64), every step is the
    Python sampler's in the same order and float64, so the same log-probs give the same tokens."""
    browser.open(served + "fp32/index.html?ep=wasm")
    for seed in (0, 42, 2**40 + 3, 2**53 - 1):
        got = browser.evaluate(f"txlDemo.uniforms({seed}, 8)")
        assert got == np.random.default_rng(seed).random(8).tolist(), seed
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(40, 73))
    random_rows = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    with TxlRuntime.load(demo_exports["fp32"], providers=["cpu"]) as rt:
        text = "And God said unto Moses, I AM THAT I AM: and he said, Thus shalt thou say unto the children"
        real_rows = rt.step(rt.encode(text)[None])[0][:40]
    for rows in (random_rows, real_rows):
        for fields in SAMPLING_CASES:
            context = rng.integers(0, 73, size=10).tolist()
            page = browser.evaluate(f"txlDemo.sampleRows({json.dumps(rows.tolist())}, "
                                    f"{json.dumps(_camel(fields))}, {json.dumps(context)})")
            assert page == _python_tokens(rows, fields, context), fields


def test_page_controls_sample_what_the_server_samples(served, browser, demo_exports):
    """The page's controls drive the shared sampler: its text equals the HTTP server's (the same Completion: the
    sampler and the stop string) on the page's own log-probs, and a value out of range is an error on the page."""
    from txl_deploy.runtimes.sampling import SamplingParams
    from txl_deploy.serving.http.completion import Completion

    browser.open(served + "fp32/index.html?ep=wasm")
    fields = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3,
                  frequency_penalty=0.2, no_repeat_ngram_size=3, seed=7, max_tokens=80)
    stop = "LORD"
    set_controls = """(() => {
        const set = (id, v) => { document.getElementById(id).value = String(v); };
        set('prompt', %s); set('temperature', 0.9); set('top-k', 20); set('top-p', 0.9); set('min-p', 0.02);
        set('repetition-penalty', 1.2); set('presence-penalty', 0.3); set('frequency-penalty', 0.2);
        set('no-repeat-ngram', 3); set('seed', 7); set('max-new', 80); set('stop-text', %s);
        document.getElementById('generate').click(); return true; })()""" % (json.dumps(PROMPT), json.dumps(stop))
    browser.evaluate(set_controls)
    browser.wait_for("document.body.dataset.state === 'done'", 120, "generation did not finish")
    on_page = browser.evaluate("document.getElementById('generated').textContent")
    ids, text = browser.evaluate(f"txlDemo.generate({json.dumps(PROMPT)}, {json.dumps(_camel(fields))}, "
                                 f"{json.dumps([stop])})")
    assert on_page == text  # the controls are these parameters
    # the server's Completion over the page's own log-probs gives the same tokens and text
    with TxlRuntime.load(demo_exports["fp32"], providers=["cpu"]) as rt:
        vocab = rt.vocab
    prompt_ids = vocab.encode(PROMPT).tolist()
    segments = [prompt_ids] + [[t] for t in ids[:-1]]
    rows = browser.evaluate(f"txlDemo.logProbs({json.dumps(segments)})")
    rows = [np.array(rows[0], dtype=np.float32).reshape(len(prompt_ids), -1)[-1]] + \
        [np.array(r, dtype=np.float32) for r in rows[1:]]
    completion = Completion(SamplingParams(**fields, stop=[stop]), vocab, len(vocab), context=prompt_ids)
    want_ids, want_text = [], ""
    for row in rows:
        out = completion.next(row)
        want_ids.append(out.token)
        want_text += out.text
        if completion.finish:
            break
    assert (want_ids, want_text) == (ids, text)
    # a control out of range is refused, on the page, with the sampler's message
    browser.evaluate("(() => { document.getElementById('top-p').value = '2'; "
                     "document.getElementById('generate').click(); return true; })()")
    browser.wait_for("document.getElementById('status').textContent.includes('top_p')", 30, "no error shown")
    assert browser.evaluate("document.getElementById('status').textContent") == \
        "error: top_p must be in (0, 1], got 2"
