"""The layers declared in pyproject.toml ([tool.importlinter], DEVELOPMENT.md) hold: no module imports a
layer above its own, at module level or inside a function, and no package has an import circle. The
linter does not see an import of a module that no longer exists, so every import of ours is also
resolved here, in every module and every function (a renamed module or a moved name fails)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("attnres_compile", "samples")


def lint(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the checkout at `root`: its pyproject.toml's contracts on its packages."""
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", command, "--no-cache", "--no-logo"], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})


def test_no_import_runs_up_a_layer():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_upward_import_or_a_circle_breaks_the_contracts(tmp_path):
    """The contracts can fail: in a copy, a function of the kernels importing the TVM backend (a lazy
    import counts) and the study's plots importing its report again are both reported."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "attnres_compile" / "kernels" / "fused.py", "a") as f:
        f.write("\n\ndef _upward():\n    from ..backends.tvm import lower  # noqa: F401\n")
    with open(tmp_path / "samples" / "study_plots.py", "a") as f:
        f.write("\n\ndef _circle():\n    from samples import study_report  # noqa: F401\n")
    proc = lint(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "attnres_compile.kernels is not allowed to import attnres_compile.backends" in proc.stdout
    assert "attnres_compile.kernels.fused -> attnres_compile.backends.tvm.lower" in proc.stdout
    assert "No cycles are allowed in samples" in proc.stdout


def _file(module: str) -> Path | None:
    """The source of one of our modules (a package's __init__.py), None if there is none."""
    path = ROOT.joinpath(*module.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def _names(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level, with those its PEP 562 `_HOMES` exports."""
    names, body = set(), list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "_HOMES" for t in getattr(node, "targets", [])):
                names |= {k.value for k in node.value.keys}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            body += node.body + node.orelse + getattr(node, "handlers", []) + getattr(node, "finalbody", [])
        elif isinstance(node, ast.ExceptHandler):
            body += node.body
    return names


def _imports(module: str, tree: ast.Module):
    """(line, module, name or None) for each import of ours in `module`, relative ones resolved."""
    file = _file(module)
    package = module if file and file.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom) and (file or not node.level):  # a script's own relative imports: not ours
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] in PACKAGES:
                yield from ((node.lineno, target, a.name) for a in node.names)


def test_every_import_of_ours_names_what_exists():
    """In the packages, the tests and the benchmarks."""
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    assert len(files) > 90
    trees = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): ast.parse(p.read_text())
             for p in files}
    scripts = {".".join(p.relative_to(ROOT).with_suffix("").parts): ast.parse(p.read_text())
               for folder in ("tests", "benchmarks") for p in (ROOT / folder).glob("*.py")}
    missing = []
    for module, tree in {**trees, **scripts}.items():
        for line, target, name in _imports(module, tree):
            where = f"{module}:{line}"
            if target not in trees:
                missing.append(f"{where} imports {target}, which does not exist")
            elif name and f"{target}.{name}" not in trees and name not in _names(trees[target]):
                missing.append(f"{where} imports {name} from {target}, which has no such name")
    assert not missing, "\n".join(dict.fromkeys(missing))
