"""The CLI's safety behaviours, each through a forked `main` (forked_cli.py), each one that failed
before issue 14: outputs checked before any work and committed whole (under kill -9 and a full
disk too), Ctrl-C and SIGTERM, crashes, hangs and memory blow-ups of onnxruntime in its child
process, native log lines, wrong file types, bad factories, the CLI's own wording, help texts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).parent))

from forked_cli import leftovers, run_cli  # noqa: E402
from hostile import _endless_loop, _nested_if, external, tiny  # noqa: E402

from attnres_compile.onnx import io as onnx_io  # noqa: E402


def one_line(run, code: int, *texts: str) -> None:
    assert run.code == code, (run.code, run.signal, run.stderr)
    assert len(run.lines) == 1 and run.lines[0].startswith("attnres-compile: error: "), run.stderr
    assert "Traceback" not in run.stderr and all(t in run.lines[0] for t in texts), run.lines


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*")) if not p.is_symlink()}


def model_folder(folder: Path, dim: int = 64, links: int = 2) -> Path:
    """m.onnx with its weights in m.onnx.data, alone in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    model, data = external(tiny(dim=dim, links=links))
    (folder / "m.onnx").write_bytes(model)
    (folder / "m.onnx.data").write_bytes(data)
    return folder / "m.onnx"


def test_every_option_has_help():
    from attnres_compile.cli.parser import build as _parser

    missing, stack = [], [("attnres-compile", _parser())]
    while stack:
        name, parser = stack.pop()
        for action in parser._actions:
            if action.help is None and action.dest not in ("help", "command", "benchmark"):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
            if isinstance(action, argparse._SubParsersAction):
                stack += [(f"{name} {sub_name}", sub) for sub_name, sub in action.choices.items()]
    assert not missing, missing


def test_outputs_are_checked_before_any_work(tmp_path):
    """--report onto the input or its data (even with --force), onto -o; an existing report, OUT.data
    or dangling symlink at OUT without --force; folders; a parent that is a file: each refused in one
    line before anything is written, every file left as it was."""
    cases = [  # (extra files, extra args, code, text)
        ({}, ["--report", "{d}/m.onnx", "--force"], 11, "would replace the input"),
        ({}, ["--report", "{d}/m.onnx.data", "--force"], 11, "would replace the input"),
        ({}, ["--report", "{d}/out.onnx"], 2, "name the same file"),
        ({}, ["--report", "{d}/out.onnx.data"], 2, "name the same file"),
        ({"r.json": b"precious"}, ["--report", "{d}/r.json"], 6, "--report"),
        ({"out.onnx.data": b"precious"}, [], 6, "out.onnx.data exists"),
        ({"out.onnx": ("symlink", "gone/nowhere")}, [], 6, "dangling symlink"),
        ({"r.json/keep": b"x"}, ["--report", "{d}/r.json", "--force"], 2, "is a folder"),
        ({"f": b"x"}, ["--report", "{d}/f/r.json"], 2, "is not a folder"),
    ]
    for i, (files, extra, code, text) in enumerate(cases):
        folder = tmp_path / f"c{i}"
        model_folder(folder)
        for rel, content in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, tuple):
                os.symlink(content[1], folder / rel)
            else:
                (folder / rel).write_bytes(content)
        before = digests(folder)
        run = run_cli(["rewrite", folder / "m.onnx", "-o", folder / "out.onnx", *[a.replace("{d}", str(folder)) for a in extra]])
        one_line(run, code, text)
        assert digests(folder) == before, (extra, code)
        assert not (folder / "out.onnx").is_file(), extra


