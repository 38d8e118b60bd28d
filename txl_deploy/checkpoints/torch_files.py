"""Legacy PyTorch checkpoints (`torch.save` files, zip or legacy format) read with the restricted unpickler.

The original CMU `model.pt` is `torch.save(model)` of a whole `mem_transformer.MemTransformerLM`, and NVIDIA's
checkpoints pickle an `argparse.Namespace` and their `Vocab` object beside the state_dict; a plain `torch.load`
would import and call whatever the pickle names. This module is passed to `torch.load(pickle_module=...)` instead:
its `Unpickler` is the restricted one with this use's allow-list (`TORCH_CHECKPOINTS`: tensor rebuilds, plain
containers, the Transformer-XL and torch.nn classes as inert attribute holders), and every storage and tensor the
file claims is checked against the file before torch allocates it. The rules: docs/security.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import os
import pickle
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from txl_deploy.checkpoints.unpickler import PLAIN, AllowList, RefusedGlobal, RestrictedUnpickler, attr, one_line
from txl_deploy.errors import CheckpointError

# Source modules whose classes we rebuild as inert attribute holders. The original code puts utils/ on sys.path
# (so its classes pickle as `proj_adaptive_softmax.X`); NVIDIA imports them as `utils.X`.
SOURCE_MODULES = {
    "mem_transformer", "proj_adaptive_softmax", "log_uniform_sampler", "vocabulary", "data_parallel",
    "utils.proj_adaptive_softmax", "utils.log_uniform_sampler", "utils.vocabulary", "utils.data_parallel",
    "argparse",
}
# torch.nn containers and layers are inert too: their state is all we need, their code stays unused.
TORCH_MODULE_PREFIXES = ("torch.nn.modules.", "torch.nn.parallel.")


def _no_backend():
    # torch < 1.0 pickled `torch.nn.backends.thnn._get_thnn_function_backend()` into every module; the backend
    # object is irrelevant to the weights.
    return None


def _allowed_callables() -> dict[tuple[str, str], object]:
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here
    import torch._utils  # optional (the torch extra): only code that runs a PyTorch model gets here

    allowed = {
        **PLAIN,
        ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,  # torch 0.4 pickled Parameter(data, requires_grad)
        ("torch.nn.backends.thnn", "_get_thnn_function_backend"): _no_backend,
    }
    for fn in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
        if hasattr(torch._utils, fn):
            allowed[("torch._utils", fn)] = getattr(torch._utils, fn)
    for fn in ("_rebuild_tensor", "_rebuild_tensor_v2"):
        if hasattr(torch._utils, fn):
            allowed[("torch._utils", fn)] = _inside_storage(getattr(torch._utils, fn))
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


def _inside_storage(rebuild):
    """A tensor rebuild that first checks the tensor lies inside its storage: sizes, strides and offset as the file
    claims them, against the bytes the storage holds."""
    def checked(storage, storage_offset, size, stride, *rest, **kwargs):
        try:
            size, stride, offset = [int(s) for s in size], [int(s) for s in stride], int(storage_offset)
            itemsize = storage.dtype.itemsize
            have = storage._untyped_storage.nbytes() if hasattr(storage, "_untyped_storage") else storage.nbytes()
        except (TypeError, ValueError, AttributeError) as e:
            raise pickle.UnpicklingError(f"a malformed tensor ({type(e).__name__})") from None
        numel = 1
        for s in size:
            numel *= s
        if len(size) != len(stride) or offset < 0 or min(size, default=1) < 0 or min(stride, default=0) < 0:
            raise pickle.UnpicklingError(f"a tensor of size {size[:8]} and stride {stride[:8]} at offset {offset}")
        end = offset + 1 + sum((s - 1) * st for s, st in zip(size, stride)) if numel else offset
        if end * itemsize > have or numel * itemsize > have:
            raise pickle.UnpicklingError(f"a tensor of {numel:,} elements of size {size[:8]} is larger than its "
                                         f"storage ({have:,} bytes)")
        return rebuild(storage, storage_offset, tuple(size), tuple(stride), *rest, **kwargs)

    return checked


def _inert(module: str, name: str) -> bool:
    return module in SOURCE_MODULES or module.startswith(TORCH_MODULE_PREFIXES)


# What a torch.save checkpoint may name: tensor / storage / Parameter rebuilds (each tensor checked to lie inside its
# storage), torch.Size, torch.device, the dtypes, plain containers; the classes of the Transformer-XL sources and of
# torch.nn, and argparse.Namespace, as inert attribute holders.
TORCH_CHECKPOINTS = AllowList(_allowed_callables, inert=_inert)


class Unpickler(RestrictedUnpickler):
    """The restricted unpickler with `TORCH_CHECKPOINTS`, whose storages are checked before torch allocates them
    (`persistent_load`)."""

    allow = TORCH_CHECKPOINTS

    def persistent_load(self, saved_id):
        # torch sets `unpickler.persistent_load = its function` after construction; that lands in the instance's
        # __dict__ (this method is not a data descriptor), and the unpickler keeps calling this one.
        load = self.__dict__.get("persistent_load")
        if load is None:
            raise pickle.UnpicklingError("a persistent id in a pickle that has no storages")
        _check_storage(saved_id)
        return load(saved_id)


@dataclass
class _StorageBudget:
    """What the storages of the file being read may claim: its size (legacy format, where every storage's bytes
    follow the pickle), or each record's size (zip format, `<archive>/data/<key>`)."""

    path: Path
    file_bytes: int
    records: dict | None = None
    claimed: dict = field(default_factory=dict)


