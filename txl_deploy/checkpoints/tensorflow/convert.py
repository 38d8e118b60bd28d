"""A TensorFlow checkpoint read into our names: the weights re-laid-out (see the package's docstring) and a config
built from the shapes, the chosen settings and what the TensorFlow code computes differently."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from txl_deploy.checkpoints.native import LoadedModel
from txl_deploy.checkpoints.reader import Reader, Source
from txl_deploy.checkpoints.tensorflow.architecture import infer_architecture
from txl_deploy.checkpoints.tensorflow.bundle import TFCheckpoint
from txl_deploy.checkpoints.tensorflow.corpus import check_corpus_info, read_corpus_info
from txl_deploy.checkpoints.tensorflow.discovery import find_checkpoint
from txl_deploy.checkpoints.tensorflow.presets import PAPER_RESULTS, eval_settings, read_flags
from txl_deploy.checkpoints.vocab_files import open_vocab_file
from txl_deploy.config import TxlConfig
from txl_deploy.errors import CheckpointError, TxlError

FORMAT = "tensorflow"
TF_LAYER_NORM_EPSILON = 1e-12
TF_SAME_LENGTH_EXTRA = 1


def to_state_dict(ckpt, arch: dict) -> dict:
    """The checkpoint's tensors under our names and in our orientation (torch tensors)."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    scope = arch["_scope"]

    def get(local):
        return ckpt.get_tensor(scope + local).astype(np.float32, copy=False)

    def t(a):
        return torch.from_numpy(np.array(a, dtype=np.float32, order="C"))  # a copy: transposed/reversed views

    sd = {}
    n_layer, div_val, cutoffs, d_model = arch["n_layer"], arch["div_val"], arch["cutoffs"], arch["d_model"]
    for i in range(n_layer):
        p, q = f"layer_{i}/", f"layers.{i}."
        sd[q + "dec_attn.qkv_net.weight"] = t(get(p + "rel_attn/qkv/kernel").T)  # TF kernels are [in, out]
        sd[q + "dec_attn.r_net.weight"] = t(get(p + "rel_attn/r/kernel").T)
        sd[q + "dec_attn.o_net.weight"] = t(get(p + "rel_attn/o/kernel").T)
        sd[q + "dec_attn.layer_norm.weight"] = t(get(p + "rel_attn/LayerNorm/gamma"))
        sd[q + "dec_attn.layer_norm.bias"] = t(get(p + "rel_attn/LayerNorm/beta"))
        sd[q + "pos_ff.CoreNet.0.weight"] = t(get(p + "ff/layer_1/kernel").T)
        sd[q + "pos_ff.CoreNet.0.bias"] = t(get(p + "ff/layer_1/bias"))
        sd[q + "pos_ff.CoreNet.3.weight"] = t(get(p + "ff/layer_2/kernel").T)
        sd[q + "pos_ff.CoreNet.3.bias"] = t(get(p + "ff/layer_2/bias"))
        sd[q + "pos_ff.layer_norm.weight"] = t(get(p + "ff/LayerNorm/gamma"))
        sd[q + "pos_ff.layer_norm.bias"] = t(get(p + "ff/LayerNorm/beta"))
    for bias in ("r_w_bias", "r_r_bias"):
        value = get(bias)
        if arch["untie_r"]:
            for i in range(n_layer):
                sd[f"layers.{i}.dec_attn.{bias}"] = t(value[i])
        else:
            sd[bias] = t(value)
    names = set(ckpt.names())
    if div_val == 1:
        sd["word_emb.emb_layers.0.weight"] = t(get("adaptive_embed/lookup_table"))
        if arch["d_embed"] != d_model:
            sd["word_emb.emb_projs.0"] = t(get("adaptive_embed/proj_W").T)  # emb @ proj_W
        if cutoffs:
            sd["crit.out_layers.0.bias"] = t(np.concatenate([get(f"adaptive_softmax/cutoff_{i}/b")
                                                             for i in range(len(cutoffs) + 1)]))
        else:
            sd["crit.out_layers.0.bias"] = t(get("adaptive_softmax/bias"))
    else:
        for i in range(len(cutoffs) + 1):
            sd[f"word_emb.emb_layers.{i}.weight"] = t(get(f"adaptive_embed/cutoff_{i}/lookup_table"))
            if scope + f"adaptive_embed/cutoff_{i}/proj_W" in names:
                sd[f"word_emb.emb_projs.{i}"] = t(get(f"adaptive_embed/cutoff_{i}/proj_W").T)
            else:  # proj_same_dim=False: no projection; ours always has one, and an identity is exact
                if d_model * d_model * 4 > ckpt.data_bytes():  # d_model comes from the index: a claim
                    raise CheckpointError(ckpt.index_path, f"d_model {d_model} needs an identity projection of "
                                                           f"{d_model * d_model * 4:,} bytes, more than the "
                                                           "checkpoint's data holds")
                sd[f"word_emb.emb_projs.{i}"] = torch.eye(d_model)
            sd[f"crit.out_layers.{i}.bias"] = t(get(f"adaptive_softmax/cutoff_{i}/b"))
    for i, tied in enumerate(arch["tie_projs"]):
        if not tied and (div_val > 1 or arch["d_embed"] != d_model):
            sd[f"crit.out_projs.{i}"] = t(get(f"adaptive_softmax/cutoff_{i}/proj").T)  # hidden @ proj.T
    if cutoffs:
        # TF reads tail cluster i from head column cutoffs[0] + i - 1, ours from column -i: reversed rows.
        sd["crit.cluster_weight"] = t(get("adaptive_softmax/cutoff_0/cluster_W")[::-1])
        sd["crit.cluster_bias"] = t(get("adaptive_softmax/cutoff_0/cluster_b")[::-1])
    return sd