def test_model_and_weights_commit_as_a_pair(tmp_path):
    """Replacing an output with external weights: killed right after the new weights were renamed
    into place, the old graph still has its old weights (the new ones have their own name); the
    next run removes the killed run's staging folder and orphaned weights, and the old weights
    once the new graph is in place."""
    model = model_folder(tmp_path)
    out = tmp_path / "out.onnx"
    assert run_cli(["rewrite", model, "-o", out, "--no-verify"]).code == 0
    first = digests(tmp_path)
    assert {"out.onnx", "out.onnx.data"} <= set(first)

    def kill_after_first_rename():
        real = os.replace

        def replace(src, dst, **kw):
            real(src, dst, **kw)
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace

    killed = run_cli(["rewrite", model, "-o", out, "--no-verify", "--force", "--scale", "paper"], setup=kill_after_first_rename)
    assert killed.signal == signal.SIGKILL
    after = digests(tmp_path)
    assert {k: after[k] for k in first} == first  # the old pair, untouched
    assert onnx_io.load(out, with_data=True)
    assert leftovers(tmp_path) and any(k.startswith("out.onnx.") and k.endswith(".data") and k not in first for k in after)

    replaced = run_cli(["rewrite", model, "-o", out, "--no-verify", "--force", "--scale", "paper"])
    assert replaced.code == 0, replaced.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    data = [n for n in names if n.startswith("out.onnx.") and n.endswith(".data")]
    assert len(data) == 1 and data[0] != "out.onnx.data" and not leftovers(tmp_path), names
    loaded = onnx.load(str(out), load_external_data=False)
    assert {e.value for t in loaded.graph.initializer for e in t.external_data if e.key == "location"} == set(data)
    assert onnx_io.load(out, with_data=True)


def test_kill_9_during_large_writes_leaves_the_old_or_the_new_output(tmp_path):
    """kill -9 at spread-out moments of a rewrite that replaces an output of 24 MiB: the destination
    always loads with all its weights, equal to the input's; the next run cleans up."""
    model = model_folder(tmp_path, dim=1024, links=6)
    out = tmp_path / "out.onnx"
    argv = ["rewrite", model, "-o", out, "--no-verify", "--force"]
    first = run_cli(argv)
    assert first.code == 0, first.stderr
    weights = {t.name: numpy_helper.to_array(t) for t in onnx_io.load(model, with_data=True).graph.initializer}
    for fraction in (0.2, 0.4, 0.55, 0.7, 0.85, 0.95):
        run = run_cli(argv, send=(signal.SIGKILL, first.seconds * fraction))
        assert run.signal == signal.SIGKILL or run.code == 0, run.stderr
        loaded = onnx_io.load(out, with_data=True)
        got = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer if t.name in weights}
        assert got.keys() == weights.keys() and all(np.array_equal(got[k], weights[k]) for k in weights)
    assert run_cli(argv).code == 0
    assert not leftovers(tmp_path)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("out.onnx.") and p.name.endswith(".data")]) == 1


