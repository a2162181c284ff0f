"""Reading and writing ONNX files: every failure classified (errors.py), every write atomic.

`load` tells a non-ONNX file from a damaged one, converts old opsets, and checks every tensor's
data (external data only inside the model's folder, exact sizes) before reading it; the checker
knows onnxruntime's own default-domain ops (ort_ops.py). `staged` / `save` write model and
`<name>.data` through outputs.staged, never leaving a partial or mismatched pair.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import onnx
import onnx.version_converter
from onnx import TensorProto
from onnx.external_data_helper import (
    ExternalDataInfo,
    load_external_data_for_tensor,
    set_external_data,
    uses_external_data,
)

from ..core.errors import (
    CorruptModelError,
    ExternalDataError,
    NotOnnxError,
    OutputWriteError,
    UnsupportedOpsetError,
    first_line,
)
from ..utils import outputs
from ..utils.file_kind import check_file, describe
from .function import MIN_OPSET, default_opset
from .ort_ops import known_to_checker, ort_only

ONNX_MAGIC = b"\x08"          # field 1 (ir_version, varint) comes first in every serialized ModelProto
EXTERNAL_LIMIT = 1 << 30      # weights above this many bytes are always written as external data
EXTERNAL_MIN_BYTES = 1024     # smaller initializers stay inside the .onnx file
EXTERNAL_KEYS = {"location", "offset", "length", "checksum", "basepath"}  # what onnx reads; others are refused
MAX_SUBGRAPH_DEPTH = 16       # If/Loop/Scan bodies nested deeper are refused (protobuf's parser stops at 32)
CONVERTED_OPSET = 17          # what older models are converted to on reading (MIN_OPSET, CastLike's, is 15)
CONVERTED_KEY = "attnres-compile.converted_from_opset"  # metadata of a converted model: its original opset
PROTOBUF_LIMIT = (2 << 30) - 1  # protobuf's largest message: larger files are not ONNX models, never read


def load(path: str | os.PathLike, with_data: bool = True) -> onnx.ModelProto:
    """The model at `path`, checked; with its external data loaded when `with_data`."""
    p = Path(path)
    check_file(p, "an ONNX model")
    head = _head(p)
    if head != ONNX_MAGIC:  # decided before the rest is read: a 3 GB file of zeros is not read into memory
        raise NotOnnxError(f"{p}: not an ONNX model (it is {describe(p)}; an ONNX model starts with its IR version, "
                           "byte 0x08)")
    size = p.stat().st_size
    if size > PROTOBUF_LIMIT:
        raise CorruptModelError(f"{p}: truncated or corrupt ONNX model ({size / 2**30:.1f} GiB; a serialized model is "
                                "at most 2 GiB, larger weights go to external data)")
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        if "MaxDepth" in str(exc):
            raise CorruptModelError(f"{p}: its messages nest deeper than protobuf reads (If/Loop/Scan subgraphs more "
                                    f"than 32 deep; at most {MAX_SUBGRAPH_DEPTH} are supported)") from None
        raise CorruptModelError(f"{p}: truncated or corrupt ONNX model ({first_line(exc)})") from None
    if not model.HasField("graph") or model.ir_version <= 0:
        raise CorruptModelError(f"{p}: truncated or corrupt ONNX model (no graph or IR version)")
    bad = _non_utf8_field(model)
    if bad:  # protobuf hands such strings over as bytes, which every later name lookup trips on
        raise CorruptModelError(f"{p}: truncated or corrupt ONNX model (a string field, {bad}, is not valid UTF-8)")
    check_opset(model, p)
    depth = subgraph_depth(model)
    if depth > MAX_SUBGRAPH_DEPTH:
        raise CorruptModelError(f"{p}: If/Loop/Scan subgraphs are nested {depth} deep; at most {MAX_SUBGRAPH_DEPTH} "
                                "levels are supported")
    check_external_data(model, p.parent, p)
    try:  # by path: the checker resolves external data against the model's folder, not the cwd
        with known_to_checker(ort_only_ops(model)):
            onnx.checker.check_model(str(p))
    except Exception as exc:  # noqa: BLE001
        raise CorruptModelError(f"{p}: invalid ONNX model ({first_line(exc)})") from None
    check_types(model, p)
    opset = default_opset(model)
    if opset < MIN_OPSET:
        model = _convert_opset(model, p, opset)
    else:  # a file we wrote from a converted one: read as it is now, its conversion is history
        _drop_converted_mark(model)
    _unknown_dims(model)
    if with_data:
        load_data(model, p)
    return model


UNNAMED_DIM = "?"  # paddle2onnx's name for every unknown dim: not one symbol, each dim its own


def ort_only_ops(model: onnx.ModelProto) -> list[str]:
    """The default-domain ops of `model` (anywhere: subgraphs, functions) that onnx has no schema for and
    onnxruntime runs (onnx/ort_ops.py): the checker checks them against onnxruntime's schemas."""
    nodes = [n for graph in _graphs(model) for n in graph.node] + [n for fn in model.functions for n in fn.node]
    return ort_only({n.op_type for n in nodes if n.domain in ("", "ai.onnx")})


