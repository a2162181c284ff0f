""".pt2 archives (torch.export programs): `export_pt2` (export.py) rewrites and writes one, `save`
(write.py) writes a program so that it loads in a fresh process, `load` (read.py) reads one without
running anything stored in it (trust.py: what a program may contain)."""

from .read import Loaded, load
from .write import save

__all__ = ["Loaded", "load", "save"]
