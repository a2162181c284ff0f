"""The README is a user's map: its Python examples run from any folder, it stays short and narrow, and its links
stay inside the repository; docs/ holds prose only (the measured runs live in benchmarks/runs/)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _run(code: str, folder: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_python_examples_run_outside_the_checkout(tmp_path):
    api, generate, _ = re.findall(r"```python\n(.*?)```", README, re.S)
    out = _run(api, tmp_path)
    assert "'verdict': 'pass'" in out and "torch.Size([3, 20, 100]) torch.Size([32])" in out
    assert _run(generate, tmp_path).strip().splitlines()[-1] == "True"


def test_fine_tune_and_ship_loop(tmp_path):
    """convert -> LoRA + queries with Trainer -> save_pretrained -> from_pretrained -> ONNX -> generate: the ONNX
    file's greedy tokens (the README's `attnres-compile generate` line) are the trained model's own."""
    loop = re.findall(r"```python\n(.*?)```", README, re.S)[2]
    assert len(loop.strip().splitlines()) <= 25
    tokens = json.loads(_run(loop, tmp_path).strip().splitlines()[-1])
    assert len(tokens) == 8
    line = re.search(r"\n    (attnres-compile generate tuned.onnx [^#\n]*?)\s*#", README).group(1).split()
    done = subprocess.run([sys.executable, "-m", "attnres_compile.cli", *line[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[0] == ",".join(map(str, tokens))


def test_readme_stays_a_map():
    """What it is, set-up, three ways in, fine-tune and ship, serve on CPU (the llama.cpp table), train at scale,
    where to read more: at most 200 lines of at most 120 characters (characters, not bytes). Other status tables
    live in docs/status.md."""
    lines = README.splitlines()
    assert len(lines) <= 200, len(lines)
    wide = [(number, len(line)) for number, line in enumerate(lines, 1) if len(line) > 120]
    assert not wide, f"README lines over 120 characters (line, length): {wide}"


def test_links_point_inside_the_repository():
    for target in LINK.findall(README):
        assert not target.startswith(("/", "..", "http")), target
        assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"
    assert "shared/" not in README and "DESIGN.md" not in README


def test_docs_hold_prose_only():
    """docs/ holds the guides as Markdown: no benchmark output, no scripts (benchmarks/ has both). A PNG may stay
    only where a page of docs/ shows it."""
    shown = {(page.parent / target).resolve() for page in DOCS.rglob("*.md")
             for target in LINK.findall(page.read_text(encoding="utf-8")) if target.endswith(".png")}
    other = [str(f.relative_to(ROOT)) for f in DOCS.rglob("*")
             if f.is_file() and f.suffix != ".md" and not (f.suffix == ".png" and f.resolve() in shown)]
    assert not other, f"docs/ holds files that are not prose: {other[:20]}"


def test_docs_links_resolve():
    for page in DOCS.rglob("*.md"):
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert not target.startswith("/"), f"{page.relative_to(ROOT)} links to the absolute path {target}"
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(ROOT.resolve()), f"{page.relative_to(ROOT)} links outside: {target}"
            assert resolved.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
