"""Triton Inference Server model repositories for txl-deploy models, with per-conversation memory.

A conversation is a Triton *sequence* (the client's sequence_id). The sequence batcher's `oldest` strategy keeps up to
`max_sequences` conversations live on each model instance and batches the next requests of different conversations
together; a conversation stays on its instance for its whole life, so its memory never meets another's.

Three backends, one wire format (`tokens` [1, Q] int64, `out_positions` [1, P] int64 -> `log_probs` [1, P, V]):
- `onnxruntime` (platform onnxruntime_onnx) and `tensorrt` (tensorrt_plan): Triton's *implicit state* carries the
  memory. A `full`-state graph (see txl_deploy.contract.io_spec) outputs the whole next memory; Triton feeds output `next_X`
  of request i back as input `X` of request i + 1 of the same sequence, and gives a new sequence zeros: an empty
  memory (mem_count 0), so no START/END/CORRID inputs (END releases the state inside Triton).
- `python`: Triton's Python backend running `TxlRuntime` (serving/triton/python_model.py) for machines without
  Triton's ONNX Runtime / TensorRT backends: the memories of the live conversations are the rows of one batched
  state, keyed by CORRID, and each Triton batch is one batched runtime call. It gets the START, END and CORRID
  controls, and parks/resumes conversations (optional input `resume_state`, output `saved_state`).
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf import text_format

from txl_deploy.config import TxlConfig
from txl_deploy.contract import io_spec
from txl_deploy.contract import parts as parts_contract
from txl_deploy.contract.engine_file import read_sidecar, sidecar_path
from txl_deploy.contract.metadata import ExportInfo, read_onnx_info
from txl_deploy.contract.onnx_file import external_data
from txl_deploy.errors import CheckpointError, ExportError
from txl_deploy.files import atomic_path
from txl_deploy.serving.triton.protocol import (
    CUTOFFS_PARAM,
    HEAD_OUTPUT,
    PARAM_PREFIX,
    RESUME_INPUT,
    SAVED_OUTPUT,
    TAIL_INPUT,
    TAIL_OUTPUT,
)
from txl_deploy.vocab import Vocab

logger = logging.getLogger(__name__)

BACKENDS = ("onnxruntime", "tensorrt", "python")
PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}
MODEL_FILES = {"onnxruntime": "model.onnx", "tensorrt": "model.plan"}
TRITON_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
                "bfloat16": "TYPE_BF16"}
VOCAB_IN_CONFIG_BYTES = 256 * 1024  # larger vocabularies travel as <model>/vocab.json only
DEFAULT_IDLE_TIMEOUT = 300.0  # seconds; Triton's own default (1 s) would drop a conversation between two messages
DEFAULT_QUEUE_DELAY_US = 1000


@dataclass
class ServedModel:
    """What the repository writer needs to know about an exported model."""

    path: Path
    kind: str  # "onnx" or "engine"
    info: object  # txl_deploy.contract.metadata.ExportInfo
    dtypes: dict = field(default_factory=dict)  # tensor name -> numpy dtype name
    max_batch: int | None = None  # the engine profile's largest batch
    # files that travel with the model: (file, its name beside the model) for external data and the sidecar
    extra_files: list = field(default_factory=list)
    # the adaptive softmax's head and tail graphs (and their external data), as (file, name): the python backend's
    # model runs the head alone and a tail when asked (python_model.py), so they travel with a python repository
    part_files: list = field(default_factory=list)

    @property
    def spec(self) -> io_spec.GraphSpec:
        return self.info.spec()

    @property
    def max_segment(self) -> int:
        return self.info.max_segment

    def dtype(self, name: str, declared: str) -> str:
        if name in self.dtypes:
            return self.dtypes[name]
        if declared != "float":
            return declared
        return "float16" if self.info.precision == "fp16" else "float32"

    def bytes_per_conversation(self) -> int:
        """Bytes of one conversation's memory (every state tensor of one batch row)."""
        total = 0
        for s in self.spec.state_inputs():
            n = 1
            for d in s.shape[1:]:
                n *= int(d)
            total += n * np.dtype(self.dtype(s.name, s.dtype)).itemsize
        return total


_ONNX_ELEM = {1: "float32", 10: "float16", 7: "int64", 6: "int32", 16: "bfloat16"}


