"""The eager baseline of the benchmark: `MemTransformerLM` as a text generator runs it.

`MemTransformerLM.forward` (and so the runtime's `torch` backend) applies the output layer to every position of
a segment and the caller keeps the ones it wants. For a prompt that is most of the work on a large vocabulary:
512 positions x 267,735 words is about 548 MB of log-probabilities per row on WikiText-103, of which generation
needs one position. `EagerAtPositions` runs the model body over the segment, then the output layer only on the
hidden states of the requested positions: the same numbers at those positions, what anyone generating text with
the original model would run. The benchmark compares against it; the full-sequence path is kept as the
"eager as written" prefill column.
"""

from __future__ import annotations

from txl_deploy.runtimes.backends.pytorch import TorchEagerBackend


class EagerAtPositions(TorchEagerBackend):
    """`torch` backend whose output layer reads only the requested positions (same memory, same state layout)."""

    name = "torch"

    def run(self, state, tokens, out_positions):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        x, idx = self._tensor(tokens), self._tensor(out_positions)
        with torch.no_grad():
            if state["batched"] is not None:
                hidden, new = self.model.body(x, state["batched"])
                picked = _at(hidden, idx)
                new_state = {"batched": new}
            else:  # rows of different memory lengths (after reset(rows)) run one at a time, as in the parent
                picked, new_rows = [], []
                for b, mems in enumerate(state["rows"]):
                    hidden, new = self.model.body(x[b:b + 1], mems)
                    picked.append(_at(hidden, idx[b:b + 1]))
                    new_rows.append(new)
                picked = torch.cat(picked)
                new_state = {"rows": new_rows}
                if len({r[0].shape[1] for r in new_rows}) == 1:  # rows caught up (all full): batch them again
                    new_state["batched"] = [torch.cat([r[i] for r in new_rows]) for i in range(self.config.n_layer)]
            log_probs = self.model.crit(picked)
        state.update(new_state)  # only once everything above succeeded
        return log_probs.float().cpu().numpy()


def _at(hidden, idx):
    """hidden [B, Q, D], idx [B, P] -> hidden [B, P, D] at those positions."""
    return hidden.gather(1, idx[:, :, None].expand(-1, -1, hidden.shape[-1]))
