"""Checkpoint import: parity with each source implementation, the restricted unpickler, bad input, convert/info.

Where each source implementation comes from:
- HuggingFace: transformers' real `TransfoXLLMHeadModel` (deprecated module, transformers <= 4.57; skipped when it
  is not installed), saved with its own `save_pretrained`.
- Original CMU code (kimiyoung/transformer-xl): not installable, so `tests/standins/cmu/` holds a stand-in that
  follows `pytorch/mem_transformer.py` and `pytorch/utils/proj_adaptive_softmax.py` line by line under the
  original module names (its docstring lists the few deviations). The test `torch.save`s the whole module, as the
  original train.py does, and txl-deploy reads it back with its restricted unpickler, without the stand-in code.
- NVIDIA DeepLearningExamples: likewise a line-by-line stand-in (`tests/standins/nvidia/`, latest version with the
  stacked memory), saved as their train.py's checkpoint dict (model_config, model_state, args, vocab, ...).

Every parity test runs >= 4 consecutive segments with the memory threaded, batch 3, fp32, and compares full
log-probabilities to 1e-5.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# NVIDIA's own code (the stand-in) compiles `add_and_scale` with torch.jit.script, deprecated in current torch.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")

from click.testing import CliRunner  # noqa: E402

from txl_deploy.checkpoints import load_model  # noqa: E402
from txl_deploy.cli import main  # noqa: E402
from txl_deploy.errors import CheckpointError  # noqa: E402

STANDINS = Path(__file__).parent / "standins"
V, N_LAYER, N_HEAD, D_HEAD, D_MODEL, D_INNER = 40, 2, 2, 8, 16, 32
Q, MEM_LEN, CLAMP_LEN, BATCH, SEGMENTS = 5, 7, 4, 3, 6
TOL = 1e-5
WORDS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(V - 2)]


# -- helpers ---------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These models are tiny: with several intra-op threads on a busy 2-core machine each op waits on the others.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def standin(name):
    """Import a stand-in source tree (tests/standins/<name>) under the original module names, then forget it.

    Both trees define `mem_transformer`; modules of that name (and NVIDIA's `utils`) are swapped out for the block
    so that pickling finds the stand-in classes under their original qualified names.
    """
    root = str(STANDINS / name)
    ours = ("mem_transformer", "proj_adaptive_softmax", "utils")
    clashing = {m: sys.modules.pop(m) for m in list(sys.modules) if m in ours or m.startswith("utils.")}
    sys.path.insert(0, root)
    try:
        yield importlib.import_module("mem_transformer")
    finally:
        sys.path.remove(root)
        for m in list(sys.modules):
            if m in ours or m.startswith("utils."):
                del sys.modules[m]
        sys.modules.update(clashing)


def randomize(module, seed):
    """Random weights everywhere (the sources leave many parameters uninitialised or at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.1 if "layer_norm" in name else 0.15
            base = 1.0 if name.endswith("layer_norm.weight") else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))
    return module.eval()


def tokens(seed=0, segments=SEGMENTS):
    return torch.randint(0, V, (BATCH, Q * segments), generator=torch.Generator().manual_seed(seed))


