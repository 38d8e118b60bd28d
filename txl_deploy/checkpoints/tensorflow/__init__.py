"""The original TensorFlow checkpoints (kimiyoung/transformer-xl `tf/`): the paper's own pretrained models.

`tf/sota/download.sh` fetches, per dataset, `pretrained_xl/tf_<name>/` with `model/model.ckpt-N.*` and
`data/cache.pkl` (the pickled corpus, holding the vocabulary) + `data/corpus-info.json`; `convert` takes that
folder, or a `model.ckpt-N` path. The weights are read by `bundle` without TensorFlow. A TF checkpoint stores no
hyper-parameters: the variable shapes fix the architecture, and the evaluation settings come from a preset of the
published run scripts or the original training flags, checked against the shapes. What the TF code computes
differently (a `same_length` window one key longer, layer-norm epsilon 1e-12) is recorded in the converted config.
How its weights' layouts map to ours: docs/checkpoints.md, "The paper's pretrained models".
"""
