"""Hugging Face integration: `convert` (a converted model of the user's own class), `load`, and the
class a saved checkpoint's modeling file names (`remote_class`)."""

from .checkpoint import load, remote_class
from .conversion import convert

__all__ = ["convert", "load", "remote_class"]
