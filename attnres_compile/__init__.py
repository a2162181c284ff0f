"""attnres-compile: rewrite the residual connections of traced models into Attention Residuals."""

__version__ = "0.1.0"

from .config import AttnResConfig  # noqa: E402
from .errors import AttnResError  # noqa: E402
from .api import RewriteResult, inspect, rewrite  # noqa: E402
from .passes.fx_two_phase import two_phase  # noqa: E402

__all__ = ["AttnResConfig", "AttnResError", "RewriteResult", "inspect", "rewrite", "two_phase", "__version__"]
