""".pt2 archives (torch.export programs): written so that they load in a fresh process, read
without running anything stored in them.

Writing (`save`): the program's outputs are flattened to a tuple of tensors (HF ModelOutputs
and other containers need their classes registered to be read back; plain tuples do not),
their names go to the archive's `extra/attnres.json`, and the archive is built in memory and
written through a staging folder (outputs.py), so a full disk is one error line and the
archive holds no temporary file name. Load it with `load`, or with `torch.export.load` after
`import attnres_compile` (which registers the depth-attention op).

Reading (`load`), the trust model: a .pt2 is data, never code. `torch.export.load` unpickles
weights, constants and example inputs with `weights_only=False`, evaluates the symbolic shape
expressions of its model.json with sympy (Python `eval`), resolves call targets by name from
the `torch`, `operator` and `math` modules (`torch.os.system` included), `exec`s its guard
code when the module is built and loads AOTInductor libraries. `load` checks the archive
first (a zip with stored entries under one folder, only the files a torch.export program
consists of, sizes within the file), reads tensors itself (raw bytes; pickled ones only with
`weights_only=True`), accepts only expressions and guards made of arithmetic on shape symbols,
call targets that are torch operators (no file I/O), arithmetic or a listed operator of another
library that only computes (transformers' MoE grouped matmul, its module imported to register
it), and refuses anything else in one line (exit code 20) before torch's deserializer sees it.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import os
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import op as _op  # noqa: F401  (registers torch.ops.attnres before a program is read)
from .errors import AttnResError, ConfigError, InputError, UnsafeArchiveError, first_line
from .file_kind import describe

META = "attnres.json"          # extra/attnres.json: {"format", "version", "outputs": [names], "constants": {name: value},
                               # decoders also "attnres.generation": {"eos_token_id": [ids], "pad_token_id"}
FORMAT = "attnres-compile.pt2"
MAX_JSON_BYTES = 256 << 20     # model.json and configs: a program of many thousand nodes is a few MiB
MAX_EXPR_CHARS = 4096
_PICKLED = "this .pt2 holds pickled objects other than tensors"


# ---------------------------------------------------------------------------------------------
# writing


def output_name(path: tuple) -> str:
    """A pytree leaf's path as a name: `logits`, `hidden_states.1`, `0` (not `['logits']`)."""
    parts = []
    for key in path:
        if isinstance(key, pytree.MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, pytree.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, pytree.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(key).strip(".[]'\""))
    return ".".join(parts) or "output"


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
    """Make `program` return a flat tuple of its outputs (in place); their names.

    Only the output spec changes (the graph's output node is already flat), so the program
    needs none of the output classes (HF ModelOutputs, ...) registered to be read back.
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
    """Forget the guards torch.export kept as code, in place. Re-exporting a module that takes the
    past as `*past` (decoder.py) leaves guards reading inputs by pytree paths that no longer
    match: `.module()` then fails ("'NoneType' object has no attribute 'size'") and our loader
    refuses them as code. Our programs' input dims say what they accept; nothing runs the guards."""
    if getattr(program, "_guards_code", None):
        program._guards_code = []


def _plain_spec(spec: pytree.TreeSpec) -> bool:
    return spec.is_leaf() or spec.type in (tuple, list, dict) and all(_plain_spec(c) for c in spec.children())


def to_bytes(program: torch.export.ExportedProgram, constants: dict | None = None,
             extra: dict | None = None) -> tuple[bytes, list[str]]:
    """The .pt2 archive of `program` with flat outputs, built in memory (its folder is `archive/`)
    and read back with `load` before it is returned; and the output names. `constants`: the
    non-tensor keyword inputs bound into it (`bind_constants`), recorded so that `Loaded.module()`
    accepts them again at their traced values. `extra`: more metadata (a decoder's end-of-sequence
    ids for `generate`), read back as `Loaded.meta`."""
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
        _Archive(io.BytesIO(data), "the .pt2 being written").load()
    except InputError as exc:
        raise AttnResError(f"internal error: the .pt2 archive does not load back ({exc}); nothing written; "
                           "please report this with the model") from None
    return data, names


