"""Whole AttnRes models through TVM: every site one fused-kernel call, artifacts against onnxruntime.

ONNX files come from `export_onnx` (fx rewrite + dynamo export) with random pseudo-queries, so
the softmax over the sources is far from uniform; they are exported and compiled once per
module. CUDA builds and compiles its device code with nvcc here, without a GPU.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnx.inliner
import pytest
import torch
import tvm
from onnx import TensorProto, helper

import attnres_compile as ac
from attnres_compile.onnx import runtime as ort_backend
from attnres_compile.backends.tvm import LowerDepthAttention, compile_model, load
from attnres_compile.backends.tvm import check as tvm_check
from attnres_compile.backends.tvm import tune
from attnres_compile.cli.parser import build as cli_parser
from attnres_compile.backends.tvm.importers import from_onnx, import_model
from attnres_compile.backends.tvm.lower import KERNEL_PREFIX, PARTIAL_PREFIX, calls
from attnres_compile.backends.tvm.pipeline import make_target
from attnres_compile.core.errors import ArtifactError, ConfigError, InputError, VerificationError
from attnres_compile.kernels import cache as kernel_cache
from attnres_compile.onnx.pipeline import export_onnx, rewrite_onnx
from attnres_compile.ops.depth_attention import depth_attention
from attnres_compile.core import two_phase as two_phase_policy
from attnres_compile.onnx.export import auto_dynamic_shapes
from attnres_compile.onnx.function import attach_functions, site_node
from attnres_compile.onnx.two_phase import sites as onnx_sites
from samples import hf_models, models

ATOL = 1e-4
PLACEHOLDER = "packed:attnres.depth_attention"


def _llama():
    model, inputs = hf_models.llama_factory()
    return hf_models.CausalLMLogits(model).eval(), (inputs["input_ids"], inputs["attention_mask"])


MODELS = {  # name: (factory, config, sites)
    "gpt_full": (models.gpt_factory, ac.AttnResConfig(), 8),
    "gpt_block": (models.gpt_factory, ac.AttnResConfig(variant="block", block_size=3), 8),
    "hf_llama": (_llama, ac.AttnResConfig(), 4),
}


def _randomize_queries(path: Path, seed: int = 0) -> None:
    """Pseudo-queries w ~ N(0, 1/D): logits of order 1, weights far from uniform."""
    model = onnx.load(str(path))
    rng = np.random.default_rng(seed)
    for init in model.graph.initializer:
        if init.name.startswith("attnres."):
            w = onnx.numpy_helper.to_array(init)
            init.CopyFrom(onnx.numpy_helper.from_array((rng.standard_normal(w.shape) / np.sqrt(w.size)).astype(np.float32),
                                                       init.name))
    onnx.save(model, str(path))


@pytest.fixture(scope="module", autouse=True)
def two_phase_on_short_histories():
    """The samples are short (histories of at most 7 sources): lower them two-phase wherever it moves
    fewer bytes, so these tests run the partial + merge kernels (production waits for MIN_HISTORY)."""
    default, two_phase_policy.MIN_HISTORY = two_phase_policy.MIN_HISTORY, 0
    yield
    two_phase_policy.MIN_HISTORY = default


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tvm_models")


@pytest.fixture(scope="module")
def exported(folder):
    """name -> AttnRes ONNX file with random queries, exported once."""
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            factory, config, _ = MODELS[name]
            model, args = factory()
            path = folder / f"{name}.onnx"
            export_onnx(model, args, path, config, verify_outputs=False)
            _randomize_queries(path)
            cache[name] = path
        return cache[name]
    return get


@pytest.fixture(scope="module")
def artifact(folder, exported):
    """(name, target) -> artifact folder, compiled once."""
    cache = {}

    def get(name: str, target: str = "llvm") -> Path:
        if (name, target) not in cache:
            out = folder / f"{name}_{target}"
            compile_model(exported(name), out, target=target)
            cache[name, target] = out
        return cache[name, target]
    return get


def _feeds(path: Path, size: tuple[int, int], seed: int = 1) -> dict[str, np.ndarray]:
    sess = ort_backend.session(path)
    shapes = {i.name: size for i in sess.get_inputs()}
    return ort_backend.make_inputs(sess, onnx.load(str(path), load_external_data=False), shapes, seed)


def _sites(path: Path):
    """The sites of the file (DepthAttention or Merge nodes) with their full source lists."""
    return onnx_sites(onnx.load(str(path)).graph)


@pytest.mark.parametrize("name", MODELS)
def test_artifact_matches_onnxruntime(exported, artifact, name):
    path = exported(name)
    model = load(artifact(name))
    for size in [(2, 8), (3, 5)]:  # symbolic batch and sequence: one artifact serves both
        feeds = _feeds(path, size)
        expected = ort_backend.run(ort_backend.session(path), feeds)
        actual = model(feeds)
        assert list(actual) == list(expected)
        for key, ref in expected.items():
            err = float(np.abs(actual[key] - ref).max())
            print(f"{name} {size}: max abs error vs onnxruntime {err:.2e} (output scale {np.abs(ref).max():.2f})")
            assert actual[key].shape == ref.shape and err <= ATOL


def test_partial_chains_of_several_links_match_onnxruntime(exported, folder, monkeypatch):
    """Links of 2 sources: gpt_full's histories of 4 and 7 become chains of 2 and 4 links, the second
    keeping the first's links; the artifact still computes what onnxruntime does."""
    monkeypatch.setattr(kernel_cache, "PARTIAL_CHUNK", 2)
    path, out = exported("gpt_full"), folder / "gpt_full_links"
    manifest = compile_model(path, out)
    chains = {tuple(s["partial"]) for s in manifest["sites"] if s.get("partial")}
    links = sorted([int(re.search(r"_j(\d+)_", k).group(1)) for k in chain] for chain in chains)
    assert links == [[2, 2], [2, 2, 2, 1]] and all(k.endswith("_cont") == (i > 0) for c in chains for i, k in enumerate(c))
    feeds = _feeds(path, (2, 8))
    (expected,), (actual,) = ort_backend.run(ort_backend.session(path), feeds).values(), load(out)(feeds).values()
    err = float(np.abs(actual - expected).max())
    print(f"gpt full, links of 2: max abs error vs onnxruntime {err:.2e} (output scale {np.abs(expected).max():.2f})")
    assert err <= ATOL