def test_ctrl_c_and_sigterm_exit_in_one_line_and_leave_nothing(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(_endless_loop().SerializeToString())
    for sig, code, text in ((signal.SIGINT, 130, "interrupted (Ctrl-C)"), (signal.SIGTERM, 143, "terminated (SIGTERM)")):
        run = run_cli(["rewrite", model, "-o", tmp_path / "out.onnx", "--verify-timeout", "60"], send=(sig, 2.0))
        one_line(run, code, text)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_a_signal_while_the_handlers_are_restored_is_one_line(monkeypatch, capsys):
    """The long fuzz run's one failure: SIGTERM after the command finished, while `main` put the
    previous handlers back, escaped as a traceback. Now it is recorded and reported."""
    from attnres_compile.cli import program as cli

    real, calls = signal.signal, []

    def signal_during_restore(sig, handler):
        calls.append(sig)
        if len(calls) == 3:  # two installs, then the first restore
            os.kill(os.getpid(), signal.SIGTERM)
        return real(sig, handler)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(cli.signal, "signal", signal_during_restore)
    monkeypatch.setattr(cli, "_main", lambda argv, received, debug: 0)
    assert cli.main(["inspect", "m.onnx"]) == 143
    assert capsys.readouterr().err == "attnres-compile: error: terminated (SIGTERM); no partial output was left\n"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_caller_that_blocked_signals_gets_its_mask_back(monkeypatch):
    """`main` unblocks SIGINT/SIGTERM for the command and puts the caller's mask back before its
    handlers: a SIGTERM after the command waits for a caller that had blocked it (CI's fixed-seed
    fuzz sample: a forked run signalled just after the handlers were restored died of it, with its
    output complete, before the harness blocked signals again)."""
    from attnres_compile.cli import program as cli

    real, calls = signal.signal, []

    def signal_after_restore(sig, handler):
        previous = real(sig, handler)
        calls.append(sig)
        if len(calls) == 4:  # two installs, two restores: the command is over (to this thread: the
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # process's others may not block it)
        return previous

    seen = []  # the caller's own handler: had the signal been delivered, it would be here
    handler = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    monkeypatch.setattr(cli.signal, "signal", signal_after_restore)
    monkeypatch.setattr(cli, "_main", lambda argv, received, debug: 0)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        assert cli.main(["inspect", "m.onnx"]) == 0
        assert not seen and signal.SIGTERM in signal.sigpending()
        assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, set())
    finally:
        signal.sigtimedwait({signal.SIGTERM}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        real(signal.SIGTERM, handler)


def _layernorm_empty_bias() -> onnx.ModelProto:
    m = tiny()
    m.graph.initializer.append(numpy_helper.from_array(np.ones(16, np.float32), "s"))
    m.graph.node.insert(2, helper.make_node("LayerNormalization", ["h1", "s", ""], ["n1"]))
    m.graph.node[3].input[0] = "n1"
    return m


def _constant_bomb() -> onnx.ModelProto:
    m = tiny()
    m.graph.initializer.append(numpy_helper.from_array(np.array([1 << 15, 1 << 15], np.int64), "big"))
    m.graph.node[-1].output[0] = "h2"
    m.graph.node.extend([helper.make_node("ConstantOfShape", ["big"], ["zeros"]),
                         helper.make_node("ReduceSum", ["zeros"], ["total"], keepdims=0),
                         helper.make_node("Add", ["h2", "total"], ["y"])])
    return m


def test_onnxruntime_crash_hang_and_memory_blow_up_are_one_line(tmp_path):
    """In the verification child: SIGSEGV (16), an endless Loop (17), a 4 GiB ConstantOfShape under a
    1 GiB limit (18); onnxruntime's own [E:onnxruntime] lines only with --debug."""
    cases = [(_layernorm_empty_bias(), [], {}, 16, "onnxruntime crashed (SIGSEGV) while verifying; the rewritten "
                                                   "model was not written. Re-run with --no-verify"),
             (_endless_loop(), ["--verify-timeout", "2"], {}, 17, "did not finish within 2 s"),
             (_constant_bomb(), [], {"ATTNRES_COMPILE_MEMORY_LIMIT": "1G"}, 18, "ran out of memory")]
    for i, (model, extra, env, code, text) in enumerate(cases):
        path = tmp_path / f"m{i}.onnx"
        onnx.save(model, str(path))
        run = run_cli(["rewrite", path, "-o", tmp_path / f"o{i}.onnx", *extra], env=env)
        one_line(run, code, text)
        assert not leftovers(tmp_path) and not (tmp_path / f"o{i}.onnx").exists()
    noisy = run_cli(["--debug", "rewrite", tmp_path / "m2.onnx", "-o", tmp_path / "o2.onnx"],
                    env={"ATTNRES_COMPILE_MEMORY_LIMIT": "1G"})
    assert noisy.code == 18 and "[E:onnxruntime" in noisy.stderr and "Traceback" in noisy.stderr
    assert run_cli(["rewrite", tmp_path / "m0.onnx", "-o", tmp_path / "o0.onnx", "--no-verify"]).code == 0


def test_full_disk_is_one_line_and_replaces_nothing(tmp_path):
    """Writes that fail (here: RLIMIT_FSIZE, as a full disk fails them) exit 19 in one line, for the
    .pt2 path (it used to end in C++ `terminate` and SIGABRT) and the ONNX path."""
    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))

    model = model_folder(tmp_path / "in", dim=256)
    for argv in (["rewrite", "samples.models:gpt_factory", "-o", tmp_path / "out" / "g.pt2", "--no-verify"],
                 ["rewrite", model, "-o", tmp_path / "out" / "m.onnx", "--no-verify"]):
        run = run_cli(argv, cwd=Path(__file__).parents[1], setup=small_disk)
        one_line(run, 19, "cannot write", "File too large")
        assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_wrong_file_types_say_what_they_are(tmp_path):
    onnx_file = tmp_path / "x.onnx"
    onnx.save(tiny(), str(onnx_file))
    pt2_file = tmp_path / "x.pt2"
    import zipfile

    with zipfile.ZipFile(pt2_file, "w") as z:
        z.writestr("x/archive_format", "pt2")
        z.writestr("x/models/model.json", "{}")
    one_line(run_cli(["inspect", "--weights", onnx_file]), 6, "is an ONNX model, not a .pt2 archive")
    (tmp_path / "y.pt2").write_bytes(onnx_file.read_bytes())
    one_line(run_cli(["compile", tmp_path / "y.pt2", "-o", tmp_path / "a"]), 6, "is an ONNX model, not a .pt2 archive")
    one_line(run_cli(["run", tmp_path / "art", "--inputs", pt2_file, "-o", tmp_path / "o.npz"]), 6,
             "is a .pt2 archive (torch.export program), not an .npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.onnx", "x.pt2", "y.pt2"]


