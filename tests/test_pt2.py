""".pt2 archives: a file we write loads again anywhere; a file from elsewhere never runs code.

- A rewritten HF model (ModelOutput outputs, `use_cache=False` input) written by
  `rewrite -o X.pt2` loads in a fresh process with only `import attnres_compile` and plain
  `torch.export.load`, takes the model's own call (`use_cache=False` included) at another batch and
  sequence size, and in `inspect --weights`; the file
  has a normal file's permissions and no temporary name inside.
- Crafted archives (tests/pt2_vectors.py), one per way torch.export.load runs code from a file,
  with a marker payload: the vectors are real (plain torch.export.load runs most payloads), and
  neither `inspect --weights` nor `compile` runs any (exit 20, one line).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from forked_cli import run_cli  # noqa: E402
from hostile import pt2_bytes  # noqa: E402
from pt2_vectors import vectors  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUN_WITH_TORCH = {"pickled-weight", "pickled-constant", "opaque-constant", "example-inputs", "legacy-weights",
                  "shape-expression", "guard-code"}  # what plain torch.export.load (+ .module()) runs, torch 2.13

FRESH = r"""
import sys, torch, attnres_compile
from samples.hf_models import gpt2_factory
model, inputs = gpt2_factory()
assert inputs["use_cache"] is False
ep = torch.export.load(sys.argv[1])
out = ep.module()(**inputs)  # the model's own call, use_cache=False included
small = ep.module()(**{k: v[:1, :5] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
print("OK", type(out).__name__, len(out), tuple(out[0].shape), tuple(small[0].shape))
"""


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("crafted")
    paths = {}
    for name, data in vectors(pt2_bytes(), "MARKER").items():
        paths[name] = folder / f"{name}.pt2"
        paths[name].write_bytes(data)
    return paths


def test_hf_model_archive_loads_in_a_fresh_process(tmp_path):
    out = tmp_path / "gpt2.pt2"
    run = run_cli(["rewrite", "samples.hf_models:gpt2_factory", "-o", out], cwd=ROOT, setup=lambda: os.umask(0o022))
    assert run.code == 0, run.stderr
    assert out.stat().st_mode & 0o777 == 0o644
    names = zipfile.ZipFile(out).namelist()
    assert all(n.startswith("archive/") for n in names) and not any(".tmp" in n for n in names)
    fresh = subprocess.run([sys.executable, "-c", FRESH, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert fresh.returncode == 0 and "OK tuple 1 (2, 8, 100) (1, 5, 100)" in fresh.stdout, fresh.stderr[-2000:]
    weights = run_cli(["inspect", "--weights", out, "--heatmap", tmp_path / "w.png"])
    assert weights.code == 0 and "chain0" in weights.stdout, weights.stderr

    from attnres_compile import pt2
    from attnres_compile.core.errors import ConfigError
    from samples.hf_models import gpt2_factory

    loaded = pt2.load(out)
    assert loaded.outputs == ["logits"] and loaded.constants == {"use_cache": False}
    model, inputs = gpt2_factory()  # the factory's own inputs, use_cache=False included, as traced
    expected = model(**inputs).logits
    torch.testing.assert_close(loaded.module()(**inputs)[0], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="traced with use_cache=False"):
        loaded.module()(**{**inputs, "use_cache": True})
    with pytest.raises(ConfigError, match="takes no such keyword input"):
        loaded.module()(**inputs, labels=inputs["input_ids"])


def test_a_program_exported_elsewhere_takes_its_constant_inputs_as_traced(tmp_path):
    """torch.export of the factory's inputs keeps use_cache=False as a constant input: `module()`
    supplies it when left out, and refuses another value in one line, before torch's guard."""
    from attnres_compile import pt2
    from attnres_compile.core.errors import ConfigError
    from samples.hf_models import gpt2_factory

    model, inputs = gpt2_factory()
    torch.export.save(torch.export.export(model, (), inputs, strict=False), tmp_path / "plain.pt2")
    loaded = pt2.load(tmp_path / "plain.pt2")
    assert loaded.constants == {"use_cache": False}
    tensors = {k: v for k, v in inputs.items() if k != "use_cache"}
    expected = model(**inputs).logits
    torch.testing.assert_close(loaded.module()(**tensors).logits, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="traced with use_cache=False"):
        loaded.module()(**{**inputs, "use_cache": True})


def test_crafted_archives_run_code_in_torch_but_never_in_attnres_compile(crafted, tmp_path):
    ran = set()
    for name, path in crafted.items():  # the threat: plain torch.export.load, in a forked child each
        cwd = tmp_path / f"torch-{name}"
        cwd.mkdir()
        pid = os.fork()
        if pid == 0:
            try:
                os.chdir(cwd)
                os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
                import torch

                torch.set_num_threads(1)
                program = torch.export.load(str(path))
                program.module()(*program.example_inputs[0])
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        if (cwd / "MARKER").exists():
            ran.add(name)
    assert ran == RUN_WITH_TORCH
    for name, path in crafted.items():
        for argv in (["inspect", "--weights", path, "--heatmap", tmp_path / "h.png"], ["compile", path, "-o", tmp_path / "art"]):
            cwd = tmp_path / f"ours-{name}-{argv[0]}"
            cwd.mkdir()
            run = run_cli(argv, cwd=cwd)
            code = 6 if name == "legacy-zip" else 20
            assert run.code == code and len(run.lines) == 1, (name, argv[0], run.code, run.stderr)
            assert "refusing to load it" in run.lines[0] or code == 6, run.lines
            assert not any(cwd.iterdir()), (name, argv[0])  # no marker, nothing else
            assert not (tmp_path / "h.png").exists() and not (tmp_path / "art").exists()


class _GroupedExperts(torch.nn.Module):
    """Two experts over sorted tokens through transformers' grouped matmul, as HF MoE layers export."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight, torch.tensor([3, 5]))


LIBRARY_OP = r"""
import sys
from attnres_compile import pt2
assert "transformers" not in sys.modules
loaded = pt2.load(sys.argv[1])
import torch
x = torch.arange(20.0).reshape(5, 4)
w = loaded.program.state_dict["weight"]
expected = torch.cat([x[:3] @ w[0], x[3:] @ w[1]])
assert torch.allclose(loaded.program.module()(x)[0], expected)
print("OK")
"""


def test_a_listed_operator_of_another_library_loads_in_a_fresh_process(tmp_path):
    """transformers' grouped matmul (HF Mixtral, Qwen2-MoE, OLMoE): the archive used to be refused
    as code, and `rewrite -o X.pt2` of an MoE model failed with an internal error. The reader now
    imports its module (transformers.integrations.moe) to register it, in a fresh process, and
    the program runs; any other operator of another library is still refused."""
    pytest.importorskip("transformers.integrations.moe")
    from attnres_compile import pt2
    from attnres_compile.core.errors import TraceError, UnsafeArchiveError
    from attnres_compile.pt2 import trust
    from attnres_compile.onnx import export as onnx_export

    x = torch.randn(5, 4)
    program = torch.export.export(_GroupedExperts(), (x,))
    pt2.save(program, tmp_path / "moe.pt2")
    fresh = subprocess.run([sys.executable, "-c", LIBRARY_OP, str(tmp_path / "moe.pt2")], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert fresh.returncode == 0 and "OK" in fresh.stdout, fresh.stderr[-2000:]
    with pytest.raises(UnsafeArchiveError, match=r"call target 'torch\.ops\.transformers\.other\.default'"):
        trust.check_program_json({"nodes": [{"target": "torch.ops.transformers.other.default"}]}, tmp_path / "x.pt2")
    with pytest.raises(TraceError, match="torch.onnx cannot export .*grouped_mm_fallback.*-o X.pt2"):
        onnx_export.export(_GroupedExperts(), (x,))
