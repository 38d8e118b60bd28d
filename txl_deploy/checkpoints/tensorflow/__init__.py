"""The original TensorFlow checkpoints (kimiyoung/transformer-xl `tf/`): the paper's own pretrained models.

`tf/sota/download.sh` fetches, per dataset, a folder `pretrained_xl/tf_<name>/` with
`model/model.ckpt-N.{index,data-00000-of-00001,meta}` (+ a `checkpoint` file) and `data/cache.pkl` (the pickled
corpus, holding the vocabulary) + `data/corpus-info.json` (vocabulary size, cutoffs, dataset name).
`convert` takes that folder as it is, or a `model.ckpt-N` path (with `--vocab`, or the layout around it).

The weights are read by `bundle` (no TensorFlow needed). A TF checkpoint stores no hyper-parameters: the
variable shapes determine the architecture, and the evaluation settings (tgt_len, mem_len, clamp_len,
same_length) come from a preset of the published run scripts (`tf/sota/*.sh`) or from the original training
flags (`--config FILE`, JSON with `tf/train_gpu.py`'s flag names). The shapes are checked against either.

What the original TF code computes differently from the PyTorch code, and what the converted config says:
- `same_length`: TF's `_create_mask` lets each query see `mlen + 1` keys, and its evaluation always runs with a
  full memory (mlen == mem_len), so the window is one key longer than the PyTorch code's: `same_length_extra = 1`.
- `tf.contrib.layers.layer_norm` uses epsilon 1e-12: `layer_norm_epsilon = 1e-12`.
- the first memory is `mem_len` zero vectors that are attended to (see docs/checkpoints.md); ours starts empty.

Layouts (from `tf/model.py`): dense kernels are [in, out] (ours: [out, in]); the embedding computes
`emb @ proj_W` (our `emb_projs[i]` is `proj_W.T`) and the softmax `hidden @ proj.T` (our `out_projs[i]` is
`proj.T`); `qkv` splits into q, k, v along its last axis, as ours; the softmax weights are always the embedding
tables; a tied projection has no `adaptive_softmax/cutoff_i/proj`; with `proj_same_dim=False` a cluster whose
embedding size equals d_model has no projection at all (ours then holds an identity, which is exact); tail cluster
i reads head column `cutoffs[0] + i - 1` (HuggingFace's order), so the cluster rows are reversed into ours.
"""