@pytest.mark.parametrize("name", MODELS)
def test_prenorm_norms_are_fused_into_their_sites(exported, name):
    """Both models are PreNorm: every site's output is read by the next norm only (the final norm
    after the last), so each site kernel stores the normed tensor and that many norms are gone;
    the embedding's norm stays. The sample GPT's LayerNorm: `_ln` kernels, fewer layer_norm calls.
    HF Llama's RMSNorm arrives decomposed (power, mean, add, sqrt, divide, multiply by the row and
    by gamma): `_rms` kernels, and each of those ops once per site fewer. The artifact test checks
    the numbers against onnxruntime."""
    imported = import_model(exported(name)).mod
    counted = calls(LowerDepthAttention(make_target("llvm"))(imported))
    suffix, ops = ("_ln", {"relax.nn.layer_norm": 1}) if name.startswith("gpt") else (
        "_rms", {"relax.power": 1, "relax.mean": 1, "relax.sqrt": 1, "relax.divide": 1, "relax.multiply": 2})
    fused = sum(v for k, v in counted.items() if k.startswith(KERNEL_PREFIX) and k.endswith(suffix))
    assert fused == MODELS[name][2]
    assert {op: calls(imported)[op] - counted[op] for op in ops} == {op: n * fused for op, n in ops.items()}
    lowered = calls(LowerDepthAttention(make_target("cuda"))(imported))
    assert {op: lowered[op] for op in ops} == {op: calls(imported)[op] for op in ops}  # CUDA keeps them: its
    # schedule has no fused-norm stages


