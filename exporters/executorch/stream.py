"""A program with the cached step's signature, stepped over a token stream with the memory threaded through it.

The program (an ExecuTorch method, or the eager module it came from) outputs only this segment's keys and values
(the incremental layout, see `io_spec`); this side keeps the ring buffer and writes them in (`write_ring`), as every
runtime does. Used by the export's checks, so they run the .pte exactly as a runtime feeds it.
"""

from __future__ import annotations

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.contract.ring import write_ring


class RingStepper:
    """`step(tokens [B, Q]) -> log_probs [B, Q, V]` over `call(tokens, out_positions, *state) -> outputs`
    (numpy in, numpy out, io_spec order), holding the memory of B rows from the first call on."""

    def __init__(self, call, spec: io_spec.GraphSpec):
        self.call, self.spec = call, spec
        self.state = None

    def reset(self):
        self.state = None

    def step(self, tokens):
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        B, Q = tokens.shape
        s = self.spec
        if self.state is None:
            self.state = [np.zeros(t.shape_for(B), dtype=np.int64 if t.dtype == "int64" else np.float32)
                          for t in s.state_inputs()]
        positions = np.ascontiguousarray(np.broadcast_to(np.arange(Q, dtype=np.int64), (B, Q)))
        outs = self.call(tokens, positions, *self.state)
        count = self.state[-1]
        for i in range(s.n_layer):
            write_ring(self.state[2 * i], self.state[2 * i + 1], outs[1 + 2 * i], outs[2 + 2 * i], count, s.mem_len)
        self.state[-1] = count + Q
        return outs[0]


def program_call(method):
    """An ExecuTorch method as a numpy callable (the Python runtime takes and returns torch tensors)."""
    import torch  # optional (the executorch extra): ExecuTorch's Python runtime exchanges torch tensors

    def call(*arrays):
        outs = method.execute([torch.from_numpy(np.require(a, requirements=["C", "W"])) for a in arrays])
        return [o.numpy().copy() for o in outs]  # copies: the runtime may reuse its output buffers next call

    return call


def module_call(module):
    """An eager torch module with the program's signature as a numpy callable."""
    import torch  # optional (the torch extra): the eager side of the checks

    def call(*arrays):
        with torch.no_grad():
            outs = module(*(torch.from_numpy(np.require(a, requirements=["C", "W"])) for a in arrays))
        return [o.numpy() for o in outs]

    return call