def save(program: torch.export.ExportedProgram, path: str | os.PathLike, constants: dict | None = None,
         extra: dict | None = None) -> list[str]:
    """Write `program` (flattened first) to `path`, normally a staged file (outputs.py commits
    it); a full disk raises OutputWriteError. Returns the output names."""
    from .outputs import write_bytes

    data, names = to_bytes(program, constants, extra)
    write_bytes(Path(path), data)
    return names


def _jsonable(constants: dict) -> dict:
    """Bound constants as JSON: None, bools, numbers and strings as they are, anything else by its repr."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else repr(v) for k, v in constants.items()}


# ---------------------------------------------------------------------------------------------
# reading


@dataclass
class Loaded:
    """A program read by `load`: `program`, its output `names` (from our metadata, else the
    graph's output names) and the metadata we wrote (empty for archives of other tools)."""

    program: torch.export.ExportedProgram
    outputs: list[str]
    meta: dict = field(default_factory=dict)

    @property
    def constants(self) -> dict[str, Any]:
        """The non-tensor keyword inputs the program was traced with (`use_cache=False`): bound into
        it by `rewrite -o X.pt2` (our metadata), or constant inputs of a program exported elsewhere."""
        spec = self.program.module_call_graph[0].signature.in_spec
        leaves = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))[0]
        user = [s for s in self.program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        traced = {path[1].key: s.arg.value for (path, _), s in zip(leaves, user)
                  if len(path) == 2 and isinstance(path[1], pytree.MappingKey) and type(s.arg).__name__ == "ConstantArgument"}
        bound = self.meta.get("constants")
        return {**(bound if isinstance(bound, dict) else {}), **traced}

    def module(self) -> torch.nn.Module:
        """`program.module()`, called like the model it was traced from: a keyword input in
        `constants` is accepted at its traced value (left out where it is bound, supplied where a
        program exported elsewhere needs it) and refused in one line (ConfigError) at any other;
        a keyword the program does not take is refused alike. Every command that runs a .pt2
        (generate, compile's check, inspect --weights) runs it through here."""
        module = self.program.module()
        spec = self.program.module_call_graph[0].signature.in_spec
        takes = list(spec.children()[1].context) if spec.num_children == 2 and spec.children()[1].type is dict else []
        constants = self.constants

        def accept(_module, args, kwargs):
            for name in list(kwargs):
                if name in constants and not _same(kwargs[name], constants[name]):
                    raise ConfigError(f"{name}={kwargs[name]!r}: this .pt2 was traced with {name}={constants[name]!r}, "
                                      f"which is fixed in the program; pass {name}={constants[name]!r} or leave it out "
                                      "(export the model again for another value)")
                if name not in takes and name not in constants:
                    raise ConfigError(f"{name}: this .pt2 takes no such keyword input (it takes "
                                      f"{', '.join(takes) or 'positional inputs only'})")
                if name not in takes:
                    del kwargs[name]
            kwargs.update({k: v for k, v in constants.items() if k in takes and k not in kwargs})
            return args, kwargs

        module.register_forward_pre_hook(accept, prepend=True, with_kwargs=True)
        return module


def load(path: str | os.PathLike) -> Loaded:
    """The torch.export program in the .pt2 at `path`, read without running anything from it.

    Raises InputError (6) for a missing file, another kind of file or a damaged archive, and
    UnsafeArchiveError (20) for anything that loading would execute (see the module docstring).
    """
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such file" if not p.exists() else f"{p} is {describe(p)}, not a .pt2 archive")
    archive = _Archive(p)
    try:
        return archive.load()
    finally:
        archive.close()


class _Archive:
    """A validated view of a .pt2 zip: entries by their name inside the archive folder."""

    def __init__(self, source: Path | io.BytesIO, name: str | None = None):
        self.path = name or source
        self.size = source.getbuffer().nbytes if isinstance(source, io.BytesIO) else source.stat().st_size
        try:
            self.zip = zipfile.ZipFile(source)
            infos = self.zip.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError, NotImplementedError) as exc:
            kind = describe(source)
            if kind.startswith("a zip"):
                raise InputError(f"{self.path}: damaged .pt2 archive ({first_line(exc)})") from None
            raise InputError(f"{self.path} is {kind}, not a .pt2 archive (a torch.export program written by "
                             "`attnres-compile rewrite -o MODEL.pt2` or torch.export.save)") from None
        self.source = source
        self.entries = self._check_entries(infos)
        self.payload_files: dict[str, set[str]] = {"weight": set(), "constant": set()}

    def close(self) -> None:
        self.zip.close()

    def _bad(self, why: str) -> InputError:
        return InputError(f"{self.path}: damaged or unsupported .pt2 archive ({why})")

    def _check_entries(self, infos: list[zipfile.ZipInfo]) -> dict[str, zipfile.ZipInfo]:
        size = self.size
        folders = {i.filename.split("/", 1)[0] for i in infos}
        if len(folders) != 1 or not all("/" in i.filename for i in infos):
            kind = describe(self.source)
            if "npz" in kind or not infos:
                raise InputError(f"{self.path} is {kind}, not a .pt2 archive (a torch.export program)")
            raise self._bad("its entries are not all inside one folder")
        entries: dict[str, zipfile.ZipInfo] = {}
        total = 0
        for info in infos:
            name = info.filename.split("/", 1)[1]
            parts = name.split("/")
            if not name or any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
                raise self._bad(f"entry name {info.filename!r}")
            if name in entries:
                raise self._bad(f"entry {name!r} appears twice")
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
                raise self._bad(f"entry {name!r} is compressed or encrypted (torch.export.save stores entries)")
            total += info.file_size
            if info.file_size != info.compress_size or total > size:
                raise self._bad(f"entry {name!r} claims more bytes than the file holds")
            entries[name] = info
        return entries

    def read(self, name: str) -> bytes:
        if name not in self.entries:
            raise self._bad(f"it has no {name}")
        try:
            return self.zip.read(self.entries[name])
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError) as exc:
            raise self._bad(f"{name}: {first_line(exc)}") from None

    def json(self, name: str) -> Any:
        if self.entries.get(name) and self.entries[name].file_size > MAX_JSON_BYTES:
            raise self._bad(f"{name} is larger than {MAX_JSON_BYTES >> 20} MiB")
        try:
            return json.loads(self.read(name))
        except (ValueError, RecursionError) as exc:
            raise self._bad(f"{name} is not valid JSON ({first_line(exc)})") from None

    # -- what a torch.export archive consists of --------------------------------------------

    def _check_layout(self) -> None:
        from torch.export.pt2_archive import constants as c

        refused = [n for n in self.entries if n.startswith((c.AOTINDUCTOR_DIR, c.EXECUTORCH_DIR, c.MTIA_DIR,
                                                             c.XL_MODEL_WEIGHTS_DIR))]
        if refused:
            raise UnsafeArchiveError(f"{self.path}: this .pt2 holds compiled code ({refused[0]}); refusing to load it")
        if self.read(c.ARCHIVE_FORMAT_PATH) != c.ARCHIVE_FORMAT_VALUE.encode():
            raise self._bad("archive_format is not pt2")
        if self.read(c.ARCHIVE_VERSION_PATH) != c.ARCHIVE_VERSION_VALUE.encode():
            raise self._bad(f"archive_version is not {c.ARCHIVE_VERSION_VALUE}")
        models = sorted(n for n in self.entries if n.startswith(c.MODELS_DIR))
        if models != [c.MODELS_FILENAME_FORMAT.format("model")]:
            raise self._bad(f"it holds {len(models)} programs, expected one, models/model.json")
        legacy = [n for n in (f"{c.WEIGHTS_DIR}model.pt", f"{c.CONSTANTS_DIR}model.pt") if n in self.entries]
        if legacy:
            raise UnsafeArchiveError(f"{self.path}: {_PICKLED} ({legacy[0]}, the legacy pickled format); refusing to load it")

    def load(self) -> Loaded:
        from torch._export.serde import schema
        from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass
        from torch.export.pt2_archive import constants as c

        self._check_layout()
        weights = self._payloads(c.WEIGHTS_CONFIG_FILENAME_FORMAT.format("model"), c.WEIGHTS_DIR, "weight")
        constants = self._payloads(c.CONSTANTS_CONFIG_FILENAME_FORMAT.format("model"), c.CONSTANTS_DIR, "constant")
        known = {c.ARCHIVE_FORMAT_PATH, c.ARCHIVE_VERSION_PATH, "byteorder", ".data/version", ".data/serialization_id",
                 c.MODELS_FILENAME_FORMAT.format("model"), c.SAMPLE_INPUTS_FILENAME_FORMAT.format("model"),
                 c.WEIGHTS_CONFIG_FILENAME_FORMAT.format("model"), c.CONSTANTS_CONFIG_FILENAME_FORMAT.format("model")}
        known |= {c.WEIGHTS_DIR + n for n in self.payload_files["weight"]}
        known |= {c.CONSTANTS_DIR + n for n in self.payload_files["constant"]}
        unknown = sorted(n for n in self.entries if n not in known and not n.startswith(c.EXTRA_DIR))
        if unknown:
            raise self._bad(f"unexpected entry {unknown[0]!r}")
        if self.entries.get("byteorder") and self.read("byteorder") not in (b"little", b""):
            raise self._bad("it was written on a big-endian machine")
        example = self._example_inputs(c.SAMPLE_INPUTS_FILENAME_FORMAT.format("model"))
        model = self.json(c.MODELS_FILENAME_FORMAT.format("model"))
        check_program_json(model, self.path)
        try:
            serialized = _dict_to_dataclass(schema.ExportedProgram, model)
        except Exception as exc:  # noqa: BLE001 - a field of the wrong type or shape
            raise self._bad(f"models/model.json does not describe a program ({first_line(exc)})") from None
        try:
            program = ExportedProgramDeserializer(None).deserialize(serialized, weights, constants, example)
        except Exception as exc:  # noqa: BLE001 - torch's own checks: versions, unknown ops, bad graphs
            raise self._bad(f"torch cannot read its program ({first_line(exc)})") from None
        check_program(program, self.path)
        meta = self._meta(c.EXTRA_DIR + META)
        outputs = meta.get("outputs") or [str(o) for o in program.graph_signature.user_outputs]
        return Loaded(program, [str(o) for o in outputs], meta)

    def _meta(self, name: str) -> dict:
        if name not in self.entries:
            return {}
        meta = self.json(name)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("outputs", []), list) \
                or not isinstance(meta.get("constants", {}), dict):
            raise self._bad(f"{name} is not attnres-compile metadata")
        return meta

    def _payloads(self, config_name: str, folder: str, kind: str) -> dict[str, torch.Tensor]:
        """fqn -> tensor of a weights or constants config: raw bytes viewed with the recorded dtype,
        sizes and strides (checked against the bytes held), pickled tensors only weights_only."""
        from torch.export.pt2_archive import constants as c

        config = self.json(config_name)
        payloads = config.get("config") if isinstance(config, dict) else None
        if not isinstance(payloads, dict):
            raise self._bad(f"{config_name} has no config")
        out: dict[str, torch.Tensor] = {}
        for fqn, meta in payloads.items():
            if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
                raise self._bad(f"{config_name}: entry {fqn!r}")
            name = meta["path_name"]
            if kind == "constant" and not name.startswith(c.TENSOR_CONSTANT_FILENAME_PREFIX):
                raise UnsafeArchiveError(f"{self.path}: {_PICKLED} (constant {fqn!r} is a pickled object); refusing to load it")
            self.payload_files[kind].add(name)
            data = self.read(folder + name)
            if meta.get("use_pickle"):
                tensor = self._pickled_tensor(data, f"{kind} {fqn!r}")
            else:
                tensor = self._raw_tensor(data, meta.get("tensor_meta"), f"{kind} {fqn!r}")
            out[fqn] = torch.nn.Parameter(tensor, requires_grad=tensor.requires_grad) if meta.get("is_param") else tensor
        return out

    def _pickled_tensor(self, data: bytes, what: str) -> torch.Tensor:
        try:
            value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception:  # noqa: BLE001 - the weights-only unpickler refuses anything but tensors and containers
            raise UnsafeArchiveError(f"{self.path}: {_PICKLED} ({what}); refusing to load it") from None
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsafeArchiveError(f"{self.path}: {_PICKLED} ({what} is a {type(value).__name__}); refusing to load it")
        return value

    def _raw_tensor(self, data: bytes, meta: Any, what: str) -> torch.Tensor:
        from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

        try:
            dtype = _SERIALIZE_TO_TORCH_DTYPE[_enum(meta["dtype"], "ScalarType")]
            sizes = [_int(s) for s in meta["sizes"]]
            strides = [_int(s) for s in meta["strides"]]
            offset = _int(meta["storage_offset"])
            requires_grad = bool(meta.get("requires_grad"))
        except (KeyError, TypeError, ValueError) as exc:
            raise self._bad(f"{what} has no valid tensor_meta ({first_line(exc)})") from None
        element = torch.empty((), dtype=dtype).element_size()
        if len(sizes) != len(strides) or min(sizes + strides + [offset], default=0) < 0:
            raise self._bad(f"{what}: sizes {sizes}, strides {strides}, offset {offset}")
        numel = 1
        for s in sizes:
            numel *= s
        extent = 0 if numel == 0 else offset + 1 + sum((s - 1) * st for s, st in zip(sizes, strides))
        if extent * element > len(data) or len(data) % element:
            raise self._bad(f"{what} needs {extent * element} bytes, the archive holds {len(data)}")
        flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        tensor = flat.as_strided(sizes, strides, offset)
        return tensor.requires_grad_(requires_grad) if requires_grad and tensor.is_floating_point() else tensor

    def _example_inputs(self, name: str) -> tuple | None:
        if name not in self.entries:
            return None
        data = self.read(name)
        if not data:
            return None
        try:
            value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception:  # noqa: BLE001
            raise UnsafeArchiveError(f"{self.path}: {_PICKLED} (its example inputs); refusing to load it") from None
        if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple) and isinstance(value[1], dict)):
            raise self._bad("its example inputs are not (args, kwargs)")
        return value


