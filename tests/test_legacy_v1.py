"""Model Runner V1 is a legacy adapter that can be deleted in one commit.

Everything of V1 lives in the package ``vllm_ddtree/runners/v1/``: the register entries of every
V1 symbol, the hooks, the proposer, V1's verification. Nothing else imports it by name
(``integration.legacy_v1`` loads it optionally), so deleting the package is the whole removal.
These tests hold that line: they scan the package for V1 outside the adapter, and they delete the
adapter from a copy of the package, import every module of the copy and check the copy's register
against vLLM 0.34.0's sources.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from vllm_ddtree import integration
from vllm_ddtree.runners.v1.register import CHANGES, V1_MODULES

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm_ddtree"
LEGACY = PACKAGE / "runners" / "v1"
LEGACY_SITE = "vllm_ddtree/runners/v1/"


def v1_imports(path: Path, text: str) -> list[str]:
    """``path:line: module`` for every import in ``text`` of the legacy adapter or of one of
    vLLM's V1 modules (absolute or relative)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if (name == integration.LEGACY_V1 or name.startswith(integration.LEGACY_V1 + ".")
                    or name in V1_MODULES):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
                break
    return found


def _outside_the_adapter() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if LEGACY not in p.parents]


def test_nothing_outside_the_adapter_imports_v1():
    bad = [line for p in _outside_the_adapter() for line in v1_imports(p, p.read_text())]
    assert bad == []


def test_the_import_scan_can_fail():
    here = PACKAGE / "runners" / "v2.py"
    assert v1_imports(here, "from vllm_ddtree.runners.v1.proposer import DDTreeProposer\n")
    assert v1_imports(here, "from .v1 import hooks\n")
    assert v1_imports(here, "from . import v1\n")
    assert v1_imports(here, "def f():\n    from vllm.v1.sample.sampler import Sampler\n")
    assert not v1_imports(here, "from vllm.v1.worker.gpu.sample.sampler import Sampler\n")


def test_the_adapter_states_every_v1_entry():
    """Every register entry that only V1 needs is the adapter's, with a site inside it, and
    absent in vLLM 0.34; no other entry names a site inside it."""
    legacy = {c.target for c in CHANGES}
    for c in integration.REGISTER:
        mine = c.target in legacy
        assert mine == c.site.startswith(LEGACY_SITE), (c.target, c.site)
        if c.module in V1_MODULES:
            assert mine and not c.present("0.34.0"), c.target
    assert all(not c.present("0.34.0") or c.module not in V1_MODULES for c in CHANGES)
    assert [c.target for c in integration.REGISTER[-len(CHANGES):]] == [c.target for c in CHANGES]


_IN_THE_COPY = r"""
import importlib, json, pkgutil, sys
import vllm_ddtree
from vllm_ddtree import integration
assert vllm_ddtree.__file__.startswith(sys.argv[1]), vllm_ddtree.__file__
assert integration.legacy_v1("register") is None and integration.legacy_v1("hooks") is None
failed = {}
for m in pkgutil.walk_packages(vllm_ddtree.__path__, "vllm_ddtree."):
    try:
        importlib.import_module(m.name)
    except Exception as e:  # noqa: BLE001 - reported by name
        failed[m.name] = f"{type(e).__name__}: {e}"
problems, skipped = integration.check_sources(sys.argv[2], "0.34.0")
from vllm_ddtree import patches
try:  # the installed vLLM (0.32) has V1: without its adapter the plugin refuses it
    patches.apply_patches()
    refused = None
except integration.UnsupportedVLLMVersion as e:
    refused = str(e)
print(json.dumps({"failed": failed, "problems": problems, "refused": refused,
                  "v1": [c.target for c in integration.REGISTER
                         if c.site.startswith("vllm_ddtree/runners/v1")],
                  "patches": len(integration.entries("patch"))}))
"""


def test_deleting_the_adapter_leaves_a_working_package(tmp_path, vllm034_overlay):
    """The package without ``runners/v1/``: every module still imports, no entry of the
    register points into the deleted adapter, and the register passes against vLLM 0.34.0's
    sources; on the installed vLLM 0.32, which has V1, the plugin refuses to install rather than
    let V1 run plain DFlash. With the adapter kept, the same check counts its patches (the
    check can see it)."""
    copy = tmp_path / "copy"
    shutil.copytree(PACKAGE, copy / "vllm_ddtree",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.rmtree(copy / "vllm_ddtree" / "runners" / "v1")
    env = {**os.environ, "PYTHONPATH": str(copy)}
    run = subprocess.run([sys.executable, "-c", _IN_THE_COPY, str(copy), str(vllm034_overlay)],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["failed"] == {} and out["problems"] == [] and out["v1"] == [], out
    assert "has Model Runner V1, but this vllm-ddtree build has no V1 adapter" in out["refused"]
    legacy_patches = sum(c.kind == "patch" for c in CHANGES)
    assert out["patches"] == len(integration.entries("patch")) - legacy_patches > 0