@pytest.mark.parametrize("name", MODELS)
def test_one_kernel_call_per_site_and_no_unfused_copy(exported, artifact, name):
    path = exported(name)
    sites = _sites(path)
    assert len(sites) == MODELS[name][2]
    attention_softmaxes = sum(n.op_type == "Softmax" for n in onnx.load(str(path)).graph.node)
    imported = import_model(path).mod
    assert calls(imported)[PLACEHOLDER] == len(sites)
    lowering = LowerDepthAttention(make_target("llvm"))
    counted = calls(lowering(imported))
    site_calls = {k: v for k, v in counted.items() if k.startswith(KERNEL_PREFIX) and not k.startswith(PARTIAL_PREFIX)}
    assert sum(site_calls.values()) == len(sites) and counted[PLACEHOLDER] == 0
    # the only softmaxes left are the model's attention ones: none over the sources
    assert counted["relax.nn.softmax"] == attention_softmaxes
    assert [r["sources"] for r in lowering.lowered] == [len(s.sources) for s in sites]
    assert Counter(r["kernel"] for r in lowering.lowered) == site_calls
    # Full's later groups read their history once, in one partial chain per group (Block's sample is too short)
    partials = Counter(tuple(r["partial"]) for r in lowering.lowered if "partial" in r)
    assert {k: v for k, v in counted.items() if k.startswith(PARTIAL_PREFIX)} == Counter(k for c in partials for k in c)
    assert sorted(partials.values()) == ([2, 3] if name == "gpt_full" else [])
    # [batch, seq, D] sources go to every kernel as they are, partial links included: the lowering adds
    # no reshape (a link's history used to go to [rows, D] and its state back, 17 reshapes here)
    assert counted["relax.reshape"] == calls(imported)["relax.reshape"]
    manifest = load(artifact(name)).manifest
    assert [s["sources"] for s in manifest["sites"]] == [len(s.sources) for s in sites]
    assert all(s["kernel"].startswith(KERNEL_PREFIX) for s in manifest["sites"])


def test_the_softmax_count_sees_an_unfused_site(exported):
    """Control for the check above: the sites as one DepthAttention node each (the two-phase pair undone)
    with their function bodies inlined import as one softmax per site of three or more sources."""
    path = exported("gpt_full")
    model = onnx.load(str(path))
    attention_softmaxes = sum(n.op_type == "Softmax" for n in model.graph.node)
    sites = {s.node.output[0]: s for s in _sites(path)}
    nodes = [site_node(sites[n.output[0]].sources, n.input[-1], n.output[0], eps=1e-6, scale=sites[n.output[0]].scale,
                       axis=-1, rank=3, name=n.name) if n.output[0] in sites else n
             for n in model.graph.node if n.op_type != "DepthAttentionPartial"]
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    attach_functions(model)
    inlined = from_onnx(onnx.inliner.inline_local_functions(model))
    assert calls(inlined)["relax.nn.softmax"] == attention_softmaxes + sum(len(s.sources) >= 3 for s in sites.values())


def test_exported_program_through_from_exported_program(folder):
    """The torch.export route: single depth_attention ops, grouped by the lowering into partial + merges
    (Full: the groups of sites 4-6 and 7-8 read their history once), numerics against torch."""
    model, args = models.gpt_factory()
    dynamic = auto_dynamic_shapes(args, {})
    gm = ac.rewrite(model, args, ac.AttnResConfig(), dynamic_shapes=dynamic).graph_module
    with torch.no_grad():
        for p in gm.attnres.parameters():
            p.copy_(torch.randn(p.shape) / p.numel() ** 0.5)
    program = torch.export.export(gm, args, dynamic_shapes=dynamic, strict=False)
    sites = sum(n.target is torch.ops.attnres.depth_attention.default for n in program.graph.nodes)
    mod = import_model(program).mod
    assert calls(mod)[PLACEHOLDER] == sites == 8
    manifest = compile_model(program, folder / "gpt_program")
    assert len(manifest["sites"]) == sites and all(s["query"].startswith("attnres.") for s in manifest["sites"])
    assert Counter(tuple(s["partial"]) for s in manifest["sites"] if s.get("partial")).most_common() == [
        (("attnres_depth_attention_partial_j4_q3_d64_float32",), 3),
        (("attnres_depth_attention_partial_j7_q2_d64_float32",), 2)]
    tokens = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = gm(tokens).numpy()
    (actual,) = load(folder / "gpt_program")({"idx": tokens.numpy()}).values()
    err = float(np.abs(actual - expected).max())
    print(f"gpt full (from_exported_program): max abs error vs torch {err:.2e}")
    assert err <= ATOL


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_cuda_artifact_builds_without_a_gpu(artifact):
    out = artifact("gpt_full", "cuda")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device"] == "cuda" and manifest["target"]["arch"] == "sm_90"
    (device,) = manifest["cuda"]
    source = (out / device["source"]).read_text()
    for kernel in manifest["kernels"]:
        assert f"{kernel}_kernel" in source
    fatbin = (out / device["fatbin"]).read_bytes()
    assert fatbin[:4] == b"\x50\xed\x55\xba"  # fatbin magic
    if not tvm.cuda(0).exist:
        with pytest.raises(ArtifactError, match="runs on cuda"):
            load(out)