def _same(given: Any, traced: Any) -> bool:
    """A keyword value given at run time equals the traced one (stored as JSON, or as its repr)."""
    if traced is None or isinstance(traced, (bool, int, float)):
        return isinstance(given, bool) == isinstance(traced, bool) and given == traced
    return given == traced or repr(given) == traced


def _int(sym: Any) -> int:
    """A serialized SymInt that must be a plain int ({"as_int": n})."""
    value = sym["as_int"] if isinstance(sym, dict) and set(sym) == {"as_int"} else sym
    if type(value) is not int:
        raise ValueError(f"{sym!r} is not an int")
    return value


def _enum(value: Any, name: str) -> Any:
    from torch._export.serde import schema

    return getattr(schema, name)(value)


# ---------------------------------------------------------------------------------------------
# what a program may contain: checked on model.json before torch reads it, and on the result

_OPERATOR_FNS = {"getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg", "pos", "eq", "ne",
                 "lt", "le", "gt", "ge", "and_", "or_", "not_", "abs"}
_MATH_FNS = {"ceil", "floor", "trunc", "sqrt"}
_TORCH_SYM_FNS = {"sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_sqrt", "sym_ite", "sym_sum", "_sym_sqrt"}
_NAMESPACES = {"aten", "prims", "attnres", "higher_order"}
# other libraries' operators that compute only, and the module whose import registers them:
# transformers' grouped matmul is how HF MoE layers (Mixtral, Qwen2-MoE, OLMoE) export
_LIBRARY_OPS = {("transformers", "grouped_mm_fallback"): "transformers.integrations.moe"}
_HIGHER_ORDER = {"cond", "while_loop", "map_impl", "wrap_with_set_grad_enabled", "wrap_with_autocast",
                 "auto_functionalized", "auto_functionalized_v2", "invoke_subgraph", "scan", "associative_scan"}
