"""PyTorch backends: the eager reference (the paper's memory of hidden states) and the fast cached path.

`torch`: `MemTransformerLM` exactly as trained: the memory holds each layer's input hidden states, starts empty
and grows to mem_len, and every step re-projects it. This is the baseline users know and what every exported
artefact is checked against.

`torch-fast`: the same numbers through `CachedTxl` (projected keys/values in preallocated ring buffers, the
positional table precomputed), for users who stay in PyTorch.
"""

from __future__ import annotations

import warnings

import numpy as np

from txl_deploy.checkpoints import load_model
from txl_deploy.contract import io_spec
from txl_deploy.contract.clusters import Clusters
from txl_deploy.contract.metadata import ExportInfo
from txl_deploy.errors import InputError
from txl_deploy.runtimes.backend import Backend
from txl_deploy.runtimes.host_rings import HostRingBackend


def _load(path, device, mem_len, overrides=None):
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model.weights import build_model  # imports torch

    loaded = load_model(path)
    # evaluation-time settings (clamp_len, same_length) change no weight shapes
    config = loaded.config.replace(**overrides) if overrides else loaded.config
    model = build_model(config, loaded.state_dict, loaded.path)
    if mem_len is not None:
        model.reset_length(mem_len)
    if model.cfg.mem_len <= 0:
        raise InputError(f"{path}: the model has mem_len {model.cfg.mem_len}; pass mem_len >= 1")
    device = torch.device(device or "cpu")
    return loaded, model.to(device), device


class _TorchBase(Backend):
    @classmethod
    def from_checkpoint(cls, path, device=None, mem_len=None, max_segment=None, overrides=None, threads=None):
        if threads:
            import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

            torch.set_num_threads(int(threads))  # process-wide: PyTorch has no per-model thread pool
        loaded, model, _ = _load(path, device, mem_len, overrides)
        self = cls.from_model(model, loaded.vocab, max_segment)
        if threads:
            self.threads = int(threads)
        return self

    @classmethod
    def from_model(cls, model, vocab=None, max_segment=None):
        """A backend on a MemTransformerLM already built (its device and mem_len as they are): the ExecuTorch
        export's fp32 side."""
        self = cls()
        self._init_common(vocab, model, next(model.parameters()).device, max_segment)
        self._prepare()
        return self

    def _prepare(self):
        """What a backend builds on top of the loaded reference model."""

    def _init_common(self, vocab, model, device, max_segment):
        from txl_deploy.model.weights import weights_sha256  # imports torch

        self.model, self.device = model, device
        self.config, self.vocab = model.cfg, vocab
        self.mem_len = model.cfg.mem_len
        self.max_segment = int(max_segment or 512)
        info = ExportInfo(model.cfg, vocab, {"mem_len": self.mem_len,
                                                    "weights_sha256": weights_sha256(model.state_dict())})
        self._fp = info.fingerprint()
        if self.config.n_clusters > 0 and isinstance(self, TorchEagerBackend):  # the reference for lazy decoding
            self.clusters = Clusters.of(self.config)

    def _tensor(self, a, copy=True):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        # owns its memory (inputs may be read-only views), unless the caller gives the array away
        return torch.from_numpy(np.array(a, copy=True) if copy else np.ascontiguousarray(a)).to(self.device)


