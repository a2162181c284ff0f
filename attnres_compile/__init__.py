"""attnres-compile: rewrite the residual connections of traced models into Attention Residuals.
The API (`api.py`) loads on first use, so `--help` needs no torch. The torch ops register when
`attnres_compile.ops` is imported, which torch does through the package's `torch.backends` entry
point, so a saved program loads with plain `torch.export.load`.
"""

from .core import __version__
from .core.config import AttnResConfig
from .core.errors import AttnResError
from .utils import lazy

_HOMES = {"RewriteResult": "api", "inspect": "api", "rewrite": "api", "inspect_onnx": "api", "rewrite_onnx": "api",
          "export_onnx": "api", "export_pt2": "api", "two_phase": "api", "fuse_norms": "api", "convert": "api",
          "load": "api"}
__all__ = ["AttnResConfig", "AttnResError", *_HOMES, "__version__"]
__getattr__, __dir__ = lazy.exports(__name__, _HOMES)


def _torch_autoload() -> None:
    """torch's `torch.backends` entry point (pyproject.toml), called at the end of `import torch`:
    registers torch.ops.attnres.*. A failure here must not break torch, so it is a warning."""
    try:
        from . import ops  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        import warnings

        warnings.warn(f"attnres_compile could not register torch.ops.attnres ({type(exc).__name__}: {exc})",
                      RuntimeWarning, stacklevel=2)