def test_bad_factories_are_bad_input(tmp_path):
    """Relative or malformed specs, a SyntaxError, sys.exit(0) (it used to exit 0 silently), an
    exception, a model that cannot be deep-copied: exit 6 in one line."""
    (tmp_path / "syntax_mod.py").write_text("def f(:\n")
    (tmp_path / "exit_mod.py").write_text("import sys\ndef f():\n    sys.exit(0)\n")
    (tmp_path / "lock_mod.py").write_text(
        "import threading, torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.lock = threading.Lock()\n        self.l = torch.nn.Linear(4, 4)\n    def forward(self, x):\n"
        "        return x + self.l(x)\ndef f():\n    return M(), (torch.ones(2, 4),)\n")
    for spec, text in (("../../x:f", "package.module:factory"), (".x:f", "package.module:factory"),
                       ("syntax_mod:f", "SyntaxError"), ("exit_mod:f", "sys.exit(0)"), ("lock_mod:f", "cannot be copied")):
        one_line(run_cli(["inspect", spec], cwd=tmp_path), 6, text)
    one_line(run_cli(["rewrite", "exit_mod:f", "-o", tmp_path / "o.pt2"], cwd=tmp_path), 6, "sys.exit(0)")
    assert not (tmp_path / "o.pt2").exists()


def test_onnx_inputs_we_cannot_feed_and_opsets_we_cannot_write(tmp_path):
    """A sequence-typed input: inspect works, verification cannot build it (15, --no-verify works); two
    default-domain opset imports: refused on reading (9), never written out."""
    m = tiny()
    m.graph.input.append(helper.make_value_info("aux", helper.make_sequence_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, ["b", 16]))))
    onnx.save(m, str(tmp_path / "seq.onnx"))
    assert run_cli(["inspect", tmp_path / "seq.onnx"]).code == 0
    one_line(run_cli(["rewrite", tmp_path / "seq.onnx", "-o", tmp_path / "o.onnx"]), 15, "seq(tensor(float))",
             "--no-verify")
    m = tiny()
    m.opset_import.append(helper.make_opsetid("", 18))
    onnx.save(m, str(tmp_path / "two.onnx"))
    for argv in (["inspect", tmp_path / "two.onnx"], ["rewrite", tmp_path / "two.onnx", "-o", tmp_path / "o.onnx", "--no-verify"]):
        one_line(run_cli(argv), 9, "imports the default ONNX domain 2 times")
    assert not (tmp_path / "o.onnx").exists()


