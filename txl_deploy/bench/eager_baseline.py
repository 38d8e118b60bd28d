"""The eager baseline of the benchmark: `MemTransformerLM` as a text generator runs it, the output layer applied
only at the positions asked for (the last of a prompt) instead of at every position as `forward` does (548 MB of
log-probabilities per 512-token row on WikiText-103). Why: docs/benchmarks.md ("`txl-deploy bench`")."""

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
                hidden, new = self._body(x, state["batched"])
                picked = _at(hidden, idx)
                new_state = {"batched": new}
            else:  # rows of different memory lengths (after reset(rows)) run one at a time, as in the parent
                picked, new_rows = [], []
                for b, mems in enumerate(state["rows"]):
                    hidden, new = self._body(x[b:b + 1], mems)
                    picked.append(_at(hidden, idx[b:b + 1]))
                    new_rows.append(new)
                picked = torch.cat(picked)
                new_state = {"rows": new_rows}
                if len({r[0].shape[1] for r in new_rows}) == 1:  # rows caught up (all full): batch them again
                    new_state["batched"] = [torch.cat([r[i] for r in new_rows]) for i in range(self.config.n_layer)]
            log_probs = self._output_layer(picked)
        state.update(new_state)  # only once everything above succeeded
        return log_probs.float().cpu().numpy()

    def _body(self, tokens, mems):
        return self.model.body(tokens, mems)

    def _output_layer(self, hidden):
        return self.model.crit(hidden)


def _at(hidden, idx):
    """hidden [B, Q, D], idx [B, P] -> hidden [B, P, D] at those positions."""
    return hidden.gather(1, idx[:, :, None].expand(-1, -1, hidden.shape[-1]))
