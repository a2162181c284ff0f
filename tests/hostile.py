"""Hostile inputs for the CLI, generated (never committed as blobs), one generator per failure class
of issues 14, 39 (edge-case verdicts, --force over inputs, special files) and 62 (genai folders,
planner layouts, generate's prompt arguments), and the checks every
run must pass. Used by test_fuzz_hostile.py (a fixed-seed sample within a time budget) and by its
long run (`python tests/test_fuzz_hostile.py --cases 10000`).

A case is a folder of files plus a command line. Every run must end with a documented exit code
(the case's own set when it has one), exactly one `attnres-compile: error:` line on failure, no
traceback, no signal death, no run past its time limit, no staging folder or partial output left,
no input changed or removed, /dev/null still a device, no marker file created by a payload, and no
verdict that claims more than was compared (a case's `says` / `never`).
"""

from __future__ import annotations

import copy
import io
import math
import os
import random
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

DOCUMENTED = {0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 130, 143}
ONNX_CODES = {0, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 15, 16, 17, 18}
D = 16
MARKER = "PAYLOAD-RAN"


@dataclass
class Case:
    """`files`: relative path -> bytes, ("symlink", target), ("dir", mode) or ("file", bytes, mode, owner);
    `argv` and `env` values may hold "{d}" for the case folder."""

    kind: str
    name: str
    argv: list[str]
    files: dict = field(default_factory=dict)
    expect: set = field(default_factory=lambda: set(ONNX_CODES))
    outputs: set = field(default_factory=set)  # files a successful run may add
    env: dict = field(default_factory=dict)
    timeout: float = 150.0
    send: tuple | None = None  # (signal, seconds)
    says: list = field(default_factory=list)   # what a run that exits 0 must print
    never: list = field(default_factory=list)  # and must not print


# ---------------------------------------------------------------------------------------------
# base models


def tiny(dim: int = D, links: int = 2) -> onnx.ModelProto:
    """h_k = h_{k-1} + h_{k-1} @ w_k: a residual chain, static feature size `dim`."""
    rng = np.random.default_rng(0)
    nodes, inits, h = [], [], "x"
    for k in range(1, links + 1):
        inits.append(numpy_helper.from_array((rng.standard_normal((dim, dim)) / dim).astype(np.float32), f"w{k}"))
        out = "y" if k == links else f"h{k}"
        nodes += [helper.make_node("MatMul", [h, f"w{k}"], [f"m{k}"]), helper.make_node("Add", [h, f"m{k}"], [out])]
        h = out
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", dim])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def external(model: onnx.ModelProto, location: str = "m.onnx.data") -> tuple[bytes, bytes]:
    """(model bytes, data bytes) with every initializer external at `location`."""
    model = copy.deepcopy(model)
    data, at = b"", 0
    for t in model.graph.initializer:
        raw = t.raw_data
        set_external_data(t, location, offset=at, length=len(raw))
        t.ClearField("raw_data")
        data, at = data + raw, at + len(raw)
    return model.SerializeToString(), data


def rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` rewritten by attnres-compile (no verification), for spoofing its sites."""
    import tempfile

    from attnres_compile.onnx.pipeline import rewrite_onnx

    with tempfile.TemporaryDirectory() as d:
        onnx.save(model, f"{d}/in.onnx")
        rewrite_onnx(f"{d}/in.onnx", f"{d}/out.onnx", verify_outputs=False)
        return onnx.load(f"{d}/out.onnx")


def pt2_bytes() -> bytes:
    """A valid rewritten .pt2 (a three-link MLP chain), as `rewrite -o X.pt2` writes it."""
    import torch

    from attnres_compile.api import rewrite
    from attnres_compile.pt2 import write

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(torch.relu(x))
            return x

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    gm = rewrite(Chain(), (x,), verify_outputs=False).graph_module
    return write.to_bytes(torch.export.export(gm, (x,), strict=False))[0]


def payload_library(marker: str) -> bytes | None:
    """A shared library whose constructor creates the file `marker` (relative: in the working
    directory of the process that loads it); None without a C compiler."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("cc") is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        Path(d, "payload.c").write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) {\n'
                                        f'    FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n')
        subprocess.run(["cc", "-shared", "-fPIC", "-o", f"{d}/payload.so", f"{d}/payload.c"], check=True)
        return Path(d, "payload.so").read_bytes()


class Bases:
    """The base files every generator mutates, built once."""

    def __init__(self):
        self.tiny = tiny()
        self.tiny_bytes = self.tiny.SerializeToString()
        self.ext_model, self.ext_data = external(tiny(dim=64))
        self.sited = rewritten(tiny(links=3))
        self.pt2 = pt2_bytes()
        from pt2_vectors import vectors

        self.vectors = vectors(self.pt2, MARKER)
        self._kernels: dict | None = None
        self._payload: bytes | None = None
        self._decoder: bytes | None = None

    def decoder(self) -> bytes:
        """A tiny decoder with past (`decoder_with_past`), built once."""
        if self._decoder is None:
            self._decoder = decoder_with_past()
        return self._decoder

    def payload(self) -> bytes:
        """A shared library that creates MARKER in the working directory when it is loaded."""
        if self._payload is None:
            self._payload = payload_library(MARKER) or b"\x7fELF no C compiler here"
        return self._payload

    def kernels(self) -> dict[str, bytes]:
        """The kernel cache (relative path -> bytes) that CACHE_ARGV's rewrite fills, built once by a
        forked run into an empty cache (never in this process, whose kernels forked runs inherit)."""
        if self._kernels is None:
            import shutil
            import tempfile

            from forked_cli import run_cli

            d = Path(tempfile.mkdtemp(prefix="attnres-cache-template-"))
            try:
                (d / "cache_fac.py").write_text(CACHE_FACTORY)
                run = run_cli([a.replace("{d}", str(d)) for a in CACHE_ARGV], cwd=d,
                              env={"ATTNRES_KERNEL_CACHE": str(d / "kc")})
                assert run.code == 0, run
                self._kernels = {str(p.relative_to(d)): p.read_bytes() for p in (d / "kc").rglob("*.kernel")}
                assert self._kernels, "the rewrite cached no kernel: is TVM installed?"
            finally:
                shutil.rmtree(d, ignore_errors=True)
        return self._kernels


# ---------------------------------------------------------------------------------------------
# helpers


def save(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString()


def onnx_case(kind: str, name: str, model_bytes: bytes, rng: random.Random, extra: dict | None = None,
              expect: set | None = None, command: str | None = None, options: list | None = None, **kw) -> Case:
    command = command or rng.choice(["inspect", "rewrite", "rewrite", "no-verify"])
    argv = {"inspect": ["inspect", "{d}/m.onnx"],
            "rewrite": ["rewrite", "{d}/m.onnx", "-o", "{d}/out.onnx", "--verify-timeout", "20"],
            "no-verify": ["rewrite", "{d}/m.onnx", "-o", "{d}/out.onnx", "--no-verify"]}[command]
    return Case(kind, f"{name}/{command}", argv + list(options or []), {"m.onnx": model_bytes, **(extra or {})},
                expect or set(ONNX_CODES), {"out.onnx", "out.onnx.data"}, **kw)


def flip(data: bytes, rng: random.Random, count: int) -> bytes:
    b = bytearray(data)
    for _ in range(count):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


# ---------------------------------------------------------------------------------------------
# generators: one per failure class (issue 14), each `gen(bases, rng) -> Case`


def gen_bytes(b: Bases, rng: random.Random) -> Case:
    """Byte level: bit flips, truncation, random bytes, of inline and external models and their data."""
    what = rng.choice(["flip", "cut", "random", "flip-data", "cut-data"])
    if what == "flip":
        return onnx_case("bytes", what, flip(b.tiny_bytes, rng, rng.randint(1, 12)), rng)
    if what == "cut":
        return onnx_case("bytes", what, b.tiny_bytes[: rng.randrange(len(b.tiny_bytes))], rng, expect={8, 9, 12})
    if what == "random":
        return onnx_case("bytes", what, rng.randbytes(rng.randrange(0, 600)), rng, expect={8, 9, 12})
    data = flip(b.ext_data, rng, 4) if what == "flip-data" else b.ext_data[: rng.randrange(len(b.ext_data))]
    return onnx_case("bytes", what, b.ext_model, rng, {"m.onnx.data": data},
                     expect=set(ONNX_CODES) if what == "flip-data" else {10})


VALUES = [0, 1, -1, 2, 3, 7, 64, 2 ** 31, 2 ** 40, -(2 ** 40)]


def gen_proto(b: Bases, rng: random.Random) -> Case:
    """Protobuf level: rewired inputs, attributes, dims, element types, duplicated opset imports,
    inputs of sequence/map/optional type, deleted fields."""
    m = copy.deepcopy(b.tiny)
    g = m.graph
    what = rng.choice(["rewire", "attr", "dim", "elem", "opsets", "seq-input", "map-input", "optional-input",
                       "drop-field", "output-name"])
    expect = None
    if what == "rewire":
        node = rng.choice(list(g.node))
        earlier = [v.name for v in g.input] + [t.name for t in g.initializer] + [o for n in g.node for o in n.output]
        node.input[rng.randrange(len(node.input))] = rng.choice(earlier)
    elif what == "attr":
        g.node[rng.randrange(len(g.node))].attribute.append(helper.make_attribute(rng.choice(["axis", "to", "alpha"]),
                                                                                  rng.choice(VALUES)))
    elif what == "dim":
        vi = rng.choice([*g.input, *g.output])
        dim = rng.choice(vi.type.tensor_type.shape.dim)
        dim.Clear()
        if rng.random() < 0.5:
            dim.dim_value = max(0, rng.choice(VALUES))
        else:
            dim.dim_param = rng.choice(["b", "s", "D"])
    elif what == "elem":
        rng.choice([*g.input, *g.output]).type.tensor_type.elem_type = rng.choice([1, 2, 6, 7, 9, 10, 11, 16, 0, 999])
    elif what == "opsets":  # a second default-domain import: never written out (issue 14 §6)
        m.opset_import.append(helper.make_opsetid(rng.choice(["", "ai.onnx"]), rng.choice([17, 18])))
        expect = {9}
    elif what.endswith("-input"):
        elem = helper.make_tensor_type_proto(TensorProto.FLOAT, ["b", D])
        typ = {"seq": helper.make_sequence_type_proto(elem), "optional": helper.make_optional_type_proto(elem),
               "map": helper.make_map_type_proto(TensorProto.INT64, elem)}[what.split("-")[0]]
        extra = helper.make_value_info("aux", typ)
        g.input.append(extra)
        expect = {0, 9, 15}
    elif what == "drop-field":
        target = rng.choice([m, g, g.node[0], g.initializer[0], g.input[0]])
        fields = [f.name for f, _ in target.ListFields()]
        if fields:
            target.ClearField(rng.choice(fields))
    else:
        g.output[0].name = rng.choice(["", "x", "m1", "nowhere", "y\n"])
    return onnx_case("proto", what, save(m), rng, expect=expect)


def _nested_if(depth: int) -> onnx.ModelProto:
    """The tiny chain with its first branch behind `depth` nested If nodes (then-branches), built in
    place: deep messages cannot be copied into a parent (protobuf's parse depth)."""
    m = tiny()
    if not depth:
        return m
    m.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    first = m.graph.node[0]
    first.Clear()
    first.op_type, first.output[:] = "If", ["m1"]
    first.input.append("cond")
    node = first
    for level in range(depth, 0, -1):
        other = node.attribute.add(name="else_branch", type=onnx.AttributeProto.GRAPH)
        other.g.name = f"e{level}"
        other.g.node.add(op_type="Identity", input=["x"], output=[f"o{level}"])
        other.g.output.add().CopyFrom(helper.make_tensor_value_info(f"o{level}", TensorProto.FLOAT, None))
        then = node.attribute.add(name="then_branch", type=onnx.AttributeProto.GRAPH).g
        then.name = f"g{level}"
        inner = then.node.add(output=[f"r{level}"])
        then.output.add().CopyFrom(helper.make_tensor_value_info(f"r{level}", TensorProto.FLOAT, None))
        if level == 1:
            inner.op_type, inner.input[:] = "MatMul", ["x", "w1"]
        else:
            inner.op_type, inner.input[:] = "If", ["cond"]
            node = inner
    return m


def _endless_loop() -> onnx.ModelProto:
    """The tiny chain times the result of a Loop whose condition never turns false."""
    m = tiny()
    body = helper.make_graph([helper.make_node("Identity", ["h"], ["hb"]), helper.make_node("Identity", ["c"], ["c2"])],
                             "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                                      helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                      helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", D])],
                             [helper.make_tensor_value_info("c2", TensorProto.BOOL, []),
                              helper.make_tensor_value_info("hb", TensorProto.FLOAT, ["b", D])])
    m.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    m.graph.node[-1].output[0] = "h2"
    m.graph.node.extend([helper.make_node("Loop", ["", "cond", "x"], ["l"], body=body),
                         helper.make_node("Mul", ["h2", "l"], ["y"])])
    return m


def gen_subgraphs(b: Bases, rng: random.Random) -> Case:
    """Nested If subgraphs (time linear in depth, depth cap), endless Loops (verification time limit)."""
    what = rng.choice(["nested", "nested", "loop"])
    if what == "nested":
        depth = rng.choice([1, 2, 3, 8, 15, 16, 17, 24, 32, 33, 40])
        return onnx_case("subgraphs", f"if-depth-{depth}", save(_nested_if(depth)), rng,
                         expect={9} if depth > 16 else set(ONNX_CODES) - {9})
    return Case("subgraphs", "endless-loop", ["rewrite", "{d}/m.onnx", "-o", "{d}/out.onnx", "--verify-timeout", "2"],
                {"m.onnx": save(_endless_loop())}, {17})


def gen_functions(b: Bases, rng: random.Random) -> Case:
    """Spoofed or damaged attnres sites and functions, user functions under our name, recursion."""
    m = copy.deepcopy(b.sited)
    sites = [n for n in m.graph.node if n.domain == "attnres"]
    what = rng.choice(["eps", "scale", "axis", "arity", "drop-function", "user-function", "recursive", "domain-version",
                       "attr-type", "function-body"])
    node = rng.choice(sites)
    if what in ("eps", "scale", "axis"):
        attr = next((a for a in node.attribute if a.name == what), None)
        if attr is not None:
            if attr.type == onnx.AttributeProto.FLOAT:
                attr.f = rng.choice([-1.0, 0.0, math.nan, math.inf, 1e30])
            else:
                attr.i = rng.choice([0, 1, 5, -9, 2 ** 40])
    elif what == "arity":
        if rng.random() < 0.5 and len(node.input) > 2:
            del node.input[0]
        else:
            node.input.append(node.input[0])
    elif what == "drop-function":
        del m.functions[rng.randrange(len(m.functions))]
    elif what == "user-function":
        fn = m.functions[0]
        del fn.node[:]
        fn.node.append(helper.make_node("Identity", [fn.input[0]], [fn.output[0]]))
    elif what == "recursive":
        fn = m.functions[0]
        fn.node.append(helper.make_node(fn.name, list(fn.input), ["again"], domain=fn.domain))
    elif what == "domain-version":
        for o in m.opset_import:
            if o.domain == "attnres":
                o.version = rng.choice([0, 2, 99])
    elif what == "attr-type":
        node.attribute.append(helper.make_attribute("eps", "not a float"))
    else:
        fn = rng.choice(list(m.functions))
        if fn.node:
            fn.node[rng.randrange(len(fn.node))].op_type = rng.choice(["Relu", "Nope", "Identity"])
    return onnx_case("functions", what, save(m), rng, expect=set(ONNX_CODES))


def gen_external(b: Bases, rng: random.Random) -> Case:
    """External data: outside the folder, missing, wrong offset or length, unknown keys."""
    m = onnx.load_model_from_string(b.ext_model)
    t = m.graph.initializer[0]
    entries = {e.key: e.value for e in t.external_data}
    what = rng.choice(["dotdot", "absolute", "missing", "offset", "length", "key", "symlink-out", "fifo-name"])
    extra = {"m.onnx.data": b.ext_data}
    expect = {10}
    if what == "dotdot":
        entries["location"] = "../secret.bin"
    elif what == "absolute":
        entries["location"] = "/etc/hostname"
    elif what == "missing":
        extra = {}
    elif what == "offset":
        entries["offset"] = str(rng.choice([-5, 10 ** 9, 3]))
        expect = {0, 4, 9, 10}
    elif what == "length":
        entries["length"] = str(rng.choice([0, 4, 10 ** 9]))
    elif what == "key":
        entries["ofset"] = "0"
    elif what == "symlink-out":
        extra = {"m.onnx.data": ("symlink", "/etc/hostname")}
    else:
        entries["location"] = "m.onnx.data\n"
    del t.external_data[:]
    for k, v in entries.items():
        t.external_data.add(key=k, value=v)
    return onnx_case("external", what, save(m), rng, extra, expect=expect)


def gen_names(b: Bases, rng: random.Random) -> Case:
    """Value names: non-UTF-8, newlines, very long, empty, shared by two values."""
    m = copy.deepcopy(b.tiny)
    what = rng.choice(["newline", "long", "empty", "not-utf8", "unicode", "quote"])
    new = {"newline": "h\n1", "long": "h" * 5000, "empty": "", "not-utf8": "h\udcff",
           "unicode": "ℎ₁\u202e", "quote": "h'\"1"}[what]
    if what == "not-utf8":
        data = save(m).replace(b"h1", b"\xff1")
        return onnx_case("names", what, data, rng, expect={9})
    for n in m.graph.node:
        n.input[:] = [new if i == "h1" else i for i in n.input]
        n.output[:] = [new if o == "h1" else o for o in n.output]
    return onnx_case("names", what, save(m), rng)


def gen_runtime(b: Bases, rng: random.Random) -> Case:
    """What onnxruntime does with a model: crash (LayerNormalization with an empty bias name), memory
    bombs (ConstantOfShape, a huge static input), ops it does not know."""
    what = rng.choice(["ln-empty-bias", "constant-bomb", "huge-input", "unknown-op"])
    m = tiny()
    g = m.graph
    env = {}
    if what == "ln-empty-bias":
        g.initializer.append(numpy_helper.from_array(np.ones(D, np.float32), "s"))
        g.node.insert(2, helper.make_node("LayerNormalization", ["h1", "s", ""], ["n1"]))
        g.node[3].input[0] = "n1"
        expect = {0, 7, 16}
    elif what == "constant-bomb":  # 4 GiB of zeros multiplied into the output
        g.initializer.append(numpy_helper.from_array(np.array([1 << 15, 1 << 15], np.int64), "big"))
        g.node[-1].output[0] = "h2"
        g.node.extend([helper.make_node("ConstantOfShape", ["big"], ["zeros"]),
                       helper.make_node("ReduceSum", ["zeros"], ["total"], keepdims=0),
                       helper.make_node("Add", ["h2", "total"], ["y"])])
        env = {"ATTNRES_COMPILE_MEMORY_LIMIT": "1G"}
        expect = {0, 4, 18}
    elif what == "huge-input":
        g.input[0].type.tensor_type.shape.dim[0].Clear()
        g.input[0].type.tensor_type.shape.dim[0].dim_value = 1 << 22
        env = {"ATTNRES_COMPILE_MEMORY_LIMIT": "512M"}
        expect = {0, 15, 18}
    else:
        g.node[0].op_type, g.node[0].domain = "Foo", "com.custom"
        m.opset_import.append(helper.make_opsetid("com.custom", 1))
        expect = {15}
    return Case("runtime", what, ["rewrite", "{d}/m.onnx", "-o", "{d}/out.onnx", "--verify-timeout", "30"],
                {"m.onnx": save(m)}, expect, {"out.onnx", "out.onnx.data"}, env)


def gen_outputs(b: Bases, rng: random.Random) -> Case:
    """Output paths: onto the input or its data, onto another output, existing files, dangling
    symlinks, folders, a parent that is a file."""
    files = {"m.onnx": b.ext_model, "m.onnx.data": b.ext_data}
    what = rng.choice(["report-input", "report-data", "report-is-o", "o-is-input", "o-exists", "data-exists",
                       "dangling-o", "report-exists", "o-folder", "report-folder", "parent-is-file", "o-is-data"])
    force = rng.random() < 0.5
    argv = ["rewrite", "{d}/m.onnx", "-o", "{d}/out.onnx", "--no-verify"]
    expect = {11} if what in ("report-input", "report-data") else {2}
    if what == "report-input":
        argv += ["--report", "{d}/m.onnx"]
    elif what == "report-data":
        argv += ["--report", "{d}/m.onnx.data"]
    elif what == "report-is-o":
        argv += ["--report", "{d}/out.onnx"]
    elif what == "o-is-input":
        argv[3] = "{d}/m.onnx"
        expect = {0} if force else {11}
    elif what == "o-is-data":
        argv[3] = "{d}/m.onnx.data"
    elif what in ("o-exists", "data-exists", "report-exists"):
        name = {"o-exists": "out.onnx", "data-exists": "out.onnx.data", "report-exists": "r.json"}[what]
        files[name] = b"precious"
        if what == "report-exists":
            argv += ["--report", "{d}/r.json"]
        expect = {0} if force else {6}
    elif what == "dangling-o":
        files["out.onnx"] = ("symlink", "nowhere/at/all")
        expect = {0} if force else {6}
    elif what == "o-folder":
        files["out.onnx/keep"] = b"keep"
    elif what == "report-folder":
        files["r.json/keep"] = b"keep"
        argv += ["--report", "{d}/r.json"]
    else:
        files["afile"] = b"x"
        argv[3] = "{d}/afile/out.onnx"
    if force:
        argv.append("--force")
    return Case("outputs", what + ("+force" if force else ""), argv, files, expect,
                {"out.onnx", "out.onnx.data", "r.json", "m.onnx"} if expect == {0} else set())


def gen_pt2(b: Bases, rng: random.Random) -> Case:
    """Crafted .pt2 archives (each code-execution vector, with a marker payload) and mutated ones."""
    what = rng.choice(["vector", "vector", "flip", "cut", "drop-entry", "not-a-zip", "onnx"])
    expect = {0, 6, 20}
    if what == "vector":
        name, data = rng.choice(sorted(b.vectors.items()))
        what, expect = f"vector-{name}", {6} if name == "legacy-zip" else {20}
    elif what == "flip":
        data = flip(b.pt2, rng, rng.randint(1, 8))
    elif what == "cut":
        data = b.pt2[: rng.randrange(len(b.pt2))]
        expect = {6}
    elif what == "drop-entry":
        z = zipfile.ZipFile(io.BytesIO(b.pt2))
        drop = rng.choice(z.namelist())
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as w:
            for n in z.namelist():
                if n != drop:
                    w.writestr(n, z.read(n))
        data = out.getvalue()
        expect = {0, 6, 20}
    elif what == "not-a-zip":
        data = rng.randbytes(rng.randrange(0, 300))
        expect = {6}
    else:
        data = b.tiny_bytes
        expect = {6}
    command = rng.choice(["weights", "weights", "compile"])
    argv = ["inspect", "--weights", "{d}/m.pt2", "--heatmap", "{d}/h.png"] if command == "weights" else \
        ["compile", "{d}/m.pt2", "-o", "{d}/art"]
    if command == "compile" and expect != {20} and expect != {6}:
        expect = expect | {13}
    return Case("pt2", f"{what}/{command}", argv, {"m.pt2": data}, expect, {"h.png", "art"})


def gen_force_inputs(b: Bases, rng: random.Random) -> Case:
    """--force over inputs (issue 39): an artifact folder holding the model, its parent, a folder
    that is not an artifact, the working folder; -o whose weights (or older weights, removed by
    the run) are another model's; --report onto the input's weights; the in-place rewrite."""
    what = rng.choice(["compile-into-model-folder", "compile-into-parent", "compile-into-foreign", "compile-dot",
                       "o-data-is-input-data", "o-older-data-is-input-data", "report-onto-data", "in-place"])
    files = {"m.onnx": b.ext_model, "m.onnx.data": b.ext_data}
    outputs, expect = set(), {11}
    if what.startswith("compile"):
        files = {"m.onnx": save(b.sited), "notes.txt": b"mine"}
        out = {"compile-into-model-folder": "{d}", "compile-into-parent": "{d}/..", "compile-dot": ".",
               "compile-into-foreign": "{d}/other"}[what]
        if what == "compile-into-foreign":
            files["other/thesis.tex"] = b"years of work"
            expect = {2}
        argv = ["compile", "{d}/m.onnx", "-o", out, "--no-verify"]
    elif what.startswith("o-"):
        location = "w.onnx.data" if what == "o-data-is-input-data" else "w.onnx.0123abcd.data"
        model, data = external(tiny(dim=64), location)
        files = {"a.onnx": model, location: data, "w.onnx": b"an older output"}
        argv = ["rewrite", "{d}/a.onnx", "-o", "{d}/w.onnx", "--no-verify"]
    elif what == "report-onto-data":
        argv = ["rewrite", "{d}/m.onnx", "-o", "{d}/out.onnx", "--no-verify", "--report", "{d}/m.onnx.data"]
    else:
        argv = ["rewrite", "{d}/m.onnx", "-o", "{d}/m.onnx", "--no-verify"]
        outputs, expect = {"m.onnx"}, {0}
    return Case("force-inputs", what, argv + ["--force"], files, expect, outputs, timeout=60)


def gen_special_files(b: Bases, rng: random.Random) -> Case:
    """FIFOs, device nodes and folders where a command reads or writes a file (issue 39): never
    replaced (even with --force), never opened, one line saying what they are."""
    what = rng.choice(["fifo-o", "device-o", "fifo-report", "devnull-report", "fifo-run-o", "fifo-model",
                       "folder-model", "fifo-data", "fifo-npz", "fifo-pt2", "device-model"])
    files = {"m.onnx": b.ext_model, "m.onnx.data": b.ext_data}
    rewrite = ["rewrite", "{d}/m.onnx", "-o", "{d}/out.onnx", "--no-verify"]
    force = ["--force"] if rng.random() < 0.5 else []
    expect = {2}
    if what in ("fifo-o", "device-o"):
        files["out.onnx"] = ("fifo",) if what == "fifo-o" else ("device",)
        argv = rewrite + force
    elif what in ("fifo-report", "devnull-report"):
        files["r.json"] = ("fifo",)
        argv = rewrite + ["--report", "{d}/r.json" if what == "fifo-report" else "/dev/null"]
        argv += force if what == "fifo-report" else []  # --force onto the real /dev/null: never, even refused
    elif what == "fifo-run-o":
        files["o.npz"] = ("fifo",)
        argv = ["run", "{d}/art", "--inputs", "{d}/i.npz", "-o", "{d}/o.npz"] + force
    elif what == "fifo-npz":
        files = {"i.npz": ("fifo",)}
        argv, expect = ["run", "{d}/art", "--inputs", "{d}/i.npz", "-o", "{d}/o.npz"], {6}
    elif what == "fifo-pt2":
        files = {"m.pt2": ("fifo",)}
        argv, expect = ["inspect", "--weights", "{d}/m.pt2", "--heatmap", "{d}/h.png"], {6}
    elif what == "fifo-data":
        files["m.onnx.data"] = ("fifo",)
        argv, expect = rewrite, {10}
    else:
        files = {"m.onnx": {"fifo-model": ("fifo",), "folder-model": ("dir",), "device-model": ("device",)}[what]}
        argv, expect = rng.choice([["inspect", "{d}/m.onnx"], rewrite, ["compile", "{d}/m.onnx", "-o", "{d}/art"]]), {6}
    return Case("special-files", what + ("+force" if force else ""), argv, files, expect, set(), timeout=30)


FACTORIES = {
    "syntax": "def f(:\n",
    "exit0": "import sys\ndef f():\n    sys.exit(0)\n",
    "exit-at-import": "import sys\nsys.exit(3)\n",
    "raises": "def f():\n    raise RuntimeError('boom')\n",
    "wrong-return": "def f():\n    return 42\n",
    "not-callable": "f = 42\n",
    "no-copy": ("import threading, torch\nclass M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                "        self.lock = threading.Lock()\n        self.l = torch.nn.Linear(4, 4)\n"
                "    def forward(self, x):\n        return x + self.l(x)\n"
                "def f():\n    return M(), (torch.ones(2, 4),)\n"),
    "import-error": "import no_such_module_here\ndef f():\n    pass\n",
}


def gen_factories(b: Bases, rng: random.Random) -> Case:
    """Factory specs and modules: relative or malformed specs, SyntaxErrors, sys.exit, raising factories,
    models that cannot be deep-copied."""
    what = rng.choice(sorted(FACTORIES) + ["dotdot-spec", "dot-spec", "empty-attr", "missing-module"])
    spec = {"dotdot-spec": "../../x:f", "dot-spec": ".x:f", "empty-attr": "fac_mod:", "missing-module": "nope_nope:f"}
    files = {} if what in spec else {"fac_mod.py": FACTORIES[what].encode()}
    model = spec.get(what, "fac_mod:f")
    command = rng.choice(["inspect", "rewrite"])
    argv = ["inspect", model] if command == "inspect" else ["rewrite", model, "-o", "{d}/out.onnx"]
    return Case("factories", f"{what}/{command}", argv, files, {6}, set())


def gen_signals(b: Bases, rng: random.Random) -> Case:
    """Ctrl-C and SIGTERM at a random moment of a rewrite (inside verification, writing or later)."""
    import signal as sig

    which = rng.choice([sig.SIGINT, sig.SIGTERM])
    delay = rng.uniform(0.05, 3.0)
    files = {"m.onnx": save(_endless_loop()) if rng.random() < 0.5 else b.ext_model}
    if files["m.onnx"] is b.ext_model:
        files["m.onnx.data"] = b.ext_data
    return Case("signals", f"{which.name}@{delay:.2f}", ["rewrite", "{d}/m.onnx", "-o", "{d}/out.onnx",
                                                        "--verify-timeout", "5"],
                files, {0, 17, 130, 143} if which == sig.SIGINT else {0, 17, 143, 130}, {"out.onnx", "out.onnx.data"},
                send=(which, delay))


def argmax_only(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` (the tiny chain) returning ids = ArgMax(y) only: an integer-only output."""
    model = copy.deepcopy(model)
    model.graph.node.append(helper.make_node("ArgMax", ["y"], ["ids"], axis=-1, keepdims=0))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"]))
    return model


def gen_verdicts(b: Bases, rng: random.Random) -> Case:
    """Edge-case verdicts: an eps float32 cannot hold, outputs with no elements, an integer-only output,
    zero rows: the run refuses in one line or says what it compared, never a ✓ for nothing."""
    what = rng.choice(["eps", "empty", "integer", "zero-rows"])
    if what == "eps":
        eps = rng.choice(["1e-300", "1e-39", "0", "-1e-6", "1e308", "inf", "nan", "2"])
        return onnx_case("verdicts", f"eps-{eps}", b.tiny_bytes, rng, command="rewrite", options=["--eps", eps],
                         expect={2})
    if what == "empty":
        return onnx_case("verdicts", "empty", b.tiny_bytes, rng, command="rewrite", options=["--input-shape", f"x:0x{D}"],
                         expect={0}, says=["nothing was compared: every output is empty"], never=["✓"])
    if what == "integer":
        return onnx_case("verdicts", "integer-only", save(argmax_only(b.tiny)), rng, command="rewrite", expect={0},
                         says=["all equal  (compared exactly)"])
    return onnx_case("verdicts", "zero-rows", b.tiny_bytes, rng, command="rewrite", expect={0},
                     says=["also with zero rows in x"])


def with_side_input(model: onnx.ModelProto, kind: str) -> onnx.ModelProto:
    """The tiny chain plus a side output whose shapes hide from a naive fill: `expression` concatenates
    a past `p` [past, D] to `x` [seq, D] and adds a mask `m` ["past + seq"] (16 everywhere breaks it);
    `split` reshapes the batch into pairs (it breaks at a batch of 1, the small shape set)."""
    model = copy.deepcopy(model)
    g = model.graph
    if kind == "expression":
        g.input[0].type.tensor_type.shape.dim[0].dim_param = "seq"
        g.input.extend([helper.make_tensor_value_info("p", TensorProto.FLOAT, ["past", D]),
                        helper.make_tensor_value_info("m", TensorProto.INT64, ["past + seq"])])
        g.node.extend([helper.make_node("Concat", ["p", "x"], ["pc"], axis=0),
                       helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
                       helper.make_node("Unsqueeze", ["mf", "one"], ["mu"]),
                       helper.make_node("Add", ["pc", "mu"], ["z"])])
        g.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "one"))
        g.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["past + seq", D]))
    else:
        g.node.append(helper.make_node("Reshape", ["x", "pairs"], ["z"]))
        g.initializer.append(numpy_helper.from_array(np.array([2, -1, D], dtype=np.int64), "pairs"))
        g.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, "h", D]))
    return model


def gen_shapes(b: Bases, rng: random.Random) -> Case:
    """Verdicts hidden by shapes (issue 39): dims that are sums of others must be filled consistently
    (verified, no flag), and a model that breaks at the small shape set must say it was not verified
    there, never claim it."""
    what = rng.choice(["expression", "split"])
    model = save(with_side_input(b.tiny, what))
    if what == "expression":
        return onnx_case("shapes", what, model, rng, command="rewrite", expect={0}, says=["verified at: "])
    return onnx_case("shapes", what, model, rng, command="rewrite", expect={0},
                     says=["not verified at the small shapes"], never=[f"verified at: x 2x{D}; x 1x{D}"])


CACHE_FACTORY = """import torch


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(torch.relu(x))
        return x