def inspect_model(path) -> ServedModel:
    """Read an exported ONNX file (metadata + I/O dtypes) or a TensorRT engine (its sidecar)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, "file not found")
    if path.suffix.lower() == ".onnx":
        info = read_onnx_info(path)
        # Only data files inside the model's folder travel with it (a repository is often uploaded as it is).
        extra = sorted({(ref.path, ref.location) for ref in external_data(path)})
        graph = onnx.load(str(path), load_external_data=False).graph
        dtypes = {vi.name: _ONNX_ELEM.get(vi.type.tensor_type.elem_type, "?")
                  for vi in list(graph.input) + list(graph.output)}
        return ServedModel(path, "onnx", info, dtypes, extra_files=extra, part_files=_part_files(path, info))
    if path.suffix.lower() in (".engine", ".plan", ".trt"):
        meta = read_sidecar(path)
        info = ExportInfo(TxlConfig.from_dict(meta["config"]),
                          Vocab.from_dict(meta["vocab"]) if meta.get("vocab") else None, meta["export"])
        dtypes = {}
        onnx_path = path.parent / str(meta.get("onnx", ""))
        if meta.get("onnx") and onnx_path.is_file():  # the engine's I/O types are its graph's (strongly typed)
            dtypes = inspect_model(onnx_path).dtypes
        return ServedModel(path, "engine", info, dtypes, max_batch=int(meta["batch"][2]),
                           extra_files=[(sidecar_path(path), sidecar_path(path).name)])
    raise CheckpointError(path, "not an exported model: pass a .onnx file (txl-deploy export) or a TensorRT "
                                ".engine/.plan with its sidecar (txl-deploy build-engine)")


def _part_files(path: Path, info) -> list:
    """The softmax parts the model's metadata lists, checked as the runtime checks them (in the model's folder,
    the sha256 it lists, external data inside the folder), with their external data files; none (and a warning)
    where the model lists parts that are missing or refused: the served model then computes full distributions."""
    try:
        parts = parts_contract.Parts.from_export(info.export, info.config, path)
        if parts is None:
            return []
        out = []
        for part in parts.files(path):
            out.append((part, part.name))
            out += sorted({(ref.path, ref.location) for ref in external_data(part)})
        return out
    except CheckpointError as e:
        logger.warning(f"{e}; the repository's model will compute full distributions only")
        return []


# -- config.pbtxt -----------------------------------------------------------------------------------------------
def _dims(values) -> str:
    return "[ " + ", ".join(str(int(v)) for v in values) + " ]" if values else "[ ]"


def pbtxt_string(text: str) -> str:
    """A protobuf text-format string literal. Octal escapes for every byte outside printable ASCII: JSON's \\u
    escapes are not text format, and a character vocabulary holds newlines, quotes and any Unicode."""
    out = []
    for b in str(text).encode("utf-8"):
        ch = chr(b)
        out.append(ch if 32 <= b < 127 and ch not in '"\\' else f"\\{b:03o}")
    return '"' + "".join(out) + '"'


def _param(key: str, value) -> str:
    return f"parameters {{ key: {pbtxt_string(key)} value {{ string_value: {pbtxt_string(value)} }} }}"


@dataclass
class RepoOptions:
    name: str = "txl"
    backend: str | None = None  # default: onnxruntime for .onnx, tensorrt for engines
    max_batch: int = 8
    instances: int = 1
    max_sequences: int | None = None  # per instance; default 4 x max_batch
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    max_queue_delay_us: int = DEFAULT_QUEUE_DELAY_US
    instance_kind: str | None = None  # KIND_CPU / KIND_GPU; default: GPU for TensorRT, Triton's choice otherwise
    threads: int | None = None  # python backend: ONNX Runtime intra-op threads per instance (None: its default)

    def resolved(self, model: ServedModel) -> "RepoOptions":
        backend = self.backend or ("tensorrt" if model.kind == "engine" else "onnxruntime")
        out = RepoOptions(**{**self.__dict__, "backend": backend})
        if out.max_sequences is None:
            out.max_sequences = 4 * out.max_batch
        return out


def check_options(model: ServedModel, opts: RepoOptions):
    """Refuse settings Triton would refuse at load time, or that cannot work with this model."""
    if opts.backend not in BACKENDS:
        raise ExportError(f"unknown Triton backend {opts.backend!r}; choose one of {', '.join(BACKENDS)}")
    for what, value, lo in (("--max-batch", opts.max_batch, 1), ("--instances", opts.instances, 1),
                            ("--max-sequences", opts.max_sequences, 1)) + \
            ((("--threads", opts.threads, 1),) if opts.threads is not None else ()):
        if not isinstance(value, int) or value < lo:
            raise ExportError(f"{what} must be an integer >= {lo}, got {value!r}")
    if not isinstance(opts.max_queue_delay_us, int) or opts.max_queue_delay_us < 0:
        raise ExportError(f"--max-queue-delay-us must be an integer >= 0, got {opts.max_queue_delay_us!r}")
    if opts.idle_timeout <= 0:
        raise ExportError(f"--idle-timeout must be > 0 seconds, got {opts.idle_timeout}")
    if not opts.name or any(c in opts.name for c in "/\\ ") or opts.name.startswith("."):
        raise ExportError(f"model name {opts.name!r} must be a plain folder name")
    if opts.backend == "onnxruntime" and model.kind != "onnx":
        raise ExportError(f"{model.path}: the onnxruntime backend serves .onnx files; this is a TensorRT engine")
    if opts.backend == "tensorrt" and model.kind != "engine":
        raise ExportError(f"{model.path}: the tensorrt backend serves engines; build one with "
                          "`txl-deploy build-engine` (or use --backend onnxruntime / python)")
    if opts.backend in PLATFORMS and model.info.config.mem_init != "empty":  # Triton's zero state: mem_count 0
        raise ExportError(f"{model.path}: this model's memory starts as mem_len attended zero vectors, which Triton's "
                          "zero initial state cannot express; serve it with --backend python")
    if opts.backend in PLATFORMS and model.info.state != "full":
        raise ExportError(f"{model.path}: Triton's implicit state needs a graph that outputs the whole next memory; "
                          f"this one was exported with the {model.info.state!r} state layout: re-export with "
                          "`--state full`, or serve it with --backend python")
    if model.max_batch is not None and opts.max_batch > model.max_batch:
        raise ExportError(f"{model.path}: --max-batch {opts.max_batch} exceeds the engine's profile (batch up to "
                          f"{model.max_batch}); rebuild the engine with a larger --batch or lower --max-batch")
    if opts.threads is not None and opts.backend != "python":
        raise ExportError("--threads applies to the python backend; Triton's onnxruntime backend takes "
                          "intra_op_thread_count in the model config's parameters")
    if opts.max_sequences < opts.max_batch:
        raise ExportError(f"--max-sequences {opts.max_sequences} is below --max-batch {opts.max_batch}: batches "
                          "are formed from live conversations, so they could never fill")


def _common_params(model: ServedModel) -> list[str]:
    c = model.info.config
    out = [_param(PARAM_PREFIX + "n_token", c.n_token), _param(PARAM_PREFIX + "mem_len", model.info.mem_len),
           _param(PARAM_PREFIX + "max_segment", model.max_segment)]
    if model.info.vocab is not None:
        vocab_json = model.info.vocab.to_json()
        if len(vocab_json.encode()) <= VOCAB_IN_CONFIG_BYTES:
            out.append(_param(PARAM_PREFIX + "vocab", vocab_json))
    return out


def config_text(model: ServedModel, opts: RepoOptions) -> str:
    """The config.pbtxt for `model` under `opts` (already resolved and checked)."""
    spec = model.spec
    v = model.info.config.n_token
    idle_us = int(round(opts.idle_timeout * 1e6))
    lp_type = TRITON_TYPES[model.dtype(io_spec.LOG_PROBS, "float")] if opts.backend != "python" else "TYPE_FP32"
    lines = [f"name: {pbtxt_string(opts.name)}"]
    if opts.backend == "python":
        lines.append('backend: "python"')
    else:
        lines.append(f'platform: "{PLATFORMS[opts.backend]}"')
        lines.append(f'default_model_filename: "{MODEL_FILES[opts.backend]}"')
    # The python model also parks and resumes conversations: an optional input with a saved state (START only) and
    # an output with the conversation's memory, returned only to requests that ask for it.
    resume = (f',\n  {{ name: "{RESUME_INPUT}" data_type: TYPE_UINT8 dims: [ -1 ] optional: true }}'
              if opts.backend == "python" else "")
    saved = (f',\n  {{ name: "{SAVED_OUTPUT}" data_type: TYPE_UINT8 dims: [ -1 ] }}'
             if opts.backend == "python" else "")
    # With an adaptive softmax it also answers lazy decoders: the head of a step, and tails of the same step on
    # request (protocol.py), so a client that samples need not fetch all V log-probs every token.
    cutoffs = list(model.info.config.cutoffs)
    if opts.backend == "python" and cutoffs:
        resume += f',\n  {{ name: "{TAIL_INPUT}" data_type: TYPE_INT64 dims: [ -1 ] optional: true }}'
        saved += (f',\n  {{ name: "{HEAD_OUTPUT}" data_type: TYPE_FP32 dims: [ -1, {cutoffs[0] + len(cutoffs)} ] }}'
                  f',\n  {{ name: "{TAIL_OUTPUT}" data_type: TYPE_FP32 dims: [ -1 ] }}')
    lines += [
        f"max_batch_size: {opts.max_batch}",
        "input [",
        f'  {{ name: "{io_spec.TOKENS}" data_type: TYPE_INT64 dims: [ -1 ] }},',
        f'  {{ name: "{io_spec.OUT_POSITIONS}" data_type: TYPE_INT64 dims: [ -1 ] }}' + resume,
        "]",
        "output [",
        f'  {{ name: "{io_spec.LOG_PROBS}" data_type: {lp_type} dims: [ -1, {v} ] }}' + saved,
        "]",
        "sequence_batching {",
        f"  max_sequence_idle_microseconds: {idle_us}",
        "  oldest {",
        f"    max_candidate_sequences: {opts.max_sequences}",
        f"    preferred_batch_size: [ {opts.max_batch} ]",
        f"    max_queue_delay_microseconds: {opts.max_queue_delay_us}",
        "  }",
    ]
    if opts.backend == "python":
        lines += [
            "  control_input [",
            '    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },',
            '    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },',
            '    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }',
            "  ]",
        ]
    else:
        # Batch-first state tensors: Triton batches on dimension 0, so `dims` are the per-conversation shape.
        pairing = spec.pairing()
        entries = []
        for s in spec.state_inputs():
            dims = list(s.shape[1:])
            t = TRITON_TYPES[model.dtype(s.name, s.dtype)]
            entries.append(
                f'    {{ input_name: "{s.name}" output_name: "{pairing[s.name]}" data_type: {t} dims: {_dims(dims)}\n'
                f'      initial_state {{ data_type: {t} dims: {_dims(dims)} zero_data: true '
                f'name: "empty memory" }} }}')
        lines += ["  state ["] + [",\n".join(entries)] + ["  ]"]
    lines.append("}")
    kind = opts.instance_kind or ("KIND_GPU" if opts.backend == "tensorrt" else
                                  "KIND_CPU" if opts.backend == "python" else None)
    lines.append(f"instance_group [ {{ count: {opts.instances}" + (f" kind: {kind}" if kind else "") + " } ]")
    params = _common_params(model)
    if opts.backend == "python":
        params += [_param("model_file", model.path.name), _param("max_request_tokens", model.max_segment)]
        if model.info.config.cutoffs:
            params.append(_param(CUTOFFS_PARAM, json.dumps([int(c) for c in model.info.config.cutoffs])))
        if opts.threads is not None:
            params.append(_param(PARAM_PREFIX + "threads", opts.threads))
    lines += params
    return "\n".join(lines) + "\n"


def parse_config(text: str):
    """Parse config.pbtxt text with Triton's own ModelConfig protobuf (from tritonclient); raises ExportError."""
    try:
        from tritonclient.grpc import model_config_pb2  # an optional dependency (the triton extra)
    except ImportError as e:
        raise ExportError(f"validating a Triton config needs tritonclient[grpc] ({e})") from None
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ExportError(f"generated config.pbtxt does not match Triton's model config schema: {e}") from None