def _unknown_dims(model: onnx.ModelProto) -> None:
    """Negative dim_values and dims named "?" (paddle2onnx writes both for dynamic dims) made unknown, as
    onnxruntime reads them: TVM's importer took -1 for a static dim and the "?" of height and width for
    one dim, refusing every --static-shape."""
    for graph, _ in graphs_with_depth(model):
        for value in [*graph.input, *graph.output, *graph.value_info]:
            for dim in value.type.tensor_type.shape.dim:
                if (dim.HasField("dim_value") and dim.dim_value < 0) or dim.dim_param == UNNAMED_DIM:
                    dim.Clear()


def _head(path: Path) -> bytes:
    """The first byte of the file at `path` (b"" when empty or unreadable)."""
    try:
        with path.open("rb") as f:
            return f.read(1)
    except OSError:
        return b""


def looks_like_onnx(path: Path) -> bool:
    """A regular file starting as every serialized ONNX model does (the ir_version field, byte 0x08),
    no larger than protobuf reads: one worth parsing."""
    return path.is_file() and _head(path) == ONNX_MAGIC and path.stat().st_size <= PROTOBUF_LIMIT


def _convert_opset(model: onnx.ModelProto, path: Path, opset: int) -> onnx.ModelProto:
    """A model older than MIN_OPSET converted to CONVERTED_OPSET (IR 8) by onnx's version converter before
    its external data is read; the original opset is kept in the metadata (`converted_from`)."""
    try:
        converted = onnx.version_converter.convert_version(model, CONVERTED_OPSET)
        converted.ir_version = max(converted.ir_version, 8)
        onnx.checker.check_model(converted)
    except Exception as exc:  # noqa: BLE001 - the converter's C++ errors and the checker's
        raise UnsupportedOpsetError(
            f"{path}: ONNX opset {opset} is older than {MIN_OPSET}, and onnx's version converter could not bring it "
            f"to opset {CONVERTED_OPSET} ({first_line(exc)}); convert it to opset {MIN_OPSET} or newer first") from None
    entry = converted.metadata_props.add()
    entry.key, entry.value = CONVERTED_KEY, str(opset)
    return converted


def _drop_converted_mark(model: onnx.ModelProto) -> None:
    kept = [p for p in model.metadata_props if p.key != CONVERTED_KEY]
    if len(kept) != len(model.metadata_props):
        del model.metadata_props[:]
        model.metadata_props.extend(kept)


def converted_from(model: onnx.ModelProto) -> int | None:
    """The opset `load` converted `model` from, or None if it was read as it is."""
    value = next((p.value for p in model.metadata_props if p.key == CONVERTED_KEY), None)
    return int(value) if value is not None else None


def _non_utf8_field(message, path: str = "model") -> str | None:
    """The first string field under `message` that does not decode as UTF-8 (its path), or None."""
    if isinstance(message, onnx.TensorProto):  # its strings only: listing its fields would copy the weights
        strings = [("name", message.name), ("doc_string", message.doc_string)]
        strings += [("external_data", v) for e in message.external_data for v in (e.key, e.value)]
        return next((f"{path}.{name}" for name, v in strings if isinstance(v, bytes)), None)
    for fd, value in message.ListFields():
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        values = value if repeated else (value,)
        if fd.type == fd.TYPE_STRING:
            if any(isinstance(v, bytes) for v in values):
                return f"{path}.{fd.name}"
        elif fd.type == fd.TYPE_MESSAGE:
            for sub in values:
                bad = _non_utf8_field(sub, f"{path}.{fd.name}")
                if bad:
                    return bad
    return None


def load_data(model: onnx.ModelProto, path: Path) -> None:
    """Read the external data of `model`, loaded from `path`, into its tensors (checked by `load` first)."""
    base = str(Path(path).parent)
    try:
        for tensor in external_tensors(model):  # every tensor check_external_data checked, sparse ones too
            load_external_data_for_tensor(tensor, base)
    except Exception as exc:  # noqa: BLE001
        raise ExternalDataError(f"{path}: cannot read external data ({first_line(exc)})") from None


