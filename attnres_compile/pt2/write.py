""".pt2 archives written so that they load in a fresh process: outputs flattened to a tuple of
tensors (names in `extra/attnres.json`), the archive built in memory, read back, then written
through a staging folder. Non-tensor keyword inputs stay constant inputs of the program
(`bind_constants` binds them away for a tensors-only signature)."""

from __future__ import annotations

import inspect
import io
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..core.errors import AttnResError, InputError
from ..core.verify import output_name
from .read import FORMAT, META, Archive


class WithConstants(torch.nn.Module):
    """`module` with its non-tensor keyword inputs (HF's `use_cache=False`) bound: exported, it takes
    tensors only, which every reader of a .pt2 (TVM's importer included) understands."""

    def __init__(self, module: torch.nn.Module, constants: dict):
        super().__init__()
        self.module = module
        self.constants = dict(constants)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs, **self.constants)


def bind_constants(module: torch.nn.Module, args: tuple, kwargs: dict, like: Any = None) -> tuple[torch.nn.Module, dict]:
    """(module to export, its tensor kwargs): non-tensor kwargs bound into a WithConstants whose
    forward has the input names of `like` (the original model), so dynamic shapes given by name
    still apply."""
    constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    if not constants:
        return module, kwargs
    try:
        original = list(inspect.signature(getattr(like, "forward", like)).parameters)
    except (TypeError, ValueError):
        original = []
    names = [f"arg{i}" for i in range(len(args))]
    names[: len(original)] = original[: len(args)]
    names += [n for n in (original or list(tensors)) if n in tensors] + [n for n in tensors if n not in original]
    param = inspect.Parameter.POSITIONAL_OR_KEYWORD
    forward = lambda self, *a, **k: WithConstants.forward(self, *a, **k)  # noqa: E731 - needs its own signature
    forward.__signature__ = inspect.Signature([inspect.Parameter("self", param)] +
                                              [inspect.Parameter(n, param) for n in dict.fromkeys(names)])
    bound = type("WithConstants", (WithConstants,), {"forward": forward})(module, constants)
    return bound, tensors


def flatten_outputs(program: torch.export.ExportedProgram) -> list[str]:
    """Make `program` return a flat tuple of its outputs (in place, output spec only); their names.
    The program then needs no output classes (HF ModelOutputs) registered to be read back.
    """
    signature = program.module_call_graph[0].signature
    names = output_names(program)
    signature.out_spec = pytree.tree_structure(tuple(range(signature.out_spec.num_leaves)))
    return names


def output_names(program: torch.export.ExportedProgram) -> list[str]:
    """The names of `program`'s outputs, in pytree (flattened) order."""
    spec = program.module_call_graph[0].signature.out_spec
    leaves = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))[0]
    return [output_name(path) for path, _ in leaves]


def drop_guards(program: torch.export.ExportedProgram) -> None:
    """Forget the guards torch.export kept as code, in place: after re-exporting a `*past` module they
    read inputs by stale pytree paths and fail; our programs' input dims say what they accept."""
    if getattr(program, "_guards_code", None):
        program._guards_code = []


def _plain_spec(spec: pytree.TreeSpec) -> bool:
    return spec.is_leaf() or spec.type in (tuple, list, dict) and all(_plain_spec(c) for c in spec.children())


def to_bytes(program: torch.export.ExportedProgram, constants: dict | None = None,
             extra: dict | None = None) -> tuple[bytes, list[str]]:
    """The .pt2 archive of `program` with flat outputs, built in memory and read back with `load`; and
    the output names. `constants`: non-tensor keyword inputs bound in, which `Loaded.module()`
    accepts again; `extra`: more metadata, read back as `Loaded.meta`."""
    in_spec = program.module_call_graph[0].signature.in_spec
    if not _plain_spec(in_spec):
        raise InputError(f"the model's inputs are not tensors in tuples and dicts ({in_spec}); a .pt2 of it would "
                         "not load without the input classes: export to .onnx instead")
    names = flatten_outputs(program)
    buffer = io.BytesIO()
    meta = {**(extra or {}), "format": FORMAT, "version": 1, "outputs": names, "constants": _jsonable(constants or {})}
    torch.export.save(program, buffer, extra_files={META: json.dumps(meta)})
    data = buffer.getvalue()
    try:
        Archive(io.BytesIO(data), "the .pt2 being written").load()
    except InputError as exc:
        raise AttnResError(f"internal error: the .pt2 archive does not load back ({exc}); nothing written; "
                           "please report this with the model") from None
    return data, names


def save(program: torch.export.ExportedProgram, path: str | os.PathLike, constants: dict | None = None,
         extra: dict | None = None) -> list[str]:
    """Write `program` (flattened first) to `path`, normally a staged file (outputs.py commits
    it); a full disk raises OutputWriteError. Returns the output names."""
    from ..utils.outputs import write_bytes

    data, names = to_bytes(program, constants, extra)
    write_bytes(Path(path), data)
    return names


def _jsonable(constants: dict) -> dict:
    """Bound constants as JSON: None, bools, numbers and strings as they are, anything else by its repr."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else repr(v) for k, v in constants.items()}
