"""The wheel holds the plugin and nothing of the tests; the plugin holds no test hook.

The wheel is built from a copy of the package sources through the PEP 517 backend of
``pyproject.toml`` (setuptools, no network, nothing written into the checkout) and its file list
is checked: every file under ``vllm_ddtree/`` or its ``.dist-info``, every package module there,
no ``tests/`` path and no module of ``tests/support``. The package sources are then scanned for
imports of test code, test environment variables and the former test hooks.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_ddtree"
SUPPORT = ROOT / "tests" / "support"

#: Hooks production code used to carry for tests (now wrapped from outside, tests/support).
FORMER_HOOKS = ("set_draft_injector", "_DRAFT_INJECTOR", "set_verify_observer",
                "notify_observer", "_VERIFY_OBSERVER", "injector_from_file")
#: Environment variables only tests may read.
TEST_ENV = re.compile(r"VLLM_DDTREE_TEST\w*|VLLM_TEST_\w*")


def _package_modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")
            if "__pycache__" not in p.parts}


def _copy_sources(dst: Path) -> Path:
    """The files a wheel is built from, as in a checkout (tests included), under ``dst``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    shutil.copytree(PACKAGE, dst / "vllm_ddtree", ignore=ignore)
    shutil.copytree(ROOT / "tests", dst / "tests", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    return dst


def _build_wheel(src: Path, out: Path) -> list[str]:
    """Build a wheel from ``src`` with the ``pyproject.toml`` backend; its file names."""
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys, setuptools.build_meta as b; print('WHEEL', b.build_wheel(sys.argv[1]))",
         str(out)], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (wheel,) = out.glob("vllm_ddtree-*.whl")
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def _leaks(wheel_files: list[str]) -> list[str]:
    """Wheel files that are not the plugin's: outside the package, under tests/ or testing/,
    or named like a module of tests/support."""
    support = {p.name for p in SUPPORT.rglob("*.py") if p.name != "__init__.py"}
    assert "oracle_drafts.py" in support and "sitecustomize.py" in support
    return [f for f in wheel_files
            if (not f.startswith("vllm_ddtree/") and ".dist-info/" not in f)
            or f.startswith("tests/") or "/tests/" in f or "/testing/" in f
            or Path(f).name in support]


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    """File names inside the wheel built from the current sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    return _build_wheel(_copy_sources(tmp / "src"), tmp / "dist")


def test_wheel_holds_the_package_only(wheel_files):
    assert not _leaks(wheel_files), f"test code in the wheel: {_leaks(wheel_files)}"
    missing = _package_modules() - set(wheel_files)
    assert not missing, f"package modules missing from the wheel: {sorted(missing)}"


def test_the_wheel_check_sees_test_code(tmp_path):
    """Power check: test support put back inside the package (the old ``vllm_ddtree/testing``
    layout) is found in the wheel."""
    src = _copy_sources(tmp_path / "src")
    shutil.copytree(src / "tests" / "support", src / "vllm_ddtree" / "testing")
    leaked = _leaks(_build_wheel(src, tmp_path / "dist"))
    assert "vllm_ddtree/testing/oracle_drafts.py" in leaked, leaked
    assert "vllm_ddtree/testing/site/sitecustomize.py" in leaked, leaked


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring constant (docs may name test code; code may not)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_package_has_no_test_hooks():
    """No import of test code, no test environment variable or test module named in a string
    of code (e.g. a lazy import or registry entry), none of the former hook names."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        for name in _imports(tree):
            if (name.split(".")[0] in ("tests", "pytest", "hypothesis")
                    or name.startswith("vllm_ddtree.testing")):
                problems.append(f"{rel}: imports {name}")
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docs):
                problems += [f"{rel}: test environment variable {m}"
                             for m in TEST_ENV.findall(node.value)]
                problems += [f"{rel}: names test module {m}" for m in
                             re.findall(r"\btests[./]support\S*|vllm_ddtree\.testing\S*", node.value)]
        problems += [f"{rel}: test hook {hook}" for hook in FORMER_HOOKS if hook in text]
    assert not problems, "\n".join(problems)


def test_the_scan_sees_a_hook(tmp_path, monkeypatch):
    """Power check: the scan above flags each kind of leak in a module of the package."""
    fake = tmp_path / "vllm_ddtree"
    shutil.copytree(PACKAGE, fake, ignore=shutil.ignore_patterns("__pycache__"))
    (fake / "leak.py").write_text(
        "import os\nfrom tests.support.oracle_drafts import OracleDrafts\n"
        "PATH = os.environ.get('VLLM_DDTREE_TEST_DRAFTS')\n"
        "ARCH = 'tests.support.unknown_recurrent:Model'\n"
        "def set_draft_injector(fn):\n    pass\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as err:
        test_package_has_no_test_hooks()
    msg = str(err.value)
    for want in ("imports tests.support.oracle_drafts", "VLLM_DDTREE_TEST_DRAFTS",
                 "names test module tests.support.unknown_recurrent", "test hook set_draft_injector"):
        assert want in msg, msg