def test_round_trip_in_a_fresh_process(exported, artifact, tmp_path):
    path, out = exported("hf_llama"), artifact("hf_llama")
    feeds = _feeds(path, (2, 6), seed=4)
    np.savez(tmp_path / "in.npz", **feeds)
    script = textwrap.dedent(f"""
        import numpy as np
        from attnres_compile.backends.tvm import load
        with np.load({str(tmp_path / 'in.npz')!r}) as data:
            outputs = load({str(out)!r})({{k: data[k] for k in data.files}})
        np.savez({str(tmp_path / 'out.npz')!r}, **outputs)
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=300)
    here = load(out)(feeds)
    with np.load(tmp_path / "out.npz") as there:
        assert sorted(there.files) == sorted(here)
        for key in here:
            np.testing.assert_array_equal(there[key], here[key])


def _gained_relus(source: str, outputs: tuple[str, str]) -> tuple[list, list]:
    """Nodes and initializers of h1 = source + relu(source) * g0, h2 = h1 + relu(h1) * g1: two residual
    links, each branch with a learned per-feature gain (a link needs a learned op on its branch)."""
    h1, h2 = outputs
    gains = [onnx.numpy_helper.from_array(np.linspace(0.5, 1.5, 16, dtype=np.float32) * (i + 1), f"gain{i}")
             for i in range(2)]
    nodes = []
    for i, (x, h) in enumerate([(source, h1), (h1, h2)]):
        nodes += [helper.make_node("Relu", [x], [f"relu{i}"]),
                  helper.make_node("Mul", [f"relu{i}", f"gain{i}"], [f"branch{i}"]),
                  helper.make_node("Add", [x, f"branch{i}"], [h])]
    return nodes, gains


def _chain_onnx(folder: Path) -> Path:
    """x -> h1 = x + relu(x) * g0 -> h2 = h1 + relu(h1) * g1, rewritten: two sites, one tunable task
    (the fused relu-multiply, the same for both branches)."""
    nodes, gains = _gained_relus("x", ("h1", "h2"))
    graph = helper.make_graph(nodes + [helper.make_node("Identity", ["h2"], ["y"])], "chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])], initializer=gains)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "chain.onnx"))
    rewrite_onnx(folder / "chain.onnx", folder / "chain_attnres.onnx", force=True)
    _randomize_queries(folder / "chain_attnres.onnx")
    return folder / "chain_attnres.onnx"


def _records(database: Path) -> int:
    return len((database / "database_tuning_record.json").read_text().splitlines())


@pytest.mark.heavy
def test_tuning_fills_the_database_then_reuses_it(tmp_path, capfd):
    """Also the time budget (--tune-minutes): spent before the first batch is back, it ends the search
    there and the build goes on. (The stop used to terminate meta_schedule's tasks from the measure
    callback, which failed the scheduler's "!task->is_terminated" check when it had already picked
    one: a 20-minute tuned build of Llama was lost that way. It now raises out of the search.)"""
    path = _chain_onnx(tmp_path)
    database = tmp_path / "db"
    first = compile_model(path, tmp_path / "tuned", tune=True, trials=2, tune_minutes=1e-4, tuning_db=database,
                          static_shapes={"x": (4, 16)})
    assert first["tuning"]["tuned"] == 1 and first["tuning"]["measured"] >= 1
    assert first["static_shapes"] == {"x": [4, 16]} and first["inputs"][0]["shape"] == [4, 16]
    records = _records(database)
    assert records >= 1
    progress = capfd.readouterr().err
    assert "tune [1/1] fused_relu_multiply" in progress  # the kernels themselves are never tuned
    assert re.search(r"tune: time budget reached after \d+ trials: stopping", progress)
    second = compile_model(path, tmp_path / "tuned", tune=True, trials=2, tuning_db=database,
                           static_shapes={"x": (4, 16)}, force=True)
    assert second["tuning"] == {**first["tuning"], "reused": 1, "tuned": 0, "measured": 0}
    assert _records(database) == records
    feeds = {"x": np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32)}
    expected = ort_backend.run(ort_backend.session(path), feeds)["y"]
    assert np.abs(load(tmp_path / "tuned")(feeds)["y"] - expected).max() <= ATOL


@pytest.mark.heavy
def test_a_task_no_trial_can_run_is_recorded_and_not_retried(tmp_path, capfd):
    """A row lookup by GatherND fed meta_schedule's random indices reads out of bounds: every
    trial fails. It keeps the default schedule, is listed in untunable.json, and the next compile
    spends no trials on it. (A Gather no longer does: take wraps its indices, rewrites.py.)"""
    table = helper.make_tensor("table", TensorProto.FLOAT, [10, 16], np.linspace(-1, 1, 160, dtype=np.float32))
    nodes, gains = _gained_relus("x", ("h1", "y"))
    graph = helper.make_graph([helper.make_node("GatherND", ["table", "ids"], ["x"]), *nodes], "embed",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, [4, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])], initializer=[table, *gains])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "embed.onnx"))
    rewrite_onnx(tmp_path / "embed.onnx", tmp_path / "embed_attnres.onnx")
    database = tmp_path / "db"
    # an unnamed handler on meta_schedule's logger (pytest attaches one to every non-propagating
    # logger) used to make meta_schedule's logging set-up fail: tuning must not care
    unnamed = logging.NullHandler()
    logging.getLogger("tvm.s_tir.meta_schedule").addHandler(unnamed)
    try:
        first = compile_model(tmp_path / "embed_attnres.onnx", tmp_path / "a", tune=True, trials=1, tuning_db=database)
    finally:
        logging.getLogger("tvm.s_tir.meta_schedule").removeHandler(unnamed)
    assert first["tuning"]["untunable"] == 1 and first["tuning"]["tuned"] >= 1
    untunable = json.loads((database / "untunable.json").read_text())
    assert len(untunable) == 1 and "gather_nd" in next(iter(untunable.values()))
    assert "no trial ran for" in capfd.readouterr().err
    second = compile_model(tmp_path / "embed_attnres.onnx", tmp_path / "b", tune=True, trials=1, tuning_db=database)
    assert second["tuning"] == {**first["tuning"], "reused": first["tuning"]["tuned"], "tuned": 0, "measured": 0}
    ids = np.array([[0], [3], [9], [3]])
    expected = ort_backend.run(ort_backend.session(tmp_path / "embed_attnres.onnx"), {"ids": ids})["y"]
    assert np.abs(load(tmp_path / "b")({"ids": ids})["y"] - expected).max() <= ATOL


def test_tuning_registers_only_the_host_tensor_intrinsics():
    """In a fresh process (the package is not imported yet): inside `_host_intrinsics_only` the
    host's intrinsics are registered and no other target's module is imported (CUDA's alone
    takes 29 s); afterwards the stand-in package is gone, so a later import loads the real one."""
    code = textwrap.dedent("""
        import platform, sys
        from tvm.s_tir import TensorIntrin
        from attnres_compile.backends.tvm import tune
        name = "tvm.s_tir.tensor_intrin"
        assert name not in sys.modules
        with tune._host_intrinsics_only():
            loaded = sorted(m for m in sys.modules if m.startswith(name + "."))
            vnni = TensorIntrin.get("dot_16x4_vnni", allow_missing=True) is not None
        print(platform.machine(), loaded, vnni, name in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    machine, rest = out.stdout.split(" ", 1)
    if machine.lower() not in ("x86_64", "amd64"):
        pytest.skip(f"checked on x86 hosts; this one is {machine}")
    assert rest.split() == ["['tvm.s_tir.tensor_intrin.x86']", "True", "False"]


def test_the_time_budget_raises_out_of_the_search_and_terminates_no_task():
    """The progress callback stops the search by raising, never by terminating the scheduler's tasks
    from inside its own loop (which failed its "!task->is_terminated" check once it had picked one)."""

    class Scheduler:
        tasks_ = [SimpleNamespace(is_terminated=False)] * 2

        def terminate_task(self, task_id):
            raise AssertionError(f"task {task_id} terminated from the measure callback")

    progress = io.StringIO()
    callback = getattr(tune._Progress(["a", "b"], tune.UNBOUNDED_TRIALS, progress, minutes=1e-9), "_inst")
    ran = SimpleNamespace(error_msg=None, run_secs=[1e-5])
    callback.apply(Scheduler(), 0, [], [], [ran])  # the budget waits for every task's first batch
    with pytest.raises(tune.BudgetReached, match="after 2 trials"):
        callback.apply(Scheduler(), 1, [], [], [ran])
    assert callback.stopped and "time budget reached after 2 trials" in progress.getvalue()


def test_tuning_needs_static_shapes(tmp_path):
    with pytest.raises(ConfigError, match="static shapes"):
        compile_model(_chain_onnx(tmp_path), tmp_path / "out", tune=True, trials=2, tuning_db=tmp_path / "db")
    assert not (tmp_path / "out").exists()


def test_nchw_site_on_axis_1(tmp_path):
    """Feature axis 1 of [N, C, H, W] streams: permuted to last around the kernel."""
    rng = np.random.default_rng(6)
    query = (rng.standard_normal(8) / np.sqrt(8)).astype(np.float32)
    names, shape = ["s0", "s1", "s2"], ["n", 8, "h", "w"]
    node = site_node(names, "q", "y", eps=1e-6, scale=3.0, axis=1, rank=4, name="site")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in names],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
                              [onnx.numpy_helper.from_array(query, "q")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    attach_functions(model)
    onnx.save(model, str(tmp_path / "nchw.onnx"))
    manifest = compile_model(tmp_path / "nchw.onnx", tmp_path / "nchw")
    assert manifest["sites"][0]["feature_size"] == 8
    sources = [rng.standard_normal((2, 8, 3, 5)).astype(np.float32) * (i + 1) for i in range(3)]
    expected = depth_attention([torch.from_numpy(s) for s in sources], torch.from_numpy(query), 1e-6, 3.0, 1).numpy()
    actual = load(tmp_path / "nchw")(dict(zip(names, sources)))["y"]
    assert np.abs(actual - expected).max() <= ATOL


def _cli(*argv: str) -> int:
    args = cli_parser().parse_args(argv)
    return args.run(args)


def test_cli_compile_and_run(tmp_path, capsys):
    path = _chain_onnx(tmp_path)
    out = tmp_path / "art"
    assert _cli("compile", str(path), "-o", str(out), "--input-shape", "x:3x16") == 0
    printed = capsys.readouterr().out
    assert "compiled 2 depth-attention sites" in printed and "verified against onnxruntime at x 3x16:" in printed
    manifest = json.loads((out / "manifest.json").read_text())  # --input-shape sizes the verification only
    assert manifest["inputs"][0]["shape"] == ["b", 16] and manifest["static_shapes"] == {}
    x = np.random.default_rng(7).standard_normal((3, 16)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    assert _cli("run", str(out), "--inputs", str(tmp_path / "in.npz"), "-o", str(tmp_path / "out.npz")) == 0
    expected = ort_backend.run(ort_backend.session(path), {"x": x})["y"]
    with np.load(tmp_path / "out.npz") as got:
        assert np.abs(got["y"] - expected).max() <= ATOL
    with pytest.raises(InputError, match="pass --force"):
        _cli("compile", str(path), "-o", str(out))
    assert _cli("compile", str(path), "-o", str(tmp_path / "static"), "--static-shape", "x:3x16") == 0
    manifest = json.loads((tmp_path / "static" / "manifest.json").read_text())
    assert manifest["inputs"][0]["shape"] == [3, 16] and manifest["verification"]["verified_shapes"] == [{"x": [3, 16]}]
    with pytest.raises(ConfigError, match="--input-shape x:2x16 differs from its --static-shape x:3x16"):
        _cli("compile", str(path), "-o", str(tmp_path / "other"), "--static-shape", "x:3x16", "--input-shape", "x:2x16")
    with pytest.raises(ConfigError, match="--arch applies to --target cuda"):
        _cli("compile", str(path), "-o", str(tmp_path / "other"), "--arch", "sm_90")
    np.savez(tmp_path / "bad.npz", y=x)
    with pytest.raises(InputError, match="inputs must be exactly"):
        _cli("run", str(out), "--inputs", str(tmp_path / "bad.npz"), "-o", str(tmp_path / "o.npz"))
    assert load(out)({"x": x[:2]})["y"].shape == (2, 16)  # --input-shape left the batch dim symbolic
    with pytest.raises(InputError, match="expected"):
        load(tmp_path / "static")({"x": x[:2]})  # --static-shape fixed x to 3x16


def test_the_check_bound_grows_with_residual_depth(tmp_path, monkeypatch):
    """A deep model's bound is RTOL·sqrt(depth / 8) (rounding adds up along the stream: a correct
    30-layer decoder was 1.3e-4 off onnxruntime), said in a note; a build off by 1e-3 of the
    scale still fails at depth 32, and the original (plain adds) counts its links."""
    assert tvm_check.tolerance(8).rtol == tvm_check.RTOL == tvm_check.tolerance(2).rtol
    assert tvm_check.tolerance(60).rtol == pytest.approx(1e-4 * (60 / 8) ** 0.5)
    nodes, gains, h = [], [], "x"
    for k in range(32):  # h_{k+1} = h_k + relu(h_k) * g_k
        gains.append(onnx.numpy_helper.from_array(np.linspace(0.05, 0.15, 16, dtype=np.float32), f"g{k}"))
        nodes += [helper.make_node("Relu", [h], [f"r{k}"]), helper.make_node("Mul", [f"r{k}", f"g{k}"], [f"b{k}"]),
                  helper.make_node("Add", [h, f"b{k}"], [f"h{k + 1}"])]
        h = f"h{k + 1}"
    graph = helper.make_graph(nodes + [helper.make_node("Identity", ["h32"], ["y"])], "deep",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16])], initializer=gains)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "deep.onnx"))
    rewrite_onnx(tmp_path / "deep.onnx", tmp_path / "deep_attnres.onnx")
    assert tvm_check.onnx_depth(tmp_path / "deep.onnx") == tvm_check.onnx_depth(tmp_path / "deep_attnres.onnx") == 32
    manifest = compile_model(tmp_path / "deep_attnres.onnx", tmp_path / "art")
    assert any("grown with the model's 32 residual steps" in n for n in manifest["verification"]["notes"])
    honest = tvm_check.run
    monkeypatch.setattr(tvm_check, "run", lambda *a: [y + 1e-3 * np.abs(y).max() for y in honest(*a)])
    with pytest.raises(VerificationError, match="2e-04 allowed"):
        compile_model(tmp_path / "deep_attnres.onnx", tmp_path / "bad")


