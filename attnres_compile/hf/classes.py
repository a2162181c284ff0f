"""The classes of a converted model: subclasses of the user's own, generated once per base class.
`converted_class(LlamaForCausalLM, LM)` is `AttnResLlamaForCausalLM(LM, Converted, LlamaForCausalLM)`,
the mixins first. Instances pickle and deep-copy as their base class with ours swapped back in
(`_restore`), so the generated class need not be importable by name.
"""

from __future__ import annotations

from torch import nn

_CLASSES: dict[tuple[type, type], type] = {}


def _restore(base: type, mixin: type):
    """An empty instance of `converted_class(base, mixin)`, for pickle and deepcopy to fill."""
    cls = converted_class(base, mixin)
    return cls.__new__(cls)


class Converted:
    """What every generated class has: its base and mixin, and how to pickle."""

    _attnres_base: type
    _attnres_mixin: type

    def __reduce_ex__(self, protocol):
        return _restore, (self._attnres_base, self._attnres_mixin), self.__dict__.copy()


class Layer(Converted):
    """A decoder layer's forward: its part of the rewritten graph."""

    def forward(self, attnres_block, *inputs):
        """This layer's part of the rewritten graph (`attnres_block`, passed by the backbone) on `inputs`."""
        return attnres_block(self, *inputs)


def converted_class(base: type, mixin: type) -> type:
    """`AttnRes<base>`: the subclass of `base` with `mixin`'s methods first; one per (base, mixin)."""
    key = (base, mixin)
    if key not in _CLASSES:
        name = "AttnRes" + base.__name__
        bases = (mixin, base) if issubclass(mixin, Converted) else (mixin, Converted, base)
        _CLASSES[key] = type(name, bases, {"_attnres_base": base, "_attnres_mixin": mixin, "__module__": __name__,
                                           "__qualname__": name})
    return _CLASSES[key]


def swap(module: nn.Module, mixin: type) -> None:
    """Make `module` an instance of its converted class (in place; no-op if it already is one)."""
    if not isinstance(module, Converted):
        module.__class__ = converted_class(type(module), mixin)


def base_class(module: nn.Module) -> type:
    """The user's class of `module` (its own class when it is not converted)."""
    return module._attnres_base if isinstance(module, Converted) else type(module)
