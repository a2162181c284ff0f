"""Artifact folders that are malformed, damaged or point elsewhere (issue 39 items 6, 9, 10): one
ArtifactError line and exit 14, never a traceback (malformed manifests were exit 1), never a crash
(a truncated model.so killed `run` with a signal), never a library loaded from outside the folder
(`library` as an absolute path, `..`, or a symlink, each ran the planted library's constructor)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from forked_cli import run_cli  # noqa: E402
from hostile import payload_library, rewritten, tiny  # noqa: E402

from attnres_compile.backends.tvm import compile_model, load  # noqa: E402
from attnres_compile.backends.tvm.runtime import MANIFEST  # noqa: E402
from attnres_compile.core.errors import ArtifactError  # noqa: E402


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    """A compiled two-site chain (x [b, 16] -> y)."""
    folder = tmp_path_factory.mktemp("artifact")
    onnx.save(rewritten(tiny()), str(folder / "m.onnx"))
    compile_model(folder / "m.onnx", folder / "art", verify_outputs=False)
    return folder / "art"


def copy_with(artifact: Path, tmp_path: Path, edit=None, text: str | None = None) -> Path:
    """A copy of the artifact whose manifest is edited in place by `edit`, or replaced by `text`."""
    folder = tmp_path / "art"
    shutil.copytree(artifact, folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    if edit is not None:
        manifest = edit(manifest) or manifest
    (folder / MANIFEST).write_text(text if text is not None else json.dumps(manifest))
    return folder


def cli_run(folder: Path, tmp_path: Path):
    np.savez(tmp_path / "in.npz", x=np.ones((2, 16), np.float32))
    return run_cli(["run", folder, "--inputs", tmp_path / "in.npz", "-o", tmp_path / "out.npz"], cwd=tmp_path)


def test_the_manifest_records_the_library(artifact):
    manifest = load(artifact).manifest
    assert manifest["library_size"] == (artifact / "model.so").stat().st_size and len(manifest["library_sha256"]) == 64
    assert load(artifact)({"x": np.ones((2, 16), np.float32)})["y"].shape == (2, 16)


EDITS = {
    "not-an-object": lambda m: [m],
    "versions-list": lambda m: m.update(versions=[]),
    "no-library": lambda m: m.pop("library"),
    "library-number": lambda m: m.update(library=5),
    "no-device": lambda m: m.pop("device"),
    "inputs-string": lambda m: m.update(inputs="x"),
    "input-without-name": lambda m: m["inputs"][0].pop("name"),
    "shape-string": lambda m: m["inputs"][0].update(shape="b,16"),
    "dtype-unknown": lambda m: m["inputs"][0].update(dtype="float99"),
    "fatbin-elsewhere": lambda m: m.update(cuda=[{"source": "d.cu", "fatbin": "../d.fatbin", "sha256": "0"}]),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_malformed_manifests_are_artifact_errors(artifact, tmp_path, name):
    with pytest.raises(ArtifactError, match="malformed manifest"):
        load(copy_with(artifact, tmp_path, EDITS[name]))


def test_deeply_nested_and_malformed_manifests_are_exit_14(artifact, tmp_path):
    for i, text in enumerate(["[" * 100_000 + "]" * 100_000, json.dumps({**json.loads(
            (artifact / MANIFEST).read_text()), "inputs": "x"})]):
        run = cli_run(copy_with(artifact, tmp_path / str(i), text=text), tmp_path / str(i))
        assert run.code == 14 and len(run.lines) == 1 and run.lines[0].startswith("attnres-compile: error: "), run


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_the_library_must_be_a_file_of_the_folder(artifact, tmp_path, how):
    """`library` naming a file elsewhere (or a symlink to one) is refused before anything is loaded."""
    marker = tmp_path / "PAYLOAD-RAN"
    library = payload_library(str(marker))
    if library is None:
        pytest.skip("no C compiler")
    (tmp_path / "payload.so").write_bytes(library)
    if how == "symlink":
        folder = copy_with(artifact, tmp_path)
        (folder / "model.so").unlink()
        (folder / "model.so").symlink_to(tmp_path / "payload.so")
    else:
        name = str(tmp_path / "payload.so") if how == "absolute" else "../payload.so"
        folder = copy_with(artifact, tmp_path, lambda m: m.update(library=name))
    with pytest.raises(ArtifactError, match="inside the artifact folder" if how != "symlink" else "is a symlink"):
        load(folder)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_damaged_library_is_one_line_not_a_crash(artifact, tmp_path, damage):
    folder = copy_with(artifact, tmp_path)
    data = bytearray((folder / "model.so").read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0xFF
    (folder / "model.so").write_bytes(bytes(data))
    run = cli_run(folder, tmp_path)
    assert run.signal is None and run.code == 14, (run.code, run.signal, run.stderr)
    assert len(run.lines) == 1 and "recompile it" in run.lines[0], run.lines


def test_an_older_format_says_recompile(artifact, tmp_path):
    folder = copy_with(artifact, tmp_path, lambda m: m.update(format_version=1))
    with pytest.raises(ArtifactError, match=r"older attnres-compile \(format 1\): recompile it"):
        load(folder)
