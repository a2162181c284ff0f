"""Every file or folder a command writes goes through here: checked before any work, staged beside
the destination, committed so that it holds either the old file untouched or the complete new one.

`check`: an existing output is replaced only with --force, and only a regular file, a symlink or
an artifact folder of ours; never an input (except the documented in-place rewrite); no two
outputs name one file. `staged` / `staged_folder`: written into `.NAME.PID.TOKEN.tmp/`, fsynced,
renamed into place; any exception or recorded signal leaves the destination as it was. Write
errors become OutputWriteError (exit 19).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import ConfigError, InputError, OutputPathError, OutputWriteError
from .file_kind import special

NOTHING_DONE = "nothing was replaced or left behind"
SIGNALS: list[int] = []  # signals this process received (the CLI's handlers record them): no commit after one

WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM,
                errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY}


@dataclass(frozen=True)
class Output:
    """One path a command will write (or, `removed`, remove once its output is in place): `option`
    names it in messages (`-o`, `--report`); `primary` outputs may replace the input in the
    in-place rewrite (`-o` is the input, with --force); `folder` for artifact folders, whose
    `marker` file marks an existing folder as one of ours (the only kind --force replaces)."""

    path: Path
    option: str
    primary: bool = False
    folder: bool = False
    marker: str | None = None
    removed: bool = False


def data_file_name(output: Path) -> str:
    """The external data file an ONNX model written to `output` uses: `<name>.onnx.data`."""
    return output.name + ".data"


def data_files(output: Path) -> list[Path]:
    """The weights files of an ONNX output that exist now: `<name>.data` and `<name>.<8 hex>.data`
    (a newer graph's, written while an older one existed); all but the new graph's are removed
    when a new output is committed."""
    pattern = re.compile(rf"^{re.escape(output.name)}(\.[0-9a-f]{{8}})?\.data$")
    try:
        return sorted(output.parent / n for n in os.listdir(output.parent) if pattern.match(n))
    except OSError:
        return []


def onnx_outputs(output: Path, option: str = "output") -> list[Output]:
    """The files an ONNX output may write or remove: the model, its `.data`, and its older weights
    files (all may replace the input's in the in-place rewrite)."""
    default = output.parent / data_file_name(output)
    older = [Output(p, f"{option}'s older data", primary=True, removed=True) for p in data_files(output) if p != default]
    return [Output(output, option, primary=True), Output(default, f"{option}'s data", primary=True), *older]


def check(outputs: list[Output], inputs: list[Path], force: bool) -> None:
    """Refuse, before any work, every output this run must not write (see the module docstring).
    `inputs[0]` is the model (or main input) file; the in-place rewrite names it as a primary output."""
    seen: dict[str, Output] = {}
    for o in outputs:
        key = _identity(o.path)
        if key in seen:
            other = seen[key]
            raise ConfigError(f"{other.option} {other.path} and {o.option} {o.path} name the same file: "
                              "give each output its own path")
        seen[key] = o
    in_place = force and bool(inputs) and any(o.primary and not o.removed and _same(o.path, inputs[0]) for o in outputs)
    for o in outputs:
        p = o.path
        for parent in [p.parent, *p.parent.parents]:
            if os.path.lexists(parent) and not parent.is_dir():
                raise ConfigError(f"{o.option} {p}: {parent} is not a folder")
        clash = next((i for i in inputs if _same(p, i)), None)
        if clash is not None and not (o.primary and in_place):
            model = _same(clash, inputs[0])
            fix = "choose another path, or pass --force to replace it" if o.primary and model else "choose another path"
            what = f"the input {clash}" + ("" if model else f" (read by {inputs[0]})")
            raise OutputPathError(f"{o.option} {p} would {'remove' if o.removed else 'replace'} {what}: {fix}")
        if o.folder:
            _check_folder(o, inputs, force)
            continue
        if not os.path.lexists(p):
            continue
        if p.is_dir():
            raise ConfigError(f"{o.option} {p} is a folder: give a file name")
        kind = special(p, follow=False)
        if kind:
            raise ConfigError(f"{o.option} {p} is {kind}: only regular files are replaced, even with --force; "
                              "choose another path")
        if not force:
            what = "exists (a dangling symlink)" if not p.exists() else "exists"
            raise InputError(f"{o.option} {p} {what}: pass --force to {'replace' if o.removed else 'overwrite'} it")


def _check_folder(o: Output, inputs: list[Path], force: bool) -> None:
    """A folder output never holds an input or the working folder (replacing it would delete them);
    an existing non-empty one is replaced only with --force and only when it is ours (its marker)."""
    p = o.path
    held = next((i for i in inputs if _inside(i, p)), None)
    if held is not None:
        raise OutputPathError(f"{o.option} {p} holds the input {held}; replacing the folder would delete it, even "
                              "with --force: choose another folder")
    if _inside(Path(os.getcwd()), p):
        raise ConfigError(f"{o.option} {p} is the working folder or holds it: choose another folder")
    if not os.path.lexists(p):
        return
    if not p.is_dir():
        raise ConfigError(f"{o.option} {p} exists and is not a folder")
    if not any(p.iterdir()):
        return
    if not force:
        raise InputError(f"{o.option} {p} exists: pass --force to replace it")
    if o.marker and not (p / o.marker).is_file():
        raise ConfigError(f"{o.option} {p} is not an artifact folder (no {o.marker}); --force replaces only a folder "
                          "`compile` wrote: choose a new or empty folder")


def _inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies under it, by its own name or where its symlinks lead."""
    try:
        base = _identity(folder)
        names = {_identity(path), os.path.join(_identity(path.parent), path.name)}
    except ValueError:  # a name with a NUL byte names no file
        return False
    return any(name == base or name.startswith(base.rstrip(os.sep) + os.sep) for name in names)


def _identity(path: Path) -> str:
    return os.path.normcase(os.path.realpath(path))


def _same(a: Path, b: Path) -> bool:
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
        return _identity(a) == _identity(b)
    except (OSError, ValueError):  # a name with a NUL byte names no file
        return False


# ---------------------------------------------------------------------------------------------
# staging and commit

_STAGE = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{12}\.(tmp|old)$")
_STAGE_EXTRA = len(".") + len(".4194304") + len(".") + 12 + len(".tmp")  # the longest pid Linux gives
NAME_MAX = 255


def _label(out: Path) -> str:
    """The output's name in its staging names: the name itself, or a digest of it when a staging
    name would exceed the system's 255 bytes (a legal 255-byte output name)."""
    name = os.fsencode(out.name)
    return out.name if len(name) + _STAGE_EXTRA <= NAME_MAX else "~" + hashlib.sha256(name).hexdigest()[:16]


def _stage_name(out: Path, kind: str = "tmp") -> Path:
    return out.parent / f".{_label(out)}.{os.getpid()}.{secrets.token_hex(6)}.{kind}"


def _stagings(out: Path) -> list[tuple[str, bool]]:
    """(path, its process is alive) of every staging folder for `out`."""
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return []
    label = _label(out)
    return [(e.path, _alive(int(m["pid"]))) for e in entries if (m := _STAGE.match(e.name)) and m["name"] == label]


def clean_stale(out: Path) -> None:
    """Remove the staging folders a killed run (its process gone) left for `out`."""
    for path, alive in _stagings(out):
        if not alive:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # an earlier run of this process that was killed cannot be running
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Stage:
    """`path`: the output inside the staging `folder`, other files there committed beside it first.
    `onnx_data` (older weights files) and `orphans` are removed once it is in place; `written`: the
    files committed."""

    out: Path
    folder: Path
    onnx_data: bool = False
    orphans: list[Path] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.folder / self.out.name


def data_name(stage: Stage) -> str:
    """The weights file name for the staged ONNX output: `<name>.data`, or `<name>.<8 hex>.data` while a
    file of that name exists (an older output's weights: the old graph keeps them until the new one
    is in place) or another live run stages the same output (it may commit `<name>.data` first)."""
    stage.onnx_data = True
    out = stage.out
    default = data_file_name(out)
    others = any(alive and path != str(stage.folder) for path, alive in _stagings(out))
    if others or os.path.lexists(out.parent / default):
        return f"{out.name}.{secrets.token_hex(4)}.data"
    return default


@contextlib.contextmanager
def staged(output: str | os.PathLike, outcome: str = NOTHING_DONE) -> Iterator[Stage]:
    """Stage files for `output` and commit them on a clean exit; on any exception, remove them
    (and the folders made for the output). `outcome` ends a write error's line: what the command
    has written before this output (default: nothing)."""
    out = Path(output)
    created = _make_parents(out)
    clean_stale(out)
    stage = Stage(out, _stage_name(out))
    committed = []
    try:
        with _write_errors(out, outcome):
            os.mkdir(stage.folder)
            yield stage
            _check_signals()
            names = sorted(n for n in os.listdir(stage.folder) if n != out.name)
            files = [*names, out.name] if (stage.folder / out.name).exists() else names
            mode = 0o666 & ~umask()
            for name in files:
                _fsync_file(stage.folder / name, mode)
            with _locked(out.parent):  # renames and removals of concurrent runs do not interleave
                for name in files:  # the output itself last: it is what makes the new files current
                    os.replace(stage.folder / name, out.parent / name)
                    committed.append(out.parent / name)
                _fsync_dir(out.parent)
                stage.written = [committed[-1], *committed[:-1]] if committed else []
                for old in [*(data_files(out) if stage.onnx_data else []), *stage.orphans]:
                    if old not in committed:
                        with contextlib.suppress(OSError):
                            old.unlink()
    except BaseException:
        if out not in committed:  # new files beside an old output would be orphans: take them back
            for p in committed:
                with contextlib.suppress(OSError):
                    p.unlink()
        raise
    finally:
        shutil.rmtree(stage.folder, ignore_errors=True)
        if not stage.written:
            _remove_created(created)


@contextlib.contextmanager
def staged_folder(output: str | os.PathLike) -> Iterator[Path]:
    """A staging folder for the folder `output`, which replaces it on a clean exit (one atomic
    exchange where renameat2 exists), and is removed on any exception."""
    out = Path(output)
    created = _make_parents(out)
    clean_stale(out)
    stage = _stage_name(out)
    done = False
    try:
        with _write_errors(out):
            os.mkdir(stage)
            yield stage
            os.chmod(stage, 0o777 & ~umask())
            _check_signals()
            for folder, _, files in os.walk(stage):
                for name in files:
                    _fsync_file(Path(folder) / name, None)
            if os.path.lexists(out) and _exchange(stage, out):
                pass  # the old folder is now at `stage`, removed below
            else:
                if os.path.lexists(out):  # no atomic exchange here: move the old folder aside first
                    old = _stage_name(out, "old")
                    os.rename(out, old)
                    os.rename(stage, out)
                    shutil.rmtree(old, ignore_errors=True)
                else:
                    os.rename(stage, out)
            _fsync_dir(out.parent)
            done = True
    finally:
        if os.path.islink(stage):  # the exchange moved a symlink that stood at `out` here
            os.unlink(stage)
        shutil.rmtree(stage, ignore_errors=True)
        if not done:
            _remove_created(created)


@contextlib.contextmanager
def _locked(folder: Path):
    """An exclusive flock on `folder` while the block runs; unlocked where it cannot be taken."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _check_signals() -> None:
    """A Ctrl-C or SIGTERM whose exception a library swallowed still stops the commit."""
    if SIGNALS:
        raise KeyboardInterrupt


def write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` (normally inside a Stage); I/O errors raise OSError for `staged`."""
    with open(path, "wb") as f:
        f.write(data)


def _make_parents(out: Path) -> list[Path]:
    created = [d for d in [out.parent, *out.parent.parents] if not os.path.lexists(d)]
    with _write_errors(out):
        out.parent.mkdir(parents=True, exist_ok=True)
    return created


def _remove_created(created: list[Path]) -> None:
    for d in created:  # innermost first: a failed run takes back the folders it made
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def _write_errors(out: Path, outcome: str = NOTHING_DONE):
    try:
        yield
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise OutputWriteError(f"cannot write {out}: {exc.strerror or exc}; {outcome}") from None


def _fsync_file(path: Path, mode: int | None) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` atomically (Linux renameat2 RENAME_EXCHANGE); False where unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def umask() -> int:
    """The process's file-creation mask (read without changing it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
