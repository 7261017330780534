"""Entry points of this checkout's ``pyproject.toml`` for processes started by tests.

The venv may hold vllm-ddtree installed (editable) from another checkout, whose installed
metadata lacks entry points added since; vLLM finds plugins only through that metadata
(``importlib.metadata.entry_points``). :func:`checkout_entry_points` writes a minimal
distribution holding the groups the installed one does not declare, for ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.metadata as md
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checkout_entry_points(dst: Path) -> Path:
    """Write ``dst/vllm_ddtree_checkout-0.dist-info`` with the entry-point groups of
    ``pyproject.toml`` that no installed distribution declares; returns ``dst`` (put it on
    ``PYTHONPATH``)."""
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    lines = []
    for group, entries in groups.items():
        if md.entry_points(group=group):
            continue
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
    info = dst / "vllm_ddtree_checkout-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-ddtree-checkout\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return dst
