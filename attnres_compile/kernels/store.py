"""The kernel cache's folders and files, trusted only as far as they are provably this user's own.

A cached kernel is code, so nothing another user could have written is loaded. Folders (below an
existing base: ATTNRES_KERNEL_CACHE's parent, $XDG_CACHE_HOME or $HOME/.cache) are 0700, opened
without following symlinks, used only if owned by this user and not group/other-writable. An entry
is a header (size, SHA-256) plus the library, renamed into place; a read checks the open
descriptor, size and hash, and hands dlopen a private copy (`copy`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from pathlib import Path

MAX_BYTES = 64 << 20  # far above any kernel library (tens of KiB); bounds what a read takes in
STALE_SECONDS = 3600  # a temporary file this old is stale whoever wrote it (a writer needs seconds)
_HEADER = re.compile(rb"attnres-kernel 1 size=(\d+) sha256=([0-9a-f]{64})\n")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class Untrusted(Exception):
    """A cache folder or entry that must not be used; the message says why, in a few words."""


def location() -> tuple[Path, tuple[str, ...]]:
    """(base, parts): the cache folder is base/parts; the base must exist, the parts are created.
    A relative ATTNRES_KERNEL_CACHE is refused (it would follow the working directory)."""
    given = os.environ.get("ATTNRES_KERNEL_CACHE")
    if given:
        path = Path(os.path.normpath(given))
        if not path.is_absolute() or not path.name:
            raise Untrusted(f"ATTNRES_KERNEL_CACHE={given!r} is not an absolute path of a folder")
        return path.parent, (path.name,)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg), ("attnres-compile", "kernels")
    home = Path(os.path.expanduser("~"))
    if (home / ".cache").is_dir():  # the user's own (possibly a symlink to another disk)
        return home / ".cache", ("attnres-compile", "kernels")
    return home, (".cache", "attnres-compile", "kernels")


class Folder:
    """A verified cache folder, held by its descriptor (later renames of its path do not matter)."""

    def __init__(self, path: Path, fd: int, keep: bool = True):
        self.path, self.fd, self.keep = path, fd, keep

    @classmethod
    def open(cls, base: Path, parts: tuple[str, ...]) -> Folder:
        """base/parts, creating the parts 0700; Untrusted if the base is missing or a part is not a
        folder of this user's that no one else may write."""
        try:
            fd = os.open(base, _DIR_FLAGS)
        except OSError as exc:
            raise Untrusted(f"{base} is not an existing folder ({exc.strerror})") from None
        path = base
        try:
            for part in parts:
                path = path / part
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
                try:
                    inner = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    why = {errno.ELOOP: "is a symlink", errno.ENOTDIR: "is not a folder"}.get(exc.errno, exc.strerror)
                    raise Untrusted(f"{path} {why}") from None
                os.close(fd)
                fd = inner
                check_owner(os.fstat(fd), str(path))
        except (Untrusted, OSError) as exc:
            os.close(fd)
            raise Untrusted(str(exc) if isinstance(exc, Untrusted) else f"{path}: {exc.strerror}") from None
        folder = cls(path, fd)
        folder.sweep()
        return folder

    @classmethod
    def private(cls) -> Folder:
        """A fresh temporary folder of this process (mkdtemp: 0700), removed when it exits. It keeps
        no entries (the process holds its kernels in memory), only files while they are loaded."""
        path = Path(tempfile.mkdtemp(prefix="attnres-kernels-"))
        owner = os.getpid()
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
        return cls(path, os.open(path, _DIR_FLAGS), keep=False)

    def read(self, name: str) -> bytes | None:
        """The library of entry `name`, checked; None if there is none; Untrusted if it is not ours or damaged."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise Untrusted("it is a symlink" if exc.errno == errno.ELOOP else exc.strerror) from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise Untrusted("it is not a regular file")
            check_owner(st, "it")
            data = f.read(MAX_BYTES + 1)
        header = _HEADER.match(data)
        if header is None:
            raise Untrusted("it has no valid header")
        library, size = data[header.end():], int(header[1])
        if len(library) != size:
            raise Untrusted(f"it holds {len(library)} bytes of a {size}-byte library (truncated or damaged)")
        if hashlib.sha256(library).hexdigest() != header[2].decode():
            raise Untrusted("its library does not match the SHA-256 recorded when it was built")
        return library

    def write(self, name: str, library: bytes) -> None:
        """Entry `name` := header + library, atomically (temporary file renamed over it); none in a private folder."""
        if not self.keep:
            return
        header = f"attnres-kernel 1 size={len(library)} sha256={hashlib.sha256(library).hexdigest()}\n".encode()
        self._write_new(self.temp_name(".kernel"), header + library, lambda tmp: os.replace(
            tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd))

    def copy(self, library: bytes) -> str:
        """A new private file holding `library`, as a path through this folder's descriptor (for
        dlopen); the caller removes it (`remove`) once loaded."""
        name = self.temp_name(".so")
        self._write_new(name, library, lambda tmp: None)
        return f"/proc/self/fd/{self.fd}/{name}"

    def temp_name(self, suffix: str) -> str:
        """A fresh temporary name: `.tmp-<pid>-<random><suffix>` (the pid lets `sweep` find dead writers)."""
        return f".tmp-{os.getpid()}-{secrets.token_hex(6)}{suffix}"

    def remove(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.basename(name), dir_fd=self.fd)

    def read_temp(self, name: str) -> bytes:
        """The bytes of this process's temporary file `name` (a library export_library wrote)."""
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        with os.fdopen(fd, "rb") as f:
            check_owner(os.fstat(f.fileno()), name)
            return f.read(MAX_BYTES + 1)

    def sweep(self) -> None:
        """Remove temporary files whose writer is no longer running, or older than STALE_SECONDS."""
        with contextlib.suppress(OSError):
            for name in os.listdir(self.fd):
                if name.startswith(".tmp-") and _stale(name, self.fd):
                    self.remove(name)

    def _write_new(self, tmp: str, data: bytes, commit) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            commit(tmp)
        except BaseException:
            self.remove(tmp)
            raise


def check_owner(st: os.stat_result, what: str) -> None:
    """Untrusted unless `st` belongs to this user and no group or other user may write it."""
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise Untrusted(f"{what} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _stale(name: str, folder: int) -> bool:
    try:
        age = time.time() - os.stat(name, dir_fd=folder, follow_symlinks=False).st_mtime
    except OSError:
        return False
    pid = re.match(r"\.tmp-(\d+)-", name)
    return age > STALE_SECONDS or (pid is not None and not _running(int(pid[1])))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: running
        pass
    return True
