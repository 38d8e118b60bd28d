"""Triton serving: generated repositories against Triton's own config schema, and a real tritonserver on loopback.

The server tests run the tritonserver that the nvidia-pytriton wheel bundles (Triton 2.51, Python backend only), on
the Python-backend repository `triton-repo --backend python` writes. Install it with
`pip install --no-deps --target .venv/triton nvidia-pytriton==0.7.0`; without it they are skipped with that command.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from google.protobuf import text_format  # comes with tritonclient[grpc]
from helpers.conversations import alone
from tritonclient.grpc import model_config_pb2 as mc

from txl_deploy.contract import io_spec
from txl_deploy.errors import ExportError, OutputExistsError
from txl_deploy.serving.triton.repository import pbtxt_string, write_repository


def parse(path):
    """Triton's own ModelConfig protobuf: unknown fields, bad enums or types fail here as they would in Triton."""
    return text_format.Parse(path.read_text(encoding="utf-8"), mc.ModelConfig())


# -- repositories ------------------------------------------------------------------------------------------------
def test_onnxruntime_repository_uses_implicit_state_for_the_whole_memory(tiny_onnx_full, tmp_path):
    from txl_deploy.contract.metadata import read_onnx_info

    repo = write_repository(tiny_onnx_full, tmp_path / "repo", max_batch=4, instances=3, max_sequences=10,
                            idle_timeout=90)
    cfg = parse(repo / "txl" / "config.pbtxt")
    info = read_onnx_info(tiny_onnx_full)
    spec = info.spec()
    assert spec.state == "full"
    assert cfg.platform == "onnxruntime_onnx" and cfg.max_batch_size == 4
    assert (repo / "txl" / "1" / "model.onnx").read_bytes() == tiny_onnx_full.read_bytes()
    sb = cfg.sequence_batching
    assert sb.WhichOneof("strategy_choice") == "oldest"
    assert sb.oldest.max_candidate_sequences == 10 and list(sb.oldest.preferred_batch_size) == [4]
    assert sb.max_sequence_idle_microseconds == 90_000_000
    assert cfg.instance_group[0].count == 3
    # every state input is fed by its next_ output, batch-first (dims are the per-conversation shape), zeros at START
    assert {s.input_name: s.output_name for s in sb.state} == spec.pairing()
    declared = {s.name: s for s in spec.state_inputs()}
    for s in sb.state:
        assert list(s.dims) == list(declared[s.input_name].shape[1:])
        assert len(s.initial_state) == 1 and s.initial_state[0].zero_data
        assert list(s.initial_state[0].dims) == list(s.dims)
    count = next(s for s in sb.state if s.input_name == io_spec.MEM_COUNT)
    assert count.data_type == mc.TYPE_INT64 and list(count.dims) == []
    assert {s.data_type for s in sb.state if s.input_name != io_spec.MEM_COUNT} == {mc.TYPE_FP32}
    # the graph takes no control tensors: Triton's ONNX Runtime backend would refuse undeclared model inputs
    assert len(sb.control_input) == 0
    assert [i.name for i in cfg.input] == [io_spec.TOKENS, io_spec.OUT_POSITIONS]
    assert [o.name for o in cfg.output] == [io_spec.LOG_PROBS] and list(cfg.output[0].dims) == [-1, info.config.n_token]
    assert json.loads(cfg.parameters["txl_deploy.vocab"].string_value) == info.vocab.to_dict()
    # README: how to start Triton, and the bytes per conversation the paper's formula gives (+ the counter)
    readme = (repo / "README.md").read_text()
    per_conv = info.config.memory_bytes_per_stream(info.mem_len)["kv_cache"] + 8
    assert f"{per_conv:,} bytes" in readme and "tritonserver --model-repository" in readme
    assert "sticky" in readme and "backlog" in readme


