"""`attnres-compile run`: a compiled TVM artifact run on the arrays of an .npz file."""

from __future__ import annotations

import contextlib
import math
import zipfile
from pathlib import Path

from ..core.errors import InputError, MemoryLimitError, first_line
from ..utils import isolate, outputs
from ..utils.file_kind import check_file, describe
from ..utils.outputs import Output
from . import args as cli_args
from .compile import dims


def add_command(subparsers) -> None:
    """Register `run` on the main parser's subparsers."""
    run = subparsers.add_parser("run", help="run a compiled artifact on inputs from an .npz file")
    run.add_argument("artifact", help="artifact folder written by `attnres-compile compile`")
    run.add_argument("--inputs", required=True, help=".npz file with one array per model input, by name")
    run.add_argument("-o", "--output", required=True, help=".npz file to write the outputs to, by name")
    run.add_argument("--force", action="store_true", help="overwrite the output file if it exists")
    run.add_argument("--profile", action="store_true",
                     help="also print the time of each kernel per forward (VM instrumentation, process CPU clock)")
    cli_args.add_debug(run)
    run.set_defaults(run=run_command, outputs=planned_outputs)


def planned_outputs(args) -> tuple[list[Output], list[Path], bool]:
    """(outputs, inputs, force) for outputs.check: -o; the .npz and every file of the artifact as inputs."""
    artifact = Path(args.artifact)
    inputs = [Path(args.inputs), artifact]
    with contextlib.suppress(OSError):
        inputs += [p for p in artifact.rglob("*") if p.is_file()]
    return [Output(Path(args.output), "-o")], inputs, args.force


def run_command(args) -> int:
    import numpy as np

    from ..backends.tvm.runtime import load

    path = Path(args.inputs)
    check_file(path, "an .npz of input arrays")
    kind = describe(path)
    if kind != "an .npz archive of arrays":
        raise InputError(f"{path} is {kind}, not an .npz of input arrays (numpy.savez(path, name=array, ...))")
    artifact = load(args.artifact)
    check_declared(path, declared_arrays(path), artifact.manifest["inputs"])
    try:
        with np.load(path, allow_pickle=False) as data:
            inputs = {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise InputError(f"{path}: not an .npz file ({first_line(exc)})") from None
    results = artifact(inputs)
    out = Path(args.output)
    with outputs.staged(out) as stage, open(stage.path, "wb") as f:
        np.savez(f, **results)
    print("wrote " + str(out) + ": " + ", ".join(f"{k} {v.dtype}[{dims(v.shape)}]" for k, v in results.items()))
    if args.profile:
        from ..backends.tvm.profile import format_table, profile

        print(format_table(profile(args.artifact, artifact.checked(inputs), device=artifact.manifest["device"])))
    return 0


def declared_arrays(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """{name: (shape, dtype)} of the arrays of the .npz at `path`, from their .npy headers only (a few
    bytes each, whatever the arrays' size or compression)."""
    import numpy as np
    from numpy.lib import format as npy

    declared = {}
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                with z.open(info) as f:
                    version = npy.read_magic(f)
                    if version not in ((1, 0), (2, 0)):
                        raise ValueError(f"unsupported .npy format version {version}")
                    read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
                    shape, _, dtype = read(f)
                declared[info.filename.removesuffix(".npy")] = (tuple(int(d) for d in shape), np.dtype(dtype))
    except (OSError, ValueError, TypeError, zipfile.BadZipFile, EOFError, RuntimeError, NotImplementedError) as exc:
        raise InputError(f"{path}: not an .npz file ({first_line(exc)})") from None
    return declared


def check_declared(path: Path, declared: dict, specs: list[dict]) -> None:
    """Refuse, before any array is read, inputs whose headers do not fit the model (names, ranks, static
    dims) or that together declare more bytes than the memory budget (a bomb: a small file claiming
    terabytes, or gigabytes of zeros compressed to megabytes)."""
    names = [s["name"] for s in specs]
    if sorted(declared) != sorted(names):
        raise InputError(f"{path}: inputs must be exactly {names}: missing {sorted(set(names) - set(declared))}, "
                         f"unknown {sorted(set(declared) - set(names))}")
    for spec in specs:
        shape, want = declared[spec["name"]][0], spec["shape"]
        fits = want is None or (len(want) == len(shape) and all(not isinstance(w, int) or w == g
                                                                 for w, g in zip(want, shape)))
        if not fits:
            raise InputError(f"{path}: input {spec['name']}: shape {list(shape)}, expected {want}")
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in declared.values())
    budget = isolate.memory_budget()
    if total > budget:
        raise MemoryLimitError(f"{path}: its arrays declare {total / 2**30:.1f} GiB, more than the memory limit "
                               f"{budget / 2**30:.1f} GiB ({isolate.MEMORY_ENV}); nothing was read or run")