def load_checkpoint(path, config=None, preset: str | None = None, vocab=None, verify_checksums: bool = True,
                    found: tuple | None = None, ckpt: TFCheckpoint | None = None):
    """A `LoadedModel` from the published folder layout or a `model.ckpt-N` path.

    `config`: the original training flags (JSON file or dict, tf/train_gpu.py names); `preset`: one of PRESETS;
    `vocab`: a vocabulary file (a `cache.pkl`, read safely, or any other `vocab_files` reads) overriding
    `data/cache.pkl`. The corpus it or `data/corpus-info.json` names picks the preset and later fixes the
    vocabulary's kind (enwik8: bytes, text8: text8); `vocab_files.attach_vocab` applies the user's kind and checks
    the size. `found`, `ckpt`: what `find_checkpoint(path)` returned and its index, when the caller has read them."""
    found = find_checkpoint(path) if found is None else found
    if found is None:
        raise CheckpointError(path, "is not a TensorFlow checkpoint (no model.ckpt-N.index)")
    prefix, data_dir = found
    if config is not None and preset is not None:
        raise CheckpointError(path, "pass either --preset or --config, not both")
    ckpt = TFCheckpoint(prefix, verify_checksums=verify_checksums) if ckpt is None else ckpt
    where = ckpt.index_path
    arch = infer_architecture({n: e.shape for n, e in ckpt.entries.items()}, where)

    notes = []
    vocab_file, dataset = None, None
    cache = Path(vocab) if vocab is not None else (data_dir / "cache.pkl" if data_dir is not None else None)
    if cache is not None:
        vocab_file = open_vocab_file(cache)
        dataset = vocab_file.dataset
    info_path = data_dir / "corpus-info.json" if data_dir is not None else None
    if info_path is not None and info_path.is_file():
        info = read_corpus_info(info_path)
        check_corpus_info(info, arch, info_path)
        dataset = dataset or info.get("dataset")
    dataset = dataset if isinstance(dataset, str) else None

    flags, flags_where = (read_flags(config, where) if config is not None else (None, None))
    settings, sources = eval_settings(arch, preset, flags, flags_where, dataset, where)
    chosen = sources.pop("_preset", None)
    try:
        cfg = TxlConfig(
            n_token=arch["n_token"], n_layer=arch["n_layer"], n_head=arch["n_head"], d_model=arch["d_model"],
            d_head=arch["d_head"], d_inner=arch["d_inner"], d_embed=arch["d_embed"], cutoffs=arch["cutoffs"],
            div_val=arch["div_val"], tie_weight=True, tie_projs=arch["tie_projs"], pre_lnorm=False,
            untie_r=arch["untie_r"], mem_len=int(settings["mem_len"]), tgt_len=int(settings["tgt_len"]),
            clamp_len=int(settings["clamp_len"]), same_length=bool(settings["same_length"]),
            same_length_extra=TF_SAME_LENGTH_EXTRA, layer_norm_epsilon=TF_LAYER_NORM_EPSILON,
        )
    except TxlError as e:
        raise CheckpointError(where, str(e)) from None
    state = to_state_dict(ckpt, arch)
    notes.append("TensorFlow evaluation starts every stream from mem_len zero vectors that are attended to; "
                 "txl-deploy starts it empty as the paper's PyTorch code does, so the first "
                 "~n_layer*ceil(mem_len/tgt_len) segments differ slightly (see docs/checkpoints.md)")
    if chosen is not None:
        notes.append(f"evaluation settings of {chosen}; the paper reports {PAPER_RESULTS[chosen]} for it")
    loaded = LoadedModel(cfg, state, vocab_file.vocab if vocab_file else None, FORMAT, str(prefix), notes=notes,
                         vocab_source=str(cache) if vocab_file else None,
                         vocab_format=vocab_file.format if vocab_file else None, dataset=dataset)
    loaded.value_sources = sources
    return loaded


def found_checkpoint(source: Source):
    """`find_checkpoint` of the source, looked for once: by REMI's claim and read, then by the paper's."""
    return source.once(FORMAT, lambda: find_checkpoint(source.path))


def checkpoint_index(source: Source) -> TFCheckpoint:
    """The index of the checkpoint `found_checkpoint` names, read once for every reader that looks at it."""
    return source.once(FORMAT + " index", lambda: TFCheckpoint(found_checkpoint(source)[0]))


# Its vocabulary is its corpus cache (data/cache.pkl), or the user's file: the corpus named there picks the preset.
READER = Reader(FORMAT, "the paper's TensorFlow checkpoint (model.ckpt-N, or the published pretrained_xl/tf_<name> "
                "folder)", lambda s: found_checkpoint(s) is not None,
                lambda s: load_checkpoint(s.path, config=s.config, preset=s.preset, vocab=s.vocab,
                                          found=found_checkpoint(s), ckpt=checkpoint_index(s)),
                location=lambda s: s.path, vocab_folder=lambda s: None,
                takes=frozenset({"config", "preset", "vocab"}))