_budget: contextvars.ContextVar = contextvars.ContextVar("txl_deploy_storage_budget", default=None)


def _check_storage(saved_id) -> None:
    if not isinstance(saved_id, tuple) or not saved_id or saved_id[0] not in ("storage", b"storage"):
        if isinstance(saved_id, tuple) and saved_id and saved_id[0] in ("module", b"module"):
            return  # the legacy format's source code of pickled classes: torch compares it, allocates nothing
        raise pickle.UnpicklingError(f"an unknown persistent id {str(saved_id)[:60]}")
    budget = _budget.get()
    if budget is None:
        raise pickle.UnpicklingError("a tensor storage outside a torch.save file")
    try:
        storage_type, key, numel = saved_id[1], saved_id[2], int(saved_id[4])
        dtype = getattr(storage_type, "dtype", None)
        itemsize = 1 if dtype is None else dtype.itemsize
    except (IndexError, TypeError, ValueError, AttributeError):
        raise pickle.UnpicklingError(f"a malformed storage id {str(saved_id)[:80]}") from None
    nbytes = numel * itemsize
    if numel < 0:
        raise pickle.UnpicklingError(f"storage {key!r} of {numel} elements")
    key = key.decode("ascii", "replace") if isinstance(key, bytes) else str(key)
    if budget.records is not None:
        have = budget.records.get(key)
        if have is None:
            raise pickle.UnpicklingError(f"storage {key!r} has no data record in the archive")
        if nbytes > have:
            raise pickle.UnpicklingError(f"storage {key!r} claims {nbytes:,} bytes, its record holds {have:,}")
    else:
        budget.claimed[key] = max(budget.claimed.get(key, 0), nbytes)
        total = sum(budget.claimed.values())
        if total > budget.file_bytes:
            raise pickle.UnpicklingError(f"storages claim {total:,} bytes, more than the file's {budget.file_bytes:,}")


@contextlib.contextmanager
def _storages_of(path: Path, records: dict | None):
    token = _budget.set(_StorageBudget(path, os.path.getsize(path), records))
    try:
        yield
    finally:
        _budget.reset(token)


def load(file, **kwargs):
    """`pickle.load` with the restricted Unpickler (torch's legacy format reads its headers with this)."""
    return Unpickler(file, **kwargs).load()


def loads(data: bytes, **kwargs):
    return Unpickler(io.BytesIO(data), **kwargs).load()


