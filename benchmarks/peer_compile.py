"""`torch.compile` of the cached step: what a PyTorch user would try next, on txl-deploy's own formulation.

A peer in the benchmark: the `torch-fast` backend (`CachedTxl`: projected keys and values in ring buffers, the
positional table precomputed) with its decode step compiled by `torch.compile` (the default mode and backend,
inductor; static shapes, so one compilation per batch size, paid in the benchmark's warm-up). The ring write
stays eager, in place. Longer inputs (a prompt, the memory's fill) run the cached step uncompiled: compiling
every segment length would only add compilations the benchmark does not time.
"""

from __future__ import annotations

from txl_deploy.runtimes.backends.pytorch import TorchCachedBackend


class TorchCompileBackend(TorchCachedBackend):
    name = "torch-compile"

    def _prepare(self):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        super()._prepare()
        # Every side of a benchmark compiles its own module; a benchmark opens one per model and batch size, and
        # past torch's recompile limit (8 per function) a module would run uncompiled without a word. Compiled
        # code of modules that are gone is dropped first.
        torch._dynamo.reset()
        self.compiled = torch.compile(self.cached, dynamic=False)

    def _module_for(self, tokens):
        return self.compiled if tokens.shape[1] == 1 else self.cached
