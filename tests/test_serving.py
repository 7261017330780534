"""DDTree in spawned engine processes and behind vLLM's OpenAI-compatible server."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.models import make_llm, release_llm

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", **extra})
    return env


def test_multiprocess_engine(qwen3_target, dflash_drafter, tmp_path):
    """With VLLM_ENABLE_V1_MULTIPROCESSING=1 the engine core runs in a spawned process: the
    plugin must load there, get its settings through additional_config, and stay exact. Oracle
    drafts are installed in that process by ``tests/support/site`` (the main job's own prompts
    and settings), so trees are accepted deeply there too."""
    from tests.support import trained
    from tests.support.oracle_drafts import reference_drafts, subprocess_env

    _, drafts = reference_drafts(qwen3_target, trained.heldout_prompts(8), 24,
                                 tmp_path / "drafts.json")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "generate.py"), "--target", str(qwen3_target),
         "--drafter", str(dflash_drafter), "--budget", "40", "--max-tokens", "24",
         "--configs", "fixed", "--rounds", "1"],
        env=subprocess_env(drafts, base=_env(VLLM_ENABLE_V1_MULTIPROCESSING="1",
                                              VLLM_LOGGING_LEVEL="INFO")),
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "greedy DDTree output identical to target-only: True" in out
    ready = [line for line in out.splitlines() if "DDTree proposer ready in pid" in line]
    assert ready, "the DDTree proposer never started"
    assert all("node budget B=40" in line for line in ready), "settings did not reach the worker"
    pids = {int(line.split("in pid ")[1].split(":")[0]) for line in ready}
    front = int(out.split("front-end pid ")[1].split()[0])
    assert front not in pids, "the proposer ran in the front-end process, not a spawned one"
    injected = {int(line.split(" in pid ")[1]) for line in out.splitlines()
                if "tests.support: oracle drafts (V1)" in line}
    assert injected and injected <= pids, (injected, pids)
    # τ of the table's DDTree rows (batch 1 and batch 8): oracle drafts are accepted deeply.
    taus = [float(t) for t in re.findall(r"^\| \d+ \| DDTree B=40 \| ([\d.]+) \|", out, re.M)]
    assert len(taus) == 2 and min(taus) > 3, f"oracle drafts not accepted deeply (τ {taus})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def _post(url: str, body: dict, timeout: float = 120.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def test_openai_server_completions_equal_offline(qwen3_target, dflash_drafter, tmp_path):
    """``python -m vllm.entrypoints.openai.api_server --speculative-config '{"method":"ddtree"…}'``
    on 127.0.0.1 answers /v1/completions with the same text as offline target-only greedy."""
    from vllm import SamplingParams

    prompts = ["def main():\n", "import os\nimport sys\n"]
    llm = make_llm(qwen3_target)
    want = [o.outputs[0].text for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))]
    release_llm(llm)

    port = _free_port()
    spec = json.dumps({"method": "ddtree", "model": str(dflash_drafter), "ddtree_budget": 16})
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(qwen3_target),
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--max-model-len", "1024", "--enforce-eager", "--served-model-name", "tiny",
         "--speculative-config", spec, "--disable-log-stats"],
        env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if server.poll() is not None:
                pytest.fail("server exited:\n" + (tmp_path / "server.log").read_text()[-4000:])
            try:
                if _get(base + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                pytest.fail("server not healthy in 300 s")
            time.sleep(1.0)
        got = []
        for p in prompts:
            r = _post(base + "/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 32,
                                                 "temperature": 0, "ignore_eos": True})
            got.append(r["choices"][0]["text"])
        assert got == want
        # A request DDTree cannot honour exactly is refused clearly, not served differently.
        req = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 4,
                             "temperature": 0.8, "frequency_penalty": 0.5}).encode(),
            headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 400 and b"frequency_penalty" in e.value.read()
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    assert "DDTree proposer ready" in (tmp_path / "server.log").read_text()