def check_config(config, model: ServedModel, opts: RepoOptions) -> list[str]:
    """What Triton checks at load time that the schema alone does not: names and shapes against the model."""
    problems = []
    spec = model.spec
    sb = config.sequence_batching
    if not config.HasField("sequence_batching") or sb.WhichOneof("strategy_choice") != "oldest":
        problems.append("the sequence batcher with the oldest strategy is missing")
    if config.max_batch_size != opts.max_batch:
        problems.append(f"max_batch_size {config.max_batch_size} != {opts.max_batch}")
    names = {i.name for i in config.input} - ({RESUME_INPUT, TAIL_INPUT} if opts.backend == "python" else set())
    if names != {io_spec.TOKENS, io_spec.OUT_POSITIONS}:
        problems.append(f"inputs {sorted(names)}")
    if opts.backend == "python":
        kinds = {c.kind for ci in sb.control_input for c in ci.control}
        from tritonclient.grpc import model_config_pb2 as mc  # optional (the triton extra)

        want = {mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START,
                mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_END,
                mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID}
        if kinds != want:
            problems.append("the python model needs START, END and CORRID controls")
    else:
        pairing = spec.pairing()
        got = {s.input_name: s.output_name for s in sb.state}
        if got != pairing:
            problems.append("state pairs differ from the graph's (io_spec) pairing")
        for s in sb.state:
            init = list(s.initial_state)  # a repeated field in Triton's schema; we write one
            if len(init) != 1 or list(s.dims) != list(init[0].dims) or not init[0].zero_data:
                problems.append(f"state {s.input_name}: initial state must be zeros of the state's dims")
        declared = {s.name: list(s.shape[1:]) for s in spec.state_inputs()}
        for s in sb.state:
            if declared.get(s.input_name) != list(s.dims):
                problems.append(f"state {s.input_name}: dims {list(s.dims)} != graph {declared.get(s.input_name)}")
    return problems


