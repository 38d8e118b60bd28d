"""Checkpoint import: parity with an independent implementation for every published PyTorch checkpoint format.

The numerical reference is HuggingFace's TransfoXL (transformers' deprecated `TransfoXLLMHeadModel`, from PyPI;
these tests skip when it is not installed), an implementation independent of ours:
- HuggingFace folders: its own `save_pretrained`.
- Original CMU code (kimiyoung/transformer-xl) and NVIDIA DeepLearningExamples: neither installs, and a checkpoint
  file holds data, not code. tests/helpers/original_checkpoints.py writes the files those trainers write (the
  pickled `mem_transformer.MemTransformerLM` tree of `torch.save(model)`; NVIDIA's checkpoint dict with an
  `argparse.Namespace` and their `Vocab`) from a HuggingFace model's weights, cross-converted to the original
  names and cluster order in the test helpers (`hf_to_original`). txl-deploy reads them back and must reproduce
  HuggingFace's log-probabilities, so a wrong cluster order, key mapping, dropped r_w_bias or mask fails here.
- NVIDIA's same_length window (one key longer than the original's) does not exist in HuggingFace: the expected
  mask is derived from NVIDIA's published formula (`mask_len = klen - mem_len - 1` in their mem_transformer.py)
  and compared with our model's, and the log-probabilities come from HuggingFace run with a window one longer
  (mem_len + 1) whose returned memory the test cuts back to mem_len, which is exactly that formula.

Every parity test runs >= 4 consecutive segments with the memory threaded, batch 3, fp32, and compares full
log-probabilities to 1e-5. The restricted unpickler is tested in test_restricted_unpickler.py, bad input and the
convert/info commands in test_convert_and_info.py.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from helpers import original_checkpoints as oc  # noqa: E402
from helpers.cli import assert_one_line_error, cli  # noqa: E402
from helpers.reference_models import (  # noqa: E402
    CLAMP_LEN,
    CMU_VARIANTS,
    D_HEAD,
    D_INNER,
    D_MODEL,
    MEM_LEN,
    N_HEAD,
    N_LAYER,
    NVIDIA_VARIANTS,
    TOL,
    WORDS,
    Q,
    assert_mems_match,
    build_hf,
    build_hf_from,
    empty_mems,
    make_nvidia_checkpoint,
    make_our_model,
    max_diff,
    nvidia_reference,
    original_kwargs,
    original_state,
    run_hf,
    run_ours,
    tokens,
    write_vocab_txt,
)

from txl_deploy.checkpoints import load_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- helpers ---------------------------------------------------------------------------------------------
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
@pytest.mark.parametrize("variant", list(CMU_VARIANTS))
def test_cmu_model_pt_parity(hf, variant, tmp_path):
    ids = tokens(1)
    hp = original_kwargs(**CMU_VARIANTS[variant])
    model = build_hf_from(hf, hp, seed=1)
    reference, ref_mems = run_hf(model, ids, empty_mems())
    # The legacy (pre-1.6) serialisation for one variant: the original checkpoints were written by torch 0.4.
    oc.save_original_model_pt(tmp_path / "model.pt", original_state(model), hp, legacy=(variant == "div2"))
    write_vocab_txt(tmp_path)

    # Nothing of mem_transformer is importable while it loads.
    assert "mem_transformer" not in sys.modules
    loaded = load_model(tmp_path / "model.pt")
    assert loaded.source_format == "cmu"
    cfg = loaded.config
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner, cfg.mem_len, cfg.clamp_len) == (
        N_LAYER, D_MODEL, N_HEAD, D_HEAD, D_INNER, MEM_LEN, CLAMP_LEN)
    assert cfg.cutoffs == hp["cutoffs"] and cfg.same_length == hp["same_length"]
    assert cfg.tie_weight == hp["tie_weight"] and cfg.tie_projs == hp["tie_projs"]
    assert cfg.same_length_extra == 0
    assert loaded.vocab is not None and loaded.vocab.symbols == WORDS

    lps, mems = run_ours(loaded.build(), ids)
    assert len(lps) >= 4
    assert max(max_diff(lps, reference)) <= TOL
    assert_mems_match(mems, ref_mems)

    if variant == "div2":
        convert_and_compare(tmp_path / "model.pt", tmp_path, lps, ids)


def test_cmu_state_dict_with_config_parity(hf, tmp_path):
    """A bare state_dict in the original names plus the constructor arguments as JSON beside it."""
    ids = tokens(2)
    hp = original_kwargs(**CMU_VARIANTS["div2-untied-same-pre"])
    model = build_hf_from(hf, hp, seed=2)
    reference, _ = run_hf(model, ids, empty_mems())
    state = original_state(model)
    torch.save(state, tmp_path / "weights.pt")
    (tmp_path / "weights.json").write_text(json.dumps(dict(hp, dropout=0.1)))
    write_vocab_txt(tmp_path)

    loaded = load_model(tmp_path / "weights.pt")
    assert loaded.source_format == "cmu-state-dict"
    lps, _ = run_ours(loaded.build(), ids)
    assert max(max_diff(lps, reference)) <= TOL

    # The same state_dict as .safetensors (tied tensors stored twice, as safetensors cannot share them).
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "weights.safetensors"))
    from_safetensors = load_model(tmp_path / "weights.safetensors")
    assert from_safetensors.source_format == "cmu-state-dict"
    assert max(max_diff(run_ours(from_safetensors.build(), ids)[0], reference)) <= TOL

    # The same config given explicitly (--config), from another place.
    other = tmp_path / "elsewhere.json"
    (tmp_path / "weights.json").rename(other)
    assert_one_line_error(cli("info", tmp_path / "weights.pt"), "weights.pt", "needs a config")
    convert_and_compare(tmp_path / "weights.pt", tmp_path, lps, ids, "--config", other)


# -- NVIDIA DeepLearningExamples -------------------------------------------------------------------------
def nvidia_expected_mask(qlen, mlen, mem_len):
    """NVIDIA's published same_length mask (mem_transformer.py, `_forward`), 1 = masked:
    mask_len = klen - mem_len - 1; shift = qlen - mask_len if mask_len > 0 else qlen;
    mask = triu(ones(qlen, klen), 1 + mlen) + tril(ones(qlen, klen), -shift)."""
    klen = mlen + qlen
    ones = torch.ones(qlen, klen)
    mask_len = klen - mem_len - 1
    shift = qlen - mask_len if mask_len > 0 else qlen
    return (torch.triu(ones, 1 + mlen) + torch.tril(ones, -shift)).bool()


@pytest.mark.parametrize("variant", list(NVIDIA_VARIANTS))
def test_nvidia_checkpoint_parity(hf, variant, tmp_path):
    ids = tokens(3)
    model, hp = make_nvidia_checkpoint(hf, variant, tmp_path / "checkpoint_best.pt")
    reference, ref_mems = nvidia_reference(model, hp, ids)

    assert "utils.vocabulary" not in sys.modules
    loaded = load_model(tmp_path / "checkpoint_best.pt")
    assert loaded.source_format == "nvidia"
    assert loaded.config.same_length == hp["same_length"] and loaded.config.same_length_extra == 1
    # The vocabulary travels inside NVIDIA's checkpoint (their Vocab object, read as inert data).
    assert loaded.vocab is not None and loaded.vocab.symbols == WORDS
    ours = loaded.build()
    lps, mems = run_ours(ours, ids)
    assert max(max_diff(lps, reference)) <= TOL
    assert_mems_match(mems, ref_mems)
    if hp["same_length"]:
        # HF's own window (the original's) is one key shorter: the difference is real.
        original_window, _ = run_hf(model, ids, empty_mems())
        assert max(max_diff(lps, original_window)) > 100 * TOL
        for mlen in range(MEM_LEN + 1):
            for qlen in (1, 2, Q, 9):
                assert torch.equal(ours.attn_mask(qlen, mlen), nvidia_expected_mask(qlen, mlen, MEM_LEN))

    if variant == "div2-same":
        back = convert_and_compare(tmp_path / "checkpoint_best.pt", tmp_path, lps, ids)
        assert back.vocab.symbols == WORDS


def test_nvidia_window_applies_when_same_length_is_turned_on_for_evaluation(hf, tmp_path):
    """NVIDIA's eval.py may turn same_length on for a model trained without it: their window then applies."""
    ids = tokens(6)
    model, hp = make_nvidia_checkpoint(hf, "div2-untied", tmp_path / "checkpoint_best.pt")
    loaded = load_model(tmp_path / "checkpoint_best.pt")
    assert not loaded.config.same_length
    ours = loaded.build()
    ours.cfg = ours.cfg.replace(same_length=True)  # what `eval --same-length` / `export --same-length` do
    for mlen in range(MEM_LEN + 1):
        assert torch.equal(ours.attn_mask(Q, mlen), nvidia_expected_mask(Q, mlen, MEM_LEN))
    model.transformer.same_length = True
    reference, _ = run_hf(model, ids, empty_mems(), window_extra=1)
    assert max(max_diff(run_ours(ours, ids)[0], reference)) <= TOL


