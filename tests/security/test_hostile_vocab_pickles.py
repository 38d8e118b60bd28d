"""Hostile vocabulary pickles (vocab.pkl / vocab.bin, what HuggingFace's TransfoXLTokenizer reads with pickle.load)
run nothing: each would create a canary file under a plain `pickle.load` (checked in a subprocess, so the case
shows something), and txl-deploy's reader, run in another subprocess, creates none and answers with one line
naming the problem.

The kinds: a `__reduce__` calling os.system; builtins.exec and builtins.eval; subprocess.Popen hidden in the
sym2idx OrderedDict; a sacremoses class given a callable as its argument; a placeholder called as a function; the
INST (protocol 0) and OBJ (protocol 1) opcodes; BUILD setting `__setstate__` so that the next BUILD calls it (with a
refused and with an allowed callable); a copyreg extension code (EXT1) registered for os.system in the reading
process; a compiled `re` pattern that could not even be compiled (never compiled: the file reads); a length claiming
a terabyte; a torch.save archive whose data.pkl is compressed (a zip bomb).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time
from collections import OrderedDict

import pytest
from crafted_files import Member, deflated_zeros, zip_bytes

EXT_CODE = 240  # a copyreg extension code both reading processes register for os.system
SYMBOLS = ["<eos>", "<unk>", "the", "@-@", "cat"]


def text(s: str) -> bytes:
    """BINUNICODE (protocol 1+): the string, its length first."""
    data = s.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


def glob(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def proto2(*ops: bytes) -> bytes:
    return b"\x80\x02" + b"".join(ops) + b"."


class Reduce:
    """Pickles as `call(*args)`: what a hostile writer puts in a file."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def vocab_dict(**extra) -> dict:
    return {"idx2sym": list(SYMBOLS), "sym2idx": OrderedDict((s, i) for i, s in enumerate(SYMBOLS)), "unk_idx": 1,
            "lower_case": False, "delimiter": None, **extra}


def hostile_files(marker) -> dict:
    """name -> (file bytes, suffix, whether plain pickle.load runs its payload, what our refusal must say)."""
    touch = f"touch {marker}"
    create = f"open({str(marker)!r}, 'w').close()"
    popen_sym2idx = vocab_dict()
    popen_sym2idx["sym2idx"]["cat"] = Reduce(subprocess.Popen, ["touch", str(marker)])
    setstate = [glob("sacremoses.tokenize", "MosesTokenizer"), b")R}", text("__setstate__")]
    return {
        "reduce-os-system": (pickle.dumps(vocab_dict(hook=Reduce(os.system, touch)), protocol=2), ".pkl", True,
                             "refused to unpickle posix.system"),
        "builtins-exec": (pickle.dumps(vocab_dict(hook=Reduce(exec, create)), protocol=4), ".pkl", True,
                          "refused to unpickle builtins.exec"),
        "builtins-eval": (pickle.dumps([Reduce(eval, create)], protocol=0), ".pkl", True,
                          "refused to unpickle builtins.eval"),
        "popen-in-sym2idx": (pickle.dumps(popen_sym2idx, protocol=2), ".pkl", True,
                             "refused to unpickle subprocess.Popen"),
        "sacremoses-given-a-callable": (proto2(glob("sacremoses.tokenize", "MosesTokenizer"), b"(",
                                               glob("os", "system"), text(touch), b"tR"), ".pkl", False,
                                        "refused to unpickle os.system"),
        "placeholder-called": (proto2(glob("sacremoses.tokenize", "MosesTokenizer"), b")R", text(touch), b"\x85R"),
                               ".pkl", False, "'MosesTokenizer' object is not callable"),
        "inst-protocol-0": (f"(S'{touch}'\nios\nsystem\n.".encode(), ".pkl", True, "refused to unpickle os.system"),
        "obj-protocol-1": (b"(" + glob("os", "system") + text(touch) + b"o.", ".pkl", True,
                           "refused to unpickle os.system"),
        "build-setstate-os-system": (proto2(*setstate, glob("os", "system"), b"sb", text(touch), b"b"), ".pkl",
                                     True, "refused to unpickle os.system"),
        "build-setstate-allowed-callable": (proto2(*setstate, glob("collections", "Counter"), b"sb", text(touch),
                                                   b"b"), ".pkl", False,
                                            "a pickled state that sets __setstate__ on a placeholder object"),
        "ext1-registered-os-system": (proto2(b"\x82" + bytes([EXT_CODE]), text(touch), b"\x85R"), ".pkl", True,
                                      "refused to unpickle os.system"),
        "terabyte-claim": (proto2(b"}", text("idx2sym"), b"\x8d" + (2**40).to_bytes(8, "little"), b"s"), ".pkl",
                           False, "claims 1,099,511,627,776 bytes"),
        "compressed-data-pkl": (zip_bytes([Member("archive/data.pkl", b"", method=8,
                                                  compressed=deflated_zeros(1 << 30), declared_size=1 << 30)]),
                                ".bin", False, "data.pkl is compressed"),
    }


