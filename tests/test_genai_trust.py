"""onnxruntime-genai folders are data, never code (issue 62, items 1-3): a genai_config.json that would
load a library, write files or hold options not known to be data only is refused in one line (exit 21)
before og.Model sees it, by `generate` and by `rewrite` into another folder; a config that is not a
regular JSON file with `model.decoder` is refused up front (exit 6) and a rewrite commits the model
and the folder's other files together or nothing.

The library is a real one: gcc builds a constructor that creates a marker file when it is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from forked_cli import leftovers, run_cli
from hostile import genai_config, tiny

from attnres_compile.core.errors import InputError, UnsafeConfigError
from attnres_compile.onnx import genai as onnx_genai


def one_line(run, code: int, *texts: str) -> None:
    assert run.code == code, (run.code, run.signal, run.stderr)
    assert len(run.lines) == 1 and run.lines[0].startswith("attnres-compile: error: "), run.stderr
    assert "Traceback" not in run.stderr and all(t in run.lines[0] for t in texts), run.lines


config = genai_config  # what onnxruntime-genai's builder writes (cpu), for the tiny chain model


def genai_folder(folder: Path, content: dict | str | bytes) -> Path:
    """`folder` with the tiny chain as model.onnx, `content` as genai_config.json and a tokenizer file."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(tiny(), str(folder / "model.onnx"))
    raw = content if isinstance(content, bytes) else (content if isinstance(content, str) else json.dumps(content))
    (folder / onnx_genai.CONFIG).write_bytes(raw.encode() if isinstance(raw, str) else raw)
    (folder / "tokenizer.json").write_text('{"model": {}}')
    return folder


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> tuple[Path, Path]:
    """(a shared library whose constructor creates the marker file, the marker's path)."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc builds the payload library")
    folder = tmp_path_factory.mktemp("payload")
    marker = folder / "PAYLOAD-RAN"
    (folder / "p.c").write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) {\n'
                                f'    FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n'
                                "int RegisterCustomOps(void *options, const void *api) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "ops.so"), str(folder / "p.c")], check=True)
    return folder / "ops.so", marker


@pytest.mark.parametrize("command", ["generate", "rewrite"])
def test_a_custom_ops_library_is_refused_before_it_is_loaded(payload, tmp_path, command):
    """Item 1: og.Model dlopens custom_ops_library (the constructor ran, then exit 6 or silence); now the
    config is refused first, exit 21, and the library never loads."""
    library, marker = payload
    folder = genai_folder(tmp_path / "g", config({"custom_ops_library": "ops.so"}))
    shutil.copy(library, folder / "ops.so")
    argv = (["generate", folder, "--prompt-ids", "5,6", "--max-new-tokens", "2"] if command == "generate" else
            ["rewrite", folder / "model.onnx", "-o", tmp_path / "out" / "model.onnx", "--no-verify"])
    run = run_cli(argv, cwd=tmp_path, timeout=120)
    assert not marker.exists(), "the library's constructor ran"
    one_line(run, 21, "custom_ops_library", "ops.so", "refusing to load it")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_enable_profiling_cannot_choose_where_generate_writes(tmp_path):
    """Item 1: session_options.enable_profiling made og write prof_<time>.json where the config said."""
    where = tmp_path / "elsewhere"
    where.mkdir()
    folder = genai_folder(tmp_path / "g", config({"enable_profiling": str(where / "prof")}))
    run = run_cli(["generate", folder, "--prompt-ids", "5,6", "--max-new-tokens", "2"], cwd=tmp_path, timeout=120)
    assert not list(where.iterdir()), "onnxruntime wrote its profile where the config said"
    one_line(run, 21, "enable_profiling", "profiling files")


UNSAFE = {
    "custom ops in the encoder": {"model": {"decoder": {}, "encoder": {"session_options": {"custom_ops_library": "x"}}}},
    "a pipeline model's": {"model": {"decoder": {"pipeline": [{"m": {"session_options": {"custom_ops_library": "x"}}}]}}},
    "an unknown session entry": config({"ep.context_file_path": "/tmp/ctx.onnx"}),
    "a context model": config({"ep.context_enable": "1"}),
    "QNN's backend library": config({"provider_options": [{"qnn": {"backend_path": "libQnnHtp.so"}}]}),
    "OpenVINO's cache folder": config({"provider_options": [{"OpenVINO": {"cache_dir": "/tmp/ov"}}]}),
    "a cuda option not known": config({"provider_options": [{"cuda": {"trt_engine_cache_path": "/tmp"}}]}),
    "run options": config(run_options={"enable_profiling": "/tmp/run"}),
    "a library anywhere": {"model": {"decoder": {}, "plugin": "libevil.so.1"}},
    "a key naming a library": {"model": {"decoder": {}, "ep_library_path": "x"}},
    "an absolute file name": config(filename="/etc/passwd"),
    "a file name out of the folder": config(filename="../other/model.onnx"),
}


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_every_option_not_known_to_be_data_is_refused(name):
    with pytest.raises(UnsafeConfigError, match="refusing to load it"):
        onnx_genai.parse_config(json.dumps(UNSAFE[name]).encode())


def test_a_duplicate_key_cannot_hide_an_option():
    """og applies both copies of a key (its parser calls back per key), json.loads keeps the last: a
    safe second `session_options` would hide a first that loads a library."""
    raw = ('{"model": {"decoder": {"session_options": {"custom_ops_library": "ops.so"}, '
           '"session_options": {"log_id": "x"}}}}')
    with pytest.raises(UnsafeConfigError, match="appears twice"):
        onnx_genai.parse_config(raw.encode())


def test_builder_configs_are_accepted():
    """What onnxruntime-genai's builder writes, for cpu and for cuda (provider options and entries)."""
    assert onnx_genai.parse_config(json.dumps(config()).encode())["model"]["decoder"]["filename"] == "model.onnx"
    cuda = config({"provider_options": [{"cuda": {"enable_cuda_graph": "0"}}], "ep.cuda.fpa_intb_gemm": "1",
                   "optimization.disable_specified_optimizers": "MatMulNBitsFusion", "intra_op_num_threads": 2,
                   "graph_optimization_level": "ORT_ENABLE_ALL"})
    onnx_genai.parse_config(json.dumps(cuda).encode())
    webgpu = config({"provider_options": [{"WebGPUExecutionProvider": {"enableGraphCapture": "1",
                                                                         "validationMode": "basic"}}]})
    onnx_genai.parse_config(json.dumps(webgpu).encode())