def run_ours(model, ids):
    """Log-probs [B, Q, V] per segment from our model, memory threaded."""
    out, mems = [], None
    with torch.no_grad():
        for s in range(ids.shape[1] // Q):
            lp, mems = model(ids[:, s * Q:(s + 1) * Q], mems)
            out.append(lp)
    return out, mems


def max_diff(a_list, b_list):
    return [float((a - b).abs().max()) for a, b in zip(a_list, b_list)]


def write_vocab_txt(folder):
    (Path(folder) / "vocab.txt").write_text("".join(f"{w}\n" for w in WORDS))


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, message
    return message


def convert_and_compare(src, tmp_path, reference_lps, ids, *extra):
    """`txl-deploy convert` to our format, reload, and expect the very same log-probs."""
    out = tmp_path / "converted"
    result = cli("convert", src, "-o", out, *extra)
    assert result.exit_code == 0, result.output
    back = load_model(out)
    assert back.source_format == "txl-deploy"
    lps, _ = run_ours(back.build(), ids)
    assert max(max_diff(lps, reference_lps)) <= 1e-6
    return back


# -- original CMU code -------------------------------------------------------------------------------------
CMU_VARIANTS = {
    # adaptive input/softmax with div_val 2, projections tied for the tail clusters
    "div2": dict(d_embed=16, div_val=2, cutoffs=[10, 25], tie_projs=[False, True, True], same_length=False),
    # d_embed != d_model, untied output layer, same_length, pre-LayerNorm
    "div2-untied-same-pre": dict(d_embed=32, div_val=2, cutoffs=[10, 25], tie_weight=False,
                                 tie_projs=[False, False, True], same_length=True, pre_lnorm=True),
    # div_val 1 with a projection (d_embed != d_model): one output layer sliced per cluster
    "div1-proj-same": dict(d_embed=24, div_val=1, cutoffs=[10, 25], tie_projs=[False, True, True],
                           same_length=True),
    # a character-level model: no clusters, plain softmax
    "char": dict(cutoffs=[], same_length=False),
}


def build_cmu(mt, variant, seed=1):
    kw = dict(tie_weight=True, d_embed=None, div_val=1, tie_projs=[False], pre_lnorm=False, cutoffs=[],
              same_length=False)
    kw.update(CMU_VARIANTS[variant])
    torch.manual_seed(seed)
    model = mt.MemTransformerLM(V, N_LAYER, N_HEAD, D_MODEL, D_HEAD, D_INNER, 0.0, 0.0, tgt_len=Q, ext_len=0,
                                mem_len=MEM_LEN, clamp_len=CLAMP_LEN, **kw)
    return randomize(model, seed), kw


def run_cmu(mt, model, ids):
    """The original model's log-probs per segment, batch-first, memory threaded (time-major inside)."""
    out, mems = [], None
    with torch.no_grad():
        for s in range(ids.shape[1] // Q):
            lp, mems = mt.full_log_probs(model, ids[:, s * Q:(s + 1) * Q].t().contiguous(), mems)
            out.append(lp.transpose(0, 1))
    return out, mems


@pytest.mark.parametrize("variant", list(CMU_VARIANTS))
def test_cmu_model_pt_parity(variant, tmp_path):
    ids = tokens(1)
    with standin("cmu") as mt:
        model, _ = build_cmu(mt, variant)
        reference, ref_mems = run_cmu(mt, model, ids)
        # The legacy (pre-1.6) serialisation for one variant: the original checkpoints were written by torch 0.4.
        torch.save(model, tmp_path / "model.pt", _use_new_zipfile_serialization=(variant != "div2"))
    write_vocab_txt(tmp_path)

    # Loaded with the stand-in modules gone: nothing of mem_transformer is importable now.
    assert "mem_transformer" not in sys.modules
    loaded = load_model(tmp_path / "model.pt")
    assert loaded.source_format == "cmu"
    cfg = loaded.config
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner, cfg.mem_len, cfg.clamp_len) == (
        N_LAYER, D_MODEL, N_HEAD, D_HEAD, D_INNER, MEM_LEN, CLAMP_LEN)
    assert cfg.cutoffs == CMU_VARIANTS[variant]["cutoffs"]
    assert cfg.same_length == CMU_VARIANTS[variant]["same_length"]
    assert cfg.tie_weight == CMU_VARIANTS[variant].get("tie_weight", True)
    assert loaded.vocab is not None and loaded.vocab.symbols == WORDS

    ours = loaded.build()
    lps, mems = run_ours(ours, ids)
    assert len(lps) >= 4
    assert max(max_diff(lps, reference)) <= TOL
    # The memory itself: the original caches n_layer + 1 time-major tensors; the first n_layer are ours.
    assert max(float((m - r.transpose(0, 1)).abs().max()) for m, r in zip(mems, ref_mems)) <= TOL

    if variant == "div2":
        convert_and_compare(tmp_path / "model.pt", tmp_path, lps, ids)


def test_cmu_state_dict_with_config_parity(tmp_path):
    """A bare state_dict in the original names plus the constructor arguments as JSON beside it."""
    ids = tokens(2)
    with standin("cmu") as mt:
        model, kw = build_cmu(mt, "div2-untied-same-pre", seed=2)
        reference, _ = run_cmu(mt, model, ids)
        torch.save(model.state_dict(), tmp_path / "weights.pt")
    config = dict(n_token=V, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, d_head=D_HEAD, d_inner=D_INNER,
                  dropout=0.1, dropatt=0.0, tgt_len=Q, ext_len=0, mem_len=MEM_LEN, clamp_len=CLAMP_LEN,
                  attn_type=0, **kw)
    (tmp_path / "weights.json").write_text(json.dumps(config))
    write_vocab_txt(tmp_path)

    loaded = load_model(tmp_path / "weights.pt")
    assert loaded.source_format == "cmu-state-dict"
    lps, _ = run_ours(loaded.build(), ids)
    assert max(max_diff(lps, reference)) <= TOL

    # The same state_dict as .safetensors (tied tensors stored twice, as safetensors cannot share them).
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "weights.safetensors"))
    from_safetensors = load_model(tmp_path / "weights.safetensors")
    assert from_safetensors.source_format == "cmu-state-dict"
    assert max(max_diff(run_ours(from_safetensors.build(), ids)[0], reference)) <= TOL

    # The same config given explicitly (--config), from another place.
    other = tmp_path / "elsewhere.json"
    (tmp_path / "weights.json").rename(other)
    assert_one_line_error(cli("info", tmp_path / "weights.pt"), "weights.pt", "needs a config")
    convert_and_compare(tmp_path / "weights.pt", tmp_path, lps, ids, "--config", other)


