"""`txl-deploy web-demo`: a static site that runs an exported model in the browser with onnxruntime-web.

The site is the page, the model and the runtime: `index.html` (the page), `app.js` (the page's logic), the
JavaScript driver (`txl.js`, the graph contract of docs/graph-contract.md, and the ES modules it imports, DRIVER_FILES:
meant to be copied into apps), `music.js` (a music model's events placed as notes, as events_to_midi places them) and
`pianoroll.js` (their piano roll and WebAudio player), `model.onnx` (a copy of the export), `model.json` (the
contract's numbers from the export's metadata, which onnxruntime-web cannot read) and `vocab.json`. onnxruntime-web comes from a pinned release on a CDN, both of its files checked with
subresource-integrity hashes, or from a local copy (`--ort-web DIR`, an npm install of onnxruntime-web) for
devices without internet access.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import logging
import shutil
from pathlib import Path

import onnx

from txl_deploy.contract import io_spec
from txl_deploy.contract.clusters import Clusters
from txl_deploy.music.grammar import detected
from txl_deploy.music.representation import representation
from txl_deploy.contract.describe import headline
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.contract.onnx_file import external_data
from txl_deploy.contract.ring import initial_mem_count
from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.files import atomic_path, check_writable

logger = logging.getLogger(__name__)

# The pinned onnxruntime-web release. Hashes: sha384 of the files in the npm tarball of this version
# (`npm pack onnxruntime-web@1.30.0`, whose sha512 the registry publishes), as the browser checks them.
ORT_WEB_VERSION = "1.30.0"
ORT_WEB_CDN = f"https://cdn.jsdelivr.net/npm/onnxruntime-web@{ORT_WEB_VERSION}/dist/"
# The ESM bundle with its Emscripten glue inside (so the wasm binary is the only other file) and the wasm build
# it loads, which has the CPU kernels (MatMulNBits included) and the WebGPU execution provider.
ORT_MODULE = "ort.bundle.min.mjs"
ORT_WASM = "ort-wasm-simd-threaded.jsep.wasm"
ORT_WEB_INTEGRITY = {
    ORT_MODULE: "sha384-T5T6cex+FSwOi/MdgNUHajqcROykeWz4lE4gtzLBTuMmV0qNiJc9GwmHDjvOzFhy",
    ORT_WASM: "sha384-Ueht0ynFKexyaENvQBCXJQmjjdEzUgnesolNNQPAhnDeYvh1YA53nYHw1mrWvaM1",
}
# The driver: txl.js (the stream, and every name an app imports) and the modules it imports, one job each.
DRIVER_FILES = ("txl.js", "vocab.js", "pcg64.js", "clusters.js", "grammar.js", "weights.js", "sampling.js",
                "factored.js", "stop_text.js")
PAGE_FILES = DRIVER_FILES + ("app.js", "music.js", "pianoroll.js")


def _template_dir() -> Path:
    """The page template: static/ beside this module (package data), in a checkout and in an install alike."""
    path = Path(__file__).resolve().parent / "static"
    if not (path / "index.html").is_file():
        raise CheckpointError(path, "the web page template is missing (was txl-deploy installed without its data?)")
    return path


def sri(data: bytes) -> str:
    """Subresource-integrity value (sha384) of some bytes."""
    return "sha384-" + base64.b64encode(hashlib.sha384(data).digest()).decode()


def find_ort_web(path) -> tuple[Path, str]:
    """The dist/ folder and version of a local onnxruntime-web: the package folder, its dist/, or a folder with
    node_modules/onnxruntime-web (where `npm install onnxruntime-web` ran)."""
    path = Path(path)
    for root in (path, path / "node_modules" / "onnxruntime-web", path.parent):
        dist = root / "dist"
        if (dist / ORT_MODULE).is_file() and (dist / ORT_WASM).is_file():
            try:
                version = json.loads((root / "package.json").read_text(encoding="utf-8"))["version"]
            except (OSError, ValueError, KeyError):
                version = "unknown"
            return dist, str(version)
    raise InputError(f"{path}: no onnxruntime-web here (expected dist/{ORT_MODULE} and dist/{ORT_WASM} in it, in "
                     f"node_modules/onnxruntime-web or in its parent); make one with `npm install onnxruntime-web`")


def graph_spec(model_path) -> dict:
    """What the JavaScript driver needs to thread the memory: the contract's numbers for this export."""
    info = read_onnx_info(model_path)
    external_data(model_path)  # a location outside the folder is refused as such, before the rule below
    if info.vocab is None:
        raise InputError(f"{model_path}: has no vocabulary, and the page turns text prompts into tokens; export a "
                         "model that has one")
    model = onnx.load(str(model_path), load_external_data=False)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        raise InputError(f"{model_path}: keeps its weights in an external data file (over 2 GB), too large for a "
                         "browser page; export a smaller or reduced-precision model (--precision int4)")
    inputs = {i.name: i for i in model.graph.input}
    mem_k = inputs[io_spec.mem_k(0)].type.tensor_type
    float_dtype = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}.get(mem_k.elem_type)
    if float_dtype is None:
        raise InputError(f"{model_path}: memory of type {onnx.TensorProto.DataType.Name(mem_k.elem_type)}; the "
                         "page handles float32 and float16")
    c = info.config
    return {"name": Path(model_path).stem, "n_layer": c.n_layer, "n_head": c.n_head, "d_head": c.d_head,
            "mem_len": info.mem_len, "n_token": c.n_token, "state": info.state, "max_segment": info.max_segment,
            "precision": info.precision, "float_dtype": float_dtype,
            # what a fresh stream's mem_count starts at: 0 (empty), or mem_len (REMI's attended zero memory)
            "initial_mem_count": initial_mem_count(c, info.mem_len),
            # an adaptive softmax's layout (None for a plain softmax): the page samples it cluster by cluster
            "clusters": layout.to_dict() if (layout := Clusters.of(c)) is not None else None,
            # a music model's grammar (valid music by construction), which the page's sampler applies
            "grammar": music.to_dict() if (music := detected(info.vocab)) is not None else None,
            # an incremental graph whose slot axis is dynamic takes a 1-slot memory for an empty stream
            "fresh_prefill": info.state == "incremental" and mem_k.shape.dim[3].HasField("dim_param")}


