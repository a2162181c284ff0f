"""Hostile ONNX files through the CLI's loading path (`inspect X.onnx`, `rewrite X.onnx -o Y.onnx`).

Every mutated model must end in a documented exit code with one `attnres-compile: error:` line
(no traceback), within a timeout, without a partial output (no `Y.onnx`, `Y.onnx.data` or
temporary file after a failure), without changing any file it was given, and without reading
external data outside the model's folder (refused with exit code 10, even when the outside file
holds valid data, so a read would have gone unnoticed).

- Explicit cases, one per named class (wrong dtypes, raw data of the wrong size, cycles,
  absurd dims, missing initializers, external data outside the folder or out of bounds), run in
  process through `cli.main`.
- Hypothesis properties (bit flips, truncation, random bytes, and well-formed files whose graph is
  rewired: inputs moved, attributes, dims, types and constants changed) run `cli.main` in one long-lived
  worker subprocess, so a crash in a native library or a hang fails the example (per-call
  timeout) instead of the test session. Budget: 10 derandomized examples per property;
  `HYPOTHESIS_PROFILE=long` runs 300 random ones.
- A few real subprocesses: the CLI on a truncated model and on external data that is a FIFO
  (a read would block), and `main` under an audit hook that records every file opened, on
  external data outside the folder.
- The worker and the subprocesses run in an empty scratch working directory that must stay
  empty (onnxruntime's symbolic shape inference used to dump the model there).

Exit code 1 (an unexpected error) is never accepted: a model the ONNX checker accepts but
onnxruntime cannot run (or one whose generated verification input would be absurdly large) is
15; crashes, hangs and memory blow-ups of onnxruntime are 16, 17 and 18 (isolate.py).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from attnres_compile.cli import main
from attnres_compile.onnx import io as onnx_io

TIMEOUT = 60  # seconds per CLI call
DOCUMENTED = {0, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 16, 17, 18}
OUTPUTS = {"out.onnx", "out.onnx.data"}
D = 16

LONG = os.environ.get("HYPOTHESIS_PROFILE") == "long"
# local settings (not a registered profile: other files register "ci"/"long" with their own budgets)
FUZZ = settings(max_examples=300 if LONG else 10, derandomize=not LONG, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------------------------------------
# models


def tiny_model(dim: int = D) -> onnx.ModelProto:
    """y = h1 + h1 @ w2, h1 = x + x @ w1: a two-link residual chain, static feature size `dim`."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((dim, dim)) / dim).astype(np.float32), f"w{i}") for i in (1, 2)]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["x", "m1"], ["h1"]),
             helper.make_node("MatMul", ["h1", "w2"], ["m2"]), helper.make_node("Add", ["h1", "m2"], ["y"])]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", dim])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def save(model: onnx.ModelProto, folder: Path, name: str = "m.onnx") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(model.SerializeToString())
    return path