def f():
    torch.manual_seed(0)
    return Chain(), (torch.randn(2, 24),)
"""
# a feature size and eps no other test uses: the forked run cannot inherit these kernels from memory
CACHE_ARGV = ["rewrite", "cache_fac:f", "-o", "{d}/out.pt2", "--eps", "2.5e-6", "--verify-timeout", "60"]
DEAD_PID = 4194305  # above the largest pid_max (2**22): never a running process


def gen_cache(b: Bases, rng: random.Random) -> Case:
    """Kernel-cache poisoning (issue 39): at a kernel's name, a library whose constructor writes the
    marker (plain, with a forged hash, behind a symlink, world-writable, another user's), a truncated
    or altered kernel, a cache folder writable by all, a dead writer's temporary file. The run must
    compute and verify as usual, run no payload and leave no temporary file."""
    import hashlib

    kernels = b.kernels()
    payload = b.payload()
    what = rng.choice(["planted", "forged-hash", "symlink", "world-writable", "foreign-owner", "truncated",
                       "altered", "shared-folder", "stale-temp"])
    files: dict = {"cache_fac.py": CACHE_FACTORY.encode(), **kernels}
    rel = rng.choice(sorted(kernels))

    def entry(library: bytes, digest: str | None = None) -> bytes:
        digest = digest or hashlib.sha256(library).hexdigest()
        return b"attnres-kernel 1 size=%d sha256=%s\n" % (len(library), digest.encode()) + library

    if what == "planted":
        files[rel] = payload
    elif what == "forged-hash":
        files[rel] = entry(payload, "0" * 64)
    elif what == "symlink":
        files["elsewhere.kernel"] = entry(payload)
        files[rel] = ("symlink", "../" * rel.count("/") + "elsewhere.kernel")
    elif what in ("world-writable", "foreign-owner"):
        owner = 65534 if what == "foreign-owner" and os.geteuid() == 0 else None
        files[rel] = ("file", entry(payload), 0o666 if owner is None else 0o644, owner)
    elif what == "truncated":
        files[rel] = kernels[rel][: rng.randrange(1, len(kernels[rel]))]
    elif what == "altered":
        files[rel] = flip(kernels[rel], rng, rng.randint(1, 4))
    elif what == "shared-folder":
        files = {**files, **{k: entry(payload) for k in kernels}, "kc": ("dir", 0o1777)}
    else:
        files[f"{rel.rsplit('/', 1)[0]}/.tmp-{DEAD_PID}-{rng.randrange(16 ** 6):06x}.kernel"] = b"half a kern"
    return Case("cache", what, CACHE_ARGV, files, {0}, {"out.pt2", "kc"}, env={"ATTNRES_KERNEL_CACHE": "{d}/kc"})


# ---------------------------------------------------------------------------------------------
# issue 62: onnxruntime-genai folders, planner layouts, generate's prompt arguments


def genai_config(session_options: dict | None = None, **decoder) -> dict:
    """A genai_config.json as onnxruntime-genai's builder writes it (cpu), for the tiny chain model."""
    return {"model": {"bos_token_id": 1, "context_length": 64, "eos_token_id": 2, "pad_token_id": 0, "type": "llama",
                      "vocab_size": 16,
                      "decoder": {"session_options": {"log_id": "onnxruntime-genai", "provider_options": [],
                                                      **(session_options or {})},
                                  "filename": "model.onnx", "head_size": 8, "hidden_size": 16, "num_attention_heads": 2,
                                  "num_hidden_layers": 1, "num_key_value_heads": 2,
                                  "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                             "past_key_names": "past_key_values.%d.key",
                                             "past_value_names": "past_key_values.%d.value"},
                                  "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                                              "present_value_names": "present.%d.value"}, **decoder}},
            "search": {"max_length": 64, "do_sample": False, "num_beams": 1}}


LIBRARIES = ["ops.so", "./ops.so", "libops.so.1", "ops.dll", "ops.dylib", "ops", "libc.so.6", "/lib/x86_64-linux-gnu/libm.so.6"]
# what would load code or write files, and where in the config it goes (session options of each model kind)
UNSAFE_OPTIONS = [
    lambda lib: {"custom_ops_library": lib},
    lambda lib: {"enable_profiling": "prof"},
    lambda lib: {"ep.context_enable": "1", "ep.context_file_path": "ctx.onnx"},
    lambda lib: {"session.load_model_format": "ORT"},
    lambda lib: {"provider_options": [{"QNN": {"backend_path": lib}}]},
    lambda lib: {"provider_options": [{"OpenVINO": {"cache_dir": "ov"}}]},
    lambda lib: {"provider_options": [{"cuda": {"trt_engine_cache_path": "trt"}}]},
    lambda lib: {"provider_options": [{"TensorRT": {"trt_engine_cache_enable": "1"}}]},
    lambda lib: {"provider_options": [{"cpu": {}}, {"RyzenAI": {}}]},
    lambda lib: {"provider_options": [{"VitisAI": {"config_file": "vaip.json"}}]},
]
PLACES = ["decoder", "encoder", "vision", "speech", "embedding", "mtp", "pipeline"]
RANDOM_VALUES = [None, True, 0, -1, 1, 2 ** 31, 2 ** 63, 10 ** 30, 1.5, float("inf"), "", "x", "../../x", "/etc/passwd",
                 "lib.so", [], {}, [1, "a"], {"custom_ops_library": "ops.so"}, "\u0000", "a" * 300]
MALFORMED = {"not-json": b"{not json", "array": b"[1, 2]", "model-string": b'{"model": "x"}',
             "no-decoder": b'{"model": {"type": "llama"}}', "deep": b"[" * 100000 + b"]" * 100000,
             "deep-40": b'{"model": {"decoder": {}, "x": ' + b"[" * 40 + b"]" * 40 + b"}}",
             "nan": b'{"model": {"decoder": {"hidden_size": NaN}}}', "empty": b"", "bom": b"\xef\xbb\xbf{}",
             "binary": bytes(range(256)), "truncated": None, "utf16": None, "duplicate": None, "huge": None}


def _set(tree, rng: random.Random, value) -> str:
    """Replace a random leaf or member of `tree` (a dict) by `value`; the path, for the case name."""
    path, node = [], tree
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return "/".join(map(str, path))
        key = rng.choice(keys)
        path.append(key)
        if isinstance(node[key], (dict, list)) and node[key] and rng.random() < 0.7:
            node = node[key]
            continue
        node[key] = value
        return "/".join(map(str, path))


def gen_genai(b: Bases, rng: random.Random) -> Case:
    """onnxruntime-genai folders (issue 62): configs that would load a library (payload with a marker) or
    write files, at every place session options go; malformed, nested, duplicated, huge and non-UTF-8
    configs; random field values; symlinked, FIFO or folder configs; odd sidecars (symlinked, FIFO,
    folders). `generate FOLDER` and `rewrite FOLDER/model.onnx -o OUT/...` must refuse before og.Model
    or any write (21 for code or writes, 6 for a bad config), run no payload and leave no partial folder."""
    import json

    what = rng.choice(["unsafe", "unsafe", "malformed", "field", "field", "symlink", "sidecar", "valid"])
    config = genai_config()
    files: dict = {"g/model.onnx": b.tiny_bytes, "g/tokenizer.json": b'{"model": {}}', "g/ops.so": b.payload()}
    expect = None
    raw = None
    if what == "unsafe":
        options = rng.choice(UNSAFE_OPTIONS)(rng.choice(LIBRARIES))
        place = rng.choice(PLACES)
        if place == "decoder":
            config["model"]["decoder"]["session_options"].update(options)
        elif place == "pipeline":
            config["model"]["decoder"]["pipeline"] = [{"m0": {"filename": "model.onnx", "session_options": options}}]
        elif rng.random() < 0.2:
            config["model"]["decoder"]["run_options"] = {"enable_profiling": "run_prof"}
        else:
            config["model"][place] = {"filename": "model.onnx", "session_options": options}
        what, expect = f"unsafe-{place}-{next(iter(options))}", {21}
    elif what == "malformed":
        kind = rng.choice(sorted(MALFORMED))
        raw = MALFORMED[kind]
        text = json.dumps(config, indent=4)
        if kind == "truncated":
            raw = text[:rng.randrange(len(text))].encode()
        elif kind == "utf16":
            raw = text.encode("utf-16")
        elif kind == "duplicate":  # a second session_options after one that loads the payload
            raw = text.replace('"session_options": {', '"session_options": {"custom_ops_library": "ops.so"}, '
                               '"session_options": {', 1).encode()
        elif kind == "huge":
            raw = b'{"model": {"decoder": {}}, "pad": "' + b"x" * (17 << 20) + b'"}'
        what, expect = f"malformed-{kind}", {21} if kind == "duplicate" else {6}
    elif what == "field":
        where = _set(config, rng, rng.choice(RANDOM_VALUES))
        what = f"field-{where}"[:80]
    elif what == "symlink":
        kind = rng.choice(["inside", "outside", "dangling", "fifo", "dev-zero"])
        files["g/real.json"] = json.dumps(config).encode()
        files["g/fifo"] = ("fifo",)
        target = {"inside": "real.json", "outside": "../../secret.bin", "dangling": "nowhere.json", "fifo": "fifo",
                  "dev-zero": "/dev/zero"}[kind]
        files["g/genai_config.json"] = ("symlink", target)
        what, expect = f"symlink-{kind}", {6}
    elif what == "sidecar":
        kind = rng.choice(["symlink-tokenizer", "fifo-tokenizer", "folder", "symlink-out", "config-folder",
                           "config-fifo", "model-symlink"])
        if kind == "symlink-tokenizer":
            files["g/tokenizer.json"] = ("symlink", "../../secret.bin")
        elif kind == "fifo-tokenizer":
            files["g/tokenizer_config.json"] = ("fifo",)
        elif kind == "folder":
            files["g/sub/vocab.txt"] = b"a b"
        elif kind == "symlink-out":
            files["g/special_tokens_map.json"] = ("symlink", "/etc/hostname")
        elif kind == "config-folder":
            files["g/genai_config.json/keep"] = b"keep"
            expect = {6}
        elif kind == "config-fifo":
            files["g/genai_config.json"] = ("fifo",)
            expect = {6}
        else:
            files["g/real.onnx"] = b.tiny_bytes
            files["g/model.onnx"] = ("symlink", "real.onnx")
        what = f"sidecar-{kind}"
    if "g/genai_config.json" not in files and not any(k.startswith("g/genai_config.json/") for k in files):
        files["g/genai_config.json"] = raw if raw is not None else json.dumps(config, indent=4).encode()
    command = rng.choice(["generate", "rewrite", "rewrite-same-name"])
    if command == "generate":
        prompt = rng.choice(["5,6", "5", "1,2,3;4", "2147483648", "5", "3,4"])
        argv = ["generate", "{d}/g", "--prompt-ids", prompt, "--max-new-tokens", str(rng.choice([1, 2, 8, 100, 10 ** 9]))]
        codes = {2, 6, 21} if expect is None else expect  # the config is checked before the prompt's ids
        outputs: set = set()
    else:
        name = "model.onnx" if command == "rewrite-same-name" else "rw.onnx"
        argv = ["rewrite", "{d}/g/model.onnx", "-o", f"{{d}}/out/{name}", "--no-verify"]
        codes = {0, 6, 21} if expect is None else expect
        outputs = {"out"}
    return Case("genai", f"{what}/{command}", argv, files, codes, outputs, timeout=60)


PLAN_FACTORY = """import torch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        x = x + self.a(torch.relu(x))
        return x + self.b(torch.relu(x))


class Chain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def f():
    torch.manual_seed(0)
    return Chain(), (torch.randn(2, 16),)
"""
NUMBERS = ["0", "1", "2", "3", "4", "7", "8", "16", "64", "255", "256", "257", "8192", "100000000", "1e23", "-2", "2.0",
           "x", "", "99999999999999999999999999"]


def gen_planner(b: Bases, rng: random.Random) -> Case:
    """`inspect FACTORY --budget` layouts (issue 62): stages, ranks and micro-batches from 0 to 10**26 and
    not numbers, every schedule and optimizer, budgets from 1 byte to 1 EiB: one line (exit 2) or the
    plan, within seconds, never a schedule built first; SIGTERM at a random moment ends it (143)."""
    import signal as sig

    argv = ["inspect", "plan_fac:f", "--budget", rng.choice(["1", "100", "64KiB", "1GiB", "1.5GB", "1e18", "0", "-1",
                                                             "40XB", "nan", "inf"])]
    for flag in ("--stages", "--ranks", "--micro-batches"):
        if rng.random() < 0.6:
            argv += [flag, rng.choice(NUMBERS)]
    if rng.random() < 0.8:
        argv += ["--schedule", rng.choice(["gpipe", "1f1b", "interleaved", "zbv", "zbv", "pipedream"])]
    if rng.random() < 0.3:
        argv += ["--optimizer", rng.choice(["adam", "sgd", "momentum", "lion"])]
    if rng.random() < 0.2:
        argv += rng.choice([["--blocks", rng.choice(["1", "2", "4", "8", "16", "0"])], ["--json"], ["--block-size", "3"]])
    send = (sig.SIGTERM, rng.uniform(0.1, 4.0)) if rng.random() < 0.15 else None
    return Case("planner", " ".join(argv[3:])[:80] + (f" SIGTERM@{send[1]:.1f}" if send else ""), argv,
                {"plan_fac.py": PLAN_FACTORY.encode()}, {0, 2, 143} if send else {0, 2}, set(), timeout=60, send=send)


def decoder_with_past(vocab: int = 50, width: int = 4) -> bytes:
    """A tiny decoder with past as optimum names it: logits from an embedding, the past concatenated
    with the new tokens' embeddings (one layer); mask and positions taken, not read."""
    rng = np.random.default_rng(0)
    names = ["past_key_values.0.key", "past_key_values.0.value"]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "past_sequence_length + sequence_length"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              *(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch_size", 1, "past_sequence_length", width])
                for n in names)]
    total = "past_sequence_length + sequence_length"
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab]),
               *(helper.make_tensor_value_info(n.replace("past_key_values", "present"), TensorProto.FLOAT,
                                               ["batch_size", 1, total, width]) for n in names)]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"]),
             helper.make_node("MatMul", ["h", "head"], ["logits"]),
             helper.make_node("Unsqueeze", ["h", "one"], ["kv"]),
             *(helper.make_node("Concat", [n, "kv"], [n.replace("past_key_values", "present")], axis=2) for n in names)]
    inits = [numpy_helper.from_array(rng.standard_normal((vocab, width)).astype(np.float32), "embed"),
             numpy_helper.from_array(rng.standard_normal((width, vocab)).astype(np.float32), "head"),
             numpy_helper.from_array(np.array([1], dtype=np.int64), "one")]
    graph = helper.make_graph(nodes, "decoder", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _ids(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.5:  # plain rows, 1 to 6 tokens, 1 to 3 rows, ids below the vocabulary (50)
        return ";".join(",".join(str(rng.randrange(50)) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
    return rng.choice(["50", "49,50", "2147483648", "9223372036854775807", "9223372036854775808", "-1", "1,-2", "",
                       ";", "1;", "1,,2", " 1", "1e3", "0x10", "+5", "１２", "a", "1 2", "1;;2", "0", "0;0,0,0,0,0,0,0,0",
                       "99999999999999999999999999999999"])


def gen_prompts(b: Bases, rng: random.Random) -> Case:
    """`generate`'s prompt arguments (issue 62) on a tiny decoder with past: one-token prompts, batches,
    ids at and beyond the vocabulary, int32 and int64, negative, malformed rows, --max-new-tokens at
    0 and below, --eos-id with and against --ignore-eos: the tokens, or one line (2 for the arguments,
    6 for ids the model cannot look up), never exit 1."""
    argv = ["generate", "{d}/m.onnx"]
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        argv += ["--prompt-ids", _ids(rng)]
    if rng.random() < 0.5:
        argv += ["--max-new-tokens", rng.choice(["1", "2", "5", "20", "0", "-3", "x", "1.5"])]
    if rng.random() < 0.3:
        argv += ["--eos-id", rng.choice(["0", "7", "-1", "2147483648", "9223372036854775808"])]
    if rng.random() < 0.2:
        argv += ["--ignore-eos"]
    if rng.random() < 0.3:
        argv += ["--json"]
    return Case("prompts", " ".join(argv[2:])[:80], argv, {"m.onnx": b.decoder()}, {0, 2, 6}, set(), timeout=60)


GENERATORS = {"bytes": gen_bytes, "proto": gen_proto, "subgraphs": gen_subgraphs, "functions": gen_functions,
              "external": gen_external, "names": gen_names, "runtime": gen_runtime, "outputs": gen_outputs,
              "pt2": gen_pt2, "factories": gen_factories, "signals": gen_signals, "verdicts": gen_verdicts,
              "shapes": gen_shapes, "force-inputs": gen_force_inputs, "special-files": gen_special_files, "cache": gen_cache,
              "genai": gen_genai, "planner": gen_planner, "prompts": gen_prompts}


# ---------------------------------------------------------------------------------------------
# running a case and judging it


def materialize(case: Case, folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for rel, content in case.files.items():
        p = folder / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        elif content == ("fifo",):
            os.mkfifo(p)
        elif content == ("device",):
            _device(p)
        elif content == ("dir",):
            p.mkdir()
            (p / "keep").write_bytes(b"keep")
        elif content[0] == "symlink":
            os.symlink(content[1], p)
        elif content[0] == "dir":
            p.mkdir(exist_ok=True)
            p.chmod(content[1])
        else:  # ("file", bytes, mode, owner uid or None)
            p.write_bytes(content[1])
            p.chmod(content[2])
            if content[3] is not None:
                os.chown(p, content[3], -1)
    (folder.parent / "secret.bin").write_bytes(b"\0" * 4096)
    return [a.replace("{d}", str(folder)) for a in case.argv]


def _device(path: Path) -> None:
    """A character device node like /dev/null's at `path` (root), else a FIFO (mknod not allowed)."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        os.mkfifo(path)


def snapshot(root: Path) -> dict[str, object]:
    import hashlib

    seen = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            seen[str(p.relative_to(root))] = ("link", os.readlink(p))
        elif p.is_file():
            seen[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            seen[str(p.relative_to(root))] = "dir"
        else:  # a FIFO or a device node: its type (never opened)
            seen[str(p.relative_to(root))] = ("node", stat.S_IFMT(os.lstat(p).st_mode))
    return seen


FAILURE_CLASSES = ("undocumented-code", "unexpected-code", "not-one-line", "traceback", "signal-death", "over-time",
                   "left-behind", "input-changed", "input-removed", "payload-ran", "partial-output", "false-verdict",
                   "dev-null-broken")


def judge(case: Case, run, root: Path, folder: Path, before: dict) -> list[str]:
    """The failure classes this run falls into (empty: it passed every check)."""
    failures = []
    if run.timed_out:
        failures.append("over-time")
    if run.signal is not None and not run.timed_out:
        failures.append("signal-death")
    code = run.code
    if code is not None:
        if code not in DOCUMENTED:
            failures.append("undocumented-code")
        elif code not in case.expect:
            failures.append("unexpected-code")
        if code != 0 and not (len(run.lines) == 1 and run.lines[0].startswith("attnres-compile: error: ")):
            failures.append("not-one-line")
        if code == 0 and run.lines:
            failures.append("not-one-line")
    if "Traceback" in run.stderr:
        failures.append("traceback")
    if code == 0 and (any(s not in run.stdout for s in case.says) or any(s in run.stdout for s in case.never)):
        failures.append("false-verdict")
    after = snapshot(root)
    if any(".tmp" in k.rsplit("/", 1)[-1] or k.rsplit("/", 1)[-1].endswith(".old") for k in after):
        failures.append("left-behind")
    if any(MARKER in k for k in after):
        failures.append("payload-ran")
    rel = str(folder.relative_to(root))
    new = {k for k in after if k not in before}
    changed = {k for k in before if k in after and after[k] != before[k]}
    allowed = {f"{rel}/{n}" for n in case.outputs}
    data = {k for k in new if k.endswith(".data") and any(k.startswith(f"{rel}/{n}.") for n in case.outputs)}
    gone = {k for k in before if k not in after}
    if code in (0, 130, 143):  # a signal after the commit leaves the complete new output; exit 7 writes nothing
        extra = {k for k in new - data if not _within(k, allowed)}
        if extra or any(not _within(k, allowed) for k in changed):
            failures.append("partial-output" if extra else "input-changed")
        if f"{rel}/out.onnx" in new | changed and not _loads(folder / "out.onnx"):
            failures.append("partial-output")
        replaced = {k for k in gone if any(k.startswith(f"{a}.") and k.endswith(".data") for a in allowed)}
        if {k for k in gone - replaced if not _within(k, allowed)}:  # only an output's own (older weights, a
            # refused cache entry or a dead writer's temporary file inside an output folder) may go
            failures.append("input-removed")
    else:
        if new - {k for k in new if k.endswith("__pycache__") or "/__pycache__/" in k}:
            failures.append("partial-output")
        if changed:
            failures.append("input-changed")
        if gone:
            failures.append("input-removed")
    if not stat.S_ISCHR(os.lstat("/dev/null").st_mode):
        failures.append("dev-null-broken")
    return failures


def _within(path: str, allowed: set[str]) -> bool:
    """Whether `path` is an allowed output or inside one (an artifact folder, a kernel cache)."""
    return path in allowed or any(path.startswith(a + "/") for a in allowed)


def _loads(path: Path) -> bool:
    from attnres_compile.core.errors import AttnResError
    from attnres_compile.onnx import io as onnx_io

    try:
        onnx_io.load(path, with_data=True)
        return True
    except AttnResError:
        return False


def describe_failure(case: Case, run, failures: list[str]) -> str:
    return f"{case.kind}:{case.name} argv={run.argv} code={run.code} signal={run.signal} " \
           f"{run.seconds:.1f}s failures={failures} stderr={run.stderr[-600:]!r}"


def make_cases(bases: Bases, seed: int, kinds: list[str] | None = None):
    """An endless stream of cases, round-robin over the classes (or `kinds`), from one seed."""
    rng = random.Random(seed)
    kinds = sorted(kinds or GENERATORS)
    i = 0
    while True:
        kind = kinds[i % len(kinds)]
        i += 1
        yield GENERATORS[kind](bases, rng)
