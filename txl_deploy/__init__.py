"""txl-deploy: ship a trained Transformer-XL (ONNX with explicit memory I/O, TensorRT, fast incremental runtime).

`import txl_deploy` imports neither torch nor tensorrt: edge devices run the ONNX Runtime and TensorRT backends
with numpy alone. torch, onnxruntime and tensorrt are imported by the code that uses them, when it runs.
"""

import os
import sys
from importlib.util import spec_from_file_location

__version__ = "0.1.0"  # before anything is imported: modules below read it while this package initialises


def _map_checkout_folders():
    """In a source checkout, import the top-level `exporters/` and `runtimes/` as `txl_deploy.exporters` and
    `txl_deploy.runtimes`, exactly as pyproject's package-dir maps them in an install.

    Why: Python started in the checkout root finds this folder before any installed copy (the working directory
    comes first on sys.path), and this folder lacks the mapped subpackages, so after a plain `pip install .`
    `import txl_deploy.runtimes` would fail there. Why a finder for just these two names: appending the checkout
    root to `__path__` would also turn every other top-level folder (tests, benchmarks, even this package again)
    into a subpackage, and symlinks need symlink support in every checkout (Windows often lacks it).
    The test looks only at where this file lies, never at the working directory: an installed copy has its
    subpackages beside this file and maps nothing, whatever folder Python runs in.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    folders = {f"{__name__}.{name}": os.path.join(root, name) for name in ("exporters", "runtimes")}
    if (os.path.isdir(os.path.join(here, "runtimes")) or not os.path.isfile(os.path.join(root, "pyproject.toml"))
            or not all(os.path.isfile(os.path.join(d, "__init__.py")) for d in folders.values())):
        return
    if any(getattr(finder, "folders", None) == folders for finder in sys.meta_path):
        return  # imported again (importlib.reload): one finder is enough

    class CheckoutFinder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            folder = folders.get(name)
            if folder is None:
                return None
            return spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                           submodule_search_locations=[folder])

    CheckoutFinder.folders = folders
    sys.meta_path.append(CheckoutFinder)


_map_checkout_folders()

# The public names. Imported after the checkout mapping above, which `txl_deploy.runtimes` needs in a checkout.
from txl_deploy.config import PUBLISHED_SHAPES, TxlConfig, published_config  # noqa: E402
from txl_deploy.errors import CheckpointError, ExportError, InputError, TxlError  # noqa: E402
from txl_deploy.runtimes import SamplingParams, TxlRuntime  # noqa: E402
from txl_deploy.vocab import Vocab  # noqa: E402

__all__ = [
    "TxlConfig", "PUBLISHED_SHAPES", "published_config", "TxlError", "CheckpointError", "InputError",
    "ExportError", "TxlRuntime", "SamplingParams", "Vocab", "__version__",
]