def head_log_probs(crit, hidden):
    """The adaptive softmax's head log-probs [..., shortlist + n_clusters] (`ProjectedAdaptiveLogSoftmax.forward`'s
    head; cluster i's column is shortlist + n_clusters - i)."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here
    import torch.nn.functional as F  # optional (the torch extra), as above

    weight, bias, proj = crit.cluster_params(0)
    weight, bias = torch.cat([weight, crit.cluster_weight], dim=0), torch.cat([bias, crit.cluster_bias], dim=0)
    return F.log_softmax(crit._logit(hidden, weight, bias, proj), dim=-1)


def tail_log_probs(crit, i, hidden, head_log_prob):
    """Tail cluster i's full log-probs [N, hi - lo]: log p_i(t | i) + the head's log p(i) ([N])."""
    import torch.nn.functional as F  # optional (the torch extra)

    return F.log_softmax(crit._logit(hidden, *crit.cluster_params(i)), dim=-1) + head_log_prob[:, None]


class TorchEagerBackend(_TorchBase):
    """State: per layer [B, mlen, d_model] hidden states shared by all rows, or per-row lists once rows diverge
    (after `reset(rows)`), in which case rows of different memory lengths run one at a time."""

    name = "torch"

    def fingerprint(self):
        return f"hidden-{self._fp}"

    def new_state(self, batch):
        return {"rows": [self.model.init_mems(1) for _ in range(batch)], "batched": self.model.init_mems(batch)}

    def state_batch(self, state):
        return len(state["rows"]) if state["batched"] is None else state["batched"][0].shape[0]

    def run(self, state, tokens, out_positions):
        return self._apply(state, tokens, out_positions, self.model).float().cpu().numpy()

    def run_head(self, state, tokens, out_positions):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        if self.clusters is None:
            return super().run_head(state, tokens, out_positions)
        hidden = self._apply(state, tokens, out_positions, self.model.body)
        with torch.no_grad():
            head = head_log_probs(self.model.crit, hidden)
        return hidden.float().cpu().numpy(), head.float().cpu().numpy()

    def run_tail(self, i, hidden, head_log_prob):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        if self.clusters is None:
            return super().run_tail(i, hidden, head_log_prob)
        if not 1 <= i <= self.clusters.n_clusters:
            raise InputError(f"tail cluster {i} does not exist (the model has {self.clusters.n_clusters})")
        dtype = next(self.model.parameters()).dtype
        with torch.no_grad():
            out = tail_log_probs(self.model.crit, i, self._tensor(hidden).to(dtype),
                                 self._tensor(head_log_prob).to(dtype))
        return out.float().cpu().numpy()

    def _apply(self, state, tokens, out_positions, fn):
        """fn(tokens, mems) -> (out [B, Q, ...], new mems) over the state's rows (batched, or one at a time when
        their memories differ in length), advancing the state; out at `out_positions`."""
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        x = self._tensor(tokens)
        with torch.no_grad():
            if state["batched"] is not None:
                result, new = fn(x, state["batched"])
                state["batched"] = new
            else:
                outs, new_rows = [], []
                for b, mems in enumerate(state["rows"]):
                    lp, new = fn(x[b:b + 1], mems)
                    outs.append(lp)
                    new_rows.append(new)
                result = torch.cat(outs)
                state["rows"] = new_rows
                lens = {r[0].shape[1] for r in new_rows}
                if len(lens) == 1:  # rows caught up (all full): batch them again
                    state["batched"] = [torch.cat([r[i] for r in new_rows]) for i in range(self.config.n_layer)]
            idx = self._tensor(out_positions)
            return torch.gather(result, 1, idx[:, :, None].expand(-1, -1, result.shape[-1]))

    def reset_rows(self, state, rows):
        if state["batched"] is not None:
            b = state["batched"][0].shape[0]
            state["rows"] = [[m[r:r + 1] for m in state["batched"]] for r in range(b)]
            state["batched"] = None
        for r in rows:
            state["rows"][int(r)] = self.model.init_mems(1)
        if len({r[0].shape[1] for r in state["rows"]}) == 1:
            import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

            state["batched"] = [torch.cat([r[i] for r in state["rows"]]) for i in range(self.config.n_layer)]

    def select_rows(self, state, index):
        rows = self._rows(state)  # hidden states are replaced, never written in place: rows may share them
        state = {"rows": [rows[int(r)] for r in index], "batched": None}
        self.reset_rows(state, [])  # batches the rows again where their lengths agree
        return state

    def state_arrays(self, state):
        rows = self._rows(state)
        B, M, D = len(rows), self.mem_len, self.config.d_model
        out = {"lens": np.array([r[0].shape[1] for r in rows], dtype=np.int64)}
        for i in range(self.config.n_layer):
            a = np.zeros((B, M, D), dtype=np.float32)
            for b, r in enumerate(rows):
                n = r[i].shape[1]
                if n:
                    a[b, M - n:] = r[i][0].float().cpu().numpy()
            out[f"mems.{i}"] = a
        return out

    def state_layout(self, batch):
        layout = {"lens": ((batch,), np.dtype(np.int64))}
        for i in range(self.config.n_layer):
            layout[f"mems.{i}"] = ((batch, self.mem_len, self.config.d_model), np.dtype(np.float32))
        return layout

    def state_from_arrays(self, arrays, copy=True):
        want = {"lens"} | {f"mems.{i}" for i in range(self.config.n_layer)}
        if set(arrays) != want:
            raise InputError("this state does not belong to this model (its tensors differ)")
        lens = np.asarray(arrays["lens"])
        B, M, D = lens.shape[0], self.mem_len, self.config.d_model
        for i in range(self.config.n_layer):
            if arrays[f"mems.{i}"].shape != (B, M, D):
                raise InputError(f"state tensor mems.{i} has shape {arrays[f'mems.{i}'].shape}, needs {(B, M, D)}")
        if lens.min(initial=0) < 0 or lens.max(initial=0) > M:
            raise InputError("state has memory lengths outside [0, mem_len]")
        state = {"rows": [[self._tensor(arrays[f"mems.{i}"][b:b + 1, M - int(n):]) for i in range(self.config.n_layer)]
                          for b, n in enumerate(lens)], "batched": None}
        self.reset_rows(state, [])
        return state

    def _rows(self, state):
        if state["batched"] is not None:
            return [[m[r:r + 1] for m in state["batched"]] for r in range(state["batched"][0].shape[0])]
        return state["rows"]


class TorchCachedBackend(HostRingBackend, _TorchBase):
    """`CachedTxl` in eager PyTorch: the contract's ring buffers as torch tensors on the model's device, updated in
    place (the state methods and the commit are HostRingBackend's, through `_adopt` and `_host`)."""

    name = "torch-fast"

    def _prepare(self):
        from txl_deploy.model.cached_step import CachedTxl  # imports torch

        self.cached = CachedTxl(self.model, self.mem_len, state="incremental", max_segment=self.max_segment).eval()
        self.spec = self.cached.spec
        self._graphs = {}  # CUDA graphs of the decode step, by state buffers (GPU only)

    def fingerprint(self):
        return f"kv-{self._fp}-float32"

    def run(self, state, tokens, out_positions):
        if self.device.type == "cuda" and tokens.shape[1] == 1 and out_positions.shape[1] == 1:
            graph = self._decode_graph(state)
            if graph is not None:
                return graph.replay(tokens, out_positions)
        return super().run(state, tokens, out_positions)

    def _execute(self, state, tokens, out_positions, advance):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        with torch.no_grad():
            x, pos = self._tensor(tokens), self._tensor(out_positions)
            count = state[io_spec.MEM_COUNT]
            if tokens.shape[1] > 1 and not bool(count.any()):
                # A prompt into an empty memory attends a 1-slot stand-in, not mem_len masked slots (CachedTxl)
                outs = self.cached(x, pos, *self._empty_memory(tokens.shape[0]), count)
            else:
                outs = self._module_for(x)(x, pos, *[state[n] for n in self._state_names])
        return outs[0].float().cpu().numpy(), outs[1:]

    def _module_for(self, tokens):
        """The module that runs a segment of `tokens` over a memory: the cached step (a peer may swap in a compiled
        one for some lengths)."""
        return self.cached

    def _empty_memory(self, batch):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        spec, mems = self.spec, []
        for _ in range(spec.n_layer):
            mems.append(torch.zeros(spec.k_shape(batch, slots=1), device=self.device))
            mems.append(torch.zeros(spec.v_shape(batch, slots=1), device=self.device))
        return mems

    def _step(self, tokens, out_positions, state):
        """One call of the cached model, ring write included: all on the device, no host sync (CUDA-graph safe)."""
        outs = self.cached(tokens, out_positions, *[state[n] for n in self._state_names])
        self._commit(state, outs[1:])
        return outs[0]

    @property
    def _state_names(self):
        return [s.name for s in self.spec.state_inputs()]

    def _decode_graph(self, state):
        """The CUDA graph of one decode step (Q = 1) over this state's buffers, captured on first use.

        A step is ~100 small kernels; replaying them as one graph removes the launch overhead that dominates
        decode on a GPU. The graph is bound to the buffers' addresses, so a new state (reset, load_state) gets
        its own capture. Any capture failure falls back to eager launches for good (same numbers, slower)."""
        if self._graphs is False:
            return None
        key = tuple(state[n].data_ptr() for n in self._state_names)
        if key not in self._graphs:
            try:
                self._graphs = {key: _DecodeGraph(self, state)}  # one live graph: older states are dropped
            except Exception as e:  # pragma: no cover - needs a GPU

                warnings.warn(f"torch-fast: CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly")
                self._graphs = False
                return None
        return self._graphs[key]

    def reset_rows(self, state, rows):
        super().reset_rows(state, self._tensor(np.asarray(rows, dtype=np.int64)))

    def _index(self, index):
        return self._tensor(np.asarray(index, dtype=np.int64))

    def _adopt(self, arrays):
        return {k: self._tensor(v, copy=False) for k, v in arrays.items()}  # the arrays are ours already

    def _host(self, state):
        return {k: v.cpu().numpy() for k, v in state.items()}


class _DecodeGraph:  # pragma: no cover - needs a GPU; the captured work is `_step`, which the CPU tests run
    """Static token/position inputs and a captured `_step` (forward + in-place ring write + counter)."""

    def __init__(self, backend, state):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        self.backend = backend
        batch = state[io_spec.MEM_COUNT].shape[0]
        dev = backend.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        # Warm-up runs (cuBLAS handles, allocator pools) mutate the memory: keep a copy and put it back.
        saved = {k: v.clone() for k, v in state.items()}
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                backend._step(self.tokens, self.positions, state)
        torch.cuda.current_stream(dev).wait_stream(side)
        for k, v in state.items():
            v.copy_(saved[k])
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not executed: the state is untouched here
            self.log_probs = backend._step(self.tokens, self.positions, state)
        torch.cuda.synchronize(dev)

    def replay(self, tokens, out_positions):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        self.tokens.copy_(torch.from_numpy(np.array(tokens, dtype=np.int64)))
        self.positions.copy_(torch.from_numpy(np.array(out_positions, dtype=np.int64)))
        self.graph.replay()
        return self.log_probs.float().cpu().numpy()
