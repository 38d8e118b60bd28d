"""Fuzzing of `txl-deploy score`'s input (runtimes/score_input.py), in-process: any bytes, and any JSON values in the
fields, give one record per line (an item or a one-line error), never an exception; and whatever the parser lets
through, `score_texts` answers per item without raising. The parser holds no native code and allocates at most one
line (MAX_LINE_BYTES), so it runs here rather than in fuzz_worker.py's subprocess."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txl_deploy.runtimes.score_input import FORMATS, read_input

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)
WORDS = st.lists(st.sampled_from(["w1", "w2", "w57", "<eos>", "<unk>", "zz", " ", "\t", "\u20ac", "\n", ""]),
                 max_size=6).map(" ".join)
FIELDS = st.fixed_dictionaries({}, optional={"text": WORDS | JSON_VALUES, "context": WORDS | JSON_VALUES,
                                             "group": st.sampled_from(["g", 1, True, 2.5, None]) | JSON_VALUES,
                                             "id": JSON_VALUES, "other": JSON_VALUES})


def check_lines(data: bytes, fmt: str):
    lines = read_input(io.BytesIO(data), fmt)
    assert len(lines) == len(data.split(b"\n")) - data.endswith(b"\n") if data else lines == []
    assert [line.line for line in lines] == list(range(1, len(lines) + 1))
    for line in lines:
        assert (line.item is None) != (line.error is None)
        if line.error is not None:
            assert line.error and "\n" not in line.error
        else:
            assert isinstance(line.item.text, str)
        json.dumps({"id": line.id})  # what the output writes
    return lines


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=400), st.sampled_from(FORMATS))
def test_any_bytes_give_a_record_per_line(data, fmt):
    check_lines(data, fmt)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(FIELDS.map(json.dumps) | JSON_VALUES.map(json.dumps), min_size=1, max_size=6),
       st.binary(max_size=8))
def test_any_json_values_give_an_item_or_an_error(objects, noise):
    data = "\n".join(objects).encode() + b"\n" + noise
    check_lines(data, "jsonl")


@pytest.fixture(scope="module")
def tiny_rt(tiny_onnx):
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(tiny_onnx, threads=1) as rt:
        yield rt


def test_whatever_the_parser_lets_through_is_scored_or_refused_per_item(tiny_rt):
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(FIELDS.map(json.dumps), min_size=1, max_size=5))
    def run(objects):
        lines = read_input(io.BytesIO("\n".join(objects).encode()), "jsonl")
        items = [line.item for line in lines if line.item is not None]
        for result in tiny_rt.score_texts(items, per_token=True, batch_budget=1 << 16):
            assert ("error" in result) != ("log_prob" in result)
            if "log_prob" in result:
                assert result["n_tokens"] >= 1 and result["log_prob"] <= 0
                assert len(result["tokens"]) == len(result["token_log_probs"])

    run()