# Plain pickle.load of each file, in a process where os.system has a copyreg extension code, as a reader could.
PLAIN_READER = f"""
import copyreg, json, pickle, sys, time
copyreg.add_extension("os", "system", {EXT_CODE})
for path in json.loads(sys.argv[1]):
    try:
        with open(path, "rb") as f:
            pickle.load(f)
    except Exception as e:
        print(path, type(e).__name__, e, file=sys.stderr)
time.sleep(1)  # a Popen's child touches its file on its own time
"""
# txl-deploy's reader of each file, in the same kind of process; one answer per file.
OUR_READER = f"""
import copyreg, json, sys, time
copyreg.add_extension("os", "system", {EXT_CODE})
from txl_deploy.checkpoints.vocab_files import read_vocab_file
from txl_deploy.errors import TxlError
answers = {{}}
for path in json.loads(sys.argv[1]):
    start = time.monotonic()
    try:
        read_vocab_file(path)
        answers[path] = {{"error": None}}
    except TxlError as e:
        answers[path] = {{"error": str(e), "type": type(e).__name__}}
    except BaseException as e:
        answers[path] = {{"error": f"{{type(e).__name__}}: {{e}}", "type": "escaped"}}
    answers[path]["seconds"] = time.monotonic() - start
time.sleep(1)
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-vocab")
    cases = {}
    for name in hostile_files(root / "x"):
        folder = root / name
        folder.mkdir()
        marker = folder / "canary"
        data, suffix, runs_plain, said = hostile_files(marker)[name]
        path = folder / f"vocab{suffix}"
        path.write_bytes(data)
        cases[name] = {"path": path, "marker": marker, "runs_plain": runs_plain, "said": said}
    plain = [str(c["path"]) for c in cases.values() if c["runs_plain"]]
    run = subprocess.run([sys.executable, "-c", PLAIN_READER, json.dumps(plain)], capture_output=True, text=True,
                         timeout=120, check=False)
    for case in cases.values():
        case["ran_plain"] = case["marker"].exists()
        case["marker"].unlink(missing_ok=True)
        case["plain_said"] = run.stderr
    run = subprocess.run([sys.executable, "-c", OUR_READER, json.dumps([str(c["path"]) for c in cases.values()])],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    answers = json.loads(run.stdout.strip().splitlines()[-1])
    for case in cases.values():
        case["answer"] = answers[str(case["path"])]
    return cases


@pytest.mark.parametrize("name", list(hostile_files("x")))
def test_a_hostile_vocabulary_pickle_runs_nothing_and_is_refused_in_one_line(hostile, name):
    case = hostile[name]
    if case["runs_plain"]:
        assert case["ran_plain"], f"plain pickle.load of {name} did not run its payload, so the case shows " \
                                  f"nothing:\n{case['plain_said']}"
    assert not case["marker"].exists()
    answer = case["answer"]
    assert answer["type"] == "CheckpointError", answer
    message = answer["error"]
    assert "\n" not in message and str(case["path"]) in message and case["said"] in message, message
    assert len(message) < 400, message


def test_a_compiled_pattern_is_never_compiled(tmp_path):
    """transformers pickles compiled `re` patterns beside the symbols (`re._compile(pattern, flags)`); they stay
    text. One that cannot compile, and one that backtracks for ages, leave the file readable at once."""
    from txl_deploy.checkpoints.vocab_files import read_vocab_file

    unclosed = "((((unclosed"
    with pytest.raises(re.error):
        re.compile(unclosed)
    path = tmp_path / "vocab.pkl"
    for pattern in (Reduce(re._compile, unclosed, 0), re.compile(r"^(a+)+$"), Reduce(re._compile, r"(x+x+)+y", 0)):
        path.write_bytes(pickle.dumps(vocab_dict(pattern=pattern), protocol=2))
        start = time.monotonic()
        assert read_vocab_file(path).symbols == SYMBOLS
        assert time.monotonic() - start < 5
