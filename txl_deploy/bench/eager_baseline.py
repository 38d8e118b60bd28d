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

        hidden = self._apply(state, tokens, out_positions, self._body)  # the body's output at those positions
        with torch.no_grad():
            return self._output_layer(hidden).float().cpu().numpy()

    def _body(self, tokens, mems):
        return self.model.body(tokens, mems)

    def _output_layer(self, hidden):
        return self.model.crit(hidden)