def test_cli_wording_and_input_shape_hint(tmp_path):
    """Messages use the CLI's spelling; onnxruntime refusing the default dims names the shapes tried
    and --input-shape (never an untried shape: x:1x16 fails here too)."""
    m = tiny()
    m.graph.initializer.append(numpy_helper.from_array(np.array([-1, 3], np.int64), "three"))
    m.graph.node.insert(0, helper.make_node("Reshape", ["x", "three"], ["x3"]))  # needs b*16 divisible by 3
    onnx.save(m, str(tmp_path / "m.onnx"))
    run = run_cli(["rewrite", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx"])
    one_line(run, 15, "--no-verify", "at the shapes tried: x 2x16;", "give the inputs' shapes with --input-shape")
    assert "verify_outputs" not in run.stderr and "input_shapes" not in run.stderr
    one_line(run_cli(["rewrite", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--min-chain", "9"]), 4,
             "(--min-chain 9)")
    one_line(run_cli(["rewrite", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--blocks", "0"]), 2,
             "--blocks must be a positive integer")
    one_line(run_cli(["rewrite", tmp_path / "m.onnx"]), 2, "-o/--output")  # argparse, in one line


def test_nested_subgraphs_are_bounded(tmp_path):
    """inspect is linear in If nesting depth (16 levels took minutes, exponential in onnxruntime's
    symbolic shape inference), and more than 16 levels are refused in one line."""
    (tmp_path / "deep.onnx").write_bytes(_nested_if(16).SerializeToString())
    run = run_cli(["inspect", tmp_path / "deep.onnx", "--json"], timeout=120)
    assert run.code == 0 and not run.timed_out, run.stderr
    assert json.loads(run.stdout)["source"] == "onnx"
    for depth, text in ((24, "nested 24 deep"), (40, "more than 32 deep")):
        (tmp_path / "deeper.onnx").write_bytes(_nested_if(depth).SerializeToString())
        one_line(run_cli(["inspect", tmp_path / "deeper.onnx"]), 9, text)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_get_the_permissions_of_a_normal_file(tmp_path, umask):
    model = model_folder(tmp_path)
    run = run_cli(["rewrite", model, "-o", tmp_path / "out.onnx", "--no-verify", "--report", tmp_path / "r.json"],
                  setup=lambda: os.umask(umask))
    assert run.code == 0, run.stderr
    for name in ("out.onnx", "out.onnx.data", "r.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_native_log_lines_are_hidden_but_progress_is_not(capfd):
    """Native libraries (TVM's "BlockBuilder destroyed...", onnxruntime's [E:onnxruntime] lines) write to
    file descriptor 2, past Python's sys.stderr: _quiet redirects the descriptor; progress written to
    sys.__stderr__ (compile's tuning lines) stays visible."""
    from attnres_compile.cli.program import _quiet

    with _quiet():
        os.write(2, b"[E:onnxruntime:, sequential_executor.cc:572] native noise\n")
        print("python warning noise", file=sys.stderr)
        sys.__stderr__.write("progress line\n")
        sys.__stderr__.flush()
    err = capfd.readouterr().err
    assert "native noise" not in err and "python warning noise" not in err and "progress line" in err
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


# ---------------------------------------------------------------------------------------------
# issue 39: --force never over inputs or special files; names, reports, races, bombs


def rewritten_model(folder: Path) -> Path:
    """m.onnx, the tiny chain rewritten (something `compile` builds in a second), alone in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(tiny(), str(folder / "t.onnx"))
    assert run_cli(["rewrite", folder / "t.onnx", "-o", folder / "m.onnx", "--no-verify"]).code == 0
    (folder / "t.onnx").unlink()
    return folder / "m.onnx"


def char_device(path: Path) -> bool:
    """A copy of /dev/null's node at `path` (root only; False where mknod is not allowed)."""
    import stat

    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError):
        return False
    return True


def no_writes_under_dev():
    """In a forked run: any rename onto /dev fails (EPERM) instead of replacing a system node."""
    real = os.replace

    def replace(src, dst, **kw):
        if str(dst).startswith("/dev/"):
            raise PermissionError(1, "refused by the test", str(dst))
        return real(src, dst, **kw)
    os.replace = os.rename = replace


def test_compile_force_never_deletes_a_folder_holding_an_input(tmp_path):
    """`compile IN -o DIR --force` deleted DIR with the input and every other file in it (issue 39 §1).
    Now a folder holding the input (its own folder, a parent) is refused (11), a folder that is not an
    artifact (no manifest.json) is refused even with --force (2); an artifact folder is still replaced."""
    model = rewritten_model(tmp_path / "in")
    (tmp_path / "in" / "notes.txt").write_text("mine")
    before = digests(tmp_path)
    for out, code, text in ((tmp_path / "in", 11, "holds the input"), (tmp_path, 11, "holds the input")):
        one_line(run_cli(["compile", model, "-o", out, "--force", "--no-verify"]), code, text, "choose another folder")
        assert digests(tmp_path) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("years of work")
    one_line(run_cli(["compile", model, "-o", other, "--force", "--no-verify"]), 2, "not an artifact folder")
    assert (other / "thesis.tex").read_text() == "years of work"
    assert run_cli(["compile", model, "-o", tmp_path / "art", "--no-verify"]).code == 0
    again = run_cli(["compile", model, "-o", tmp_path / "art", "--force", "--no-verify"])
    assert again.code == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "art").iterdir()) == ["manifest.json", "model.so"]
    assert not leftovers(tmp_path)


def test_compile_into_the_working_folder_is_one_line(tmp_path):
    """`compile -o . --force` failed with rc 1 blaming TVM (EBUSY renaming the working folder)."""
    model = rewritten_model(tmp_path / "in")
    for cwd in (tmp_path / "cwd", tmp_path / "cwd" / "deeper"):
        cwd.mkdir()
        one_line(run_cli(["compile", model, "-o", ".", "--force", "--no-verify"], cwd=cwd), 2, "is the working folder")
    one_line(run_cli(["compile", model, "-o", tmp_path / "cwd", "--force", "--no-verify"],
                     cwd=tmp_path / "cwd" / "deeper"), 2, "is the working folder or holds it")
    assert sorted(p.name for p in (tmp_path / "cwd").rglob("*")) == ["deeper"]


def test_force_never_replaces_or_removes_another_inputs_weights(tmp_path):
    """`rewrite a.onnx -o w.onnx --force`, a.onnx's weights in w.onnx.data (or w.onnx.<hex>.data, which the
    run would remove as an older output's), deleted them (issue 39 §2). Refused (11), files untouched;
    the in-place rewrite (-o is the input) still replaces its own weights."""
    for location, text in (("w.onnx.data", "would replace"), ("w.onnx.0123abcd.data", "would remove")):
        folder = tmp_path / location
        folder.mkdir()
        model, data = external(tiny(dim=64), location)
        (folder / "a.onnx").write_bytes(model)
        (folder / location).write_bytes(data)
        (folder / "w.onnx").write_bytes(b"an older output")
        before = digests(folder)
        run = run_cli(["rewrite", folder / "a.onnx", "-o", folder / "w.onnx", "--force", "--no-verify"])
        one_line(run, 11, f"{text} the input {folder / location} (read by {folder / 'a.onnx'})")
        assert digests(folder) == before
        assert onnx_io.load(folder / "a.onnx", with_data=True)
    model = model_folder(tmp_path / "inplace")
    run = run_cli(["rewrite", model, "-o", model, "--force", "--no-verify"])
    assert run.code == 0, run.stderr
    assert onnx_io.load(model, with_data=True) and not leftovers(tmp_path / "inplace")


def test_older_weights_of_an_output_need_force(tmp_path):
    """An existing `out.onnx.<hex>.data` (an older output's weights) is removed by the run: only with --force."""
    model = model_folder(tmp_path)
    (tmp_path / "out.onnx.0123abcd.data").write_bytes(b"precious")
    one_line(run_cli(["rewrite", model, "-o", tmp_path / "out.onnx", "--no-verify"]), 6, "older data", "--force")
    assert (tmp_path / "out.onnx.0123abcd.data").read_bytes() == b"precious"


def test_force_replaces_only_regular_files(tmp_path):
    """FIFOs and device nodes as outputs were replaced by regular files with --force (issue 39 §7; as
    root, `-o /dev/null --force` broke the system's /dev/null). Now one line (2), with or without
    --force, and the node is left as it was."""
    import stat

    model = model_folder(tmp_path / "in")
    os.mkfifo(tmp_path / "pipe.onnx")
    os.mkfifo(tmp_path / "pipe.json")
    nodes = [(tmp_path / "pipe.onnx", "a FIFO (named pipe)", ["-o", tmp_path / "pipe.onnx"]),
             (tmp_path / "pipe.json", "a FIFO (named pipe)",
              ["-o", tmp_path / "o.onnx", "--report", tmp_path / "pipe.json"])]
    if char_device(tmp_path / "null.onnx"):
        nodes.append((tmp_path / "null.onnx", "a character device", ["-o", tmp_path / "null.onnx"]))
    for node, kind, args in nodes:
        for force in ([], ["--force"]):
            one_line(run_cli(["rewrite", model, *args, "--no-verify", *force]), 2, kind, "only regular files")
        mode = os.lstat(node).st_mode
        assert stat.S_ISFIFO(mode) or stat.S_ISCHR(mode), node
    assert not (tmp_path / "o.onnx").exists()
    for force in ([], ["--force"]):
        for argv in (["rewrite", model, "-o", tmp_path / "o.onnx", "--report", "/dev/null", "--no-verify"],
                     ["run", tmp_path / "art", "--inputs", tmp_path / "i.npz", "-o", "/dev/null"]):
            one_line(run_cli([*argv, *force], setup=no_writes_under_dev), 2, "/dev/null is a character device")
            assert os.path.exists("/dev/null") and stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_special_files_as_inputs_say_what_they_are(tmp_path):
    """A FIFO or a folder named x.onnx was "no such file" (issue 39 §21); a FIFO is never opened."""
    os.mkfifo(tmp_path / "pipe.onnx")
    (tmp_path / "dir.onnx").mkdir()
    os.mkfifo(tmp_path / "pipe.npz")
    for argv, text in ((["inspect", tmp_path / "pipe.onnx"], "pipe.onnx is a FIFO (named pipe), not an ONNX model"),
                       (["rewrite", tmp_path / "dir.onnx", "-o", tmp_path / "o.onnx"],
                        "dir.onnx is a folder, not an ONNX model"),
                       (["inspect", "/dev/null"], "/dev/null is a character device, not an ONNX model"),
                       (["compile", tmp_path / "pipe.onnx", "-o", tmp_path / "art"], "is a FIFO (named pipe)"),
                       (["run", tmp_path / "art", "--inputs", tmp_path / "pipe.npz", "-o", tmp_path / "o.npz"],
                        "pipe.npz is a FIFO (named pipe), not an .npz")):
        one_line(run_cli(argv, timeout=60), 6, text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.onnx", "pipe.npz", "pipe.onnx"]


def test_a_255_byte_output_name_is_written(tmp_path):
    """The staging folder's name is longer than the output's: a legal 255-byte name was refused (issue 39
    §19). Now its staging name uses a digest; weights that would need `<255 bytes>.data` are one line (19)."""
    onnx.save(tiny(), str(tmp_path / "m.onnx"))
    out = tmp_path / ("n" * 250 + ".onnx")
    run = run_cli(["rewrite", tmp_path / "m.onnx", "-o", out, "--no-verify"])
    assert run.code == 0, run.stderr
    assert onnx_io.load(out) and not leftovers(tmp_path)
    assert run_cli(["rewrite", tmp_path / "m.onnx", "-o", out, "--no-verify", "--force"]).code == 0
    model = model_folder(tmp_path / "ext")
    one_line(run_cli(["rewrite", model, "-o", tmp_path / "ext" / out.name, "--no-verify"]), 19,
             "longer than 255 bytes", "shorter output name")
    assert sorted(p.name for p in (tmp_path / "ext").iterdir()) == ["m.onnx", "m.onnx.data"]


def test_a_report_that_cannot_be_written_says_what_was(tmp_path):
    """`--report` failing on a full disk after -o was written said "nothing was replaced" (issue 39 §16)."""
    import errno

    def full_disk_for_reports():
        real = Path.write_text

        def write_text(self, *a, **kw):
            if self.name == "r.json":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
            return real(self, *a, **kw)
        Path.write_text = write_text

    model = model_folder(tmp_path)
    run = run_cli(["rewrite", model, "-o", tmp_path / "out.onnx", "--no-verify", "--report", tmp_path / "r.json"],
                  setup=full_disk_for_reports)
    one_line(run, 19, "No space left on device", f"wrote {tmp_path / 'out.onnx'} and", "but not the report")
    assert "nothing was replaced" not in run.stderr
    assert onnx_io.load(tmp_path / "out.onnx", with_data=True) and not (tmp_path / "r.json").exists()


def test_compile_on_a_full_disk_is_a_write_error(tmp_path):
    """The linker failing with ENOSPC while exporting the library was exit 13 (a TVM error); now 19."""
    model = rewritten_model(tmp_path / "in")

    def full_disk():
        from attnres_compile.backends.tvm import vm_files

        def save(executable, path):
            raise RuntimeError("Compilation error:\n/usr/bin/ld: final link failed: No space left on device\n")
        vm_files.save = save

    run = run_cli(["compile", model, "-o", tmp_path / "art", "--no-verify"], setup=full_disk)
    one_line(run, 19, "cannot write", "No space left on device", "nothing was replaced")
    assert not (tmp_path / "art").exists() and not leftovers(tmp_path)


def test_concurrent_rewrites_leave_one_model_and_its_weights(tmp_path):
    """Two rewrites of one output, the second committing while the first verifies: the first one's
    commit left the second's weights as an orphan (issue 39 §20). The older weights are now found
    when committing, under a lock on the folder; the result is one graph and the weights it names."""
    model = model_folder(tmp_path / "in")
    for existing in (False, True):  # no output yet; an output with its weights in out.onnx.data
        folder = tmp_path / f"existing-{existing}"
        folder.mkdir()
        out = folder / "out.onnx"
        argv = ["rewrite", model, "-o", out, "--no-verify", "--force"]
        if existing:
            assert run_cli(argv).code == 0

        def second_run_meanwhile():
            from attnres_compile.cli import program as cli
            from attnres_compile.onnx import pipeline as onnx_api

            real = onnx_api.check_written

            def check_written(path):
                real(path)
                onnx_api.check_written = real  # the second run is a plain one
                pid = os.fork()
                if pid == 0:
                    os._exit(cli.main([str(a) for a in argv]))
                assert os.waitpid(pid, 0)[1] == 0
            onnx_api.check_written = check_written

        run = run_cli(argv, setup=second_run_meanwhile)
        assert run.code == 0, run.stderr
        graph = onnx.load(str(out), load_external_data=False)
        named = {e.value for t in graph.graph.initializer for e in t.external_data if e.key == "location"}
        data = {p.name for p in folder.iterdir() if p.name.endswith(".data")}
        assert len(named) == 1 and data == named, (named, data)
        assert onnx_io.load(out, with_data=True) and not leftovers(folder)


def npz_claiming(path: Path, shape: tuple, zeros: int = 64) -> Path:
    """An .npz whose one array `x` declares float32 `shape` and holds `zeros` bytes of zeros, deflated."""
    import zipfile

    from numpy.lib import format as npy

    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z, z.open("x.npy", "w", force_zip64=True) as f:
        npy.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False, "shape": shape})
        for start in range(0, zeros, 1 << 20):
            f.write(bytes(min(1 << 20, zeros - start)))
    return path


def reads_mark(marker: Path):
    """In a forked run: reading an array of an .npz or parsing an ONNX file leaves `marker` and fails
    instead (a regression costs no memory)."""
    def setup():
        import numpy.lib.npyio as npyio

        def refuse(*args, **kwargs):
            marker.touch()
            raise MemoryError("the test refuses to read this file")
        npyio.NpzFile.__getitem__ = onnx.load = refuse
    return setup


def test_run_inputs_are_bounded_by_their_headers(tmp_path):
    """`run --inputs`: an .npz claiming 64 TiB was rc 1, and a few MB of deflated zeros in a shape the
    model does not take were read whole (GBs) before being refused (issue 39 §11). Now the .npy
    headers are checked against the model and the memory limit before any array is read."""
    model = rewritten_model(tmp_path / "in")
    assert run_cli(["compile", model, "-o", tmp_path / "art", "--no-verify"]).code == 0
    marker = tmp_path / "read"
    cases = [(npz_claiming(tmp_path / "huge.npz", (1 << 40, 16)), {}, 18,
              "declare 65536.0 GiB, more than the memory limit"),
             (npz_claiming(tmp_path / "shape.npz", (1 << 18, 4), 1 << 22), {}, 6,
              "shape [262144, 4], expected ['b', 16]"),
             (npz_claiming(tmp_path / "big.npz", (1 << 18, 16), 1 << 24), {"ATTNRES_COMPILE_MEMORY_LIMIT": "8M"}, 18,
              "declare 0.0 GiB, more than the memory limit 0.0 GiB (ATTNRES_COMPILE_MEMORY_LIMIT)")]
    for npz, env, code, text in cases:
        one_line(run_cli(["run", tmp_path / "art", "--inputs", npz, "-o", tmp_path / "o.npz"], env=env,
                         setup=reads_mark(marker)), code, text)
        assert not marker.exists() and not (tmp_path / "o.npz").exists(), npz
    np.savez(tmp_path / "ok.npz", x=np.ones((2, 16), np.float32))
    run = run_cli(["run", tmp_path / "art", "--inputs", tmp_path / "ok.npz", "-o", tmp_path / "o.npz"])
    assert run.code == 0 and np.load(tmp_path / "o.npz")["y"].shape == (2, 16), run.stderr


def test_onnx_type_is_checked_from_the_header(tmp_path):
    """A 3 GB sparse file named x.onnx was read whole before being called "not ONNX" (3.4 GB, 37 s;
    issue 39 §12). Now its first byte decides (8), and a file over protobuf's 2 GiB is refused (9),
    both without parsing it."""
    marker = tmp_path / "read"
    with open(tmp_path / "zeros.onnx", "wb") as f:
        f.truncate(3 << 30)
    with open(tmp_path / "big.onnx", "wb") as f:
        f.write(b"\x08\x08")
        f.truncate(3 << 30)
    for name, code, text in (("zeros.onnx", 8, "not an ONNX model (it is a binary file of unknown type"),
                             ("big.onnx", 9, "3.0 GiB; a serialized model is at most 2 GiB")):
        for argv in (["inspect", tmp_path / name], ["rewrite", tmp_path / name, "-o", tmp_path / "o.onnx"],
                     ["compile", tmp_path / name, "-o", tmp_path / "art"]):
            one_line(run_cli(argv, setup=reads_mark(marker), timeout=60), code, text)
            assert not marker.exists(), argv
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "zeros.onnx"]
