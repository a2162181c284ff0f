"""The kernel cache never loads what another user (or a damaged disk) could have put there (issue 39).

A planted library whose constructor writes a marker file stands for hostile code: at the kernel's
predictable name, behind a symlink, with a forged header, owned by another user, writable by others,
or in a shared folder, it must never run, and the op must still compute the right result.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from hostile import payload_library  # noqa: E402

from attnres_compile.ops import depth_attention as op_module  # noqa: E402
from attnres_compile.kernels import cache as kernel_cache  # noqa: E402

SPEC = kernel_cache.Spec("forward", 2, 2, 8, "float32", 1e-6, 2.0, "cpu", 1)
NOBODY = 65534


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty kernel cache at tmp/kc and a fresh process state (no kernel in memory, no folder opened)."""
    monkeypatch.setenv("ATTNRES_KERNEL_CACHE", str(tmp_path / "kc"))
    monkeypatch.setattr(kernel_cache, "_MEMORY", {})
    monkeypatch.setattr(kernel_cache, "_FOLDERS", {}, raising=False)
    monkeypatch.setattr(kernel_cache, "_WARNED", set(), raising=False)
    return tmp_path / "kc"


@pytest.fixture(scope="module")
def payload(tmp_path_factory):
    """(library bytes, marker path): a shared library whose constructor creates the marker."""
    marker = tmp_path_factory.mktemp("payload") / "PAYLOAD-RAN"
    library = payload_library(str(marker))
    if library is None:
        pytest.skip("no C compiler")
    return library, marker


def entry(library: bytes, digest: bytes | None = None) -> bytes:
    """`library` in the form the cache reads at a kernel's name: a header with its size and SHA-256
    (`digest` forges it) before the library; a plain library where the name is a `.so`."""
    if not str(kernel_cache.path(SPEC)).endswith(".kernel"):
        return library
    digest = digest or hashlib.sha256(library).hexdigest().encode()
    return b"attnres-kernel 1 size=%d sha256=%s\n" % (len(library), digest) + library


def computes_right() -> None:
    sources, w = [torch.randn(3, 8), torch.randn(3, 8)], torch.randn(8)
    out = torch.empty(3, 8)
    kernel_cache.get(SPEC)(*sources, w, out)
    torch.testing.assert_close(out, op_module.forward_reference(sources, w, 1e-6, 2.0, -1), atol=1e-5, rtol=1e-5)


def plant(path, data: bytes, mode: int = 0o600, owner: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner, -1)


@pytest.mark.parametrize("how", ["raw", "forged-hash", "symlink", "world-writable", "foreign-owner"])
def test_a_planted_kernel_never_runs(cache, payload, capsys, how):
    """A library planted at the kernel's predictable name is refused before dlopen (one warning
    line), the kernel is rebuilt, and the op computes the reference's result."""
    library, marker = payload
    marker.unlink(missing_ok=True)
    if how == "foreign-owner" and os.geteuid() != 0:
        pytest.skip("needs root to give a file to another user")
    file = kernel_cache.path(SPEC)
    if how == "raw":
        plant(file, library)
    elif how == "forged-hash":
        plant(file, entry(library, b"0" * 64))
    elif how == "symlink":
        plant(cache / "elsewhere.so", entry(library))
        file.parent.mkdir(parents=True, exist_ok=True)
        file.symlink_to(cache / "elsewhere.so")
    else:  # a valid entry, but one that someone else could have written
        plant(file, entry(library), 0o666 if how == "world-writable" else 0o600,
              NOBODY if how == "foreign-owner" else None)
    computes_right()
    assert not marker.exists()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "not loading the cached kernel" in line]
    assert len(warnings) == 1 and str(file) in warnings[0], warnings
    assert not file.is_symlink() and file.stat().st_uid == os.geteuid()  # replaced by the rebuilt kernel


@pytest.mark.parametrize("how", ["world-writable", "foreign-owner", "symlink"])
def test_a_shared_or_foreign_cache_folder_is_not_used(cache, payload, capsys, tmp_path, how):
    """A cache folder someone else could write (a 1777 folder, another user's, a symlink) is not
    read or written: one warning line, kernels built in a private folder, nothing planted runs."""
    library, marker = payload
    marker.unlink(missing_ok=True)
    if how == "foreign-owner" and os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    file = kernel_cache.path(SPEC)
    plant(file, entry(library))
    if how == "symlink":
        cache.rename(tmp_path / "real")
        cache.symlink_to(tmp_path / "real")
    elif how == "world-writable":
        cache.chmod(0o1777)
    else:
        os.chown(cache, NOBODY, -1)
    before = sorted(p.name for p in cache.rglob("*"))
    computes_right()
    assert not marker.exists() and sorted(p.name for p in cache.rglob("*")) == before
    err = capsys.readouterr().err
    assert err.count("not using the kernel cache") == 1 and "private temporary folder" in err, err


def test_new_cache_folders_are_private(cache):
    computes_right()
    folder = kernel_cache.path(SPEC).parent
    for path in (cache, folder.parent, folder):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE(kernel_cache.path(SPEC).stat().st_mode) & 0o077 == 0


def test_a_truncated_kernel_is_rebuilt_not_a_crash(cache):
    """A cached kernel cut short (a full disk, an interrupted copy) killed every process that loaded
    it with SIGBUS. Now it is refused before loading and rebuilt. The load is tried in a forked
    child, so that a crash fails only this test; the child stops where it would build (a build in
    a forked child can deadlock on the parent's threads), and the parent then rebuilds."""
    computes_right()
    file = kernel_cache.path(SPEC)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    kernel_cache._MEMORY.clear()
    pid = os.fork()
    if pid == 0:
        try:
            from attnres_compile.kernels import schedule

            schedule.build = lambda *a: os._exit(3)
            computes_right()
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3, (
        f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else status)
    computes_right()
    assert file.stat().st_size >= len(data)


@pytest.mark.parametrize("where", ["relative", "missing-home"])
def test_no_folder_is_created_outside_an_existing_base(tmp_path, monkeypatch, capsys, where):
    """A relative ATTNRES_KERNEL_CACHE (it would follow the working directory) and a HOME that does
    not exist are refused with one warning line; nothing is created; the op still runs."""
    monkeypatch.setattr(kernel_cache, "_MEMORY", {})
    monkeypatch.setattr(kernel_cache, "_FOLDERS", {}, raising=False)
    monkeypatch.setattr(kernel_cache, "_WARNED", set(), raising=False)
    monkeypatch.chdir(tmp_path)
    if where == "relative":
        monkeypatch.setenv("ATTNRES_KERNEL_CACHE", "rel/kernels")
    else:
        monkeypatch.delenv("ATTNRES_KERNEL_CACHE", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "missing" / "home"))
    computes_right()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err.count("not using the kernel cache") == 1


def test_stale_temporary_files_of_dead_writers_are_removed(cache):
    """`kill -9` during a save left `.tmp-*` files that no run removed: a dead writer's (its pid in
    the name) and any older than an hour go; a running writer's stays."""
    folder = kernel_cache.path(SPEC).parent
    folder.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = {"dead": f".tmp-{dead.pid}-0a1b2c.kernel", "old": ".tmp-x8k2p1.so", "live": f".tmp-{os.getpid()}-3d4e5f.so"}
    for name in names.values():
        (folder / name).write_bytes(b"partial")
    hour_ago = time.time() - 2 * 3600
    os.utime(folder / names["old"], (hour_ago, hour_ago))
    computes_right()
    assert sorted(p.name for p in folder.glob(".tmp-*")) == [names["live"]]
