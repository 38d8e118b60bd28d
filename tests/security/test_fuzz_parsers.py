"""Fuzzing of every reader of outside input, in the suite: only the project's documented errors (TxlError) escape,
with no hang and no large allocation.

One test per format. Hypothesis damages seed files (fuzz_harness.py: byte-level and structure-aware damage, with
checksums recomputed so it reaches the parsers behind them) and fuzz_worker.py reads each case in a subprocess
whose address space has 512 MB to spare and that must answer within 30 s. The budget is time: TXL_FUZZ_SECONDS
(default 60) for all formats together, spread evenly; run `TXL_FUZZ_SECONDS=3600 pytest tests/security/
test_fuzz_parsers.py` for an hour (docs/development.md). Hypothesis shrinks a failure to a small case and prints
it; the failing files are also written to TXL_FUZZ_FAILURES (default: the test's tmp folder). A failure found this
way becomes a regression test in test_fuzz_regressions.py.
"""

from __future__ import annotations

import io
import json
import os
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from fuzz_harness import (
    Worker,
    budget_seconds,
    damaged,
    json_structured,
    make_seeds,
    npz_structured,
    safetensors_structured,
    tf_structured,
    torch_zip_structured,
    triton_calls,
)
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st

from txl_deploy.serving.triton.repository import write_repository

FORMATS = ["tf-bundle", "cache-pkl", "tokenizer-vocab", "safetensors", "config-json", "vocab-json", "torch-pickle",
           "onnx-metadata", "ort-file", "saved-state", "triton-requests", "midi-file"]
BATCH = 10  # Hypothesis examples per round; rounds run until the format's share of the budget is spent


@pytest.fixture(scope="module")
def fuzz(tiny_ckpt, tiny_onnx, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    seeds = make_seeds(tiny_ckpt, tiny_onnx, folder)
    repo = write_repository(tiny_onnx, folder / "repo", backend="python", max_batch=4, max_sequences=16)
    worker = Worker(tiny_onnx, tiny_ckpt / "config.json", triton_repo=repo)
    failures = Path(os.environ.get("TXL_FUZZ_FAILURES") or folder / "failures")
    yield {"seeds": seeds, "worker": worker, "failures": failures}
    worker.stop()


def checked(fuzz, target: str, files: dict | None = None, **case) -> None:
    """Runs one case in the worker; fails with the answer (and saves the files) unless it was read or refused."""
    answer = fuzz["worker"].run({"target": target, "files": files or {}, **case})
    if answer["status"] in ("ok", "refused"):
        return
    fuzz["failures"].mkdir(parents=True, exist_ok=True)
    stamp = f"{target}-{time.time_ns()}"
    for name, data in (files or {}).items():
        (fuzz["failures"] / f"{stamp}-{name}").write_bytes(data)
    raise AssertionError(f"{answer['status']}: {answer.get('error')}: {answer.get('message')}\n"
                         f"{answer.get('trace', '')}\nfiles: {fuzz['failures']}/{stamp}-*")


def run_for_budget(test, fmt: str):
    """Runs the Hypothesis test `test` in rounds of BATCH examples until this format's share of the budget is
    spent (at least one round)."""
    share = budget_seconds() / len(FORMATS)
    deadline = time.monotonic() + share
    run = settings(max_examples=BATCH, deadline=None, database=None, derandomize=False, print_blob=True,
                   phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))(test)
    rounds = 0
    while rounds == 0 or time.monotonic() < deadline:
        run()  # a fresh random start each round
        rounds += 1
    return rounds


def fuzz_case(fuzz, fmt, build):
    """A Hypothesis test over st.data(): `build(data)` draws (target, files); the case must be read or refused."""
    @given(st.data())
    def test(data):
        target, files = build(data)
        note(f"{fmt}: files {sorted(files)}")
        checked(fuzz, target, files)

    run_for_budget(test, fmt)


def test_fuzz_tf_bundle_index_and_shards(fuzz):
    seed = fuzz["seeds"]["tf"][0]

    def build(data):
        if data.draw(st.booleans(), label="structure-aware"):
            return "tf_bundle", data.draw(tf_structured(seed))
        name = data.draw(st.sampled_from(sorted(seed)), label="damaged file")
        return "tf_bundle", {**seed, name: data.draw(damaged(seed[name]))}

    fuzz_case(fuzz, "tf-bundle", build)


def test_fuzz_cache_pkl(fuzz):
    seeds = fuzz["seeds"]["cache"]

    def build(data):
        seed = data.draw(st.sampled_from(seeds))["cache.pkl"]
        return "cache_pkl", {"cache.pkl": data.draw(damaged(seed))}

    fuzz_case(fuzz, "cache-pkl", build)