def test_compile_checks_the_build_against_its_source(tmp_path, capsys, monkeypatch):
    """`compile` runs the build against onnxruntime on generated inputs (rows in the manifest and
    printed); a build that differs (here: its outputs shifted by 1e-3 of their scale, as a
    miscompiled operator would) writes nothing and says how to skip the check."""
    path = _chain_onnx(tmp_path)
    assert _cli("compile", str(path), "-o", str(tmp_path / "art")) == 0
    printed = capsys.readouterr().out
    assert "verified against onnxruntime at x 2x16; x 1x16:" in printed and "✓ y" in printed
    check = json.loads((tmp_path / "art" / "manifest.json").read_text())["verification"]
    (row,) = check["rows"]
    assert check["reference"] == "onnxruntime" and row["verdict"] == "pass" and row["max_rel"] < 1e-5, row
    honest = tvm_check.run
    monkeypatch.setattr(tvm_check, "run", lambda *a: [y + 1e-3 * np.abs(y).max() for y in honest(*a)])
    with pytest.raises(VerificationError, match=r"differs from onnxruntime on output 'y' .*verify_outputs=False"):
        compile_model(path, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    manifest = compile_model(path, tmp_path / "unchecked", verify_outputs=False)
    assert "verification" not in manifest


def _chain_with_int_and_empty_outputs(folder: Path, only_empty: bool = False) -> Path:
    """The `_chain_onnx` chain returning y, ids = ArgMax(y) (int64) and none = y[0:0] (no elements), rewritten;
    or, `only_empty`, none alone."""
    nodes, gains = _gained_relus("x", ("h1", "h2"))
    gains.append(onnx.numpy_helper.from_array(np.array([0], np.int64), "zero"))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 16]),
               helper.make_tensor_value_info("ids", TensorProto.INT64, ["b"]),
               helper.make_tensor_value_info("none", TensorProto.FLOAT, [0, 16])]
    nodes += [helper.make_node("Slice", ["h2", "zero", "zero", "zero"], ["none"])]
    if only_empty:
        outputs = outputs[2:]
    else:
        nodes += [helper.make_node("Identity", ["h2"], ["y"]), helper.make_node("ArgMax", ["h2"], ["ids"], axis=-1, keepdims=0)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])], outputs,
                              initializer=gains)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "chain.onnx"))
    rewrite_onnx(folder / "chain.onnx", folder / "chain_attnres.onnx", force=True)
    return folder / "chain_attnres.onnx"