_TARGET = re.compile(r"^torch\.ops\.(?P<ns>[A-Za-z_]\w*)\.(?P<op>[A-Za-z_]\w*)(?:\.(?P<overload>[A-Za-z_]\w*))?$")
_SYMBOL = re.compile(r"^[a-z]{1,6}\d{0,9}$")
_SYMPY_FNS = {"Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Mod", "Abs", "Eq", "Ne",
              "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Equality",
              "Unequality", "And", "Or", "Not", "floor", "ceiling", "sqrt", "FloorDiv", "ModularIndexing", "Where",
              "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural",
              "FloatPow", "FloatTrueDiv", "IntTrueDiv", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
              "ToFloat", "Identity", "IsNonOverlappingAndDenseIndicator", "oo", "zoo", "nan", "true", "false", "pi",
              "E", "BooleanTrue", "BooleanFalse", "int_oo", "IntInfinity", "NegativeIntInfinity", "S"}
_SYMPY_KEYWORDS = {"positive", "integer", "nonnegative", "negative", "nonpositive", "real", "finite", "zero",
                   "evaluate"}
_POWERS = {"Pow", "PowByNatural", "FloatPow", "LShift", "RShift"}
_GUARD_NAMES = {"L", "max", "min", "abs", "math", "inf", "True", "False"}
_GUARD_ATTRS = {"size", "stride", "storage_offset", "dim", "isnan", "inf", "floor", "ceil", "trunc"}


