"""Every TensorRT name our code uses exists in TensorRT 10.x and 11.x, checked without TensorRT.

The name lists in tests/data/tensorrt_api_<version>.txt are read from the PyPI bindings wheels by
tests/data/trt_api_names.py (10.3: JetPack 6, the oldest we support; 10.16: the newest 10.x; 11.4). The lists hold
names, not (class, name) pairs: a name is accepted if some class of that release registers it.

What counts as a TensorRT name (the convention exporters/tensorrt/build.py, runtimes/backends/tensorrt.py and
txl_deploy/contract/engine_file.py follow):
- every attribute in a chain rooted at the module `trt` (`trt.BuilderFlag.FP16`);
- attributes of TensorRT objects, i.e. of variables (or `self.<name>` / `self._<name>` attributes) named
  one of TRT_OBJECTS; an assignment of `trt.X(...)` or of a `create_*` / `build_*` / `deserialize_*` call on a
  TensorRT object must target such a name, so the convention cannot be bypassed by accident;
- the methods of our subclasses of TensorRT classes (`phase_start` of an IProgressMonitor: TensorRT calls them
  by these names), except the attributes those classes set on `self` themselves.
A name may be missing from some releases if the code only reaches it under a version check:
`if _trt_version(...) >= (10, 12):` / `if _trt_major(...) < 11:` (the body is checked against the matching
releases only, the else branch against the others), or `if hasattr(obj, "NAME")` / an early
`if not hasattr(obj, "NAME"): return` (NAME itself is then not required).
"""

import ast
import operator
import re

import pytest
from helpers.paths import ROOT, TESTS

DATA = TESTS / "data"
SOURCES = [ROOT / "exporters" / "tensorrt" / "build.py", ROOT / "runtimes" / "backends" / "tensorrt.py",
           ROOT / "txl_deploy" / "contract" / "engine_file.py"]
TRT_OBJECTS = {"builder", "network", "config", "parser", "profile", "engine", "context", "runtime", "logger",
               "cache", "tensor", "serialized", "inspector"}
_CREATORS = re.compile(r"^(create_|build_|deserialize_)")
_OPS = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
        ast.Eq: operator.eq, ast.NotEq: operator.ne}


def load_snapshots() -> dict:
    snapshots = {}
    for path in sorted(DATA.glob("tensorrt_api_*.txt")):
        lines = path.read_text().splitlines()
        version = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("# version:"))
        key = tuple(int(x) for x in version.split(".")[:3])
        snapshots[key] = {line for line in lines if line and not line.startswith("#")}
    return snapshots


SNAPSHOTS = load_snapshots()
ALL = ", ".join(".".join(map(str, v)) for v in sorted(SNAPSHOTS))


def _object_name(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr.lstrip("_")
    return None


def _trt_chain(node):
    """['BuilderFlag', 'FP16'] for trt.BuilderFlag.FP16, else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "trt" and names:
        return names[::-1]
    return None


def _version_predicate(test):
    """A function of a release version tuple for `_trt_version(..) OP (..)` / `_trt_major(..) OP N`, else None."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Call)
            and isinstance(test.left.func, ast.Name) and test.left.func.id in ("_trt_version", "_trt_major")):
        return None
    bound = ast.literal_eval(test.comparators[0])
    op = _OPS[type(test.ops[0])]
    if test.left.func.id == "_trt_major":
        return lambda v: op(v[0], bound)
    return lambda v: op(v[: len(bound)], tuple(bound))


def _hasattr_name(test):
    if (isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "hasattr"
            and len(test.args) == 2 and isinstance(test.args[1], ast.Constant)):
        return test.args[1].value
    return None


def _guards(test):
    """(version predicates, hasattr names) that hold when `test` is true."""
    parts = test.values if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) else [test]
    preds, names = [], set()
    for part in parts:
        pred = _version_predicate(part)
        if pred is not None:
            preds.append(pred)
        name = _hasattr_name(part)
        if name is not None:
            names.add(name)
    return preds, names


class Uses(ast.NodeVisitor):
    """Collects (name, line, releases the line runs on, names excused by hasattr) for one module."""

    def __init__(self):
        self.uses = []
        self.problems = []
        self.own_attrs = set()
        self.versions = frozenset(SNAPSHOTS)
        self.excused = frozenset()

    def use(self, name, node):
        if name.startswith("__") or name in self.excused:
            return
        self.uses.append((name, node.lineno, self.versions))

    # -- guarded blocks ---------------------------------------------------------------------------------------
    def visit_block(self, stmts):
        saved = self.excused
        for stmt in stmts:
            self.visit(stmt)
            # `if not hasattr(x, "N"): return ...` excuses N for the rest of the block.
            if (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.UnaryOp) and isinstance(stmt.test.op, ast.Not)
                    and _hasattr_name(stmt.test.operand) and stmt.body
                    and isinstance(stmt.body[-1], (ast.Return, ast.Raise))):
                self.excused = self.excused | {_hasattr_name(stmt.test.operand)}
        self.excused = saved

    def generic_visit(self, node):
        for field, value in ast.iter_fields(node):
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.visit_block(value)
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, ast.AST):
                        self.visit(item)
            elif isinstance(value, ast.AST):
                self.visit(value)

    def visit_If(self, node):
        self.visit(node.test)
        preds, names = _guards(node.test)
        saved_v, saved_e = self.versions, self.excused
        self.versions = frozenset(v for v in saved_v if all(p(v) for p in preds))
        self.excused = saved_e | names
        self.visit_block(node.body)
        self.versions, self.excused = saved_v, saved_e
        if len(preds) == 1 and not names and not (isinstance(node.test, ast.BoolOp)):
            self.versions = frozenset(v for v in saved_v if not preds[0](v))
        self.visit_block(node.orelse)
        self.versions = saved_v

    # -- names ------------------------------------------------------------------------------------------------
    def visit_Attribute(self, node):
        chain = _trt_chain(node)
        if chain is not None:
            for name in chain:
                self.use(name, node)
            return
        if _object_name(node.value) in TRT_OBJECTS and node.attr not in self.own_attrs:
            self.use(node.attr, node)
        self.visit(node.value)

    def visit_Assign(self, node):
        value = node.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            from_trt = _trt_chain(value.func) is not None
            creator = _object_name(value.func.value) in TRT_OBJECTS and _CREATORS.match(value.func.attr)
            if from_trt or creator:
                for target in node.targets:
                    if _object_name(target) not in TRT_OBJECTS:
                        self.problems.append(
                            f"line {node.lineno}: {ast.unparse(target)} = {ast.unparse(value)}: name TensorRT "
                            f"objects one of {sorted(TRT_OBJECTS)} so their methods are checked")
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        if any(_trt_chain(base) for base in node.bases):
            for item in ast.walk(node):
                if (isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
                        and isinstance(item.value, ast.Name) and item.value.id == "self"):
                    self.own_attrs.add(item.attr)
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                    self.use(item.name, item)
        self.generic_visit(node)