MALFORMED = {"not json": "{not json", "an array": "[1, 2]", "model a string": '{"model": "x"}',
             "no decoder": '{"model": {"type": "llama"}}', "nested 100,000 deep": "[" * 100000 + "]" * 100000,
             "NaN": '{"model": {"decoder": {"hidden_size": NaN}}}', "UTF-16": '{"model": {"decoder": {}}}'}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_config_is_refused_before_anything_is_written(tmp_path, name):
    """Item 2: the model and its .data were verified and committed into OUT first, then the config's parse
    failed (exit 1) and both stayed in a folder that is no genai folder. Now: exit 6, OUT untouched."""
    text = MALFORMED[name]
    folder = genai_folder(tmp_path / "g", text.encode("utf-16") if name == "UTF-16" else text)
    out = tmp_path / "out"
    run = run_cli(["rewrite", folder / "model.onnx", "-o", out / "rw.onnx"], cwd=tmp_path, timeout=120)
    one_line(run, 6, "genai_config.json")
    assert not out.exists() and not leftovers(tmp_path)


def test_a_symlinked_config_is_refused_in_one_line(tmp_path):
    """Item 3: a symlinked config was skipped without a word and the note still said OUT is a genai folder."""
    real = tmp_path / "real.json"
    real.write_text(json.dumps(config()))
    folder = genai_folder(tmp_path / "g", "{}")
    (folder / onnx_genai.CONFIG).unlink()
    os.symlink(real, folder / onnx_genai.CONFIG)
    out = tmp_path / "out"
    run = run_cli(["rewrite", folder / "model.onnx", "-o", out / "rw.onnx"], cwd=tmp_path, timeout=120)
    one_line(run, 6, "is a symlink")
    assert not out.exists()
    run = run_cli(["generate", folder, "--prompt-ids", "5,6"], cwd=tmp_path, timeout=120)
    one_line(run, 6, "is a symlink")