class _Refused(ValueError):
    pass


def check_program_json(model: Any, path: Path) -> None:
    """Every string of model.json that torch evaluates or resolves is plain: call targets are
    torch operators or arithmetic, shape expressions and guards are arithmetic on symbols."""
    if not isinstance(model, dict):
        raise InputError(f"{path}: damaged or unsupported .pt2 archive (models/model.json is not an object)")
    try:
        _walk(model)
        guards = model.get("guards_code") or []
        if not isinstance(guards, list):
            raise _Refused("guards_code is not a list")
        for guard in guards:
            _check_python(guard, _GUARD_NAMES, _GUARD_ATTRS, "guard")
    except _Refused as exc:
        raise UnsafeArchiveError(f"{path}: this .pt2 holds code, not only a program ({exc}); refusing to load it") from None
    except RecursionError:
        raise InputError(f"{path}: damaged or unsupported .pt2 archive (models/model.json nests too deep)") from None


def _walk(value: Any, key: str = "") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if k in ("target", "as_operator") and isinstance(v, str):
                _check_target(v)
            elif k == "expr_str":
                _check_python(v, set(), set(), "shape expression")
            elif k in ("as_custom_obj", "custom_obj"):
                raise _Refused(f"a custom object argument ({str(v)[:60]})")
            _walk(v, k)
    elif isinstance(value, list):
        for v in value:
            _walk(v, key)


