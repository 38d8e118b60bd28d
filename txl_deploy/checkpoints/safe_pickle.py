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

Nothing is allocated from a size the file claims before that size is checked against the file:

- every pickle is scanned before it is unpickled (`check_lengths`): each length-prefixed opcode (bytes, strings,
  frames) must fit in what is left of the file, and memo indices must not run ahead of the pickle, since Python's
  unpickler allocates what a length says before it reads (3.11: 1 TiB for a 9-byte BINBYTES8 header);
- every storage torch is about to allocate for (`persistent_load`) must fit in the file (legacy format) or in its
  record of the archive (zip format), and every tensor rebuilt over a storage must lie inside it (no view larger
  than its data, which a later copy would materialise);
- `bytes`, `bytearray` and `_codecs.encode` rebuild data only, never an allocation of a size (`bytes(2**40)`).
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import contextlib
import contextvars
import io
import os
import pickle
import pickletools
import re
import sys
import warnings
import zipfile
from dataclasses import dataclass, field
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


def is_class_name(name: str) -> bool:
    """Whether `name` is spelled as a class is (CamelCase): only such names become inert placeholders."""
    return bool(_CLASS_NAME.match(name))


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
                self.__dict__.update(_plain_attributes(slots))
        if isinstance(state, dict):
            self.__dict__.update(_plain_attributes(state))
        elif state is not None:
            self.__dict__["_state"] = state

    def __repr__(self):
        return f"<inert {self._pickled_class}>"


def _plain_attributes(state: dict) -> dict:
    """A pickled state as attributes, refusing a name like `__setstate__`: set on a placeholder, the unpickler would
    look it up there and call it on the next BUILD. Real objects' pickled states hold no such names."""
    for key in state:
        if isinstance(key, str) and key.startswith("__") and key.endswith("__"):
            raise pickle.UnpicklingError(f"a pickled state that sets {key[:40]} on a placeholder object")
    return state


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


def data_only(kind):
    """bytes / bytearray from data (a str and its encoding, or bytes), never from a size: `bytes(2**40)` in a
    pickle would allocate a terabyte of zeros."""
    def rebuild(*args):
        if args and not isinstance(args[0], (str, bytes, bytearray)):
            raise pickle.UnpicklingError(f"{kind.__name__}() of a {type(args[0]).__name__} (only of data)")
        return kind(*args)

    return rebuild


def latin1_encode(obj, encoding="utf-8", errors="strict"):
    # protocol 2 spells bytes as _codecs.encode(str, "latin1"); no other codec is needed (or wanted)
    if not isinstance(obj, str) or str(encoding).lower().replace("-", "").replace("_", "") not in ("latin1",):
        raise pickle.UnpicklingError(f"_codecs.encode({type(obj).__name__}, {str(encoding)[:20]!r}) is not bytes")
    return codecs.encode(obj, "latin1", errors)


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
        ("builtins", "bytearray"): data_only(bytearray),
        ("builtins", "bytes"): data_only(bytes),
        ("builtins", "complex"): complex,
        ("_codecs", "encode"): latin1_encode,  # how protocol 2 spells bytes
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
    """pickle.Unpickler whose `find_class` resolves only `resolve_global`'s allowlist, over a pickle whose lengths
    were checked against the file first (`check_lengths`), and whose storages are checked before torch allocates
    them (`persistent_load`)."""

    def __init__(self, file, *args, **kwargs):
        check_lengths(file)
        super().__init__(file, *args, **kwargs)

    def persistent_load(self, saved_id):
        # torch sets `unpickler.persistent_load = its function` after construction; that lands in the instance's
        # __dict__ (this method is not a data descriptor), and the unpickler keeps calling this one.
        load = self.__dict__.get("persistent_load")
        if load is None:
            raise pickle.UnpicklingError("a persistent id in a pickle that has no storages")
        _check_storage(saved_id)
        return load(saved_id)

    def find_class(self, module, name):
        # Protocol 0-2 pickles written by Python 2 / with fix_imports name `__builtin__` etc.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        return resolve_global(module, name)


# -- sizes the file claims, against the file ------------------------------------------------------------------------
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_MAX_LINE = 1 << 20  # read at a time while looking for the end of a text argument (protocol 0)
_CHUNK = 1 << 16
_COUNTED = {pickletools.TAKEN_FROM_ARGUMENT1: (1, True), pickletools.TAKEN_FROM_ARGUMENT4: (4, False),
            pickletools.TAKEN_FROM_ARGUMENT4U: (4, True), pickletools.TAKEN_FROM_ARGUMENT8U: (8, True)}