def test_incremental_graph_is_refused_for_implicit_state(tiny_onnx, tmp_path):
    with pytest.raises(ExportError, match="--state full"):
        write_repository(tiny_onnx, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_options_that_triton_or_the_model_cannot_honour_are_refused(tiny_onnx_full, tmp_path):
    with pytest.raises(ExportError, match="below --max-batch"):
        write_repository(tiny_onnx_full, tmp_path / "r", max_batch=8, max_sequences=4)
    with pytest.raises(ExportError, match="--instances must be"):
        write_repository(tiny_onnx_full, tmp_path / "r", instances=0)
    with pytest.raises(ExportError, match="tensorrt backend serves engines"):
        write_repository(tiny_onnx_full, tmp_path / "r", backend="tensorrt")
    write_repository(tiny_onnx_full, tmp_path / "r")
    with pytest.raises(OutputExistsError):
        write_repository(tiny_onnx_full, tmp_path / "r")
    write_repository(tiny_onnx_full, tmp_path / "r", force=True, max_batch=2)
    assert parse(tmp_path / "r" / "txl" / "config.pbtxt").max_batch_size == 2


def fake_engine(onnx_path, folder, batch_max=8):
    """An engine file + sidecar as build-engine writes them (TensorRT itself is not needed to write a repository)."""
    from txl_deploy.contract.engine_file import SIDECAR_FORMAT, SIDECAR_VERSION
    from txl_deploy.contract.metadata import read_onnx_info

    info = read_onnx_info(onnx_path)
    engine = folder / "tiny.engine"
    engine.write_bytes(b"not really an engine")
    meta = {"format": SIDECAR_FORMAT, "format_version": SIDECAR_VERSION, "tensorrt_version": "10.3.0",
            "precision": "fp32", "batch": [1, 4, batch_max], "segment": [1, 8, 16], "config": info.config.to_dict(),
            "vocab": info.vocab.to_dict(), "export": info.export, "onnx": onnx_path.name}
    (folder / "tiny.engine.json").write_text(json.dumps(meta))
    shutil.copy2(onnx_path, folder / onnx_path.name)
    return engine


def test_tensorrt_repository(tiny_onnx_full, tmp_path):
    engine = fake_engine(tiny_onnx_full, tmp_path)
    repo = write_repository(engine, tmp_path / "repo", max_batch=8)
    cfg = parse(repo / "txl" / "config.pbtxt")
    assert cfg.platform == "tensorrt_plan" and cfg.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert (repo / "txl" / "1" / "model.plan").read_bytes() == engine.read_bytes()
    assert (repo / "txl" / "1" / "model.plan.json").is_file()
    assert len(cfg.sequence_batching.state) == len(io_spec.GraphSpec(2, 2, 8, 12, 60, "full").state_inputs())
    with pytest.raises(ExportError, match="exceeds the engine's profile"):
        write_repository(engine, tmp_path / "repo2", max_batch=16)


def test_python_repository_has_sequence_controls_and_the_model(tiny_onnx, tmp_path):
    repo = write_repository(tiny_onnx, tmp_path / "repo", backend="python", name="chat", max_batch=2)
    cfg = parse(repo / "chat" / "config.pbtxt")
    assert cfg.backend == "python" and cfg.name == "chat"
    kinds = {ci.name: ci.control[0] for ci in cfg.sequence_batching.control_input}
    Control = mc.ModelSequenceBatching.Control
    assert kinds["START"].kind == Control.CONTROL_SEQUENCE_START
    assert kinds["END"].kind == Control.CONTROL_SEQUENCE_END
    assert kinds["CORRID"].kind == Control.CONTROL_SEQUENCE_CORRID and kinds["CORRID"].data_type == mc.TYPE_UINT64
    assert cfg.sequence_batching.oldest.max_candidate_sequences == 8  # default 4 x max_batch
    assert len(cfg.sequence_batching.state) == 0
    assert (repo / "chat" / "1" / "model.py").read_text().startswith('"""Triton Python-backend model')
    assert (repo / "chat" / "1" / tiny_onnx.name).is_file()
    assert cfg.parameters["model_file"].string_value == tiny_onnx.name


def test_config_strings_survive_any_vocabulary():
    text = 'a"b\\c\nd\t é ✓ {"k": [1]}'
    cfg = text_format.Parse(f"name: {pbtxt_string('m')}\nparameters {{ key: \"v\" value {{ string_value: "
                            f"{pbtxt_string(text)} }} }}", mc.ModelConfig())
    assert cfg.parameters["v"].string_value == text


def test_triton_repo_command(tiny_onnx, tiny_onnx_full, tmp_path):
    from txl_deploy.cli import main

    runner = CliRunner()
    ok = runner.invoke(main, ["triton-repo", str(tiny_onnx_full), "-o", str(tmp_path / "r"), "--max-batch", "2",
                              "--instances", "2", "--max-sequences", "6", "--idle-timeout", "30"])
    assert ok.exit_code == 0, ok.output
    cfg = parse(tmp_path / "r" / "txl" / "config.pbtxt")
    assert (cfg.max_batch_size, cfg.instance_group[0].count, cfg.sequence_batching.oldest.max_candidate_sequences,
            cfg.sequence_batching.max_sequence_idle_microseconds) == (2, 2, 6, 30_000_000)
    bad = runner.invoke(main, ["triton-repo", str(tiny_onnx), "-o", str(tmp_path / "r2")])
    assert bad.exit_code == 2 and "--state full" in bad.output and "Traceback" not in bad.output
    again = runner.invoke(main, ["triton-repo", str(tiny_onnx_full), "-o", str(tmp_path / "r")])
    assert again.exit_code == 2 and "already exists" in again.output


# -- a real server -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served_repo(tritonserver, tiny_onnx, tmp_path_factory):
    """One repository, two Python-backend models: `txl` (16 live conversations) and `one` (a single slot)."""
    base = tmp_path_factory.mktemp("triton")
    repo = write_repository(tiny_onnx, base / "repo", backend="python", max_batch=4, max_sequences=16,
                            idle_timeout=120)
    single = write_repository(tiny_onnx, base / "single", backend="python", name="one", max_batch=1,
                              max_sequences=1, idle_timeout=120)
    shutil.move(str(single / "one"), str(repo / "one"))
    return repo


@pytest.fixture(scope="module")
def server(served_repo):
    from txl_deploy.serving.triton.local_server import TritonServer

    with TritonServer(served_repo) as srv:
        yield srv


def through_server(url, prompt, n, barrier=None):
    from txl_deploy.serving.triton.client import TxlTritonClient

    client = TxlTritonClient(url, timeout=120)
    toks, lps = [], []
    with client.conversation() as conv:
        if barrier is not None:
            barrier.wait(timeout=60)  # all conversations are live at once
        gen = conv.generate(prompt, max_new_tokens=n)
        for tok in gen:
            lps.append(conv.last_log_probs.copy())
            toks.append(tok)
    client.close()
    return toks, lps


def test_concurrent_conversations_each_get_exactly_their_own_tokens(server, reference):
    rng = np.random.default_rng(0)
    # different prompts and lengths, some longer than one request segment (16) so they go in pieces
    prompts = [rng.integers(0, 60, size=int(rng.integers(1, 30))).tolist() for _ in range(16)]
    n = 8
    urls = [server.http_url if i % 2 else server.grpc_url for i in range(16)]
    barrier = threading.Barrier(16)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda a: through_server(a[0], a[1], n, barrier), zip(urls, prompts)))
    for prompt, (toks, lps) in zip(prompts, results):
        want_toks, want_lps = alone(reference, prompt, n)
        assert toks == want_toks
        np.testing.assert_allclose(np.stack(lps), np.stack(want_lps), rtol=0, atol=1e-5)