_BITS = {TensorProto.UINT4: 4, TensorProto.INT4: 4, TensorProto.FLOAT4E2M1: 4}
_BITS.update({getattr(TensorProto, n): 2 for n in ("UINT2", "INT2") if hasattr(TensorProto, n)})
_SIZED = {TensorProto.FLOAT, TensorProto.UINT8, TensorProto.INT8, TensorProto.UINT16, TensorProto.INT16,
          TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.DOUBLE,
          TensorProto.UINT32, TensorProto.UINT64, TensorProto.COMPLEX64, TensorProto.COMPLEX128, TensorProto.BFLOAT16,
          TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ}
_SIZED.update(getattr(TensorProto, n) for n in ("FLOAT8E8M0",) if hasattr(TensorProto, n))


def tensor_bytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes `tensor`'s shape and type need as raw data; None for types without a fixed size (strings)."""
    if tensor.data_type in _BITS:
        bits = _BITS[tensor.data_type]
    elif tensor.data_type in _SIZED:
        bits = 8 * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    else:
        return None
    return -(-math.prod(tensor.dims) * bits // 8)


def _typed_field(data_type: int) -> str | None:
    """The TensorProto field holding one value per element of `data_type` (None: sub-byte types, packed)."""
    if data_type in _BITS or data_type not in _SIZED | {TensorProto.STRING}:
        return None
    return onnx.helper.tensor_dtype_to_field(data_type)


def check_types(model: onnx.ModelProto, path: Path) -> None:
    """Known data types everywhere, and embedded raw data of exactly the size shape and type need (the
    checker lets unknown types and over-long data through).
    """
    known = set(TensorProto.DataType.values())
    for tensor in _tensors(model):
        if tensor.data_type not in known:
            raise CorruptModelError(f"{path}: truncated or corrupt ONNX model (tensor {tensor.name!r} has unknown "
                                    f"data type {tensor.data_type})")
        if uses_external_data(tensor):
            continue
        if tensor.HasField("raw_data"):
            held, need, unit = len(tensor.raw_data), tensor_bytes(tensor), "bytes"
        else:  # typed fields: one value per element (two for complex types; sub-byte types pack theirs)
            field = _typed_field(tensor.data_type)
            if field is None:
                continue
            held, unit = len(getattr(tensor, field)), f"{field} values"
            complex_ = tensor.data_type in (TensorProto.COMPLEX64, TensorProto.COMPLEX128)
            need = math.prod(tensor.dims) * (2 if complex_ else 1)
            if held == 0 and need > 0:
                continue  # no data at all: the checker's call (a tensor without a value field)
        if need is not None and held != need:
            raise CorruptModelError(f"{path}: truncated or corrupt ONNX model (tensor {tensor.name!r} holds "
                                    f"{held} {unit}, its shape {list(tensor.dims)} and type need {need})")
    for graph in _graphs(model):
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            elem = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
            if elem not in known:
                raise CorruptModelError(f"{path}: truncated or corrupt ONNX model (value {vi.name!r} has unknown "
                                        f"element type {elem})")


def check_opset(model: onnx.ModelProto, path: Path) -> int:
    """The default-domain opset of `model`, which must lie in 1..(the installed onnx's newest)."""
    domains = [o.domain if o.domain != "ai.onnx" else "" for o in model.opset_import]
    twice = next((d for d in domains if domains.count(d) > 1), None)
    if twice is not None:
        versions = [o.version for o in model.opset_import if (o.domain if o.domain != "ai.onnx" else "") == twice]
        raise CorruptModelError(f"{path}: truncated or corrupt ONNX model (it imports the "
                                f"{'default ONNX domain' if not twice else f'domain {twice!r}'} {len(versions)} times, "
                                f"opsets {versions}; ONNX allows one import per domain)")
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if opset is None or not 1 <= opset <= newest:
        what = "imports no ai.onnx opset" if opset is None else f"ONNX opset {opset} is not supported"
        raise UnsupportedOpsetError(f"{path}: {what} (supported: 1..{newest}, opsets below {MIN_OPSET} converted "
                                    f"to {CONVERTED_OPSET} on reading); export it at an opset in that range")
    return opset


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in _tensors(model) if uses_external_data(t)]


