"""A music model's events vocabulary travels with every file made from it, verbatim (REMI's events hold spaces) and
naming its representation: our checkpoint folder's vocab.json, the ONNX metadata read back by TxlRuntime, `info`,
the web page's vocab.json and a Triton repository's config."""

from __future__ import annotations

import json
import pickle

import pytest

torch = pytest.importorskip("torch")

from helpers.cli import cli  # noqa: E402
from helpers.tiny import make_tiny_model  # noqa: E402

from txl_deploy.checkpoints import load_model  # noqa: E402
from txl_deploy.contract.metadata import read_onnx_info  # noqa: E402
from txl_deploy.exporters.export import export_checkpoint  # noqa: E402
from txl_deploy.runtimes import TxlRuntime  # noqa: E402
from txl_deploy.vocab import Vocab  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REMI_EVENTS = (["Bar_None"] + [f"Position_{k}/16" for k in range(1, 17)] + [f"Note Velocity_{v}" for v in (16, 20)]
               + [f"Note On_{p}" for p in (60, 62, 64, 65, 67)] + [f"Note Duration_{d}" for d in (1, 3, 7)]
               + ["Chord_C:maj", "Chord_A:min", "Chord_N:N", "Tempo Class_slow", "Tempo Class_mid", "Tempo Value_12"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny model with n_token = the events', as a bare state_dict with REMI's dictionary.pkl beside it, and its
    ONNX export (the graph's parity is checked elsewhere: here only its vocabulary is). A plain softmax, as REMI's
    and remi-xl's (an adaptive one's parts would double the export's time)."""
    folder = tmp_path_factory.mktemp("remi")
    model = make_tiny_model(n_token=len(REMI_EVENTS), cutoffs=[], div_val=1, tie_projs=[False])
    torch.save(model.state_dict(), folder / "weights.pt")
    (folder / "weights.json").write_text(model.cfg.to_json())
    (folder / "dictionary.pkl").write_bytes(pickle.dumps(({e: i for i, e in enumerate(REMI_EVENTS)},
                                                          dict(enumerate(REMI_EVENTS)))))
    onnx_path = export_checkpoint(folder / "weights.pt", folder / "remi.onnx", max_segment=16, verify=False).path
    return folder, onnx_path


def test_the_onnx_metadata_and_the_runtime_keep_the_events_verbatim(exported, tmp_path):
    _, onnx_path = exported
    vocab = read_onnx_info(onnx_path).vocab
    assert vocab.kind == "events" and vocab.symbols == REMI_EVENTS and vocab.representation == "remi"
    with TxlRuntime.load(onnx_path) as rt:
        assert rt.vocab == vocab and rt.vocab.representation == "remi"
        prompt = "Bar_None\nPosition_1/16\nTempo Class_mid\nTempo Value_12\n"
        ids = rt.encode(prompt)
        assert rt.vocab.events(ids) == ["Bar_None", "Position_1/16", "Tempo Class_mid", "Tempo Value_12"]
        tokens = list(rt.generate(prompt, max_new_tokens=6, seed=0))
        rt.reset()
        text = "".join(rt.generate_text(prompt, max_new_tokens=6, seed=0))  # each event whole, on its own line
        assert text == rt.decode(tokens) == "".join(REMI_EVENTS[i] + "\n" for i in tokens)
    result = cli("info", onnx_path)
    assert result.exit_code == 0 and "kind events" in result.output and "representation: remi" in result.output
    piece = tmp_path / "piece.txt"  # an events text is scored per event, as a perplexity
    piece.write_text(prompt * 3, encoding="utf-8")
    scored = cli("eval", onnx_path, "--text", piece, "--json", tmp_path / "score.json")
    assert scored.exit_code == 0 and "perplexity" in scored.output, scored.output
    score = json.loads((tmp_path / "score.json").read_text())
    assert score["unit"] == "ppl" and score["counted"] == "events" and score["n_tokens"] == 11
    listed = json.loads(cli("info", onnx_path, "--list-vocab", "--json").output)
    assert listed == REMI_EVENTS


def test_our_checkpoint_folder_and_the_web_page_keep_the_events_and_the_representation(exported, tmp_path):
    folder, onnx_path = exported
    out = tmp_path / "ours"
    result = cli("convert", folder / "weights.pt", "-o", out)
    assert result.exit_code == 0, result.output
    stored = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert stored == {"kind": "events", "symbols": REMI_EVENTS, "representation": "remi"}
    assert load_model(out).vocab.representation == "remi"

    from txl_deploy.exporters.web.site import write_site

    site = write_site(onnx_path, tmp_path / "site")
    assert Vocab.from_dict(json.loads((site / "vocab.json").read_text(encoding="utf-8"))) == \
        read_onnx_info(onnx_path).vocab


def test_a_triton_repository_carries_the_events_verbatim(exported, tmp_path):
    pytest.importorskip("tritonclient.grpc")
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc  # the config as Triton parses it

    from txl_deploy.serving.triton.repository import write_repository

    _, onnx_path = exported
    repo = write_repository(onnx_path, tmp_path / "repo", backend="python", max_batch=2, max_sequences=4)
    config = json_format.MessageToDict(text_format.Parse((repo / "txl" / "config.pbtxt").read_text(),
                                                         mc.ModelConfig()), preserving_proto_field_name=True)
    vocab = Vocab.from_dict(json.loads(config["parameters"]["txl_deploy.vocab"]["string_value"]))
    assert vocab.symbols == REMI_EVENTS and vocab.representation == "remi"