def test_compile_compares_integer_outputs_exactly_and_no_empty_output_passes(tmp_path, capsys, monkeypatch):
    """Issue 39 (13, 14): an int64 output beside the float one has its row and must be equal (a build whose
    argmax is off by one fails); an output with no elements is no ✓, and an all-empty check says so."""
    path = _chain_with_int_and_empty_outputs(tmp_path)
    assert _cli("compile", str(path), "-o", str(tmp_path / "art")) == 0
    printed = capsys.readouterr().out
    assert re.search(r"✓ ids +int64\[2\]: all equal", printed) and "∅ none" in printed and "✓ none" not in printed
    honest = tvm_check.run
    monkeypatch.setattr(tvm_check, "run", lambda *a: [y + (y.dtype == np.int64) for y in honest(*a)])
    with pytest.raises(VerificationError, match=r"on output 'ids' \(int64\[2\]: 2 of 2 values differ"):
        compile_model(path, tmp_path / "bad")
    monkeypatch.undo()
    empty = _chain_with_int_and_empty_outputs(tmp_path, only_empty=True)
    assert _cli("compile", str(empty), "-o", str(tmp_path / "empty")) == 0
    printed = capsys.readouterr().out
    assert re.search(r"not verified against onnxruntime at x 2x16[^:]*: nothing was compared: every output is empty", printed)
    assert "✓" not in printed


def test_bad_inputs_are_classified(tmp_path):
    with pytest.raises(ArtifactError, match="not an artifact folder"):
        load(tmp_path)
    plain = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    onnx.save(helper.make_model(plain, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "plain.onnx"))
    with pytest.raises(ConfigError, match="--target"):
        compile_model(tmp_path / "plain.onnx", tmp_path / "out", target="rocm")
    assert not (tmp_path / "out").exists()
