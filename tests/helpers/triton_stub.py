"""The Triton Python model (txl_deploy/serving/triton/python_model.py) in this process, over a stand-in for the
parts of Triton's `triton_python_backend_utils` it uses, for tests and fuzzing of its request handling.

`ShapeOnly` tensors report a shape and refuse to hand over data: a request the model refuses by its shape alone
never reads (or copies) what it claims.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np

MODEL_PY = Path(__file__).resolve().parents[2] / "txl_deploy" / "serving" / "triton" / "python_model.py"


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, np.ascontiguousarray(array)

    def shape(self):
        return list(self.array.shape)

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    @classmethod
    def from_dlpack(cls, name, capsule_owner):
        return cls(name, np.from_dlpack(capsule_owner).copy())


class ShapeOnly:
    """An input that claims `shape` and fails the test if its data is ever asked for."""

    def __init__(self, name, shape):
        self.name, self._shape = name, list(shape)

    def shape(self):
        return list(self._shape)

    def __dlpack__(self, **kwargs):
        raise AssertionError(f"the model read the data of {self.name} {self._shape}")

    def __dlpack_device__(self):
        raise AssertionError(f"the model read the data of {self.name} {self._shape}")


class Response:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class Request:
    def __init__(self, corrid, tokens=None, positions=None, start=False, end=False, resume=None, want_state=False,
                 raw=None, outputs=None):
        self.inputs = {"CORRID": Tensor("CORRID", np.array([[corrid]], np.uint64)),
                       "START": Tensor("START", np.array([[int(start)]], np.int32)),
                       "END": Tensor("END", np.array([[int(end)]], np.int32))}
        if tokens is not None:
            self.inputs["tokens"] = Tensor("tokens", np.asarray(tokens, np.int64).reshape(1, -1))
        if positions is not None:
            self.inputs["out_positions"] = Tensor("out_positions", np.asarray(positions, np.int64).reshape(1, -1))
        if resume is not None:
            self.inputs["resume_state"] = Tensor("resume_state", np.frombuffer(bytes(resume), np.uint8)[None])
        for name, tensor in (raw or {}).items():
            self.inputs[name] = tensor
        # the outputs the client asks for: by default what TxlTritonClient asks for
        self.wanted = list(outputs) if outputs is not None else ["log_probs"] + (["saved_state"] if want_state else [])

    def requested_output_names(self):
        return self.wanted


def stub_module() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor = Tensor
    m.InferenceResponse = Response
    m.TritonError = lambda message: message
    m.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    m.Logger = types.SimpleNamespace(log_info=lambda message: None)
    return m


def load_model_module():
    """python_model.py imported with the stand-in stub (restored afterwards), as the Triton stub would."""
    saved = sys.modules.get("triton_python_backend_utils")
    hook = sys.unraisablehook
    sys.modules["triton_python_backend_utils"] = stub_module()
    try:
        spec = importlib.util.spec_from_file_location("txl_triton_model_in_process", MODEL_PY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved
        sys.unraisablehook = hook
    return module


def start_model(module, onnx_path, repo_dir, **repo_options):
    """A TritonPythonModel initialised as Triton would from `triton-repo --backend python`'s repository."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from txl_deploy.serving.triton.repository import write_repository

    repo = write_repository(onnx_path, repo_dir, backend="python", **repo_options)
    config = json_format.MessageToDict(text_format.Parse((repo / "txl" / "config.pbtxt").read_text(),
                                                         mc.ModelConfig()), preserving_proto_field_name=True)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_repository": str(repo / "txl"),
                      "model_version": "1"})
    return model
