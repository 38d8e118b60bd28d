"""The process the fuzz tests run their cases in (test_fuzz_parsers.py starts it; it is not a test module).

It imports every reader, opens the tiny model, then limits its own address space (RLIMIT_AS) to what it holds plus
`--spare-mb`, so that a case asking for a large allocation fails here instead of passing unnoticed. Then, for each
case read from stdin (a length-prefixed pickle from the parent: trusted, it is the test itself), it writes the
case's files into a fresh folder, runs the format's reader on them, and answers one JSON line:

- {"status": "ok"}: read (a mutation may leave a file valid);
- {"status": "refused", "error": "CheckpointError", ...}: one of the project's documented errors (TxlError);
- {"status": "bug", "error": ..., "trace": ...}: anything else escaped, or a refusal changed what it must not.

The parent times each case out (a hang) and notices if this process dies (a crash).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import struct
import sys
import tempfile
import traceback
from pathlib import Path

import mido  # noqa: F401  (imported before the limit: the MIDI reader needs it)
import numpy as np
import onnx  # noqa: F401  (imported before the limit, as every reader below needs it)
import torch  # noqa: F401  (imported before the limit: the pickle readers need it)

from txl_deploy.checkpoints import load_model
from txl_deploy.checkpoints.tensorflow.bundle import TFCheckpoint
from txl_deploy.checkpoints.torch_files import torch_load
from txl_deploy.checkpoints.vocab_files import read_vocab_file
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.contract.onnx_file import external_data, weight_file_bytes
from txl_deploy.errors import TxlError
from txl_deploy.music.midi_to_events import midi_to_events
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.vocab import Vocab


class Broken(Exception):
    """A property the reader must keep did not hold (reported as a bug)."""


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k], equal_nan=a[k].dtype.kind == "f") for k in a)


class Targets:
    def __init__(self, args):
        self.config = json.loads(Path(args.config).read_text())["config"]
        self.rt = TxlRuntime.load(args.onnx)
        self.rt.step([[5, 17, 42]])
        self.model = None
        if args.triton_repo:
            from google.protobuf import json_format, text_format
            from helpers.triton_stub import load_model_module  # the stand-in stub (tests/ is on PYTHONPATH)
            from tritonclient.grpc import model_config_pb2 as mc  # the Python model's config, as Triton hands it

            self.module = load_model_module()
            repo = Path(args.triton_repo)
            config = json_format.MessageToDict(text_format.Parse((repo / "txl" / "config.pbtxt").read_text(),
                                                                 mc.ModelConfig()), preserving_proto_field_name=True)
            self.model = self.module.TritonPythonModel()
            self.model.initialize({"model_config": json.dumps(config), "model_repository": str(repo / "txl"),
                                   "model_version": "1"})
            self.canary = TxlRuntime.load(args.onnx)

    # each target reads the case's files in `folder`
    def tf_bundle(self, folder, case):
        prefix = folder / "model.ckpt-0"
        ckpt = TFCheckpoint(prefix)
        for name in ckpt.names():
            ckpt.shape(name)
            ckpt.get_tensor(name)
        load_model(prefix)

    def cache_pkl(self, folder, case):
        read_vocab_file(folder / "cache.pkl")

    def tokenizer_vocab(self, folder, case):  # vocab.pkl or vocab.bin
        for name in ("vocab.pkl", "vocab.bin"):
            if (folder / name).is_file():
                read_vocab_file(folder / name)

    def checkpoint_folder(self, folder, case):  # safetensors, config.json, vocab.json
        load_model(folder)
        if (folder / "vocab.json").is_file():
            Vocab.read(folder / "vocab.json")

    def midi_file(self, folder, case):  # MIDI to REMI events, chords included
        midi_to_events(folder / "song.mid", chords=True)

    def torch_file(self, folder, case):
        path = folder / "model.pt"
        torch_load(path)
        load_model(path, config=dict(self.config))

    def onnx_metadata(self, folder, case):
        path = folder / "model.onnx"
        read_onnx_info(path)
        external_data(path)
        weight_file_bytes(path)

    def ort_file(self, folder, case):  # parsed by ONNX Runtime, metadata validated by txl-deploy
        # ONNX Runtime's native code writes some messages about a damaged file to stdout, the answers' channel.
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            TxlRuntime.load(folder / "model.ort").close()
        finally:
            os.dup2(saved, 1)
            os.close(saved)

    def saved_state(self, folder, case):
        blob = (folder / "state.npz").read_bytes()
        before = self.rt.save_state()
        try:
            self.rt.load_state(blob)
        except TxlError:
            if not same(self.rt.save_state(), before):
                raise Broken("a refused state changed the runtime's memory") from None
            raise
        self.rt.load_state(before)

    def triton_requests(self, folder, case):
        """case["calls"]: execute() calls of request dicts; conversation 999 (the canary) runs beside them and must
        get what it gets alone."""
        from helpers.triton_stub import Request, Tensor  # the stand-in stub (tests/ is on PYTHONPATH)

        model = self.model
        self.canary.reset()
        model.execute([Request(999, [7, 8], [1], start=True)])
        self.canary.step([[7, 8]])
        for call in case["calls"]:
            requests = []
            for r in call:
                raw = {name: Tensor(name, value) for name, value in r.get("raw", {}).items()}
                requests.append(Request(r["corrid"], r.get("tokens"), r.get("positions"), r.get("start", False),
                                        r.get("end", False), r.get("resume"), r.get("want_state", False), raw=raw,
                                        outputs=r.get("outputs")))
            responses = model.execute(requests)
            if len(responses) != len(requests) or any(x is None for x in responses):
                raise Broken(f"execute() answered {len(responses)} of {len(requests)} requests")
            for x in responses:  # the model turns any exception into an error response: look at which
                if x.error is not None and any(w in x.error for w in ("MemoryError", "Traceback", "RecursionError")):
                    raise Broken(f"a request's error hides a failure: {x.error[:200]}")
        out = model.execute([Request(999, [3], [0], end=True)])[0]
        if out.error is not None:
            raise Broken(f"the canary conversation got an error: {out.error}")
        want = self.canary.step([[3]])[0, 0]
        if not np.allclose(out.outputs["log_probs"][0, 0], want, rtol=0, atol=1e-5):
            raise Broken("the canary conversation's log-probs changed")
        for corrid in list(model.conversations):  # end every fuzzed conversation: the next case starts clean
            model._forget(corrid)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--onnx", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--triton-repo")
    parser.add_argument("--spare-mb", type=int, default=512)
    args = parser.parse_args()
    targets = Targets(args)
    vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize")) * 1024
    limit = vm + (args.spare_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    stdin = sys.stdin.buffer
    while True:
        head = stdin.read(8)
        if len(head) < 8:
            return
        case = pickle.loads(stdin.read(struct.unpack("<Q", head)[0]))  # from the test itself
        folder = Path(tempfile.mkdtemp(prefix="txl-fuzz-"))
        try:
            for name, data in case.get("files", {}).items():
                (folder / name).write_bytes(data)
            getattr(targets, case["target"])(folder, case)
            answer = {"status": "ok"}
        except TxlError as e:
            answer = {"status": "refused", "error": type(e).__name__, "message": str(e)[:300]}
        except BaseException as e:  # everything else is what the fuzzer looks for (MemoryError included)
            answer = {"status": "bug", "error": type(e).__name__, "message": str(e)[:300],
                      "trace": "".join(traceback.format_exception(e))[-3000:]}
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