def test_an_ended_conversation_frees_its_slot(server):
    from txl_deploy.serving.triton.client import TxlTritonClient

    a, b = TxlTritonClient(server.http_url, model="one"), TxlTritonClient(server.grpc_url, model="one")
    conv_a = a.conversation()
    conv_a.feed([1, 2, 3])
    conv_b = b.conversation()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(conv_b.feed, [4, 5])  # the only slot is A's: B waits in Triton's backlog
        for tok in (6, 7, 8):
            conv_a.feed([tok])
            assert not waiting.done()
        conv_a.close()
        waiting.result(timeout=120)  # A ended: B gets the slot
    conv_b.close()
    # the freed slot serves new conversations again
    with a.conversation() as conv_c:
        conv_c.feed([9])


def test_unknown_or_ended_conversation_gets_an_error(server):
    from txl_deploy.serving.triton.client import ServingError, TxlTritonClient

    client = TxlTritonClient(server.http_url)
    with pytest.raises(ServingError, match="does not know conversation 12345"):
        client.infer(12345, [1], [0])
    conv = client.conversation()
    conv.feed([1, 2])
    conv.close()
    with pytest.raises(ServingError, match=f"does not know conversation {conv.id}"):
        client.infer(conv.id, [3], [0])


def test_bad_input_over_the_wire_is_refused_and_other_conversations_are_undisturbed(server, reference):
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    from txl_deploy.serving.triton.client import ServingError, TxlTritonClient

    client = TxlTritonClient(server.http_url)
    prompt, n = [5, 17, 42, 3], 6
    want_toks, want_lps = alone(reference, prompt, n)
    with client.conversation() as good, client.conversation() as victim:
        good_lps = [good.feed(prompt)]
        victim.feed([8, 9])
        raw = th.InferenceServerClient(server.http_url[len("http://"):])

        def send(name_dtype_array, sid):
            inputs = []
            for name, dtype, array in name_dtype_array:
                inp = th.InferInput(name, list(array.shape), dtype)
                inp.set_data_from_numpy(array)
                inputs.append(inp)
            return raw.infer("txl", inputs, sequence_id=sid)

        cases = {
            "wrong dtype": [("tokens", "INT32", np.array([[1]], np.int32)), ("out_positions", "INT64", np.array([[0]]))],
            "float tokens": [("tokens", "FP32", np.array([[1.0]], np.float32)), ("out_positions", "INT64", np.array([[0]]))],
        }
        for what, inputs in cases.items():
            with pytest.raises(InferenceServerException, match="data-type is '(INT32|FP32)'.*expects 'INT64'"):
                send(inputs, victim.id)
        with pytest.raises(ServingError, match="outside the vocabulary"):
            client.infer(victim.id, [60], [0])
        with pytest.raises(ServingError, match="outside the vocabulary"):
            client.infer(victim.id, [-1], [0])
        with pytest.raises(ServingError, match="longer than this server accepts"):
            client.infer(victim.id, np.zeros(17, np.int64), [16])
        with pytest.raises(ServingError, match="out_positions"):
            client.infer(victim.id, [1, 2], [2])
        with pytest.raises(InferenceServerException, match="must specify batch-size 1"):  # the sequence batcher
            send([("tokens", "INT64", np.array([[1], [2]])), ("out_positions", "INT64", np.array([[0], [0]]))],
                 victim.id)
        # the untouched conversation continues exactly as it would alone
        toks = []
        for _ in range(n):
            toks.append(int(np.argmax(good_lps[-1])))
            good_lps.append(good.feed([toks[-1]]))
        assert toks == want_toks
        np.testing.assert_allclose(np.stack(good_lps[:n]), np.stack(want_lps), rtol=0, atol=1e-5)
        # and the conversation that received the bad requests kept its memory: it still matches its own history
        victim_next = victim.feed([10])
        v_toks, v_lps = alone(reference, [8, 9, 10], 1)
        np.testing.assert_allclose(victim_next, v_lps[0], rtol=0, atol=1e-5)