def missing_names(source: str):
    """['line N: NAME missing in TensorRT 11.4.0', ...] for a module's source."""
    visitor = Uses()
    visitor.visit(ast.parse(source))
    problems = list(visitor.problems)
    for name, line, versions in visitor.uses:
        missing = [".".join(map(str, v)) for v in sorted(versions) if name not in SNAPSHOTS[v]]
        if missing:
            problems.append(f"line {line}: {name} missing in TensorRT {', '.join(missing)}")
    return problems, visitor.uses


# -- the lists themselves -----------------------------------------------------------------------------------------
def test_snapshots_cover_10_and_11():
    majors = {v[0] for v in SNAPSHOTS}
    assert {10, 11} <= majors
    assert (10, 3, 0) in SNAPSHOTS  # JetPack 6


@pytest.mark.parametrize("name", ["Builder", "Runtime", "OnnxParser", "ILogger", "IProgressMonitor", "BuilderFlag",
                                  "NetworkDefinitionCreationFlag", "STRONGLY_TYPED", "create_optimization_profile",
                                  "build_serialized_network", "deserialize_cuda_engine", "execute_async_v3",
                                  "set_tensor_address", "set_input_shape", "num_io_tensors", "set_timing_cache",
                                  "set_memory_pool_limit", "__version__", "nptype"])
def test_extraction_finds_the_core_api_in_every_release(name):
    assert all(name in names for names in SNAPSHOTS.values()), name


def test_tensorrt_11_removed_weak_typing():
    for version, names in SNAPSHOTS.items():
        removed = {"FP16", "EXPLICIT_BATCH", "IInt8EntropyCalibrator2", "set_dynamic_range"}
        if version[0] >= 11:
            assert not removed & names
        else:
            assert removed <= names
    # INT8 stays a name in 11 (DataType.INT8); only the builder flag went, which a name list cannot tell apart.
    assert all("INT8" in names for names in SNAPSHOTS.values())


# -- the checker on snippets -------------------------------------------------------------------------------------
def test_checker_flags_unguarded_removed_names():
    problems, _ = missing_names("def f(trt, config):\n    config.set_flag(trt.BuilderFlag.FP16)\n")
    assert problems == ["line 2: FP16 missing in TensorRT 11.4.0"]
    problems, _ = missing_names("def f(engine):\n    return engine.get_binding_index('x')\n")  # gone since 10.0
    assert problems == [f"line 2: get_binding_index missing in TensorRT {ALL}"]


def test_checker_accepts_version_and_hasattr_guards():
    src = (
        "def f(trt, config):\n"
        "    if _trt_major(trt) < 11:\n"
        "        config.set_flag(trt.BuilderFlag.FP16)\n"
        "    else:\n"
        "        config.set_flag(trt.BuilderFlag.TF32)\n"
        "    if hasattr(trt.BuilderFlag, 'FP16'):\n"
        "        config.set_flag(trt.BuilderFlag.FP16)\n"
        "def g(trt):\n"
        "    if not hasattr(trt, 'FP16'):\n"
        "        return None\n"
        "    return trt.FP16\n"
    )
    assert missing_names(src)[0] == []
    # ...and the else branch of a version check is checked against the other releases.
    src = "def f(trt):\n    if _trt_major(trt) >= 11:\n        pass\n    else:\n        x = trt.BuilderFlag.INT8\n"
    assert missing_names(src)[0] == []
    src = "def f(trt):\n    if _trt_major(trt) < 11:\n        pass\n    else:\n        x = trt.BuilderFlag.FP16\n"
    assert missing_names(src)[0] == ["line 5: FP16 missing in TensorRT 11.4.0"]


def test_checker_enforces_the_naming_convention_and_checks_overrides():
    problems, _ = missing_names("def f(trt, logger):\n    b = trt.Builder(logger)\n    b.no_such_method()\n")
    assert len(problems) == 1 and "name TensorRT objects" in problems[0]
    src = ("def f(trt):\n    class M(trt.IProgressMonitor):\n        def phase_start(self, a, b, c):\n"
           "            self.bars = {}\n        def step_complet(self, a, b):\n            return True\n")
    assert missing_names(src)[0] == [f"line 5: step_complet missing in TensorRT {ALL}"]


# -- our code ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_our_tensorrt_code_uses_only_names_of_every_release(path):
    problems, uses = missing_names(path.read_text())
    assert len(uses) > 10  # the checker does see the code's TensorRT calls
    assert problems == []
