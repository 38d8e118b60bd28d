"""HuggingFace transfo-xl folders (transformers <= 4.57, `models/deprecated/transfo_xl`).

A folder with `config.json` (`model_type: "transfo-xl"`) and `model.safetensors` or `pytorch_model.bin` (also
sharded, with an `.index.json`). `pytorch_model.bin` is read with the restricted unpickler. HF's vocabulary, the
pickle `vocab.pkl` (or its torch.save twin `vocab.bin`) beside it, is found and read by `vocab_files`, through its
restricted unpickler: only the symbols and the tokenizer's settings are taken, nothing in it runs.

Two differences from the original code, both handled here:
- HF reads tail cluster i's logit from head column `cutoffs[0] + i - 1`; ours (like CMU and NVIDIA) from column
  `-i`. The rows of `crit.cluster_weight` / `crit.cluster_bias` are reversed on import.
- HF starts the memory as `mem_len` zero vectors that are attended to; ours starts empty (see docs/checkpoints.md).
"""

from __future__ import annotations

import json
from pathlib import Path

from txl_deploy.checkpoints.cmu import _config, check_supported
from txl_deploy.checkpoints.keymap import Rule, normalise, rename
from txl_deploy.checkpoints.native import LoadedModel
from txl_deploy.checkpoints.reader import Reader, read_safetensors
from txl_deploy.checkpoints.torch_files import torch_load
from txl_deploy.errors import CheckpointError


def reverse_rows(t):
    # HF's cluster i sits in row i-1, ours in row n_clusters - i: the same rows in reverse order.
    return t.flip(0).contiguous()


HF_RULES = [
    Rule(r"transformer\.word_emb\.emb_layers\.(\d+)\.weight", r"word_emb.emb_layers.\1.weight"),
    Rule(r"transformer\.word_emb\.emb_projs\.(\d+)", r"word_emb.emb_projs.\1"),
    Rule(r"transformer\.layers\.(\d+)\.dec_attn\.(qkv_net|o_net|r_net)\.weight", r"layers.\1.dec_attn.\2.weight"),
    Rule(r"transformer\.layers\.(\d+)\.dec_attn\.layer_norm\.(weight|bias)", r"layers.\1.dec_attn.layer_norm.\2"),
    # untie_r (HF's default): one pair per layer. Without it the layers hold the shared pair again.
    Rule(r"transformer\.layers\.(\d+)\.dec_attn\.(r_w_bias|r_r_bias)", r"layers.\1.dec_attn.\2"),
    Rule(r"transformer\.layers\.(\d+)\.pos_ff\.CoreNet\.(0|3)\.(weight|bias)", r"layers.\1.pos_ff.CoreNet.\2.\3"),
    Rule(r"transformer\.layers\.(\d+)\.pos_ff\.layer_norm\.(weight|bias)", r"layers.\1.pos_ff.layer_norm.\2"),
    Rule(r"transformer\.(r_w_bias|r_r_bias)", r"\1"),
    Rule(r"transformer\.pos_emb\.inv_freq", r"pos_emb.inv_freq"),
    Rule(r"crit\.(cluster_weight|cluster_bias)", r"crit.\1", reverse_rows),
    Rule(r"crit\.out_layers\.(\d+)\.(weight|bias)", r"crit.out_layers.\1.\2"),
    Rule(r"crit\.out_projs\.(\d+)", r"crit.out_projs.\1"),
]

CONFIG_FILE = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# TransfoXLConfig's constructor defaults (the transfo-xl-wt103 shape), for keys a config.json leaves out.
HF_DEFAULTS = dict(
    vocab_size=267735, cutoffs=[20000, 40000, 200000], d_model=1024, d_embed=1024, n_head=16, d_head=64,
    d_inner=4096, div_val=4, pre_lnorm=False, n_layer=18, mem_len=1600, clamp_len=1000, same_length=True,
    proj_share_all_but_first=True, attn_type=0, sample_softmax=-1, untie_r=True, layer_norm_epsilon=1e-5,
)


def read_config_json(folder: Path):
    try:
        data = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def is_hf_config(data: dict | None) -> bool:
    return data is not None and data.get("model_type") in ("transfo-xl", "transfo_xl")


def config_fields(d: dict, path) -> dict:
    d = {**HF_DEFAULTS, **d}
    check_supported(d["attn_type"], d["sample_softmax"], path)
    cutoffs = [int(c) for c in d["cutoffs"]]
    tie_projs = d.get("tie_projs")
    if tie_projs is None:
        tie_projs = [False] + [bool(d["proj_share_all_but_first"])] * len(cutoffs)
    return dict(
        n_token=d.get("n_token", d["vocab_size"]), n_layer=d["n_layer"], n_head=d["n_head"], d_model=d["d_model"],
        d_head=d["d_head"], d_inner=d["d_inner"], d_embed=d["d_embed"], cutoffs=cutoffs, div_val=d["div_val"],
        # HF ties the output layers by the generic `tie_word_embeddings` (default true).
        tie_weight=bool(d.get("tie_word_embeddings", d.get("tie_weight", True))), tie_projs=list(tie_projs),
        pre_lnorm=bool(d["pre_lnorm"]), untie_r=bool(d["untie_r"]), mem_len=d["mem_len"] or 0,
        tgt_len=d.get("tgt_len") or 128, clamp_len=d["clamp_len"], same_length=bool(d["same_length"]),
        layer_norm_epsilon=float(d["layer_norm_epsilon"]),
    )


def _weight_files(folder: Path) -> list[Path]:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return [folder / name]
        index = folder / f"{name}.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                raise CheckpointError(index, f"unreadable shard index ({str(e)[:200]})") from None
            for shard in shards:  # weights are read from the model's own folder only
                if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                    raise CheckpointError(index, f"shard {str(shard)[:80]!r} is not a file name in the model's "
                                                 "folder")
            return [folder / shard for shard in shards]
    raise CheckpointError(folder, f"HuggingFace folder without weights (no {' or '.join(WEIGHT_FILES)})")


def read_weights(file: Path) -> dict:
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    if file.suffix == ".safetensors":
        return read_safetensors(file)
    obj = torch_load(file)
    if not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise CheckpointError(file, "is not a state_dict (a mapping of names to tensors)")
    return obj


def load_folder(folder, data: dict | None = None) -> LoadedModel:
    """`data`: the folder's config.json, when the caller has read it already."""
    folder = Path(folder)
    data = read_config_json(folder) if data is None else data
    cfg = _config(config_fields(data, folder / CONFIG_FILE), folder / CONFIG_FILE)
    files = _weight_files(folder)
    state = {}
    for file in files:
        state.update(read_weights(file))
    weights_path = files[0] if len(files) == 1 else folder
    state = normalise(rename(state, HF_RULES, weights_path, "HuggingFace"), cfg, weights_path)
    notes = ["HuggingFace starts the memory as mem_len zero vectors that are attended to; txl-deploy starts "
             "it empty as the paper does, so the first ~n_layer*ceil(mem_len/segment) segments differ"]
    return LoadedModel(cfg, state, None, "huggingface", str(weights_path), notes=notes)


READER = Reader.of_folder("huggingface", "HuggingFace transformers' transfo-xl folder (config.json, model.safetensors "
                          "or pytorch_model.bin)", lambda s: is_hf_config(s.folder_config),
                          lambda s: load_folder(s.folder, s.folder_config))
