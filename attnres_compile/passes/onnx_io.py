"""Reading and writing ONNX files: every failure classified (errors.py), every write atomic.

`load` tells a file that is not ONNX from a truncated or damaged one (ONNX files start with
the ir_version field, byte 0x08), checks the opset and the external data before reading it.
`staged` / `save` write the model (and its `<name>.data` when weights go external) into a
temporary folder beside the output and rename them into place only when everything done
there succeeded, so a failed run leaves no partial file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, set_external_data, uses_external_data

from ..errors import CorruptModelError, ExternalDataError, InputError, NotOnnxError, UnsupportedOpsetError, first_line
from .onnx_function import MIN_OPSET, default_opset

ONNX_MAGIC = b"\x08"          # field 1 (ir_version, varint) comes first in every serialized ModelProto
EXTERNAL_LIMIT = 1 << 30      # weights above this many bytes are always written as external data
EXTERNAL_MIN_BYTES = 1024     # smaller initializers stay inside the .onnx file


def load(path: str | os.PathLike, with_data: bool = True) -> onnx.ModelProto:
    """The model at `path`, checked; with its external data loaded when `with_data`."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such file")
    with p.open("rb") as f:
        head = f.read(1)
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        if head == ONNX_MAGIC:
            raise CorruptModelError(f"{p}: truncated or corrupt ONNX model ({first_line(exc)})") from None
        raise NotOnnxError(f"{p}: not an ONNX model (it does not parse as an ONNX ModelProto)") from None
    if not model.HasField("graph") or model.ir_version <= 0:
        error = CorruptModelError if head == ONNX_MAGIC else NotOnnxError
        raise error(f"{p}: {'truncated or corrupt ONNX model' if head == ONNX_MAGIC else 'not an ONNX model'} (no graph or IR version)")
    check_opset(model, p)
    check_external_data(model, p.parent, p)
    try:  # by path: the checker resolves external data against the model's folder, not the cwd
        onnx.checker.check_model(str(p))
    except Exception as exc:  # noqa: BLE001
        raise CorruptModelError(f"{p}: invalid ONNX model ({first_line(exc)})") from None
    if with_data:
        load_data(model, p)
    return model


def load_data(model: onnx.ModelProto, path: Path) -> None:
    """Read the external data of `model`, loaded from `path`, into its tensors."""
    try:
        onnx.load_external_data_for_model(model, str(Path(path).parent))
    except Exception as exc:  # noqa: BLE001
        raise ExternalDataError(f"{path}: cannot read external data ({first_line(exc)})") from None


def check_opset(model: onnx.ModelProto, path: Path) -> int:
    """The default-domain opset of `model`, which must lie in MIN_OPSET..(the installed onnx's newest)."""
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if opset is None or not MIN_OPSET <= opset <= newest:
        raise UnsupportedOpsetError(
            f"{path}: ONNX opset {opset} is not supported (supported: {MIN_OPSET}..{newest}); "
            f"convert it first, e.g. onnx.version_converter.convert_version(model, {max(MIN_OPSET, min(17, newest))})"
        )
    return opset


def external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in _tensors(model) if uses_external_data(t)]


def _tensors(model: onnx.ModelProto):
    """Initializers and Constant-node tensors of the graph, its subgraphs and its functions."""
    def graph_tensors(graph: onnx.GraphProto):
        yield from graph.initializer
        yield from node_tensors(graph.node)

    def node_tensors(nodes):
        for node in nodes:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    yield a.t
                yield from a.tensors
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from graph_tensors(a.g)
                for g in a.graphs:
                    yield from graph_tensors(g)

    yield from graph_tensors(model.graph)
    for fn in model.functions:
        yield from node_tensors(fn.node)


def check_external_data(model: onnx.ModelProto, base: Path, path: Path) -> None:
    """Every external tensor's file exists and is long enough for its offset and length."""
    for tensor in external_tensors(model):
        info = ExternalDataInfo(tensor)
        data = base / info.location
        if not data.is_file():
            raise ExternalDataError(f"{path}: external data file {data} for tensor {tensor.name!r} is missing; "
                                    "keep the .data file next to the model")
        end = (info.offset or 0) + (info.length or 0)
        if data.stat().st_size < end:
            raise ExternalDataError(f"{path}: external data file {data} is truncated ({data.stat().st_size} bytes, "
                                    f"tensor {tensor.name!r} needs {end})")


def weight_bytes(model: onnx.ModelProto) -> int:
    return sum(t.ByteSize() for t in _tensors(model))


@dataclass
class Staged:
    """`path`: where to write, inside a temporary folder beside the output; `written`: the files committed."""

    path: Path
    written: list[Path] = field(default_factory=list)


@contextlib.contextmanager
def staged(output: str | os.PathLike) -> Iterator[Staged]:
    """Stage files for `output`; on a clean exit, rename them into place (`.data` first), else drop them.

    Whatever runs inside (writing, then verifying the staged model) leaves no partial file
    behind when it fails, and the input is still intact while the staged copy is checked,
    even when the output will replace it.
    """
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        stage = Staged(tmpdir / out.name)
        yield stage
        mode = 0o666 & ~_umask()
        for name in (data_file_name(out), out.name):
            if (tmpdir / name).exists():
                os.chmod(tmpdir / name, mode)
                os.replace(tmpdir / name, out.parent / name)
                stage.written.insert(0, out.parent / name)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def data_file_name(output: Path) -> str:
    """The external data file written beside `output`: `<name>.onnx.data`."""
    return output.name + ".data"


def write(model: onnx.ModelProto, path: Path, external: bool = False) -> None:
    """Write `model` to `path`; weights go to `<path>.data` when `external` or large.

    `model`'s tensors are moved to external data in place when written that way.
    """
    if external or weight_bytes(model) > EXTERNAL_LIMIT:  # marked by hand: onnx's own conversion checks the cwd
        for tensor in model.graph.initializer:
            if len(tensor.raw_data) >= EXTERNAL_MIN_BYTES:
                set_external_data(tensor, data_file_name(path))
    onnx.save_model(model, str(path))


def save(model: onnx.ModelProto, path: str | os.PathLike, external: bool = False) -> list[Path]:
    """`write` atomically (through `staged`); returns the files written."""
    with staged(path) as stage:
        write(model, stage.path, external)
    return stage.written


def input_files(model: onnx.ModelProto, path: Path) -> list[Path]:
    """The files a model loaded from `path` reads: the .onnx and its external data files."""
    return [path] + sorted({path.parent / ExternalDataInfo(t).location for t in external_tensors(model)})


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
