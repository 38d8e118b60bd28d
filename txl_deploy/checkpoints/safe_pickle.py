"""A restricted unpickler for legacy PyTorch checkpoints: rebuilds data, never runs code from the file.

The original CMU `model.pt` is `torch.save(model)` of a whole `mem_transformer.MemTransformerLM`, and NVIDIA's
checkpoints pickle an `argparse.Namespace` and their `Vocab` object beside the state_dict. A plain `torch.load`
imports and calls whatever the pickle names. This module is passed to `torch.load(pickle_module=...)` instead
(torch uses its `Unpickler` and `load` for both the zip and the legacy formats) and resolves a global only if it is:

- a tensor / storage / Parameter rebuild function of torch, `torch.Size`, `torch.device`, a torch dtype;
- `collections.OrderedDict` / `Counter`, the plain builtin containers, `_codecs.encode` (protocol-2 bytes);
- a class of the Transformer-XL sources (`mem_transformer`, `proj_adaptive_softmax`, NVIDIA's `utils.*`),
  of `torch.nn.modules` / `torch.nn.parallel`, or `argparse.Namespace`. These come back as `InertObject`s:
  attribute holders with the pickled `__dict__` (`_parameters`, `_modules`, `n_layer`, `cutoffs`, ...) and no
  behaviour, since none of their code is imported.

Anything else (`os.system`, `builtins.eval`, `subprocess.Popen`, ...) raises `RefusedGlobal` the moment the pickle
names it, before any call, so nothing from the file runs. `torch_load` turns that into a `CheckpointError`.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import io
import pickle
import re
import sys
import warnings
import zipfile
from pathlib import Path

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
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*\Z")


class RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module, name):
        self.module, self.name = module, name
        super().__init__(f"refused global {module}.{name}")


class InertObject:
    """Stands in for an instance of a class from an allowed source module: the pickled attributes, no behaviour."""

    _pickled_class = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["_init_args"] = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
            state, slots = state
            if isinstance(slots, dict):
                self.__dict__.update(slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif state is not None:
            self.__dict__["_state"] = state

    def __repr__(self):
        return f"<inert {self._pickled_class}>"


_inert_classes: dict[str, type] = {}


def inert_class(module: str, name: str) -> type:
    qualname = f"{module}.{name}"
    if qualname not in _inert_classes:
        _inert_classes[qualname] = type(name, (InertObject,), {"_pickled_class": qualname, "__module__": __name__})
    return _inert_classes[qualname]


def pickled_class(obj) -> str | None:
    """`module.Name` of the class an inert object was pickled as, else None."""
    return obj._pickled_class if isinstance(obj, InertObject) else None


def _no_backend():
    # torch < 1.0 pickled `torch.nn.backends.thnn._get_thnn_function_backend()` into every module; the backend
    # object is irrelevant to the weights.
    return None


def _allowed_callables() -> dict[tuple[str, str], object]:
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here
    import torch._utils  # optional (the torch extra): only code that runs a PyTorch model gets here

    allowed = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "Counter"): collections.Counter,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "list"): list,
        ("builtins", "dict"): dict,
        ("builtins", "tuple"): tuple,
        ("builtins", "slice"): slice,
        ("builtins", "bytearray"): bytearray,
        ("builtins", "bytes"): bytes,
        ("builtins", "complex"): complex,
        ("_codecs", "encode"): codecs.encode,  # how protocol 2 spells bytes
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,  # torch 0.4 pickled Parameter(data, requires_grad)
        ("torch.nn.backends.thnn", "_get_thnn_function_backend"): _no_backend,
    }
    for fn in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_parameter_with_state"):
        if hasattr(torch._utils, fn):
            allowed[("torch._utils", fn)] = getattr(torch._utils, fn)
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


_ALLOWED = None


def resolve_global(module: str, name: str):
    """The object a pickle may name as `module.name`, or RefusedGlobal."""
    global _ALLOWED
    if _ALLOWED is None:
        _ALLOWED = _allowed_callables()
    if (module, name) in _ALLOWED:
        return _ALLOWED[(module, name)]
    if _CLASS_NAME.match(name) and (module in SOURCE_MODULES or module.startswith(TORCH_MODULE_PREFIXES)):
        return inert_class(module, name)
    raise RefusedGlobal(module, name)


class Unpickler(pickle.Unpickler):
    """pickle.Unpickler whose `find_class` resolves only `resolve_global`'s allowlist."""

    def find_class(self, module, name):
        # Protocol 0-2 pickles written by Python 2 / with fix_imports name `__builtin__` etc.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        return resolve_global(module, name)


def load(file, **kwargs):
    """`pickle.load` with the restricted Unpickler (torch's legacy format reads its headers with this)."""
    return Unpickler(file, **kwargs).load()


def loads(data: bytes, **kwargs):
    return Unpickler(io.BytesIO(data), **kwargs).load()


def _one_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    if is_zip:
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError) as e:
            raise CheckpointError(path, f"truncated or corrupt torch.save archive ({_one_line(e)})") from None
        if any(n.endswith("/constants.pkl") or n == "constants.pkl" for n in names):
            # torch.load would hand this to torch.jit.load, which runs TorchScript: not a checkpoint we read.
            raise CheckpointError(path, "is a TorchScript archive, not a checkpoint")
        if not any(n.endswith("data.pkl") for n in names):
            raise CheckpointError(path, "is a zip file but not a torch.save archive (no data.pkl)")
    elif not (head[:1] == b"\x80" or head[257:262] == b"ustar"):
        raise CheckpointError(path, "is not a checkpoint of a supported format (expected a txl-deploy or "
                                    "HuggingFace folder, a torch.save file or a .safetensors file)")
    try:
        with warnings.catch_warnings():
            # The legacy format stores each module class's source to compare with the installed code; our inert
            # stand-ins have none, and the comparison is moot since that code never runs.
            warnings.filterwarnings("ignore", message="Couldn't retrieve source code")
            return torch.load(path, map_location="cpu", pickle_module=sys.modules[__name__], weights_only=False,
                              mmap=is_zip)  # zip archives map their tensors from the file: no copy in memory
    except RefusedGlobal as e:
        raise CheckpointError(
            path, f"refused to unpickle {e.module}.{e.name}: only tensors, plain containers and Transformer-XL "
                  f"module attributes are allowed (nothing from the file was run)") from None
    except (EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(path, f"truncated or corrupt pickle ({_one_line(e)})") from None
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError,
            zipfile.BadZipFile) as e:
        if "explicit pickle_module" in str(e):
            raise CheckpointError(path, "TORCH_FORCE_WEIGHTS_ONLY_LOAD is set, which disables txl-deploy's "
                                        "restricted unpickler; unset it to read this file") from None
        raise CheckpointError(path, f"truncated or corrupt torch.save file ({type(e).__name__}: "
                                    f"{_one_line(e)})") from None


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


def attr(obj, name, default=None):
    """An attribute of an inert object (its pickled __dict__ entry), or `default`."""
    return getattr(obj, "__dict__", {}).get(name, default)


def submodule(obj, dotted: str):
    """`obj._modules[a]._modules[b]...` for "a.b", or None."""
    for part in dotted.split("."):
        if obj is None:
            return None
        obj = (attr(obj, "_modules") or {}).get(part)
    return obj