# -- README in the repository ------------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def readme_text(model: ServedModel, opts: RepoOptions) -> str:
    per_conv = model.bytes_per_conversation()
    live = opts.max_sequences * opts.instances
    name = opts.name
    if opts.backend == "python":
        start = """The `python` backend serves `TxlRuntime` inside Triton's Python backend: each model instance holds
its conversations' memories as the rows of one batched state and runs each batch as one batched call. The Python
that runs it needs `txl-deploy` and its runtime dependencies (numpy, onnx, onnxruntime or tensorrt).

- Without Docker (Triton 2.51 from the `nvidia-pytriton` wheel, which bundles the Python backend):

      pip install -e '.[cpu]' 'tritonclient[all]'      # from the txl-deploy checkout
      pip install --no-deps --target .venv/triton nvidia-pytriton==0.7.0
      txl-deploy triton-server REPO --http-port 8000 --grpc-port 8001

  It sets what the bundled server
  needs: the Python-backend stub for your Python version in a backend folder, `LD_LIBRARY_PATH` to your Python's
  libpython, `PYTHONPATH` to your environment's site-packages (model.py applies it: the stub ignores it), and a
  working directory holding a link to your numpy.
- In Triton's container (`nvcr.io/nvidia/tritonserver:<yy.mm>-py3`), install txl-deploy into the container's
  Python (mount its checkout: `pip install -e '.[cpu]'`) and run `tritonserver --model-repository=/models`.
"""
    else:
        platform = PLATFORMS[opts.backend]
        start = f"""This repository uses `{platform}`, which needs Triton's `{opts.backend}` backend: use NVIDIA's container
(the `nvidia-pytriton` wheel bundles only the Python backend).

    docker run --rm --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 \\
        -v $PWD/REPO:/models nvcr.io/nvidia/tritonserver:<yy.mm>-py3 \\
        tritonserver --model-repository=/models
""" + ("""
A TensorRT engine only runs on the TensorRT version and GPU architecture it was built for: pick the container
release whose TensorRT matches the engine's sidecar (`1/model.plan.json`).
""" if opts.backend == "tensorrt" else "")
    return f"""# Triton model repository for a txl-deploy Transformer-XL

Written by `txl-deploy triton-repo` from `{model.path.name}`: model `{name}`, backend `{opts.backend}`,
max_batch_size {opts.max_batch}, {opts.instances} instance(s), up to {opts.max_sequences} live conversations per
instance, conversations idle for more than {opts.idle_timeout:g} s are dropped.

## Start Triton

{start}
Check it: `curl -s localhost:8000/v2/health/ready` answers 200 once the model is loaded.

## Talk to it

Each conversation is a Triton sequence: pick a non-zero `sequence_id` per conversation, send the first request with
`sequence_start=True` and the last with `sequence_end=True`. Inputs: `tokens` [1, Q] INT64 (Q <= {model.max_segment}),
`out_positions` [1, P] INT64 (which of the Q positions to return); output `log_probs` [1, P, {model.info.config.n_token}].

    txl-deploy serve-client http://localhost:8000 --prompt "Once upon a time" --max-new-tokens 50
    txl-deploy serve-client grpc://localhost:8001 --prompt "..." --model {name}

or from Python: `from txl_deploy.serving.triton.client import TxlTritonClient`. The vocabulary is in the model config
(`parameters`) when small, and always in `{name}/vocab.json`.

A request for a sequence the server does not know (never started, ended, idled out, or the server restarted)
gets an error ("must specify the START flag ..."): start a new conversation and send its text again.

## Memory and capacity

One conversation's memory is {per_conv:,} bytes ({_mib(per_conv)}): {model.spec.n_layer} layers x keys and
values for {model.info.mem_len} positions, plus a counter. This server holds at most {live} live conversations
({opts.max_sequences} per instance x {opts.instances}), i.e. about {_mib(per_conv * live)} of memory state (Triton also
keeps an output buffer per state tensor of a running batch).

When more conversations start than there are slots, the new ones wait in Triton's backlog (their first request
does not fail; it is answered once a slot frees) until a conversation ends (`sequence_end`) or idles out. Clients
should set a request timeout; raise `--max-sequences` / `--instances` if the backlog grows.

## Scaling out

Run several Triton servers with this repository. A conversation's memory lives in exactly one server process, so
every request of a conversation must reach the server that holds it (sticky routing by sequence id; a load
balancer that spreads connections does not do that). `TxlTritonClient(["grpc://a:8001", "grpc://b:8001", ...])`
routes by itself: rendezvous hashing of the sequence id over the list. A request routed elsewhere gets the
unknown-sequence error above, never another conversation's state.
""" + ("""
## Park, resume, move

Ask for the output `saved_state` (UINT8 [1, N]) in a request and the response carries the conversation's memory
after that request, as the bytes of an .npz file (`TxlRuntime.save_state()`'s arrays, the model's fingerprint, a
format version); with `sequence_end` that parks the conversation. A request with `sequence_start` and the input
`resume_state` (those bytes) starts a conversation from it, on this server or another one serving the same model; a
state from another model is refused. `tokens` may be empty ([1, 0]) in such a request. With `TxlTritonClient`:
`state = conv.park()`, `client.resume(state)`, `client.drain(url)` (move every conversation off a server).
""" if opts.backend == "python" else "")