def _check_target(target: str) -> None:
    if target.startswith("_operator."):
        ok = target.split(".", 1)[1] in _OPERATOR_FNS
    elif target.startswith("math."):
        ok = target.split(".", 1)[1] in _MATH_FNS
    elif target.startswith("torch.") and target.split(".", 1)[1] in _TORCH_SYM_FNS:
        ok = True
    else:
        m = _TARGET.match(target)
        if m and (m["ns"], m["op"]) in _LIBRARY_OPS:
            _register(m["ns"], m["op"])
            return
        ok = bool(m) and m["ns"] in _NAMESPACES and (m["ns"] != "higher_order" or m["op"] in _HIGHER_ORDER)
        ok = ok and not _does_io(m["ns"], m["op"])
    if not ok:
        raise _Refused(f"call target {target[:80]!r}")


def _register(namespace: str, op: str) -> None:
    """Import the module that registers a _LIBRARY_OPS operator, so that torch can resolve it."""
    import importlib

    module = _LIBRARY_OPS[(namespace, op)]
    try:
        importlib.import_module(module)
    except ImportError:
        raise InputError(f"this .pt2 calls the operator {namespace}::{op}: install {module.split('.')[0]} "
                         "to load it") from None


def _does_io(namespace: str, op: str) -> bool:
    """aten operators that read or write files or print: save, from_file, _print, warn."""
    return namespace == "aten" and op in {"save", "from_file", "_print", "warn", "load"}


