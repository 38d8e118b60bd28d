"""The wire protocol between txl-deploy's Triton Python model and its clients, beyond the graph's own tensors
(`txl_deploy.contract.io_spec`): the park/resume tensors, the parked state's format, the config parameters that
publish the model's settings, and the server's messages a client recognises.

The Python model runs inside Triton's own Python and the clients in the application's: both read these names from
here, so neither can drift from the other.
"""

# Config parameters (config.pbtxt `parameters`) that publish the model's settings to clients: txl_deploy.<name>.
PARAM_PREFIX = "txl_deploy."
# Park and resume (python backend): the optional input that starts a conversation from a parked state, and the
# output that returns a conversation's state (an .npz of TxlRuntime.save_state()'s arrays) after a request.
RESUME_INPUT = "resume_state"
SAVED_OUTPUT = "saved_state"
# What a parked state says about itself: its format and version (besides the model's fingerprint).
STATE_FORMAT = "txl-deploy conversation state"
STATE_FORMAT_VERSION = 1
# Triton's answer for a sequence it does not know, and the python model's for one Triton knows but the model does not
# (its memory was dropped: ended, idled out, or the server restarted).
UNKNOWN_SEQUENCE = "must specify the START flag"
UNKNOWN_TO_MODEL = "is unknown to this model instance"

# Lazy adaptive-softmax decoding (python backend, models with an adaptive softmax: config `cutoffs`). The layout
# (shortlist, tail clusters 1..n, head columns) is `Clusters.from_cutoffs(cutoffs, n_token)` (contract/clusters.py),
# the exported head graph's and the sampler's. A client that samples lazily
# asks a step for the head instead of the full log-probs, and then, only when its decision needs them, for some tails
# of the same distribution, in a request that feeds no tokens (the memory does not move). For a WikiText-103 model
# that is 20,003 floats a token instead of 267,735, plus a tail now and then.
#  HEAD_OUTPUT [1, P, shortlist + n] FP32: per position, the shortlist tokens' log-probs, then one column per tail
#    cluster in the original code's order (`Clusters.head_column(i)`), holding
#    log p_head(i), the log of the probability that the token lies in cluster i (every token t of cluster i has
#    log p(t) <= log p_head(i)).
#  TAIL_INPUT [1, K] INT64: distinct tail clusters (1..n), taken from the conversation's latest next-token
#    distribution (after this request's tokens, if it feeds any).
#  TAIL_OUTPUT [1, sum of the clusters' sizes] FP32: the log p(t) of those clusters' tokens (the values the full
#    log-probs hold there), the clusters concatenated in the order asked.
# `log_probs` is returned when it is asked for, or when neither the head nor tails are (older clients ask for it).
HEAD_OUTPUT = "head_log_probs"
TAIL_INPUT = "tail_clusters"
TAIL_OUTPUT = "tail_log_probs"
CUTOFFS_PARAM = PARAM_PREFIX + "cutoffs"  # JSON list; published by models with an adaptive softmax only

