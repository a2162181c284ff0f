"""The README is a newcomer's map: its Python example runs from any folder, its links stay inside
the repository."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def _run(code: str, folder: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_python_examples_run_outside_the_checkout(tmp_path):
    api, generate = re.findall(r"```python\n(.*?)```", README, re.S)
    out = _run(api, tmp_path)
    assert "'verdict': 'pass'" in out and "torch.Size([3, 20, 100]) torch.Size([32])" in out
    assert _run(generate, tmp_path).strip().splitlines()[-1] == "True"


def test_links_point_inside_the_repository():
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        assert not target.startswith(("/", "..", "http")), target
        assert (ROOT / target).exists(), f"README links to {target}, which is not in the repository"
    assert "shared/" not in README and "DESIGN.md" not in README