def test_fuzz_tokenizer_vocabularies(fuzz):
    seeds = fuzz["seeds"]["tokenizer-vocab"]

    def build(data):
        ((name, seed),) = data.draw(st.sampled_from(seeds)).items()
        if name == "vocab.bin" and zipfile.is_zipfile(io.BytesIO(seed)) and data.draw(st.booleans(),
                                                                                      label="structure-aware"):
            return "tokenizer_vocab", {name: data.draw(torch_zip_structured(seed))}
        return "tokenizer_vocab", {name: data.draw(damaged(seed))}

    fuzz_case(fuzz, "tokenizer-vocab", build)


def test_fuzz_midi_files(fuzz):
    seeds = fuzz["seeds"]["midi"]

    def build(data):
        seed = data.draw(st.sampled_from(seeds))["song.mid"]
        return "midi_file", {"song.mid": data.draw(damaged(seed))}

    fuzz_case(fuzz, "midi-file", build)


def test_fuzz_safetensors_header(fuzz):
    seed = fuzz["seeds"]["checkpoint"][0]
    weights = seed["model.safetensors"]
    header_end = 8 + int.from_bytes(weights[:8], "little")

    def build(data):
        if data.draw(st.booleans(), label="structure-aware"):
            damaged_weights = data.draw(safetensors_structured(weights))
        else:
            damaged_weights = data.draw(damaged(weights, (0, header_end)))
        return "checkpoint_folder", {**seed, "model.safetensors": damaged_weights}

    fuzz_case(fuzz, "safetensors", build)


@pytest.mark.parametrize("name", ["config.json", "vocab.json"])
def test_fuzz_config_and_vocab_json(fuzz, name):
    seed = fuzz["seeds"]["checkpoint"][0]

    def build(data):
        if data.draw(st.booleans(), label="structure-aware"):
            text = data.draw(json_structured(seed[name]))
        else:
            text = data.draw(damaged(seed[name]))
        return "checkpoint_folder", {**seed, name: text}

    fuzz_case(fuzz, name.replace(".", "-"), build)


def test_fuzz_torch_pickles(fuzz):
    seeds = [s["model.pt"] for s in fuzz["seeds"]["torch"]]

    def build(data):
        seed = data.draw(st.sampled_from(seeds))
        if zipfile.is_zipfile(io.BytesIO(seed)) and data.draw(st.booleans(), label="structure-aware"):
            return "torch_file", {"model.pt": data.draw(torch_zip_structured(seed))}
        # a legacy file's pickles come first and its storages after: damage lands in the pickles half the time
        region = (0, min(len(seed), 4096)) if data.draw(st.booleans()) else None
        return "torch_file", {"model.pt": data.draw(damaged(seed, region))}

    fuzz_case(fuzz, "torch-pickle", build)


def test_fuzz_onnx_metadata_reader(fuzz):
    seed = fuzz["seeds"]["onnx"][0]["model.onnx"]

    def build(data):
        # the fields before the weights (metadata, graph and node headers) and anywhere
        region = (0, 4096) if data.draw(st.booleans()) else (len(seed) - 8192, len(seed))
        return "onnx_metadata", {"model.onnx": data.draw(damaged(seed, region if data.draw(st.booleans()) else None))}

    fuzz_case(fuzz, "onnx-metadata", build)


def test_fuzz_ort_files(fuzz):
    seed = fuzz["seeds"]["ort"][0]["model.ort"]

    def build(data):
        # the flatbuffer's root table and offsets (its start), its metadata strings (its end) and anywhere
        region = (0, 4096) if data.draw(st.booleans()) else (len(seed) - 8192, len(seed))
        return "ort_file", {"model.ort": data.draw(damaged(seed, region if data.draw(st.booleans()) else None))}

    fuzz_case(fuzz, "ort-file", build)


def test_fuzz_saved_states(fuzz):
    seeds = [s["state.npz"] for s in fuzz["seeds"]["state"]]

    def build(data):
        seed = data.draw(st.sampled_from(seeds))
        blob = data.draw(npz_structured(seed)) if data.draw(st.booleans()) else data.draw(damaged(seed))
        return "saved_state", {"state.npz": blob}

    fuzz_case(fuzz, "saved-state", build)


def test_fuzz_triton_request_inputs(fuzz, tiny_onnx):
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.serving.triton.protocol import STATE_FORMAT, STATE_FORMAT_VERSION

    states = []
    with TxlRuntime.load(tiny_onnx) as rt:
        for prompt in ([[5, 17]], [[1] * 9]):
            rt.reset()
            rt.step(prompt)
            arrays = {**rt.save_state(), "__format__": np.array(STATE_FORMAT),
                      "__format_version__": np.array(STATE_FORMAT_VERSION)}
            buf = io.BytesIO()
            np.savez(buf, **arrays)
            states.append(buf.getvalue())

    @given(triton_calls(states))
    def test(calls):
        note(json.dumps([[{k: (v if k != "raw" else sorted(v)) for k, v in r.items()} for r in c] for c in calls]))
        answer = fuzz["worker"].run({"target": "triton_requests", "files": {}, "calls": calls})
        assert answer["status"] in ("ok", "refused"), answer

    run_for_budget(test, "triton-requests")
