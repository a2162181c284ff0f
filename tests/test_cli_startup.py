"""What the command line costs before any work: `attnres-compile --help` answers in under a second
of CPU because nothing on the way imports torch (~1.2 s); the ops a saved program needs are still
registered as soon as torch is imported (torch's `torch.backends` entry point, pyproject.toml)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "import sys; from attnres_compile.cli import main; sys.argv[0] = 'attnres-compile'; sys.exit(main())"


def _cpu_seconds(argv: list[str]) -> float:
    """User plus system CPU time of one run of the console script's code (as pip's launcher runs it)."""
    child = subprocess.Popen([sys.executable, "-c", SCRIPT, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, argv
    return usage.ru_utime + usage.ru_stime


def test_help_answers_in_under_a_second():
    """CPU time, best of 3, so a loaded machine does not decide it (was 1.4 s with torch, 0.16 s without)."""
    best = min(_cpu_seconds(["--help"]) for _ in range(3))
    assert best < 1.0, f"attnres-compile --help took {best:.2f} s of CPU"


def test_parser_help_version_and_usage_errors_import_no_torch():
    code = textwrap.dedent("""
        import sys
        from attnres_compile import cli
        from attnres_compile.cli import parser
        parser.build()
        loaded = ["torch" in sys.modules]
        codes = []
        for argv in (["--help"], ["rewrite", "--help"], ["compile", "--help"], ["bench", "--help"], ["--version"],
                     ["rewrite"], ["nonsense"], ["inspect", "--blocks", "x"]):
            try:
                codes.append(cli.main(argv))
            except SystemExit as exc:
                codes.append(exc.code)
        print(codes, loaded + ["torch" in sys.modules])
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines()[-1] == "[0, 0, 0, 0, 0, 2, 2, 2] [False, False]", (run.stdout, run.stderr[-2000:])
    assert "\nattnres-compile 0.1.0\n" in run.stdout and run.stderr.count("attnres-compile: error:") == 3, run.stderr


class _TwoSites(torch.nn.Module):
    """One depth_attention and one two-phase partial + merge: the three ops a saved program can hold."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 8, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        y = torch.ops.attnres.depth_attention([x, x * 2], self.w[0], 1e-6, 2.0, -1)
        m, l, acc = torch.ops.attnres.depth_attention_partial([x, y], self.w, 1e-6, -1)
        return torch.ops.attnres.depth_attention_merge(m, l, acc, 1, [y * 3], self.w[1], 1e-6, 3.0, -1)


LOAD = r"""
import sys
{first}
import torch
ep = torch.export.load(sys.argv[1])
expected = torch.load(sys.argv[2])
out = ep.module()(expected["x"])
print("OK" if torch.allclose(out, expected["out"]) else "DIFFERS")
"""


def test_a_saved_program_loads_with_plain_torch(tmp_path):
    """torch.export.load needs torch.ops.attnres.*: torch's import registers them through our entry point,
    with nothing of ours imported first, after the package (which imports no torch), and after its ops."""
    model, x = _TwoSites(), torch.randn(3, 8)
    torch.export.save(torch.export.export(model, (x,)), tmp_path / "two.pt2")
    torch.save({"x": x, "out": model(x)}, tmp_path / "expected.pt")
    for first in ("", "import attnres_compile, importlib.util; importlib.util.find_spec('torch')",  # as transformers looks
                  "import attnres_compile.ops"):
        run = subprocess.run([sys.executable, "-c", LOAD.format(first=first), tmp_path / "two.pt2",
                              tmp_path / "expected.pt"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.stdout.strip() == "OK", (first, run.stderr[-2000:])
