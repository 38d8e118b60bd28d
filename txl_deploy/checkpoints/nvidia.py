"""NVIDIA DeepLearningExamples checkpoints (PyTorch/LanguageModeling/Transformer-XL, `train.py:save_checkpoint`).

A `torch.save`d dict: `model_config` (the MemTransformerLM constructor arguments), `model_state` (its
state_dict), `args` (an argparse.Namespace), `vocab` (their `utils.vocabulary.Vocab`), optimizer and scheduler
state. Read with the restricted unpickler; the Namespace and the Vocab come back as inert attribute holders, and
the vocabulary's `idx2sym` list becomes ours (of kind bytes or text8 when `args.dataset` is enwik8 or text8).

NVIDIA's ProjectedAdaptiveLogSoftmax stores its output layers as `out_layers_weights.N` / `out_layers_biases.N`
(weights absent when tied to the embedding), the untied projections as `out_projs.N`, and registers the
embedding's projections again as `shared_out_projs`. Its cluster order is the original one (head column -i).
Its same_length mask lets each query see one key more than the original (`klen - mem_len - 1`):
`same_length_extra = 1`, recorded for every NVIDIA checkpoint (it matters only once same_length is on, which
their eval.py may do for a model trained without it).
"""

from __future__ import annotations

from txl_deploy.checkpoints.cmu import _config, config_fields_from_kwargs
from txl_deploy.checkpoints.keymap import Rule, normalise, rename, strip_prefix
from txl_deploy.checkpoints.native import LoadedModel
from txl_deploy.checkpoints.reader import Reader
from txl_deploy.checkpoints.unpickler import attr, pickled_class
from txl_deploy.errors import CheckpointError
from txl_deploy.vocab import Vocab, choose_kind

NVIDIA_RULES = [
    Rule(r"word_emb\.emb_layers\.(\d+)\.weight", r"word_emb.emb_layers.\1.weight"),
    Rule(r"word_emb\.emb_projs\.(\d+)", r"word_emb.emb_projs.\1"),
    Rule(r"layers\.(\d+)\.dec_attn\.(qkv_net|o_net|r_net)\.weight", r"layers.\1.dec_attn.\2.weight"),
    Rule(r"layers\.(\d+)\.dec_attn\.layer_norm\.(weight|bias)", r"layers.\1.dec_attn.layer_norm.\2"),
    Rule(r"layers\.(\d+)\.pos_ff\.CoreNet\.(0|3)\.(weight|bias)", r"layers.\1.pos_ff.CoreNet.\2.\3"),
    Rule(r"layers\.(\d+)\.pos_ff\.layer_norm\.(weight|bias)", r"layers.\1.pos_ff.layer_norm.\2"),
    Rule(r"(r_w_bias|r_r_bias)", r"\1"),
    Rule(r"pos_emb\.inv_freq", r"pos_emb.inv_freq"),  # used as stored (NVIDIA trains in fp16)
    Rule(r"crit\.(cluster_weight|cluster_bias)", r"crit.\1"),
    Rule(r"crit\.out_layers_weights\.(\d+)", r"crit.out_layers.\1.weight"),
    Rule(r"crit\.out_layers_biases\.(\d+)", r"crit.out_layers.\1.bias"),
    Rule(r"crit\.out_projs\.(\d+)", r"crit.out_projs.\1"),
    Rule(r"crit\.shared_out_projs\.(\d+)", None),  # the embedding's projections again (tie_projs)
]


def is_checkpoint(obj) -> bool:
    return isinstance(obj, dict) and "model_config" in obj and "model_state" in obj


def vocab_from_pickled(obj, dataset=None, path="<checkpoint>") -> Vocab | None:
    """Their `utils.vocabulary.Vocab` (inert): `idx2sym` in id order. Its kind: the one the corpus fixes
    (`args.dataset` enwik8: bytes, text8: text8), else what the symbols show, else characters for an empty
    delimiter and words otherwise."""
    if pickled_class(obj) not in ("utils.vocabulary.Vocab", "vocabulary.Vocab"):
        return None
    symbols = attr(obj, "idx2sym")
    if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
        return None
    default = "char" if attr(obj, "delimiter") == "" else "word"
    try:
        kind = choose_kind(symbols, dataset=dataset if isinstance(dataset, str) else None, default=default)
    except ValueError as e:
        raise CheckpointError(path, f"vocabulary: {e}") from None
    try:
        return Vocab(symbols, kind=kind)
    except ValueError:
        return None


def load_checkpoint(obj, path, config=None) -> LoadedModel:
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    state = obj["model_state"]
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise CheckpointError(path, "model_state is not a state_dict (a mapping of names to tensors)")
    fields = config_fields_from_kwargs(obj["model_config"], path, "NVIDIA model_config")
    # Set whether or not the model trained with same_length: NVIDIA's eval.py turns same_length on for
    # evaluation, and an export or eval with --same-length must then use their window, not the original's.
    fields["same_length_extra"] = 1
    cfg = _config(fields, path)
    state = normalise(rename(strip_prefix(state, "module."), NVIDIA_RULES, path, "NVIDIA"), cfg, path)
    vocab = vocab_from_pickled(obj.get("vocab"), attr(obj.get("args"), "dataset"), path)
    notes = []
    if cfg.same_length:
        notes.append("NVIDIA's same_length window is one key longer than the original's (same_length_extra=1)")
    if (obj["model_config"].get("ext_len") or 0) > 0:
        notes.append(f"trained with ext_len={obj['model_config']['ext_len']}; evaluated with ext_len 0")
    return LoadedModel(cfg, state, vocab, "nvidia", str(path), notes=notes,
                       vocab_source=str(path) if vocab is not None else None,
                       vocab_format="its vocab entry (NVIDIA's utils.vocabulary.Vocab, read without running it)"
                       if vocab is not None else None)


READER = Reader("nvidia", "NVIDIA DeepLearningExamples' checkpoint_best.pt / checkpoint_last.pt (or their work "
                "directory)", lambda s: is_checkpoint(s.payload), lambda s: load_checkpoint(s.payload, s.file))