def torch_load(path):
    """Read a `torch.save` file (zip or legacy) on the CPU with the restricted unpickler; errors name the file."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as e:
        raise CheckpointError(path, f"cannot read ({e.strerror or e})") from None
    is_zip = head.startswith(b"PK\x03\x04")
    records = None
    if is_zip:
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
                # storage key -> bytes of its record: what each storage the pickle names may claim
                records = {i.filename.rsplit("/data/", 1)[1]: i.file_size for i in z.infolist()
                           if "/data/" in i.filename and "/.data/" not in i.filename}
        # NotImplementedError: a record claiming a zip version or a feature zipfile lacks
        except (zipfile.BadZipFile, OSError, ValueError, IndexError, NotImplementedError) as e:
            raise CheckpointError(path, f"truncated or corrupt torch.save archive ({one_line(e)})") from None
        if any(n.endswith("/constants.pkl") or n == "constants.pkl" for n in names):
            # torch.load would hand this to torch.jit.load, which runs TorchScript: not a checkpoint we read.
            raise CheckpointError(path, "is a TorchScript archive, not a checkpoint")
        if not any(n.endswith("data.pkl") for n in names):
            raise CheckpointError(path, "is a zip file but not a torch.save archive (no data.pkl)")
    elif head[257:262] == b"ustar":
        # torch's first format (2016) sizes each storage from a number in the file before reading it; no published
        # Transformer-XL checkpoint uses it, so it is not read rather than trusted
        raise CheckpointError(path, "is a torch.save file in the tar format of torch before 0.2, which is not read; "
                                    "re-save it with a newer torch (torch.save writes the zip format)")
    elif not head[:1] == b"\x80":
        raise CheckpointError(path, "is not a checkpoint of a supported format (expected a txl-deploy or "
                                    "HuggingFace folder, a torch.save file or a .safetensors file)")
    try:
        with warnings.catch_warnings():
            # The legacy format stores each module class's source to compare with the installed code; our inert
            # stand-ins have none, and the comparison is moot since that code never runs.
            warnings.filterwarnings("ignore", message="Couldn't retrieve source code")
            with _storages_of(path, records):
                return torch.load(path, map_location="cpu", pickle_module=sys.modules[__name__], weights_only=False,
                                  mmap=is_zip)  # zip archives map their tensors from the file: no copy in memory
    except RefusedGlobal as e:
        raise CheckpointError(
            path, f"refused to unpickle {e.module}.{e.name}: only tensors, plain containers and Transformer-XL "
                  f"module attributes are allowed (nothing from the file was run)") from None
    except (EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(path, f"truncated or corrupt pickle ({one_line(e)})") from None
    # torch asserts on persistent ids and archive records it does not expect; zipfile lacks some zip versions
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError, AssertionError,
            NotImplementedError, zipfile.BadZipFile) as e:
        if "explicit pickle_module" in str(e):
            raise CheckpointError(path, "TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, which disables txl-deploy's "
                                        "restricted unpickler; unset it to read this file") from None
        raise CheckpointError(path, f"truncated or corrupt torch.save file ({type(e).__name__}: "
                                    f"{one_line(e)})") from None


# -- reading the inert module tree -----------------------------------------------------------------------
def module_tree_state_dict(root, path="<checkpoint>") -> dict:
    """The state_dict of a pickled nn.Module tree, read from its `_parameters`, `_buffers` and `_modules`.

    Tied parameters come back as the same tensor object under both names (the pickle memoised them).
    """
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    out: dict = {}
    seen: set[int] = set()

    def walk(obj, prefix, depth):
        if depth > 64:
            raise CheckpointError(path, "pickled module tree is nested too deeply")
        if id(obj) in seen:  # a submodule registered twice (NVIDIA's shared_out_projs) keeps its first name
            return
        seen.add(id(obj))
        d = getattr(obj, "__dict__", {})
        non_persistent = d.get("_non_persistent_buffers_set") or set()
        for kind in ("_parameters", "_buffers"):
            entries = d.get(kind) or {}
            if not isinstance(entries, dict):
                raise CheckpointError(path, f"pickled module {prefix or '<root>'} has a malformed {kind}")
            for name, t in entries.items():
                if t is None or (kind == "_buffers" and name in non_persistent):
                    continue
                if not isinstance(t, torch.Tensor):
                    raise CheckpointError(path, f"{prefix}{name} is a {type(t).__name__}, not a tensor")
                out[prefix + str(name)] = t
        for name, sub in (d.get("_modules") or {}).items():
            if sub is not None:
                walk(sub, f"{prefix}{name}.", depth + 1)

    walk(root, "", 0)
    return out


def submodule(obj, dotted: str):
    """`obj._modules[a]._modules[b]...` for "a.b", or None."""
    for part in dotted.split("."):
        if obj is None:
            return None
        obj = (attr(obj, "_modules") or {}).get(part)
    return obj