def externalize(model: onnx.ModelProto, folder: Path, location: str, blob: Path | None | bool = None,
                offset: int | None = None, length: int | None = None) -> Path:
    """`model` saved in `folder` with every initializer external at `location` (offsets and lengths
    as onnx writes them unless given); the bytes go to `blob` (default: `folder / location`; False: nowhere)."""
    model = copy.deepcopy(model)
    data, at = b"", 0
    for t in model.graph.initializer:
        raw = t.raw_data
        set_external_data(t, location, offset=at if offset is None else offset, length=len(raw) if length is None else length)
        t.ClearField("raw_data")
        data, at = data + raw, at + len(raw)
    path = save(model, folder)
    if blob is not False:
        (blob or folder / location).write_bytes(data)
    return path


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """name -> model file, each alone in its folder (with its .data): tiny inline and external,
    the sample GPT (2 layers, legacy export) inline and with its weights in gpt.onnx.data."""
    import torch

    from samples import models

    root = tmp_path_factory.mktemp("bases")
    paths = {"tiny": save(tiny_model(), root / "tiny"),
             "tiny_ext": externalize(tiny_model(), root / "tiny_ext", "m.onnx.data")}
    model, args = models.gpt_factory(layers=2)
    (root / "gpt").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(root / "gpt" / "gpt.onnx"), dynamo=False, opset_version=17,
                          input_names=["idx"], output_names=["logits"],
                          dynamic_axes={"idx": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    paths["gpt"] = root / "gpt" / "gpt.onnx"
    paths["gpt_ext"] = root / "gpt_ext" / "gpt.onnx"
    onnx_io.save(onnx.load(str(paths["gpt"])), paths["gpt_ext"], external=True)
    assert (root / "gpt_ext" / "gpt.onnx.data").is_file()
    return paths


# ---------------------------------------------------------------------------------------------
# what every run must satisfy


def snapshot(root: Path) -> dict[str, tuple]:
    """relative path -> (kind, size, content hash) of everything under `root` (links not followed,
    FIFOs not opened)."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            mode = p.lstat().st_mode
            if stat.S_ISREG(mode):
                content = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(mode):
                content = os.readlink(p)
            else:  # folders, FIFOs: never opened
                content = None
            seen[str(p.relative_to(root))] = (stat.S_IFMT(mode), content)
    return seen


def check_run(argv: list, code, err: str, root: Path, before: dict, out_dir: Path) -> None:
    """The run's exit code is documented, its error one line, and nothing but a complete output changed."""
    assert isinstance(code, int), f"{argv}: {code}"  # a worker that died, hung or saw an exception escape
    lines = err.strip().splitlines()
    assert "Traceback" not in err, (argv, err)
    if code == 0:
        assert not lines, (argv, err)
    else:
        assert len(lines) == 1 and lines[0].startswith("attnres-compile: error: "), (argv, err)
    assert code in DOCUMENTED, (argv, code, err)
    after = snapshot(root)
    new = {Path(k) for k in set(after) - set(before)}
    changed = {k for k in set(after) & set(before) if after[k] != before[k]}
    assert not changed, (argv, code, changed)  # inputs (and anything else) untouched
    if code in (0, 7) and argv[0] == "rewrite":  # a complete output (7 keeps it for inspection)
        assert all(p.parent == out_dir.relative_to(root) and p.name in OUTPUTS for p in new), (argv, code, new)
        if new:
            onnx_io.load(out_dir / "out.onnx", with_data=False)
    else:
        assert not new, (argv, code, new)


def drop_outputs(out_dir: Path) -> None:
    for name in OUTPUTS:
        (out_dir / name).unlink(missing_ok=True)


def commands(model: Path, out_dir: Path) -> dict[str, list[str]]:
    out = str(out_dir / "out.onnx")
    return {"inspect": ["inspect", str(model)], "rewrite": ["rewrite", str(model), "-o", out],
            "no-verify": ["rewrite", str(model), "-o", out, "--no-verify"]}


# ---------------------------------------------------------------------------------------------
# explicit cases, one per named class, in process


@dataclass
class Case:
    id: str
    build: object          # (model folder, secret file outside it) -> model path
    expect: dict           # command -> (exit code, part of the error line)


def mutated(mutate):
    """A builder for tiny_model() changed in place by `mutate` (saved without any check)."""
    def build(folder: Path, secret: Path) -> Path:
        model = tiny_model()
        mutate(model)
        return save(model, folder)
    return build


def setattr_(obj_path, value):
    def mutate(model):
        target, attr = obj_path(model)
        setattr(target, attr, value)
    return mutate


def init0(model):
    return model.graph.initializer[0]


def set_dims(dims, of_input=False):
    def mutate(model):
        if of_input:
            shape = model.graph.input[0].type.tensor_type.shape
            for d, v in zip(shape.dim, dims):
                d.Clear()
                if v is not None:
                    d.dim_value = v
        else:
            del init0(model).dims[:]
            init0(model).dims.extend(dims)
    return mutate


def local_functions(bodies: dict[str, list]):
    """Replace the first MatMul by a call of model-local function `f` (domain "local")."""
    def mutate(model):
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
        model.functions.extend(helper.make_function("local", name, ["a"], ["b"], body, opsets) for name, body in bodies.items())
        model.opset_import.append(helper.make_opsetid("local", 1))
        node = model.graph.node[0]
        node.op_type, node.domain = "f", "local"
        del node.input[1:]
    return mutate


def subgraph_cycle(model):
    then = helper.make_graph([helper.make_node("Relu", ["q"], ["p"]), helper.make_node("Relu", ["p"], ["q"])], "then", [],
                             [helper.make_tensor_value_info("p", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["m1"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    model.graph.node.insert(2, helper.make_node("If", ["cond"], ["m1b"], then_branch=then, else_branch=other))
    model.graph.node[1].input[1] = "m1b"
    model.graph.node.insert(1, model.graph.node.pop(2))  # If before its consumer


def nested_ifs(depth):
    """`depth` If nodes nested in each other's then-branch (built in place: protobuf cannot parse it back)."""
    def mutate(model):
        graph = model.graph
        for i in range(depth):
            node = graph.node.add(op_type="If", input=["cond"], output=[f"e{i}"])
            attr = node.attribute.add(name="then_branch", type=onnx.AttributeProto.GRAPH)
            graph = attr.g
    return mutate


def outside(location, how: str):
    """External data whose location leads outside the model's folder, to a file with the right bytes."""
    def build(folder: Path, secret: Path) -> Path:
        folder.mkdir(parents=True)
        if how == "symlink":
            os.symlink(secret, folder / location)
        elif how == "symlinked dir":
            os.symlink(secret.parent, folder / "up")
        loc = str(secret) if how == "absolute" else location
        return externalize(tiny_model(), folder, loc, blob=secret)
    return build


def outside_in(where: str):
    """A sparse initializer's values, or a Constant node's tensor, external at ../secret.bin (valid bytes)."""
    def build(folder: Path, secret: Path) -> Path:
        model = tiny_model()
        values = numpy_helper.from_array(np.ones(4, np.float32), "sparse_values")
        secret.write_bytes(values.raw_data)
        set_external_data(values, "../secret.bin", offset=0, length=16)
        values.ClearField("raw_data")
        if where == "sparse":
            indices = numpy_helper.from_array(np.arange(4, dtype=np.int64), "sparse_indices")
            model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [16]))
        else:
            model.graph.node.insert(0, helper.make_node("Constant", [], ["c"], value=values))
        return save(model, folder)
    return build


def external(location="m.onnx.data", offset=None, length=None, blob=True, entries=None):
    """Tiny with external data in `folder / location`; `entries` maps a key of the first initializer's
    external data entries to a new (key, value) pair, or to None to drop it."""
    def build(folder: Path, secret: Path) -> Path:
        path = externalize(tiny_model(), folder, location, blob=None if blob else False, offset=offset, length=length)
        if entries:
            model = onnx.load(str(path), load_external_data=False)
            kept = [(e.key, e.value) for e in model.graph.initializer[0].external_data]
            kept = [entries.get(k, (k, v)) for k, v in kept]
            del model.graph.initializer[0].external_data[:]
            for k, v in filter(None, kept):
                model.graph.initializer[0].external_data.add(key=k, value=v)
            path.write_bytes(model.SerializeToString())
        return path
    return build


def non_utf8(build, old: bytes, new: bytes):
    """`build`'s model file with the string `old` replaced by the same-length, invalid UTF-8 `new`."""
    def edit(folder: Path, secret: Path) -> Path:
        path = build(folder, secret)
        data = path.read_bytes()
        assert data.count(old) >= 1
        path.write_bytes(data.replace(old, new))
        return path
    return edit


def both(code, message="", no_verify=False):
    expect = {"inspect": (code, message), "rewrite": (code, message)}
    if no_verify:
        expect["no-verify"] = (code, message)
    return expect


OUTSIDE = "outside the model's folder"
CASES = [
    # wrong dtypes and raw data of the wrong size
    Case("dtype-int64", mutated(setattr_(lambda m: (init0(m), "data_type"), TensorProto.INT64)), both(9, "too small")),
    Case("dtype-double", mutated(setattr_(lambda m: (init0(m), "data_type"), TensorProto.DOUBLE)), both(9, "too small")),
    Case("dtype-string", mutated(setattr_(lambda m: (init0(m), "data_type"), TensorProto.STRING)), both(9, "STRING")),
    Case("dtype-float16", mutated(setattr_(lambda m: (init0(m), "data_type"), TensorProto.FLOAT16)),
         both(9, "holds 1024 bytes", no_verify=True)),
    Case("dtype-undefined", mutated(setattr_(lambda m: (init0(m), "data_type"), 0)), both(9, "UNDEFINED")),
    Case("dtype-unknown", mutated(setattr_(lambda m: (init0(m), "data_type"), 999)), both(9, "unknown data type 999")),
    Case("elem-type-unknown", mutated(setattr_(lambda m: (m.graph.input[0].type.tensor_type, "elem_type"), 999)),
         both(9, "unknown element type 999")),
    Case("raw-data-short", mutated(lambda m: setattr(init0(m), "raw_data", init0(m).raw_data[:100])), both(9, "too small")),
    Case("raw-data-long", mutated(lambda m: setattr(init0(m), "raw_data", init0(m).raw_data * 2)),
         both(9, "holds 2048 bytes", no_verify=True)),
    Case("raw-data-missing", mutated(lambda m: init0(m).ClearField("raw_data")), both(9, "one and only one value field")),
    Case("float-data-long", mutated(lambda m: (init0(m).ClearField("raw_data"), init0(m).float_data.extend([0.5] * 300))),
         both(9, "holds 300 float_data values", no_verify=True)),
    # cycles
    Case("cycle-self", mutated(lambda m: m.graph.node[2].input.__setitem__(0, "m2")), both(9, "topologically sorted")),
    Case("cycle-two-nodes", mutated(lambda m: m.graph.node[0].input.__setitem__(0, "h1")), both(9, "topologically sorted")),
    Case("cycle-recursive-function", mutated(local_functions({"f": [helper.make_node("f", ["a"], ["b"], domain="local")]})),
         both(9, "must not be recursive")),
    Case("cycle-mutual-functions", mutated(local_functions({"f": [helper.make_node("g", ["a"], ["b"], domain="local")],
                                                            "g": [helper.make_node("f", ["a"], ["b"], domain="local")]})),
         both(9, "must not be recursive")),
    Case("cycle-in-function-body", mutated(local_functions({"f": [helper.make_node("Relu", ["c"], ["b"]),
                                                                  helper.make_node("Relu", ["b"], ["c"])]})),
         both(9, "topologically sorted")),
    Case("cycle-in-subgraph", mutated(subgraph_cycle), both(9, "topologically sorted")),
    Case("subgraphs-nested-200-deep", mutated(nested_ifs(200)), both(9, "more than 32 deep")),
    # absurd dims
    Case("initializer-dim-2**40", mutated(set_dims([2 ** 40, D])), both(9, "too small")),
    Case("initializer-dim-negative", mutated(set_dims([-1, D])), both(9, "Negative dimension")),
    Case("initializer-dim-zero", mutated(set_dims([0, D])), both(9, "0-element")),
    Case("initializer-dims-overflow", mutated(set_dims([2 ** 62, 2 ** 62])), both(9, "overflow")),
    Case("input-dim-2**40", mutated(set_dims([2 ** 40, D], of_input=True)),
         {"inspect": (0, ""), "rewrite": (15, "too many to generate a verification input"), "no-verify": (0, "")}),
    Case("input-dim-2**25", mutated(set_dims([2 ** 25, D], of_input=True)),  # 8 GiB as float64: refused, not allocated
         {"rewrite": (15, "too many to generate a verification input")}),
    Case("input-dim-negative", mutated(set_dims([-1, D], of_input=True)), {"inspect": (0, ""), "rewrite": (0, "")}),
    Case("input-dim-zero", mutated(set_dims([0, D], of_input=True)), {"inspect": (0, ""), "rewrite": (0, "")}),
    Case("feature-dim-2**40", mutated(set_dims([None, 2 ** 40], of_input=True)),
         {"inspect": (0, ""), "rewrite": (4, "no residual chain")}),
    # missing initializers and dangling names
    Case("missing-initializer", mutated(lambda m: m.graph.initializer.pop()), both(9, "topologically sorted")),
    Case("dangling-input", mutated(lambda m: m.graph.node[2].input.__setitem__(1, "nowhere")), both(9, "'nowhere'")),
    Case("output-produced-by-nothing", mutated(lambda m: setattr(m.graph.output[0], "name", "zzz")), both(9, "'zzz'")),
    Case("output-produced-twice", mutated(lambda m: m.graph.node[2].output.__setitem__(0, "h1")), both(9, "SSA")),
    Case("name-not-utf8", non_utf8(mutated(lambda m: None), b"h1", b"\xff1"), both(9, "not valid UTF-8")),
    Case("unknown-op", mutated(lambda m: setattr(m.graph.node[1], "op_type", "Nope")), both(9, "No Op registered")),
    Case("no-opset-import", mutated(lambda m: m.ClearField("opset_import")), both(12, "imports no ai.onnx opset")),
    # external data outside the model's folder: refused before it is read, though it holds the right bytes
    Case("external-dotdot", outside("../secret.bin", "dotdot"), both(10, OUTSIDE, no_verify=True)),
    Case("external-absolute", outside(None, "absolute"), both(10, OUTSIDE, no_verify=True)),
    Case("external-symlink-file", outside("m.onnx.data", "symlink"), both(10, OUTSIDE, no_verify=True)),
    Case("external-symlinked-dir", outside("up/secret.bin", "symlinked dir"), both(10, OUTSIDE, no_verify=True)),
    Case("external-dotdot-through-subdir", outside("sub/../../secret.bin", "dotdot"), both(10, OUTSIDE)),
    Case("external-sparse-initializer", outside_in("sparse"), both(10, OUTSIDE)),
    Case("external-constant-node", outside_in("constant"), both(10, OUTSIDE)),
    Case("external-dev-zero", external(location="/dev/zero", blob=False), both(10, OUTSIDE)),
    # external data out of bounds or badly described
    Case("external-offset-beyond", external(offset=10 ** 6), both(10, "truncated")),
    Case("external-length-beyond", external(length=10 ** 6), both(10, "is 1000000 bytes")),
    Case("external-length-short", external(length=4), both(10, "is 4 bytes", no_verify=True)),
    Case("external-offset-negative", external(offset=-5), both(10, "invalid external data reference")),
    Case("external-offset-not-a-number", external(entries={"offset": ("offset", "12abc")}), both(10, "invalid external data reference")),
    Case("external-location-empty", external(entries={"location": ("location", "")}), both(10, "invalid external data location")),
    Case("external-location-nul", external(entries={"location": ("location", "m.onnx\0.data")}), both(10, "invalid external data location")),
    Case("external-location-newline", external(entries={"location": ("location", "m.onnx\n.data")}), both(10, "missing")),
    Case("external-location-not-given", external(entries={"location": None}), both(10, "invalid external data location")),
    Case("external-key-misspelt", external(entries={"offset": ("ofnset", "0")}), both(10, "unknown external data key(s) ['ofnset']")),
    Case("external-key-empty", external(entries={"length": ("", "1024")}), both(10, "unknown external data key(s) ['']")),
    Case("external-location-not-utf8", non_utf8(external(), b"m.onnx.data", b"\xed.onnx.data"), both(9, "not valid UTF-8")),
    Case("external-missing", external(blob=False), both(10, "missing")),
    Case("external-is-a-folder", external(location=".", blob=False), both(10, "missing (or not a file)")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_named_hostile_inputs(case, tmp_path, capsys):
    secret = tmp_path / "secret.bin"
    model = case.build(tmp_path / "model", secret)
    before = snapshot(tmp_path)
    argvs = commands(model, tmp_path / "model")
    for command, (code, message) in case.expect.items():
        got = main(argvs[command])
        out, err = capsys.readouterr()
        check_run(argvs[command], got, err, tmp_path, before, tmp_path / "model")
        assert got == code and message in err, (command, got, err)
        if OUTSIDE in message:
            assert "refused" in err
        drop_outputs(tmp_path / "model")


def test_valid_external_data_still_loads(tmp_path, capsys):
    """The refusals above leave external data beside the model, or in a subfolder of its folder, alone."""
    for folder, location, files in ((tmp_path / "a", "m.onnx.data", ["m.onnx", "m.onnx.data"]),
                                    (tmp_path / "b", "weights/w.bin", ["m.onnx", "weights"])):
        (folder / Path(location).parent).mkdir(parents=True, exist_ok=True)
        model = externalize(tiny_model(), folder, location)
        assert main(["rewrite", str(model), "-o", str(folder / "out.onnx")]) == 0, capsys.readouterr().err
        assert "✓ y" in capsys.readouterr().out
        assert sorted(p.name for p in folder.iterdir()) == sorted(files + ["out.onnx", "out.onnx.data"])


def test_runtime_failure_leaves_nothing_not_even_the_output_folders(tmp_path, capsys):
    """A model the checker accepts but onnxruntime cannot run (an op of an unknown domain): exit 15, the
    documented one-line message, no file, and the output folders the run made are taken back."""
    model = tiny_model()
    model.graph.node[0].op_type, model.graph.node[0].domain = "Foo", "com.custom"
    model.opset_import.append(helper.make_opsetid("com.custom", 1))
    path = save(model, tmp_path / "model")
    before = snapshot(tmp_path)
    argv = ["rewrite", str(path), "-o", str(tmp_path / "new" / "deeper" / "out.onnx")]
    code = main(argv)
    check_run(argv, code, capsys.readouterr().err, tmp_path, before, tmp_path / "new" / "deeper")
    assert code == 15 and snapshot(tmp_path) == before
    assert main([*argv, "--no-verify"]) == 0 and (tmp_path / "new" / "deeper" / "out.onnx").is_file()


def test_incomplete_shape_inference_writes_nothing_to_the_cwd(bases, tmp_path, monkeypatch, capsys):
    """onnxruntime's symbolic shape inference dumps the model (sym_shape_infer_temp.onnx and a <uuid>.data
    holding its weights) into the working directory when it cannot infer every shape; here, because a
    Softmax is rewired onto a scalar. Found by fuzzing; the CLI must write nothing there."""
    model = onnx.load(str(bases["gpt"]))
    node = next(n for n in model.graph.node if n.name == "/blocks.0/attn/Softmax")
    node.input[0] = "/blocks.0/attn/Sqrt_2_output_0"
    path = save(model, tmp_path / "model")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    before = snapshot(tmp_path)
    for argv in commands(path, path.parent).values():
        code = main(argv)
        check_run(argv, code, capsys.readouterr().err, tmp_path, before, path.parent)
        assert code in (0, 4) and not any((tmp_path / "cwd").iterdir()), (argv, code)
        drop_outputs(path.parent)


# ---------------------------------------------------------------------------------------------
# random mutations, in a worker subprocess (crash- and hang-proof)

WORKER = r"""
import contextlib, io, json, os, sys
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # native libraries' prints go to stderr (discarded), not onto the reply channel
from attnres_compile.cli import main
reply.write("ready\n"); reply.flush()
for line in sys.stdin:
    argv = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except BaseException as exc:  # an exception main let escape: a failure of the property
        code = f"escaped {type(exc).__name__}: {exc}"
    reply.write(json.dumps({"code": code, "stderr": err.getvalue()}) + "\n"); reply.flush()
"""


class Worker:
    """One long-lived python running `cli.main` on request; restarted after a crash or a timeout.
    Its working directory `cwd` is an empty scratch folder, which must stay empty."""

    def __init__(self, cwd: Path):
        self.proc, self.cwd = None, cwd

    def _start(self):
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=self.cwd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self._read(300) == "ready\n", "worker did not start"

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline() if ready else None

    def run(self, argv: list[str]) -> tuple[int | str, str]:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        line = self._read(TIMEOUT)
        if not line:
            self.close()
            return ("hung" if line is None else "crashed"), ""
        reply = json.loads(line)
        return reply["code"], reply["stderr"]

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("worker-cwd"))
    yield w
    w.close()


@contextlib.contextmanager
def copy_of(model: Path):
    """A scratch copy of `model`'s folder; yields (root, model path inside it)."""
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        shutil.copytree(model.parent, root / "model")
        yield root, root / "model" / model.name
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_all(worker: Worker, root: Path, model: Path, which=("inspect", "rewrite")) -> dict[str, int]:
    before = snapshot(root)
    codes = {}
    for command in which:
        argv = commands(model, model.parent)[command]
        code, err = worker.run(argv)
        check_run(argv, code, err, root, before, model.parent)
        assert not any(worker.cwd.iterdir()), (argv, sorted(worker.cwd.iterdir()))  # nothing written to the cwd
        drop_outputs(model.parent)
        codes[command] = code
    return codes


FLIP_TARGETS = [("tiny", "m.onnx"), ("tiny_ext", "m.onnx"), ("gpt_ext", "gpt.onnx"), ("gpt_ext", "gpt.onnx.data")]
CUT_TARGETS = [("gpt", "gpt.onnx"), ("tiny_ext", "m.onnx"), ("gpt_ext", "gpt.onnx"), ("gpt_ext", "gpt.onnx.data")]


@FUZZ
@given(target=st.sampled_from(FLIP_TARGETS),
       flips=st.lists(st.tuples(st.integers(0, 2 ** 32), st.integers(0, 7)), min_size=1, max_size=12))
def test_bit_flips(bases, worker, target, flips):
    base, name = target
    with copy_of(bases[base]) as (root, model):
        file = model.parent / name
        data = bytearray(file.read_bytes())
        for offset, bit in flips:
            data[offset % len(data)] ^= 1 << bit
        file.write_bytes(bytes(data))
        codes = run_all(worker, root, model)
        if name.endswith(".data"):  # other weights, same graph: loads as before
            assert codes["inspect"] == 0, codes


@FUZZ
@given(target=st.sampled_from(CUT_TARGETS), fraction=st.floats(0, 1, exclude_max=True))
def test_truncation(bases, worker, target, fraction):
    base, name = target
    with copy_of(bases[base]) as (root, model):
        file = model.parent / name
        data = file.read_bytes()
        file.write_bytes(data[: int(len(data) * fraction)])
        codes = run_all(worker, root, model)
        expected = {10} if name.endswith(".data") else {8, 9, 12}  # 12: cut after the graph, before opset_import
        assert set(codes.values()) <= expected, codes


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes(worker, data):
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        model = root / "model" / "m.onnx"
        model.parent.mkdir()
        model.write_bytes(data)
        codes = run_all(worker, root, model)
        assert set(codes.values()) <= {8, 9, 12}, codes
        if not data:
            assert codes == {"inspect": 8, "rewrite": 8}
    finally:
        shutil.rmtree(root, ignore_errors=True)


VALUES = [0, 1, -1, 2, 3, 7, 64, 2 ** 31, 2 ** 40, -(2 ** 40)]


def rewire(model: onnx.ModelProto, kind: str, a: int, b: int, c: int) -> None:
    """One graph edit the ONNX checker mostly accepts: a node input moved onto an earlier value, an int
    attribute, a declared dim, an element type, a Constant's value or the graph output changed."""
    g = model.graph
    if kind == "input":
        node = g.node[a % len(g.node)]
        earlier = [v.name for v in g.input] + [t.name for t in g.initializer] + \
            [o for n in g.node[: list(g.node).index(node)] for o in n.output]
        if node.input:
            node.input[b % len(node.input)] = earlier[c % len(earlier)]
    elif kind == "attribute":
        attrs = [x for n in g.node for x in n.attribute if x.type in (onnx.AttributeProto.INT, onnx.AttributeProto.INTS)]
        x = attrs[a % len(attrs)] if attrs else None
        if x is not None and x.type == onnx.AttributeProto.INT:
            x.i = VALUES[c % len(VALUES)]
        elif x is not None and x.ints:
            x.ints[b % len(x.ints)] = VALUES[c % len(VALUES)]
    elif kind == "dim":
        values = [*g.input, *g.output, *g.value_info]
        dims = values[a % len(values)].type.tensor_type.shape.dim if values else []
        if dims:
            dim = dims[b % len(dims)]
            dim.Clear()
            if c % 3:
                dim.dim_value = VALUES[c % len(VALUES)] if VALUES[c % len(VALUES)] >= 0 else 0
            else:
                dim.dim_param = ["batch", "seq", "other"][c % 9 // 3]
    elif kind == "elem_type":
        values = [*g.input, *g.output]
        values[a % len(values)].type.tensor_type.elem_type = [1, 2, 6, 7, 9, 10, 11, 16][c % 8]
    elif kind == "constant":
        consts = [n.attribute[0].t for n in g.node
                  if n.op_type == "Constant" and n.attribute and n.attribute[0].t.data_type == TensorProto.INT64]
        if consts:
            t = consts[a % len(consts)]
            arr = numpy_helper.to_array(t).copy()
            if arr.size:
                arr.flat[b % arr.size] = VALUES[c % len(VALUES)]
                t.CopyFrom(numpy_helper.from_array(arr, t.name))
    elif kind == "output":
        g.output[0].name = [o for n in g.node for o in n.output][a % sum(len(n.output) for n in g.node)]


@FUZZ
@given(base=st.sampled_from(["gpt", "tiny"]),
       edits=st.lists(st.tuples(st.sampled_from(["input", "input", "attribute", "dim", "elem_type", "constant", "output"]),
                                st.integers(0, 10 ** 6), st.integers(0, 10 ** 6), st.integers(0, 10 ** 6)),
                      min_size=1, max_size=3))
def test_rewired_graphs(bases, worker, base, edits):
    """Well-formed files with a hostile graph: the checker passes many of these, so they reach shape
    inference, the analysis, the rewrite and onnxruntime."""
    model = onnx.load(str(bases[base]))
    for edit in edits:
        rewire(model, *edit)
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    try:
        run_all(worker, root, save(model, root / "model"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# real subprocesses: the CLI itself, a FIFO as external data, an audit hook on every open

AUDITED = r"""
import json, os, sys
opened = []
sys.addaudithook(lambda event, args: opened.append(args[0]) if event == "open" and isinstance(args[0], (str, bytes)) else None)
from attnres_compile.cli import main
secret = os.path.realpath(os.environ["SECRET"])
codes = [main(argv) for argv in json.loads(sys.argv[1])]
paths = {os.fsdecode(p) for p in opened}
hits = sorted(p for p in paths if os.path.realpath(p) == secret)
models = sum(p.endswith("m.onnx") for p in paths)  # the hook sees the files main opens
print("AUDIT " + json.dumps({"codes": codes, "opened_secret": hits, "opened_models": models > 0}))
"""


def test_cli_subprocesses(bases, tmp_path):
    # a cut model, through the installed CLI module
    cut = tmp_path / "cut" / "gpt.onnx"
    cut.parent.mkdir()
    cut.write_bytes(bases["gpt"].read_bytes()[:50_000])
    # external data that is a FIFO in the model's folder: opening it would block (no writer)
    fifo_model = externalize(tiny_model(), tmp_path / "fifo", "m.onnx.data", blob=False)
    os.mkfifo(tmp_path / "fifo" / "m.onnx.data")
    # external data outside the folder, holding the right bytes
    secret = tmp_path / "secret.bin"
    outside_models = [outside("../secret.bin", "dotdot")(tmp_path / "dotdot", secret),
                      outside(None, "absolute")(tmp_path / "absolute", secret),
                      outside("m.onnx.data", "symlink")(tmp_path / "symlink", secret),
                      outside("up/secret.bin", "symlinked dir")(tmp_path / "updir", secret)]
    audited = [a for m in outside_models for a in (["inspect", str(m)], ["rewrite", str(m), "-o", str(m.parent / "out.onnx")])]
    (tmp_path / "cwd").mkdir()
    before = snapshot(tmp_path)
    cli = [sys.executable, "-m", "attnres_compile.cli"]
    runs = [[*cli, "inspect", str(cut)], [*cli, "rewrite", str(fifo_model), "-o", str(tmp_path / "fifo" / "out.onnx")],
            [sys.executable, "-c", AUDITED, json.dumps(audited)]]
    procs = [subprocess.Popen(r, cwd=tmp_path / "cwd", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "SECRET": str(secret)}) for r in runs]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT * 2)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for (code, out, err), expected in zip(results[:2], [(9, "truncated or corrupt"), (10, "missing (or not a file)")]):
        lines = err.strip().splitlines()
        assert code == expected[0] and len(lines) == 1 and expected[1] in lines[0] and "Traceback" not in err, (code, err)
    code, out, err = results[2]
    assert code == 0, err
    audit = json.loads(next(line for line in out.splitlines() if line.startswith("AUDIT "))[6:])
    assert audit == {"codes": [10] * len(audited), "opened_secret": [], "opened_models": True}, audit
    assert err.count("attnres-compile: error: ") == len(audited) and err.count(OUTSIDE) == len(audited), err
    assert snapshot(tmp_path) == before  # nothing written anywhere, the secret and the FIFO untouched
