"""What an operator relies on in the OpenAI server with DDTree (issue 15): no request kills it,
refusals say what the user did, ``/metrics`` counts trees. One server on the shipped trained
pair for the module."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from tests.support import trained
from tests.support.entry_points import checkout_entry_points
from tests.support.server import free_port, served, server_env

SERVED = "pystdlib"
CHUNK = 64  # max_num_batched_tokens: LONG_PROMPT's prefill takes several steps
LONG_PROMPT = trained.heldout_prompts(1)[0] * 3


BUDGET, HORIZON = 16, 15  # the trained drafter's block is 16: L = 15


def server_argv(port: int, *extra: str) -> list[str]:
    """The module entry of vLLM's server with DDTree (B = 16) on the trained pair, fp32, eager."""
    target, drafter = trained.require()
    spec = json.dumps({"method": "ddtree", "model": str(drafter), "ddtree_budget": BUDGET})
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "1024", "--enforce-eager", "--served-model-name", SERVED,
            "--max-num-batched-tokens", str(CHUNK), "--speculative-config", spec, *extra]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    root = tmp_path_factory.mktemp("server")
    # This checkout's stat-logger entry point, and the periodic stats line every second.
    path = os.pathsep.join(filter(None, [str(checkout_entry_points(root / "site")),
                                         os.environ.get("PYTHONPATH")]))
    env = server_env(PYTHONPATH=path, VLLM_LOG_STATS_INTERVAL="1")
    with served(server_argv(port), port, root / "server.log", env=env) as s:
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


_SAMPLE = re.compile(r'^(vllm:[\w:]+)\{([^}]*)\} (\S+)$')


def scrape(server) -> dict[tuple[str, str], float]:
    """``(metric, labels other than model_name/engine) -> value`` of this model's ``vllm:``
    samples in ``/metrics``."""
    status, body = server.get("/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        m = _SAMPLE.match(line)
        if not m or f'model_name="{SERVED}"' not in m.group(2):
            continue
        labels = ",".join(sorted(x for x in m.group(2).split(",")
                                 if not x.startswith(("model_name=", "engine="))))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def _steady(server) -> dict[tuple[str, str], float]:
    """Scrape until two scrapes a second apart agree (stats reach the front end with outputs)."""
    last = scrape(server)
    for _ in range(10):
        time.sleep(1.0)
        now = scrape(server)
        if now == last:
            return now
        last = now
    return last


def test_tau_from_metrics_equals_offline_counters(server):
    """After a known run, the DDTree series in ``/metrics`` say what the engine's own counters
    say for the same prompts offline: same verification steps, accepted tokens and per-depth
    counts (so the same τ), vLLM's per-position series sized by L, and τ in the log line."""
    from vllm import SamplingParams

    from tests.support.models import make_llm, release_llm

    prompts = trained.heldout_prompts(4)[1:]
    before = _steady(server)
    for p in prompts:  # one at a time, as offline below
        status, body = server.post("/v1/completions", {
            "model": SERVED, "prompt": p, "max_tokens": 32, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, body
    after = _steady(server)

    def delta(name, labels=""):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    steps = delta("vllm:ddtree_verification_steps_total")
    accepted = delta("vllm:ddtree_accepted_tokens_total")
    per_depth = [delta("vllm:ddtree_accepted_tokens_per_depth_total", f'depth="{d}"')
                 for d in range(1, HORIZON + 1)]
    assert steps > 0 and accepted > steps  # the trained pair accepts deep paths
    tau_metrics = 1 + accepted / steps

    target, drafter = trained.require()
    llm = make_llm(target, max_num_batched_tokens=CHUNK, speculative_config={
        "method": "ddtree", "model": str(drafter), "ddtree_budget": BUDGET})
    try:
        for p in prompts:
            llm.generate([p], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                         use_tqdm=False)
        offline = {m.name: m for m in llm.get_metrics()}
    finally:
        release_llm(llm)
    drafts = offline["vllm:spec_decode_num_drafts"].value
    offline_accepted = offline["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = offline["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == HORIZON  # per tree depth, not max(B, L) positions
    assert (steps, accepted, per_depth) == (drafts, offline_accepted, per_pos)
    assert tau_metrics == 1 + offline_accepted / drafts

    # The same run through vLLM's own series and the histogram.
    assert delta("vllm:spec_decode_num_drafts_total") == steps
    assert sorted(lbl for name, lbl in after
                  if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total") == sorted(
        f'position="{p}"' for p in range(HORIZON))
    assert delta("vllm:ddtree_acceptance_length_count") == steps
    assert delta("vllm:ddtree_acceptance_length_sum") == steps + accepted
    # Worker-side figures: one commit per verifying step (one request at a time: one tree per
    # step; the last step's figures may still wait in the scheduler), one tree build per
    # drafting step (prefill chunks draft too), host times that are real.
    builds, commits = delta("vllm:ddtree_tree_builds_total"), delta("vllm:ddtree_kv_compactions_total")
    assert abs(commits - steps) <= 3 and builds >= commits > 0, (builds, commits, steps)
    assert 0 < delta("vllm:ddtree_tree_build_seconds_total") < builds  # under 1 s per build
    assert 0 < delta("vllm:ddtree_kv_compaction_seconds_total") < commits
    assert delta("vllm:ddtree_shadow_steps_total") == 0  # not a shadow_linear engine
    assert re.search(r"DDTree step overhead \(engine 0\): tree build \d+\.\d+ ms per step",
                     server.log())
    assert after[("vllm:ddtree_node_budget", "")] == BUDGET
    assert after[("vllm:ddtree_drafter_horizon", "")] == HORIZON
    assert re.search(r"DDTree metrics \(engine 0\): mean acceptance length τ \d+\.\d\d",
                     server.log())
    # vLLM's own periodic line: one rate per tree depth (the scheduler's stats sized by L).
    rates = re.findall(r"Per-position acceptance rate: ([\d., ]+?), Avg", server.log())
    assert rates and {len(r.split(", ")) for r in rates} == {HORIZON}, rates[-1:]