def test_a_server_restart_gives_the_client_a_clear_error(served_repo):
    from txl_deploy.serving.triton.client import ServingError, TxlTritonClient
    from txl_deploy.serving.triton.local_server import TritonServer

    with TritonServer(served_repo) as srv:
        client = TxlTritonClient(srv.grpc_url, timeout=30)
        conv = client.conversation()
        conv.feed([1, 2, 3])
        srv.stop()
        with pytest.raises(ServingError, match="cannot reach Triton"):
            conv.feed([4])
        srv.start()
        # gRPC reconnects with a backoff, so the first calls may still say "cannot reach"; never an answer
        deadline = time.monotonic() + 60
        while True:
            with pytest.raises(ServingError) as err:
                conv.feed([4])
            if "cannot reach" not in str(err.value) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert f"does not know conversation {conv.id}" in str(err.value) and "restarted" in str(err.value)
        # a new conversation on the restarted server works
        with client.conversation() as fresh:
            assert fresh.feed([1, 2, 3]).shape == (60,)


def test_a_port_taken_before_the_first_start_is_chosen_again(served_repo):
    """Ports chosen free can be taken by another process before the server binds them: a first start on ports of
    its own choosing chooses again instead of failing."""
    from txl_deploy.serving.triton.local_server import TritonServer

    srv = TritonServer(served_repo)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", srv.http_port))
        taken.listen()
        with srv:
            assert srv.http_port != taken.getsockname()[1] and srv.ready()
            assert "in use" in Path(srv.log_path).read_text().lower()  # the first try met the taken port


def test_serve_client_command_streams_the_greedy_continuation(server, reference):
    from txl_deploy.cli import main

    prompt = "w5 w17 w42"
    rt = reference()
    want = rt.decode(list(rt.generate(prompt, max_new_tokens=6, temperature=0)))
    result = CliRunner().invoke(main, ["serve-client", server.grpc_url, "--prompt", prompt, "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == want.strip()
    down = CliRunner().invoke(main, ["serve-client", "http://127.0.0.1:9", "--prompt", "w1"])
    assert down.exit_code == 2 and "cannot reach Triton" in down.output and "Traceback" not in down.output


def test_triton_core_loads_the_implicit_state_section(tritonserver, tiny_onnx_full, tmp_path):
    """The bundled server has no ONNX Runtime backend, but Triton core validates the sequence batcher and its state
    section for any backend: load the onnxruntime config with the python backend in the platform's place."""
    from txl_deploy.serving.triton.local_server import TritonServer

    repo = write_repository(tiny_onnx_full, tmp_path / "repo")
    config = repo / "txl" / "config.pbtxt"
    text = config.read_text().replace('platform: "onnxruntime_onnx"', 'backend: "python"')
    config.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith("default_model_filename")))
    (repo / "txl" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n")
    with TritonServer(repo) as srv:
        import urllib.request

        loaded = json.loads(urllib.request.urlopen(f"{srv.http_url}/v2/models/txl/config", timeout=10).read())
    states = {s["input_name"]: s for s in loaded["sequence_batching"]["state"]}
    assert set(states) == set(io_spec.GraphSpec(2, 2, 8, 12, 60, "full").pairing())
    assert states[io_spec.MEM_COUNT]["dims"] == [] and states[io_spec.MEM_COUNT]["initial_state"][0]["zero_data"]
    assert states[io_spec.mem_k(0)]["dims"] == [2, 8, 12]
