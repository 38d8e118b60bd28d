"""`torch.compile` of the cached step (the `torch-fast` backend): what a PyTorch user would try next. The decode
step is compiled (inductor, static shapes: one compilation per batch size, in the warm-up); the ring write and
longer inputs (a prompt, the memory's fill) run eager."""

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
