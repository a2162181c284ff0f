""".pt2 archives read without running anything stored in them (the trust checks are trust.py's).
`load` checks the zip's layout and sizes, reads tensors itself (pickles only with
`weights_only=True`), hands torch a model.json that trust.py passed, and checks the result again."""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..core.errors import ConfigError, InputError, UnsafeArchiveError, first_line
from ..ops import depth_attention  # noqa: F401  (a program's attnres ops must be registered before it is read)
from ..utils.file_kind import describe
from .trust import check_program, check_program_json

META = "attnres.json"          # extra/attnres.json: {"format", "version", "outputs": [names], "constants": {name: value},
                               # decoders also "attnres.generation": {"eos_token_id": [ids], "pad_token_id"}
FORMAT = "attnres-compile.pt2"
MAX_JSON_BYTES = 256 << 20     # model.json and configs: a program of many thousand nodes is a few MiB
_PICKLED = "this .pt2 holds pickled objects other than tensors"


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
    archive = Archive(p)
    try:
        return archive.load()
    finally:
        archive.close()


class Archive:
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