def _default_prompt(vocab, grammar: dict | None) -> str:
    if grammar is not None:  # a music model (the page samples under its grammar): a piece opens with a bar
        return representation(grammar["name"]).bar
    for prompt in ("And God said", "The", "the"):
        try:
            ids = vocab.encode(prompt)
        except InputError:
            continue
        if vocab.unk is None or vocab.index[vocab.unk] not in ids.tolist():
            return prompt
    return ""


def write_site(model_path, out_dir, ort_web=None, force: bool = False, title: str | None = None,
               prompt: str | None = None) -> Path:
    """Write the static site for `model_path` (an ONNX export) into `out_dir`, atomically."""
    model_path, out_dir = Path(model_path), Path(out_dir)
    check_writable(out_dir, force)
    spec = graph_spec(model_path)
    info = read_onnx_info(model_path)
    vocab = info.vocab
    template = _template_dir()
    local = find_ort_web(ort_web) if ort_web is not None else None
    with atomic_path(out_dir, force=force) as tmp:
        tmp.mkdir()
        if local is None:
            ort = {"version": ORT_WEB_VERSION, "module": ORT_WEB_CDN + ORT_MODULE, "wasm": ORT_WEB_CDN + ORT_WASM,
                   "module_integrity": ORT_WEB_INTEGRITY[ORT_MODULE], "wasm_integrity": ORT_WEB_INTEGRITY[ORT_WASM]}
        else:
            dist, version = local
            (tmp / "ort").mkdir()
            hashes = {}
            for name in (ORT_MODULE, ORT_WASM):
                data = (dist / name).read_bytes()
                (tmp / "ort" / name).write_bytes(data)
                hashes[name] = sri(data)
            ort = {"version": version, "module": f"./ort/{ORT_MODULE}", "wasm": f"./ort/{ORT_WASM}",
                   "module_integrity": hashes[ORT_MODULE], "wasm_integrity": hashes[ORT_WASM]}
        shutil.copyfile(model_path, tmp / "model.onnx")
        (tmp / "model.json").write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
        (tmp / "vocab.json").write_text(vocab.to_json(), encoding="utf-8")
        for name in PAGE_FILES:
            shutil.copyfile(template / name, tmp / name)
        importmap = {"imports": {"onnxruntime-web": ort["module"]},
                     "integrity": {ort["module"]: ort["module_integrity"]}}
        page = (template / "index.html").read_text(encoding="utf-8")
        fills = {"TITLE": _html(title or headline(info, model_path)),
                 "IMPORTMAP": json.dumps(importmap, indent=1),
                 "ORT_MODULE": _html(ort["module"]), "ORT_MODULE_INTEGRITY": ort["module_integrity"],
                 "SITE_CONFIG": json.dumps({"ort": ort}, indent=1).replace("</", "<\\/"),
                 "PROMPT": _html(_default_prompt(vocab, spec["grammar"]) if prompt is None else prompt)}
        for key, value in fills.items():
            page = page.replace(f"@@{key}@@", value)
        (tmp / "index.html").write_text(page, encoding="utf-8")
    size = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    where = f"a local copy of onnxruntime-web {ort['version']} (in its ort/ folder)" if local else \
        (f"onnxruntime-web {ORT_WEB_VERSION} from {ORT_WEB_CDN} (integrity-checked), so the browser needs "
         "access to it; for a device without, write the site with a local copy: --ort-web DIR")
    logger.info(f"wrote {out_dir}/ ({size / 1e6:.1f} MB): index.html, app.js, the driver txl.js and its modules, "
                f"music.js, pianoroll.js, model.onnx, model.json, vocab.json; "
                f"the page loads {where}")
    logger.info(f"serve it over HTTP, e.g. `python -m http.server -d {out_dir} 8000`, and open http://localhost:8000/")
    return out_dir


def _html(text: str) -> str:
    return html.escape(text, quote=True)