def _check_python(source: Any, names: set[str], attrs: set[str], what: str) -> None:
    """`source` is an expression of numbers, shape symbols and the allowed names, attributes and calls."""
    if not isinstance(source, str) or len(source) > MAX_EXPR_CHARS:
        raise _Refused(f"a {what} that is not a short string")
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _Refused(f"a {what} that is not an expression: {source[:60]!r}") from None
    allowed_names = names | (_SYMPY_FNS if what == "shape expression" else set())
    count = 0
    for node in ast.walk(tree):
        count += 1
        if count > 2000:
            raise _Refused(f"a {what} of more than 2000 terms")
        if isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.unaryop, ast.cmpop, ast.boolop, ast.BoolOp,
                             ast.Compare, ast.UnaryOp)):
            if isinstance(node, (ast.Pow, ast.BitXor, ast.LShift, ast.RShift, ast.MatMult)):
                raise _Refused(f"a {what} with a power or shift: {source[:60]!r}")
            continue
        if isinstance(node, ast.BinOp):
            continue
        if isinstance(node, ast.Constant):
            v = node.value
            ok = (type(v) in (int, float, bool) and (type(v) is not int or abs(v) < 1 << 64)) or v is None or \
                (isinstance(v, str) and (bool(_SYMBOL.match(v)) or what == "guard" and len(v) < 64 and v.isidentifier()))
            if not ok:
                raise _Refused(f"a {what} with the constant {str(v)[:40]!r}")
            continue
        if isinstance(node, ast.Name):
            if node.id not in allowed_names and not (what == "shape expression" and _SYMBOL.match(node.id)):
                raise _Refused(f"a {what} naming {node.id!r}")
            continue
        if isinstance(node, ast.keyword):
            if what != "shape expression" or node.arg not in _SYMPY_KEYWORDS or not isinstance(node.value, ast.Constant):
                raise _Refused(f"a {what} with the keyword {node.arg!r}")
            continue
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in _POWERS:
                if any(isinstance(a, ast.Call) and isinstance(a.func, ast.Name) and a.func.id in _POWERS
                       for a in ast.walk(node) if a is not node) or _big_exponent(node):
                    raise _Refused(f"a {what} with a large power: {source[:60]!r}")
            ok = isinstance(func, ast.Name) and func.id in allowed_names or \
                isinstance(func, ast.Attribute) and func.attr in attrs
            if not ok:
                raise _Refused(f"a {what} calling {ast.unparse(func)[:40]!r}")
            continue
        if isinstance(node, ast.Attribute):
            if node.attr not in attrs or node.attr.startswith("_"):
                raise _Refused(f"a {what} reading .{node.attr}")
            continue
        if isinstance(node, ast.Subscript):
            if not isinstance(node.slice, ast.Constant):
                raise _Refused(f"a {what} with a computed subscript")
            continue
        raise _Refused(f"a {what} with {type(node).__name__}: {source[:60]!r}")


def _big_exponent(call: ast.Call) -> bool:
    exponent = call.args[1] if len(call.args) > 1 else None
    return isinstance(exponent, ast.Call) and exponent.args and isinstance(exponent.args[0], ast.Constant) and \
        isinstance(exponent.args[0].value, int) and abs(exponent.args[0].value) > 64 or \
        isinstance(exponent, ast.Constant) and isinstance(exponent.value, int) and abs(exponent.value) > 64


def check_program(program: torch.export.ExportedProgram, path: Path) -> None:
    """After deserialization: every call is a torch operator of the allowed namespaces or arithmetic."""
    import math
    import operator

    allowed = {getattr(operator, n) for n in _OPERATOR_FNS} | {getattr(math, n) for n in _MATH_FNS}
    allowed |= {getattr(torch, n) for n in _TORCH_SYM_FNS if hasattr(torch, n)}
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else []:
            if node.op in ("call_module", "call_method"):
                raise UnsafeArchiveError(f"{path}: this .pt2 holds code, not only a program ({node.op} {node.target!r}); "
                                         "refusing to load it")
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
                ns, op = target.namespace, target.__name__.split(".")[0]
                ok = ns in _NAMESPACES and not _does_io(ns, op) or (ns, op) in _LIBRARY_OPS
            else:
                ok = target in allowed
            if not ok:
                raise UnsafeArchiveError(f"{path}: this .pt2 holds code, not only a program (call target "
                                         f"{str(target)[:80]!r}); refusing to load it")
