"""The restricted unpickler: a checkpoint whose pickle would run code (os.system, builtins.eval, subprocess.call) is
refused in every container (a plain pickle, torch's zip and legacy files, NVIDIA's checkpoint dict, an attribute of a
pickled module, HuggingFace's vocab.pkl), with a one-line error naming the callable, and nothing runs.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from helpers.cli import assert_one_line_error, cli  # noqa: E402
from helpers.reference_models import WORDS, V, build_hf, save_our_model_as_model_pt  # noqa: E402

from txl_deploy.checkpoints import load_model  # noqa: E402
from txl_deploy.errors import CheckpointError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the restricted unpickler -----------------------------------------------------------------------------
class _Evil:
    """Unpickling this runs `callable(*args)` under a plain pickle.load."""

    def __init__(self, argv, call=None):
        self.argv, self.call = argv, call or subprocess.call

    def __reduce__(self):
        return self.call, (self.argv,)


class _EvilSystem:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _EvilEval:
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return eval, (self.code,)


def _payloads(marker):
    return {
        "os.system": _EvilSystem(f"touch {marker}"),
        "builtins.eval": _EvilEval(f"open({str(marker)!r}, 'w').close()"),
        "subprocess.call": _Evil(["touch", str(marker)]),
    }


KINDS = ["os.system", "builtins.eval", "subprocess.call"]
CONTAINERS = ["pickle", "torch-zip", "torch-legacy", "nvidia-dict"]

# Reads each file as an unrestricted reader of its container does: pickle.load for a pickle, torch.load with
# weights_only=False (pickle, plus torch's storages) for what torch.save wrote.
PLAIN_READER = """
import json, pickle, sys
import torch
for path, container in json.loads(sys.argv[1]):
    try:
        if container == "pickle":
            with open(path, "rb") as f:
                pickle.load(f)
        else:
            torch.load(path, weights_only=False)
    except Exception as e:
        print(path, type(e).__name__, e, file=sys.stderr)
"""


def _write(container, payload, path):
    if container == "pickle":
        path.write_bytes(pickle.dumps(payload, protocol=2))
    elif container == "torch-zip":
        torch.save({"word_emb.emb_layers.0.weight": torch.zeros(2), "evil": payload}, path)
    elif container == "torch-legacy":
        torch.save([payload], path, _use_new_zipfile_serialization=False)
    else:
        torch.save({"model_config": {"n_token": V}, "model_state": {}, "args": payload}, path)


@pytest.fixture(scope="module")
def malicious(tmp_path_factory):
    """{(kind, container): (the file, its marker, whether an unrestricted reader created the marker, what that
    reader said)}. One subprocess reads every file as plain pickle / torch.load would; its markers are removed."""
    root = tmp_path_factory.mktemp("malicious")
    cases = {}
    for kind in KINDS:
        for container in CONTAINERS:
            folder = root / f"{container}-{kind}"
            folder.mkdir()
            marker = folder / "pwned"
            _write(container, _payloads(marker)[kind], folder / "model.pt")
            cases[kind, container] = (folder / "model.pt", marker)
    order = [[str(path), container] for (_, container), (path, _) in cases.items()]
    run = subprocess.run([sys.executable, "-c", PLAIN_READER, json.dumps(order)], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    out = {}
    for key, (path, marker) in cases.items():
        out[key] = (path, marker, marker.exists(), run.stderr)
        marker.unlink(missing_ok=True)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("container", CONTAINERS)
def test_malicious_pickle_is_refused_and_nothing_runs(malicious, kind, container):
    path, marker, ran_unrestricted, said = malicious[kind, container]
    assert ran_unrestricted, f"an unrestricted reader of {path} did not run its payload, so this case shows " \
                             f"nothing:\n{said}"
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    message = str(err.value)
    assert str(path) in message and "refused to unpickle" in message
    callable_name = {"os.system": "system", "builtins.eval": "builtins.eval", "subprocess.call": "subprocess.call"}
    assert callable_name[kind] in message
    assert not marker.exists()

    result = cli("info", path)
    assert_one_line_error(result, path, "refused to unpickle")
    assert not marker.exists()


def test_pickled_module_holding_a_malicious_attribute_is_refused(tmp_path):
    """A real-looking model.pt whose module carries one extra attribute that would run a command."""
    marker = tmp_path / "pwned"
    save_our_model_as_model_pt(tmp_path / "model.pt", extra_attrs={"hook": _EvilSystem(f"touch {marker}")})
    assert_one_line_error(cli("convert", tmp_path / "model.pt", "-o", tmp_path / "out", "--no-vocab"),
                          "model.pt", "refused to unpickle", "system")
    assert not marker.exists() and not (tmp_path / "out").exists()


# -- HuggingFace's pickled vocabulary ------------------------------------------------------------------
def test_a_hostile_huggingface_vocab_pickle_is_refused_and_an_explicit_vocabulary_skips_it(hf, tmp_path):
    marker = tmp_path / "pwned"
    model = build_hf(hf, untie_r=True, same_length=True)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    (folder / "vocab.pkl").write_bytes(pickle.dumps(_Evil(["touch", str(marker)])))
    with pytest.raises(CheckpointError, match="vocab.pkl: refused to unpickle subprocess.call"):
        load_model(folder)
    assert_one_line_error(cli("convert", folder, "-o", tmp_path / "out"), "vocab.pkl", "refused to unpickle",
                          "subprocess.call", "nothing from the file was run")
    assert not marker.exists() and not (tmp_path / "out").exists()
    # --vocab names the vocabulary: the pickle beside the model is then not opened at all
    vocab_file = tmp_path / "words.txt"
    vocab_file.write_text("".join(f"{w}\n" for w in WORDS))
    result = cli("convert", folder, "-o", tmp_path / "out", "--vocab", vocab_file)
    assert result.exit_code == 0, result.output
    assert load_model(tmp_path / "out").vocab.symbols == WORDS and not marker.exists()


def test_every_pickle_goes_through_the_one_restricted_unpickler():
    """One `find_class`, in `RestrictedUnpickler`: each use (torch checkpoints, vocabulary files) gives it an
    allow-list, never its own resolution; and no module unpickles with Python's own unpickler."""
    import ast

    from helpers.paths import ROOT

    from txl_deploy.checkpoints.torch_files import Unpickler as TorchUnpickler
    from txl_deploy.checkpoints.unpickler import AllowList, RestrictedUnpickler
    from txl_deploy.checkpoints.vocab_files import VocabUnpickler

    resolvers, direct = [], []
    for path in sorted((ROOT / "txl_deploy").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if isinstance(node, ast.FunctionDef) and node.name == "find_class":
                resolvers.append(where)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "pickle" \
                    and node.attr in ("load", "loads", "Unpickler") and where != "txl_deploy/checkpoints/unpickler.py":
                direct.append(f"{where}:{node.lineno}")
    assert resolvers == ["txl_deploy/checkpoints/unpickler.py"]
    assert direct == []
    for use in (TorchUnpickler, VocabUnpickler):
        assert issubclass(use, RestrictedUnpickler) and "find_class" not in vars(use)
        assert isinstance(use.allow, AllowList)
    assert TorchUnpickler.allow is not VocabUnpickler.allow
