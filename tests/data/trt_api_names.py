"""Extract the names the TensorRT Python API registers, from the PyPI bindings wheels, without TensorRT's libraries.

    python tests/data/trt_api_names.py                       # download the pinned wheels, write the lists beside it
    python tests/data/trt_api_names.py --wheel some.whl ...  # use wheels already on disk

The lists are tests/data/tensorrt_api_<version>.txt; `tests/exporters/test_tensorrt_api.py` checks every TensorRT
class, attribute and method our code uses against them, so a name that does not exist in TensorRT 10.x or 11.x fails
CI on a machine that cannot install TensorRT.

Why not `strings`: the linker merges string literals that are suffixes of others, so "INT8" is stored only as the
tail of "UINT8" and "Builder" only as the tail of "IExprBuilder"; a list of whole strings misses them, and a list
of every suffix would invent names. pybind11 registers each class, method, property and enum value by passing a
pointer to its name literal, which x86-64 position-independent code loads with a RIP-relative `lea`. So we read
the strings *at the addresses the code references* (plus the addresses in relative relocations, for tables of
names): exactly the literals in use, tail-merged ones included. Literals that are identifiers are the API names
(and some C++ noise such as error-message words, which only makes the lists slightly permissive). The names the
package's `__init__.py` adds in Python (`__version__`, `nptype`, `DataType.itemsize`, ...) are read with `ast`.

Only the x86-64 Linux wheels are supported (the instruction pattern is x86-64).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# The API snapshots CI checks against. 10.3 is what JetPack 6 ships (the oldest TensorRT we support),
# 10.16 the newest 10.x, 11.4 the current release (removed weak typing: no FP16/INT8 builder flags).
DEFAULT_WHEELS = {
    "10.3": "tensorrt-cu12-bindings==10.3.0",
    "10.16": "tensorrt-cu12-bindings==10.16.1.11",
    "11.4": "tensorrt-cu13-bindings==11.4.0.106",
}
IDENTIFIER = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
OUT_DIR = Path(__file__).resolve().parent  # tests/data/, beside this script


def _sections(elf: bytes) -> dict:
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise SystemExit("not a 64-bit little-endian ELF file")
    (e_shoff,) = struct.unpack_from("<Q", elf, 0x28)
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    raw = []
    for i in range(e_shnum):
        name, _type, _flags, addr, offset, size = struct.unpack_from("<IIQQQQ", elf, e_shoff + i * e_shentsize)
        raw.append((name, addr, offset, size))
    strtab_off = raw[e_shstrndx][2]
    out = {}
    for name, addr, offset, size in raw:
        end = elf.index(b"\0", strtab_off + name)
        out[elf[strtab_off + name:end].decode()] = (addr, offset, size)
    return out


def _referenced_addresses(elf: bytes, sections: dict):
    # lea reg, [rip + disp32]: REX.W (0x48-0x4f), 0x8d, modrm with mod=00 and rm=101.
    text_addr, text_off, text_size = sections[".text"]
    text = elf[text_off:text_off + text_size]
    for m in re.finditer(rb"[\x48-\x4f]\x8d[\x05\x0d\x15\x1d\x25\x2d\x35\x3d]", text, re.DOTALL):
        i = m.start()
        (disp,) = struct.unpack_from("<i", text, i + 3)
        yield text_addr + i + 7 + disp
    # R_X86_64_RELATIVE relocations: pointers stored in data (tables of names, docstrings).
    if ".rela.dyn" in sections:
        _addr, off, size = sections[".rela.dyn"]
        for j in range(off, off + size, 24):
            _r_offset, r_info, r_addend = struct.unpack_from("<QQq", elf, j)
            if r_info & 0xFFFFFFFF == 8:
                yield r_addend


def names_in_extension(elf: bytes) -> set[str]:
    sections = _sections(elf)
    ro_addr, ro_off, ro_size = sections[".rodata"]
    names = set()
    for target in set(_referenced_addresses(elf, sections)):
        if not ro_addr <= target < ro_addr + ro_size:
            continue
        start = ro_off + (target - ro_addr)
        end = elf.find(b"\0", start, start + 256)
        if end > start and IDENTIFIER.fullmatch(elf[start:end]):
            names.add(elf[start:end].decode())
    return names


def names_in_init(source: str) -> set[str]:
    """Names the package's __init__.py defines or attaches to the compiled classes."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                elif isinstance(target, ast.Attribute):
                    names.add(target.attr)
    return names


def names_in_wheel(path: Path) -> tuple[str, set[str]]:
    with zipfile.ZipFile(path) as wheel:
        members = wheel.namelist()
        so = [m for m in members if re.fullmatch(r"tensorrt[^/]*/tensorrt\.(so|cpython[^/]*\.so)", m)]
        init = [m for m in members if re.fullmatch(r"tensorrt[^/]*/__init__\.py", m)]
        if len(so) != 1 or len(init) != 1:
            raise SystemExit(f"{path}: expected one tensorrt*/tensorrt.so and __init__.py, found {so} {init}")
        names = names_in_extension(wheel.read(so[0])) | names_in_init(wheel.read(init[0]).decode())
        version = re.search(r'__version__ = "([^"]+)"', wheel.read(init[0]).decode()).group(1)
    return version, names


def write_list(out: Path, wheel: Path, version: str, names: set[str]):
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    header = [
        f"# version: {version}",
        f"# wheel: {wheel.name}",
        f"# sha256: {digest}",
        "# Names registered by the TensorRT Python bindings, extracted by tests/data/trt_api_names.py "
        "(see its docstring).",
        "# Regenerate with: python tests/data/trt_api_names.py",
    ]
    out.write_text("\n".join(header + sorted(names)) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", action="append", type=Path, default=[],
                        help="a tensorrt*-bindings wheel already downloaded (repeatable); default: download the pinned ones")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where to write tensorrt_api_<version>.txt")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = list(args.wheel)
        if not wheels:
            for requirement in DEFAULT_WHEELS.values():
                # Only the x86-64 CPython 3.11 wheel: the extraction reads x86-64 code, and the API is the same
                # for every Python version of one release.
                subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
                                "--platform", "manylinux_2_17_x86_64", "-d", tmp, requirement], check=True)
            wheels = sorted(Path(tmp).glob("*.whl"))
        args.out_dir.mkdir(parents=True, exist_ok=True)
        for wheel in wheels:
            version, names = names_in_wheel(wheel)
            short = ".".join(version.split(".")[:2])
            out = args.out_dir / f"tensorrt_api_{short}.txt"
            write_list(out, wheel, version, names)
            print(f"{wheel.name}: {len(names)} names -> {out}")


if __name__ == "__main__":
    main()