# -- writing ---------------------------------------------------------------------------------------------------
def write_repository(model_path, out_dir, *, force: bool = False, **options) -> Path:
    """Write a Triton model repository for an exported model. Options: see RepoOptions."""
    model = inspect_model(model_path)
    opts = RepoOptions(**options).resolved(model)
    check_options(model, opts)
    text = config_text(model, opts)
    try:
        config = parse_config(text)
    except ExportError as e:
        if "needs tritonclient" not in str(e):
            raise
        config = None  # tritonclient is optional for writing; the tests validate every layout
    if config is not None:
        problems = check_config(config, model, opts)
        if problems:
            raise ExportError("generated config.pbtxt is inconsistent with the model: " + "; ".join(problems))
    out_dir = Path(out_dir)
    with atomic_path(out_dir, force=force) as tmp:
        model_dir = tmp / opts.name
        version = model_dir / "1"
        version.mkdir(parents=True)
        (model_dir / "config.pbtxt").write_text(text, encoding="utf-8")
        if model.info.vocab is not None:
            (model_dir / "vocab.json").write_text(model.info.vocab.to_json(), encoding="utf-8")
        if opts.backend == "python":
            shutil.copy2(model.path, version / model.path.name)
            shutil.copy2(Path(__file__).with_name("python_model.py"), version / "model.py")
        else:
            shutil.copy2(model.path, version / MODEL_FILES[opts.backend])
        for extra, name in model.extra_files + (model.part_files if opts.backend == "python" else []):
            if opts.backend == "tensorrt" and model.kind == "engine" and name.endswith(".json"):
                name = MODEL_FILES["tensorrt"] + ".json"  # the sidecar beside Triton's model.plan
            # an external data file keeps the location the model names (checked to stay inside the folder)
            target = version / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if Path(extra).is_file():
                shutil.copy2(extra, target)
        (tmp / "README.md").write_text(readme_text(model, opts), encoding="utf-8")
    logger.info(f"wrote Triton repository {out_dir} (model {opts.name!r}, {opts.backend} backend, "
                f"{_mib(model.bytes_per_conversation())} per conversation)")
    return out_dir