def _tensors(model: onnx.ModelProto):
    """Initializers, sparse initializers and attribute tensors of the graph, its subgraphs and its
    functions; an attribute's tensor counts when set, whatever its declared type (as the loaders see it).
    """
    def sparse(s: onnx.SparseTensorProto):
        yield s.values
        yield s.indices

    def node_tensors(nodes):
        for node in nodes:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                if a.HasField("sparse_tensor"):
                    yield from sparse(a.sparse_tensor)
                for s in a.sparse_tensors:
                    yield from sparse(s)

    for graph, _ in graphs_with_depth(model):
        yield from graph.initializer
        for s in graph.sparse_initializer:
            yield from sparse(s)
        yield from node_tensors(graph.node)
    for fn in model.functions:
        yield from node_tensors(fn.node)


def _graphs(model: onnx.ModelProto):
    """The main graph and every subgraph (of the graph and of the functions), each once."""
    for graph, _ in graphs_with_depth(model):
        yield graph


def graphs_with_depth(model: onnx.ModelProto):
    """(graph, nesting depth) for the main graph (0), function bodies' subgraphs and every subgraph below,
    each visited once, without recursion."""
    stack = [(model.graph, 0)] + [(g, 1) for fn in model.functions for g in subgraphs(fn.node)]
    while stack:
        graph, depth = stack.pop()
        yield graph, depth
        stack.extend((g, depth + 1) for g in subgraphs(graph.node))


def subgraphs(nodes):
    """The subgraphs held by `nodes`' attributes (If/Loop/Scan bodies), one level down."""
    for node in nodes:
        for a in node.attribute:
            if a.HasField("g"):
                yield a.g
            yield from a.graphs


def subgraph_depth(model: onnx.ModelProto) -> int:
    """How deep If/Loop/Scan subgraphs nest (0: none), in one linear walk."""
    return max(depth for _, depth in graphs_with_depth(model))


def external_location(base: Path, location: str, tensor: str, path: Path) -> Path:
    """`location` under `base`, refused before the file is touched unless it lies inside `base` (no
    absolute path, `..` or symlink leading out).
    """
    if not location or "\0" in location:
        raise ExternalDataError(f"{path}: tensor {tensor!r} has an invalid external data location {location!r}")
    folder = base.resolve()
    how = "an absolute path" if os.path.isabs(location) else None
    if how is None and not Path(os.path.normpath(folder / location)).is_relative_to(folder):
        how = "'..' leads out"
    if how is None:
        try:
            if not (folder / location).resolve().is_relative_to(folder):
                how = "a symlink leads out"
        except (OSError, RuntimeError, ValueError):  # a symlink loop
            how = "a symlink loop"
    if how:
        raise ExternalDataError(f"{path}: external data {location!r} of tensor {tensor!r} is outside the model's "
                                f"folder {folder} ({how}); refused: keep the .data file next to the model")
    return base / location


def check_external_data(model: onnx.ModelProto, base: Path, path: Path) -> None:
    """Every external tensor's file lies inside the model's folder, exists, and holds the tensor's bytes
    (offset plus length within the file; a length equal to what the shape and type need)."""
    for tensor in external_tensors(model):
        unknown = sorted({e.key for e in tensor.external_data} - EXTERNAL_KEYS)
        if unknown:  # onnx would ignore them (a misspelt offset reads the wrong bytes), onnxruntime refuses them
            raise ExternalDataError(f"{path}: tensor {tensor.name!r} has unknown external data key(s) {unknown} "
                                    f"(known: {', '.join(sorted(EXTERNAL_KEYS))})")
        try:
            info = ExternalDataInfo(tensor)
        except Exception as exc:  # noqa: BLE001 - a negative or non-numeric offset or length
            raise ExternalDataError(f"{path}: tensor {tensor.name!r} has an invalid external data reference "
                                    f"({first_line(exc)})") from None
        data = external_location(base, info.location, tensor.name, path)
        try:
            size = data.stat().st_size if data.is_file() else None
        except OSError:  # a name too long, a permission denied
            size = None
        if size is None:
            raise ExternalDataError(f"{path}: external data file {str(data)!r} for tensor {tensor.name!r} is missing "
                                    "(or not a file); keep the .data file next to the model")
        need = tensor_bytes(tensor)
        if info.length is not None and need is not None and info.length != need:
            raise ExternalDataError(f"{path}: external data of tensor {tensor.name!r} is {info.length} bytes, its "
                                    f"shape {list(tensor.dims)} and type need {need}")
        end = (info.offset or 0) + (info.length if info.length is not None else need or 0)
        if size < end:
            raise ExternalDataError(f"{path}: external data file {str(data)!r} is truncated ({size} bytes, "
                                    f"tensor {tensor.name!r} needs {end})")


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(t.ByteSize() for t in _tensors(model))


