"""txl-deploy: ship a trained Transformer-XL (ONNX with explicit memory I/O, TensorRT, fast incremental runtime).

`import txl_deploy` imports neither torch nor tensorrt: edge devices run the ONNX Runtime and TensorRT backends
with numpy alone. The heavy modules are imported when first used.
"""

from .config import PUBLISHED_SHAPES, TxlConfig, published_config
from .errors import CheckpointError, ExportError, InputError, TxlError

__version__ = "0.1.0"

__all__ = [
    "TxlConfig", "PUBLISHED_SHAPES", "published_config", "TxlError", "CheckpointError", "InputError",
    "ExportError", "TxlRuntime", "Vocab", "__version__",
]


def __getattr__(name):
    # Lazy: `from txl_deploy import TxlRuntime` must not pull in torch.
    if name == "TxlRuntime":
        from .runtimes import TxlRuntime

        return TxlRuntime
    if name == "Vocab":
        from .vocab import Vocab

        return Vocab
    raise AttributeError(name)