def _opcode_table() -> dict[int, tuple[str, str, int]]:
    """opcode byte -> (name, how its argument is laid out, bytes): "none", "fixed" n bytes, "counted" (a length of n
    bytes, then that many bytes), "lines" (n newline-terminated lines), "memo" (a memo index of n bytes), "frame"."""
    table = {}
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            layout, n = "none", 0
        elif arg.n == pickletools.UP_TO_NEWLINE:
            layout, n = "lines", 2 if arg.name == "stringnl_noescape_pair" else 1
        elif arg.n in _COUNTED:
            layout, n = "counted", arg.n
        elif op.name == "FRAME":
            layout, n = "frame", arg.n
        elif op.name in _MEMO_PUTS:
            layout, n = "memo", arg.n
        else:
            layout, n = "fixed", arg.n
        table[op.code.encode("latin1")[0]] = (op.name, layout, n)
    return table


_OPCODES = _opcode_table()


def check_lengths(file) -> None:
    """Walk the pickle that starts at `file`'s position up to its STOP opcode without building anything, and refuse
    (UnpicklingError) any length that runs past the end of the file, or a memo index ahead of the opcodes read so
    far; then seek back. Python's unpickler allocates a length before reading it; this bounds every allocation it
    makes by the bytes the file holds. A file object that cannot seek is not checked (torch and this module always
    pass seekable ones). Reads through a buffer and seeks over the data it skips: never reads what it skips."""
    try:
        if not file.seekable():
            return
        start = file.tell()
        end = file.seek(0, io.SEEK_END)
        file.seek(start)
    except (AttributeError, OSError, ValueError):
        return
    table = _OPCODES
    base, buf, pos, ops = start, b"", 0, 0  # the buffer holds the file's bytes from `base`

    def refill(need):
        nonlocal base, buf, pos
        base += pos
        file.seek(base)
        buf, pos = file.read(max(_CHUNK, need)), 0
        if len(buf) < need:
            raise pickle.UnpicklingError("pickle data was truncated")

    try:
        while True:
            if pos >= len(buf):
                refill(1)
            entry = table.get(buf[pos])
            if entry is None:
                raise pickle.UnpicklingError(f"invalid pickle opcode {buf[pos]:#04x} at byte {base + pos}")
            pos += 1
            ops += 1
            name, layout, n = entry
            if layout == "none":
                if name == "STOP":
                    return
                continue
            if layout == "lines":
                for _ in range(n):
                    found = buf.find(b"\n", pos)
                    if found < 0:  # not in the buffer: read on from here to the line's end (the file bounds it)
                        refill(0)
                        while found < 0:
                            more = file.read(_MAX_LINE)
                            if not more:
                                raise pickle.UnpicklingError("a text argument that is not a line")
                            found = (buf + more).find(b"\n", len(buf))
                            buf += more
                    line, pos = buf[pos:found], found + 1
                if name in _MEMO_PUTS:
                    _memo_index(line, ops)
                continue
            width = _COUNTED[n][0] if layout == "counted" else n
            if layout == "fixed":
                skip = width
            else:
                if pos + width > len(buf):
                    refill(width)
                signed = layout == "counted" and not _COUNTED[n][1]
                value = int.from_bytes(buf[pos:pos + width], "little", signed=signed)
                pos += width
                if layout == "memo":
                    _memo_index(str(value).encode(), ops)
                    continue
                if layout == "frame":
                    if value > end - base - pos:
                        raise pickle.UnpicklingError(f"a frame of {value:,} bytes with {end - base - pos:,} left")
                    continue  # a frame holds opcodes: they are walked one by one
                if value < 0:
                    raise pickle.UnpicklingError(f"{name} of negative length {value}")
                skip = value
            if skip > end - base - pos:
                raise pickle.UnpicklingError(f"{name} claims {skip:,} bytes with {end - base - pos:,} left in the "
                                             "file")
            if pos + skip <= len(buf):
                pos += skip
            else:  # past the buffer: seek, never read
                base, buf, pos = base + pos + skip, b"", 0
    finally:
        file.seek(start)


def _memo_index(line: bytes, ops: int) -> int:
    try:
        index = int(line.strip() or b"-1")
    except ValueError:
        raise pickle.UnpicklingError("a memo index that is not a number") from None
    # The memo grows to twice the largest index: writers number entries in order, so none is ahead of the opcodes.
    if not 0 <= index <= ops:
        raise pickle.UnpicklingError(f"memo index {index} after {ops} opcodes")
    return index


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


def one_line(e: BaseException, limit: int = 160) -> str:
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
    records = None
    if is_zip:
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
                # storage key -> bytes of its record: what each storage the pickle names may claim
                records = {i.filename.rsplit("/data/", 1)[1]: i.file_size for i in z.infolist()
                           if "/data/" in i.filename and "/.data/" not in i.filename}
        except (zipfile.BadZipFile, OSError, ValueError, IndexError) as e:
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
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError, AssertionError,
            zipfile.BadZipFile) as e:  # torch asserts on persistent ids and archive records it does not expect
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