# -- NVIDIA DeepLearningExamples -------------------------------------------------------------------------
NVIDIA_VARIANTS = {
    "div2-same": dict(d_embed=16, div_val=2, cutoffs=[10, 25], tie_projs=[False, True, True], same_length=True),
    "div2-untied": dict(d_embed=32, div_val=2, cutoffs=[10, 25], tie_weight=False, tie_projs=[False, False, True],
                        same_length=False),
    "div1-proj-same": dict(d_embed=24, div_val=1, cutoffs=[10, 25], tie_projs=[False, False, True],
                           same_length=True, pre_lnorm=True),
}


def save_nvidia_checkpoint(mt, variant, path, seed=3):
    vocabulary = importlib.import_module("utils.vocabulary")
    model_config = dict(n_token=V, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, d_head=D_HEAD, d_inner=D_INNER,
                        dropout=0.1, dropatt=0.0, dtype=None, tie_weight=True, d_embed=D_MODEL, div_val=1,
                        tie_projs=[False], pre_lnorm=False, tgt_len=Q, ext_len=0, mem_len=MEM_LEN, cutoffs=[],
                        same_length=False, attn_type=0, clamp_len=CLAMP_LEN, sample_softmax=-1)
    model_config.update(NVIDIA_VARIANTS[variant])
    torch.manual_seed(seed)
    model = randomize(mt.MemTransformerLM(**model_config), seed)
    vocab = vocabulary.Vocab(special=["<eos>"], lower_case=False)
    vocab.count_sents([[w] * (V - i) for i, w in enumerate(WORDS[1:])])
    with contextlib.redirect_stdout(None):
        vocab.build_vocab()
    args = argparse.Namespace(dataset="wt103", n_layer=N_LAYER, d_model=D_MODEL, fp16=False, work_dir="LM-TFM")
    # train.py:save_checkpoint
    state = {
        "args": args,
        "model_config": model_config,
        "model_state": model.state_dict(),
        "optimizer_state": torch.optim.Adam(model.parameters(), lr=0.01).state_dict(),
        "scheduler_state": {"T_max": 100, "eta_min": 0.001, "base_lrs": [0.01], "last_epoch": 3},
        "vocab": vocab,
        "amp_state": None,
        "train_step": 3,
        "best_val_loss": 4.25,
    }
    torch.save(state, path)
    return model, vocab.idx2sym


@pytest.mark.parametrize("variant", list(NVIDIA_VARIANTS))
def test_nvidia_checkpoint_parity(variant, tmp_path):
    ids = tokens(3)
    with standin("nvidia") as mt:
        model, symbols = save_nvidia_checkpoint(mt, variant, tmp_path / "checkpoint_best.pt")
        reference, mems = [], None
        with torch.no_grad():
            for s in range(SEGMENTS):
                lp, mems = mt.full_log_probs(model, ids[:, s * Q:(s + 1) * Q].t().contiguous(), mems)
                reference.append(lp.transpose(0, 1))

    loaded = load_model(tmp_path / "checkpoint_best.pt")
    assert loaded.source_format == "nvidia"
    assert loaded.config.same_length_extra == (1 if NVIDIA_VARIANTS[variant]["same_length"] else 0)
    # The vocabulary travels inside NVIDIA's checkpoint (their Vocab object, read as inert data).
    assert loaded.vocab is not None and loaded.vocab.symbols == symbols and len(symbols) == V
    lps, our_mems = run_ours(loaded.build(), ids)
    assert max(max_diff(lps, reference)) <= TOL
    assert float((torch.stack(our_mems) - mems.transpose(1, 2)).abs().max()) <= TOL  # NVIDIA: [L, M, B, D]

    if variant == "div2-same":
        back = convert_and_compare(tmp_path / "checkpoint_best.pt", tmp_path, lps, ids)
        assert back.vocab.symbols == symbols


