"""What an operator relies on in the OpenAI server with DDTree (issue 15): no request kills it,
refusals say what the user did. One server on the shipped trained pair for the module."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support import trained
from tests.support.server import free_port, served

SERVED = "pystdlib"
CHUNK = 64  # max_num_batched_tokens: LONG_PROMPT's prefill takes several steps
LONG_PROMPT = trained.heldout_prompts(1)[0] * 3


def server_argv(port: int, *extra: str) -> list[str]:
    """The module entry of vLLM's server with DDTree (B = 16) on the trained pair, fp32, eager."""
    target, drafter = trained.require()
    spec = json.dumps({"method": "ddtree", "model": str(drafter), "ddtree_budget": 16})
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "1024", "--enforce-eager", "--served-model-name", SERVED,
            "--max-num-batched-tokens", str(CHUNK), "--speculative-config", spec, *extra]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with served(server_argv(port), port, log) as s:
        yield s


def test_seeded_request_with_chunked_prefill_is_served(server):
    """A seeded request whose prefill is chunked used to kill the CPU engine (500, then /health
    503); now it completes, reproduces, and the server stays healthy."""
    body = {"model": SERVED, "prompt": LONG_PROMPT, "max_tokens": 16, "temperature": 0.8,
            "seed": 1234, "ignore_eos": True}
    status, first = server.post("/v1/completions", body)
    assert status == 200, first
    assert first["usage"]["prompt_tokens"] > 2 * CHUNK  # the prefill really was chunked
    assert first["usage"]["completion_tokens"] == 16
    status, again = server.post("/v1/completions", body)
    assert status == 200 and again["choices"][0]["text"] == first["choices"][0]["text"]
    assert server.get("/health")[0] == 200
    assert "CPU Generator does not use offset" not in server.log()


def test_echo_with_logprobs_is_refused_naming_echo(server):
    status, body = server.post("/v1/completions", {
        "model": SERVED, "prompt": "def f(x):\n", "max_tokens": 4, "echo": True, "logprobs": 1})
    assert status == 400, body
    message = json.dumps(body)
    assert "echo" in message and "logprobs" in message, message
    assert server.get("/health")[0] == 200