@contextlib.contextmanager
def staged(output: str | os.PathLike):
    """outputs.staged for an ONNX output: write with `write(model, stage.path, external, data_name(stage))`.
    The weights files of the graph it replaces that no other model in the folder reads (optimum's
    `model.onnx_data`, any name) are removed once the new graph is in place."""
    with outputs.staged(output) as stage:
        stage.orphans = orphaned_weights(Path(output))
        yield stage


def orphaned_weights(output: Path) -> list[Path]:
    """The external data files of the ONNX model now at `output` (regular files inside its folder, whatever their
    names, in a subfolder too) that no other ONNX file of the folder names: they go when `output` is replaced."""
    if not output.is_file() or output.is_symlink():
        return []
    folder = output.parent.resolve()
    mine = {_inside(p, folder) for p in files_of(output)[1:] if p.is_file() and not p.is_symlink()} - {None}
    return sorted(folder / name for name in mine - folder_data_names(folder, but=output.name)) if mine else []


def folder_data_names(folder: Path, but: str | None = None) -> set[str]:
    """The external data files the ONNX models of `folder` (but the one named `but`) name, as paths relative to
    `folder` (`model.onnx.data`, `shards/b.bin`)."""
    base = folder.resolve()
    return {name for m in folder.iterdir() if m.suffix == ".onnx" and m.name != but and m.is_file()
            for f in files_of(m)[1:] if (name := _inside(f, base)) is not None}


def _inside(path: Path, folder: Path) -> str | None:
    """`path` (its folder resolved, itself not followed) relative to `folder` as a posix path, or None outside it."""
    try:
        relative = (path.parent.resolve() / path.name).relative_to(folder)
    except (ValueError, OSError, RuntimeError):
        return None
    return relative.as_posix()


def data_name(stage: outputs.Stage) -> str:
    """The external data file for the staged output (outputs.data_name: `<name>.onnx.data`, or
    `<name>.onnx.<token>.data` while the old graph still needs that name); the output's older
    weights files are removed once the new graph is in place."""
    return outputs.data_name(stage)


def write(model: onnx.ModelProto, path: Path, external: bool = False, data: str | None = None) -> None:
    """Write `model` to `path`; weights go to the file `data` beside it (default `<path>.data`)
    when `external` or large. `model`'s tensors are moved to external data in place when written
    that way. I/O errors (a full disk) raise OSError, which `staged` reports in one line."""
    if external or weight_bytes(model) > EXTERNAL_LIMIT:  # marked by hand: onnx's own conversion checks the cwd
        name = data or outputs.data_file_name(path)
        if len(os.fsencode(name)) > outputs.NAME_MAX:
            raise OutputWriteError(f"cannot write the weights of {path.name}: their file name {name} would be longer "
                                   f"than {outputs.NAME_MAX} bytes; choose a shorter output name; nothing was replaced")
        for tensor in model.graph.initializer:
            if len(tensor.raw_data) >= EXTERNAL_MIN_BYTES:
                set_external_data(tensor, data or outputs.data_file_name(path))
    onnx.save_model(model, str(path))


def save(model: onnx.ModelProto, path: str | os.PathLike, external: bool = False) -> list[Path]:
    """`write` atomically (through `staged`); returns the files written."""
    with staged(path) as stage:
        write(model, stage.path, external, data_name(stage))
    return stage.written


def files_of(path: Path) -> list[Path]:
    """The files a model at `path` reads, by a light parse before any check (`load` checks them): the
    file and, when its header is an ONNX model's, the external data files it names."""
    files = [path]
    if not looks_like_onnx(path):
        return files
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - a damaged model: load() reports it
        return files
    for tensor in external_tensors(proto):
        try:
            location = ExternalDataInfo(tensor).location
        except Exception:  # noqa: BLE001 - a bad reference: load() refuses it before reading anything
            continue
        if isinstance(location, str) and location and "\0" not in location:  # not UTF-8 (bytes): load() refuses it
            files.append(path.parent / location)
    return files


def input_files(model: onnx.ModelProto, path: Path) -> list[Path]:
    """The files a model loaded from `path` reads: the .onnx and its external data files."""
    return [path] + sorted({path.parent / ExternalDataInfo(t).location for t in external_tensors(model)})