# -- HuggingFace transformers ------------------------------------------------------------------------------
@pytest.fixture
def hf(monkeypatch):
    transfo = pytest.importorskip("transformers.models.deprecated.transfo_xl")
    from transformers.utils import logging

    logging.set_verbosity_error()
    original = torch.Tensor.type_as
    # The deprecated TransfoXLModel.forward calls `torch.arange(...).type_as(dtype=word_emb.dtype)`; current torch
    # only has `type_as(other)` and raises TypeError. Let the `dtype=` keyword mean `.to(dtype)`.
    monkeypatch.setattr(torch.Tensor, "type_as",
                        lambda self, other=None, dtype=None: self.to(dtype) if other is None else original(self, other))
    return transfo


def build_hf(transfo, untie_r, same_length, tie_word_embeddings=True, d_embed=16, seed=4):
    cfg = transfo.TransfoXLConfig(
        vocab_size=V, cutoffs=[10, 25], d_model=D_MODEL, d_embed=d_embed, n_head=N_HEAD, d_head=D_HEAD,
        d_inner=D_INNER, div_val=2, n_layer=N_LAYER, mem_len=MEM_LEN, clamp_len=CLAMP_LEN, same_length=same_length,
        untie_r=untie_r, proj_share_all_but_first=True, dropout=0.0, dropatt=0.0,
        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return randomize(transfo.TransfoXLLMHeadModel(cfg), seed)


def run_hf(model, ids, mems):
    out = []
    with torch.no_grad():
        for s in range(ids.shape[1] // Q):
            result = model(input_ids=ids[:, s * Q:(s + 1) * Q], mems=mems)
            out.append(result.prediction_scores)
            mems = result.mems
    return out


HF_VARIANTS = [
    # (untie_r, same_length, tie_word_embeddings, d_embed)
    (True, True, True, 16),
    (True, False, False, 32),
    (False, True, True, 32),
    (False, False, True, 16),
]


@pytest.mark.parametrize("untie_r,same_length,tie_word_embeddings,d_embed", HF_VARIANTS)
def test_huggingface_parity(hf, tmp_path, untie_r, same_length, tie_word_embeddings, d_embed):
    model = build_hf(hf, untie_r, same_length, tie_word_embeddings, d_embed)
    folder = tmp_path / "hf"
    # HF refuses to write the layers' shared r-biases (untie_r false) to safetensors: those go to pytorch_model.bin.
    model.save_pretrained(folder, safe_serialization=untie_r)
    assert (folder / ("model.safetensors" if untie_r else "pytorch_model.bin")).is_file()
    write_vocab_txt(folder)

    loaded = load_model(folder)
    assert loaded.source_format == "huggingface"
    assert loaded.config.untie_r == untie_r and loaded.config.tie_weight == tie_word_embeddings
    ours = loaded.build()
    ids = tokens(4)
    lps, _ = run_ours(ours, ids)
    # HF fed an explicitly empty memory behaves as the paper (and we) do from the first segment on.
    empty = [torch.zeros(0, BATCH, D_MODEL) for _ in range(N_LAYER)]
    reference = run_hf(model, ids, empty)
    assert max(max_diff(lps, reference)) <= TOL
    # Same parameter count as HF's own model (tied parameters counted once).
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in model.parameters())

    if untie_r and same_length:
        convert_and_compare(folder, tmp_path, lps, ids)


def test_huggingface_zero_memory_semantics(hf, tmp_path):
    """HF's default memory is mem_len zero vectors that ARE attended to, so its first segments differ from the
    paper's empty memory; once every layer's memory holds only states computed from real context (about
    n_layer * ceil(mem_len / segment) segments) both agree. The README documents this."""
    model = build_hf(hf, untie_r=True, same_length=False)
    model.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf").build()
    warmup = N_LAYER * math.ceil(MEM_LEN / Q)
    ids = tokens(5, segments=warmup + 5)
    diffs = max_diff(run_ours(ours, ids)[0], run_hf(model, ids, None))
    assert diffs[0] > 1e-3  # the zeros do influence HF's first segment
    assert len(diffs[warmup:]) >= 4 and max(diffs[warmup:]) <= TOL


def test_huggingface_vocab_pickle_is_never_read(hf, tmp_path):
    marker = tmp_path / "pwned"
    model = build_hf(hf, untie_r=True, same_length=True)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    (folder / "vocab.pkl").write_bytes(pickle.dumps(_Evil(["touch", str(marker)])))
    loaded = load_model(folder)
    assert loaded.vocab is None and not marker.exists()
    assert any("vocab.pkl" in note for note in loaded.notes)
    # ...and the CLI says what is missing when a vocabulary is needed.
    assert_one_line_error(cli("convert", folder, "-o", tmp_path / "out"), "model.safetensors", "no vocabulary")
    vocab_file = tmp_path / "words.txt"
    vocab_file.write_text("".join(f"{w}\n" for w in WORDS))
    result = cli("convert", folder, "-o", tmp_path / "out", "--vocab", vocab_file)
    assert result.exit_code == 0, result.output
    assert load_model(tmp_path / "out").vocab.symbols == WORDS and not marker.exists()


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


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval", "subprocess.call"])
@pytest.mark.parametrize("container", ["pickle", "torch-zip", "torch-legacy", "nvidia-dict"])
def test_malicious_pickle_is_refused_and_nothing_runs(kind, container, tmp_path):
    marker = tmp_path / "pwned"
    payload = _payloads(marker)[kind]
    # Self-check: a plain pickle.load of this payload would create the marker.
    if container == "pickle" and kind == "os.system":
        pickle.loads(pickle.dumps(payload))
        assert marker.exists()
        marker.unlink()
    path = tmp_path / "model.pt"
    if container == "pickle":
        path.write_bytes(pickle.dumps(payload, protocol=2))
    elif container == "torch-zip":
        torch.save({"word_emb.emb_layers.0.weight": torch.zeros(2), "evil": payload}, path)
    elif container == "torch-legacy":
        torch.save([payload], path, _use_new_zipfile_serialization=False)
    else:
        torch.save({"model_config": {"n_token": V}, "model_state": {}, "args": payload}, path)

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
    with standin("cmu") as mt:
        model, _ = build_cmu(mt, "char")
        model.hook = _EvilSystem(f"touch {marker}")
        torch.save(model, tmp_path / "model.pt")
    assert_one_line_error(cli("convert", tmp_path / "model.pt", "-o", tmp_path / "out", "--no-vocab"),
                          "model.pt", "refused to unpickle", "system")
    assert not marker.exists() and not (tmp_path / "out").exists()


# -- bad input ---------------------------------------------------------------------------------------------
@pytest.fixture
def cmu_checkpoint(tmp_path):
    with standin("cmu") as mt:
        model, _ = build_cmu(mt, "div2")
        torch.save(model, tmp_path / "model.pt")
    return tmp_path / "model.pt"


def test_random_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "random.bin"
    path.write_bytes(bytes(range(256)) * 8)
    assert_one_line_error(cli("info", path), path, "not a checkpoint of a supported format")
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    assert_one_line_error(cli("convert", text, "-o", tmp_path / "out"), text, "not a checkpoint")
    assert_one_line_error(cli("info", tmp_path / "missing.pt"), "missing.pt", "does not exist")
    (tmp_path / "folder").mkdir()
    assert_one_line_error(cli("info", tmp_path / "folder"), "folder", "neither a txl-deploy checkpoint")


@pytest.mark.parametrize("legacy", [False, True])
def test_truncated_checkpoint(cmu_checkpoint, tmp_path, legacy):
    source = cmu_checkpoint
    if legacy:
        source = tmp_path / "legacy.pt"
        torch.save(load_model(cmu_checkpoint).state_dict, source, _use_new_zipfile_serialization=False)
    data = source.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    assert_one_line_error(cli("info", cut), cut, "truncated or corrupt")


def test_torch_file_of_something_else(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"epoch": 3, "note": "not a model"}, path)
    assert_one_line_error(cli("info", path), path, "not a Transformer-XL checkpoint", "epoch")
    linear = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(2, 3).state_dict(), linear)
    (tmp_path / "linear.json").write_text(json.dumps(dict(n_token=V, n_layer=1, n_head=1, d_model=4, d_head=4,
                                                          d_inner=8)))
    assert_one_line_error(cli("info", linear), linear, "'weight' is not part of a CMU")


