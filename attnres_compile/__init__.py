"""attnres-compile: rewrite the residual connections of traced models into Attention Residuals.

Importing the package registers the torch ops (torch.ops.attnres.*: a saved rewritten program then
loads with torch.export.load) as soon as torch is imported, not before (op_registration.py). The
rewrite API (`inspect`, `rewrite`, `two_phase`, `fuse_norms`, `RewriteResult`) loads on first use, with onnx and the
passes: the command line answers `--help`, `--version` and usage errors without torch, onnx or the
passes (~1.2 s of CPU less per call)."""

__version__ = "0.1.0"

from . import lazy  # noqa: E402
from .op_registration import register_ops  # noqa: E402
from .config import AttnResConfig  # noqa: E402
from .errors import AttnResError  # noqa: E402

_HOMES = {"RewriteResult": "api", "inspect": "api", "rewrite": "api", "two_phase": "passes.fx_two_phase",
          "fuse_norms": "passes.fx_site_norm"}
__all__ = ["AttnResConfig", "AttnResError", "RewriteResult", "inspect", "rewrite", "two_phase", "fuse_norms",
           "__version__"]
__getattr__, __dir__ = lazy.exports(__name__, _HOMES)
register_ops()