def test_a_rewrite_carries_the_folder_in_one_commit(tmp_path):
    """The model, its config (decoder file renamed) and the tokenizer are committed together; a symlinked
    tokenizer file is left out and the note says so."""
    folder = genai_folder(tmp_path / "g", config())
    (tmp_path / "vocab.txt").write_text("a b c")
    os.symlink(tmp_path / "vocab.txt", folder / "vocab.txt")
    out = tmp_path / "out"
    run = run_cli(["rewrite", folder / "model.onnx", "-o", out / "rw.onnx"], cwd=tmp_path, timeout=120)
    assert run.code == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["genai_config.json", "rw.onnx", "tokenizer.json"]
    assert json.loads((out / "genai_config.json").read_text())["model"]["decoder"]["filename"] == "rw.onnx"
    assert "not copied: vocab.txt, symlinks" in run.stdout and "og.Model loads it" in run.stdout


def test_read_config_is_the_one_reader(tmp_path):
    folder = genai_folder(tmp_path / "g", config())
    assert onnx_genai.read_config(folder)["model"]["eos_token_id"] == 2
    os.mkfifo(tmp_path / "fifo")
    (folder / onnx_genai.CONFIG).unlink()
    os.symlink(tmp_path / "fifo", folder / onnx_genai.CONFIG)
    with pytest.raises(InputError, match="symlink"):  # never opened: a FIFO would block
        onnx_genai.read_config(folder)


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "5,2147483648"], "--prompt-ids: token id 2147483648 does not fit onnxruntime-genai's int32"),
    (["--prompt-ids", "5", "--max-new-tokens", "1000000000"], "exceeds the folder's context length of 64"),
])
def test_generate_arguments_a_genai_folder_cannot_take_are_exit_2(tmp_path, argv, message):
    """Issue 62 item 9: prompt ids beyond int32 ended in exit 1 (OverflowError), the bug code."""
    folder = genai_folder(tmp_path / "g", config())
    run = run_cli(["generate", folder, *argv], cwd=tmp_path, timeout=120)
    one_line(run, 2, message)


def test_ids_in_a_genai_config_must_fit_int32(tmp_path):
    """The pad id right-pads the shorter row into og's int32 prompt: 2**40 was an OverflowError, exit 1."""
    data = config()
    data["model"]["pad_token_id"] = 2**40
    folder = genai_folder(tmp_path / "g", data)
    run = run_cli(["generate", folder, "--prompt-ids", "5", "--prompt-ids", "5,6"], cwd=tmp_path, timeout=120)
    one_line(run, 6, "pad_token_id", "int32")


def test_the_note_never_claims_a_folder_that_is_not_whole(tmp_path):
    """A folder of several models (a vision model beside the decoder) rewritten into another folder lacks
    the models that were not rewritten; a config whose decoder is another file runs the original: the
    note says so instead of `og.Model loads it` (issue 62, item 3)."""
    data = config()
    data["model"]["vision"] = {"filename": "vision.onnx"}
    folder = genai_folder(tmp_path / "g", data)
    shutil.copy(folder / "model.onnx", folder / "vision.onnx")
    run = run_cli(["rewrite", folder / "model.onnx", "-o", tmp_path / "out" / "rw.onnx"], cwd=tmp_path, timeout=120)
    assert run.code == 0 and "lacks vision.onnx, which its config names" in run.stdout, run.stderr
    assert "og.Model loads it" not in run.stdout
    run = run_cli(["rewrite", folder / "vision.onnx", "-o", tmp_path / "out2" / "v.onnx"], cwd=tmp_path, timeout=120)
    assert run.code == 0 and "its config's decoder is model.onnx, not v.onnx" in run.stdout, run.stderr