def test_shapes_contradicting_the_config(tmp_path):
    with standin("cmu") as mt:
        model, kw = build_cmu(mt, "div2")
        torch.save(model.state_dict(), tmp_path / "weights.pt")
    config = dict(n_token=V, n_layer=N_LAYER, n_head=N_HEAD, d_model=D_MODEL, d_head=D_HEAD, d_inner=2 * D_INNER,
                  tgt_len=Q, mem_len=MEM_LEN, clamp_len=CLAMP_LEN, **kw)
    (tmp_path / "weights.json").write_text(json.dumps(config))
    message = assert_one_line_error(cli("info", tmp_path / "weights.pt"), "weights.pt", "has shape", "config implies")
    assert "pos_ff.CoreNet" in message
    config.update(d_inner=D_INNER, n_layer=3)
    (tmp_path / "weights.json").write_text(json.dumps(config))
    assert_one_line_error(cli("info", tmp_path / "weights.pt"), "weights.pt", "layers.2", "missing")
    config.update(n_layer=N_LAYER, dropout_rate=0.1)
    (tmp_path / "weights.json").write_text(json.dumps(config))
    assert_one_line_error(cli("info", tmp_path / "weights.pt"), "weights.json", "unknown CMU config keys: dropout_rate")


def test_missing_and_mismatched_vocabulary(cmu_checkpoint, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(cli("convert", cmu_checkpoint, "-o", out), "model.pt", "no vocabulary", "--vocab")
    assert not out.exists()
    # info works without one and says so
    result = cli("info", cmu_checkpoint)
    assert result.exit_code == 0 and "vocabulary:  none" in result.output
    # the weights alone, when asked for
    result = cli("convert", cmu_checkpoint, "-o", out, "--no-vocab")
    assert result.exit_code == 0, result.output
    assert load_model(out).vocab is None
    with pytest.raises(CheckpointError, match="has no vocabulary"):
        load_model(out).require_vocab()
    short = tmp_path / "short.txt"
    short.write_text("a\nb\nc\n")
    assert_one_line_error(cli("info", cmu_checkpoint, "--vocab", short), "short.txt", "3 symbols", f"n_token={V}")
    # a character list
    chars = tmp_path / "chars.txt"
    chars.write_text("".join(chr(ord("!") + i) for i in range(V)) + "\n")
    result = cli("info", cmu_checkpoint, "--vocab", chars, "--vocab-kind", "char", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["vocab_kind"] == "char"


def test_convert_refuses_to_overwrite(cmu_checkpoint, tmp_path):
    write_vocab_txt(cmu_checkpoint.parent)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(cli("convert", cmu_checkpoint, "-o", out), "out", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    result = cli("convert", cmu_checkpoint, "-o", out, "--force")
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and load_model(out).vocab.symbols == WORDS


def test_info_reports_format_config_parameters_vocab_and_memory(cmu_checkpoint):
    write_vocab_txt(cmu_checkpoint.parent)
    result = cli("info", cmu_checkpoint, "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    loaded = load_model(cmu_checkpoint)
    assert d["format"] == "cmu" and d["vocab_size"] == V and d["config"] == loaded.config.to_dict()
    assert d["parameters"] == sum(p.numel() for p in loaded.build().parameters())
    assert d["memory_bytes_per_stream"]["fp32"] == loaded.config.memory_bytes_per_stream()
    assert d["memory_bytes_per_stream"]["fp32"]["hidden"] == N_LAYER * MEM_LEN * D_MODEL * 4
    text = cli("info", cmu_checkpoint)
    assert text.exit_code == 0
    assert "format:      cmu" in text.output and f"{V} symbols" in text.output and "memory per stream" in text.output


def test_help_on_every_option():
    for command in ("convert", "info"):
        result = cli(command, "--help")
        assert result.exit_code == 0
        for option in ("--vocab", "--config", "--vocab-kind") + (("--force", "--no-vocab", "--output")
                                                                  if command == "convert" else ("--json",)):
            assert option in result.output
