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