def test_nvidia_work_directory(hf, tmp_path):
    """A work directory (what NVIDIA's eval.py --work_dir takes) stands for checkpoint_best.pt, else
    checkpoint_last.pt; which one was read is said in the notes and by `info`."""
    ids = tokens(7)
    work = tmp_path / "LM-TFM"
    work.mkdir()
    best, hp = make_nvidia_checkpoint(hf, "div2-same", work / "checkpoint_best.pt", seed=11)
    last, _ = make_nvidia_checkpoint(hf, "div2-same", work / "checkpoint_last.pt", seed=12)

    loaded = load_model(work)
    assert loaded.source_format == "nvidia" and Path(loaded.path) == work / "checkpoint_best.pt"
    assert f"work directory {work}: read checkpoint_best.pt (checkpoint_last.pt is also there)" in loaded.notes
    assert max(max_diff(run_ours(loaded.build(), ids)[0], nvidia_reference(best, hp, ids)[0])) <= TOL
    result = cli("info", work)
    assert result.exit_code == 0, result.output
    assert f"path:        {work / 'checkpoint_best.pt'}" in result.output
    assert "note: work directory" in result.output and "read checkpoint_best.pt" in result.output
    assert "read checkpoint_best.pt" in json.loads(cli("info", work, "--json").output)["notes"][0]

    (work / "checkpoint_best.pt").unlink()
    loaded = load_model(work)
    assert Path(loaded.path) == work / "checkpoint_last.pt"
    assert loaded.notes[0] == f"work directory {work}: read checkpoint_last.pt"
    assert max(max_diff(run_ours(loaded.build(), ids)[0], nvidia_reference(last, hp, ids)[0])) <= TOL
    result = cli("convert", work, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert load_model(tmp_path / "out").vocab.symbols == WORDS

    (work / "checkpoint_last.pt").unlink()
    assert_one_line_error(cli("info", work), work, "NVIDIA work directory", "checkpoint_best.pt or checkpoint_last.pt")


# -- the stored positional buffer ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["cmu", "nvidia", "huggingface"])
def test_fp16_saved_checkpoint_uses_the_stored_inv_freq(hf, fmt, tmp_path):
    """A checkpoint saved in fp16 stores pos_emb.inv_freq rounded, and its model ran with the rounded values: the
    loaded model must match HF run with the rounded inv_freq, and must not match HF with it recomputed."""
    ids = tokens(8)
    variant = "div2-same" if fmt == "nvidia" else "div2"
    hp = original_kwargs(**(NVIDIA_VARIANTS if fmt == "nvidia" else CMU_VARIANTS)[variant], clamp_len=0)
    model = build_hf_from(hf, hp, seed=8)
    with torch.no_grad():
        # Random weights make attention nearly position-blind; a larger positional term (as training produces)
        # makes the inv_freq rounding visible well above float rounding.
        for layer in model.transformer.layers:
            layer.dec_attn.r_net.weight.mul_(8)
        model.transformer.r_r_bias.mul_(8)
    model.half()  # as a checkpoint saved from an fp16 model holds it, inv_freq included
    folder = tmp_path / fmt
    folder.mkdir()
    if fmt == "huggingface":
        model.save_pretrained(folder, safe_serialization=False)  # shared r-biases: pytorch_model.bin
        src = folder
    elif fmt == "cmu":
        oc.save_original_model_pt(folder / "model.pt", original_state(model), hp)
        src = folder / "model.pt"
    else:
        oc.save_nvidia_checkpoint(folder / "checkpoint_best.pt", original_state(model), hp, WORDS)
        src = folder / "checkpoint_best.pt"
    write_vocab_txt(folder)
    model.float()
    window = 1 if fmt == "nvidia" and hp["same_length"] else 0
    rounded = model.transformer.pos_emb.inv_freq.clone()
    recomputed = 1.0 / (10000 ** (torch.arange(0.0, D_MODEL, 2.0) / D_MODEL))
    assert 0 < float((rounded - recomputed).abs().max()) < 1e-3 and rounded.dtype == torch.float32
    reference_stored, _ = run_hf(model, ids, empty_mems(), window)
    model.transformer.pos_emb.inv_freq.copy_(recomputed)
    reference_recomputed, _ = run_hf(model, ids, empty_mems(), window)

    loaded = load_model(src)
    assert loaded.state_dict["pos_emb.inv_freq"].dtype == torch.float16
    assert any("stored pos_emb.inv_freq (float16)" in note for note in loaded.notes)
    lps, _ = run_ours(loaded.build(), ids)
    assert max(max_diff(lps, reference_stored)) <= TOL
    # The difference is real: recomputing inv_freq moves the log-probs by far more than the tolerance.
    gap = max(max_diff(reference_stored, reference_recomputed))
    assert gap > 5 * TOL
    assert max(max_diff(lps, reference_recomputed)) > 5 * TOL
    # Our own format keeps the stored values.
    back = convert_and_compare(src, tmp_path, lps, ids)
    assert torch.equal(back.state_dict["pos_emb.inv_freq"], rounded)


def test_checkpoint_without_inv_freq_gets_the_formula(tmp_path):
    """HF folders and bare state_dicts may lack the buffer: it is a function of d_model, recomputed then."""
    from txl_deploy.model.mem_transformer import default_inv_freq

    model = make_our_model(cutoffs=[10, 25], div_val=2, tie_projs=[False, True, True])
    state = {k: v for k, v in model.state_dict().items() if k != "pos_emb.inv_freq"}
    torch.save(state, tmp_path / "weights.pt")
    (tmp_path / "weights.json").write_text(json.dumps(model.cfg.to_dict()))
    loaded = load_model(tmp_path / "weights.pt")
    assert "pos_emb.inv_freq" not in loaded.state_dict and not loaded.notes
    rebuilt = loaded.build()
    assert torch.equal(rebuilt.pos_emb.inv_freq, default_inv_freq(D_MODEL))
    ids = tokens(9)
    assert max(max_diff(run_ours(rebuilt, ids)[0], run_ours(model, ids)[0])) == 0.0


# -- HuggingFace transformers ------------------------------------------------------------------------------
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
    reference, _ = run_hf(model, ids, empty_mems())
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
    diffs = max_diff(run_ours(ours, ids)[0], run_hf(model, ids, None)[0])
    assert diffs[0] > 1e-3  # the zeros do influence HF's first segment
    assert len(diffs[warmup:]) >= 4 and max(diffs[warmup:]) <= TOL
