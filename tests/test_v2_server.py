"""The OpenAI server on Model Runner V2, started the operator's way (``vllm-ddtree serve``):
the DDTree series in ``/metrics`` count trees, their nodes and the worker's times (issue 15).

V2 runs here through the CPU harness (``tests/support/v2_site`` on ``PYTHONPATH``: vLLM
chooses V2, its Triton kernels interpreted). B = 9 < L = 15: V2 verifies ``max(B, L)`` rows per
request, and the 6 rows past each tree must not count as tree nodes.
"""

from __future__ import annotations

import json
import os
import sys

from tests.support import trained
from tests.support.entry_points import checkout_entry_points
from tests.support.server import free_port, served, server_env
from tests.support.v2_run import subprocess_env
from tests.test_cli import SCRIPT
from tests.test_server_ops import _steady

SERVED = "pystdlib"
BUDGET, HORIZON = 9, 15


def test_v2_server_metrics_count_trees_and_times(tmp_path):
    target, drafter = trained.require()
    port = free_port()
    spec = json.dumps({"method": "ddtree", "model": str(drafter), "ddtree_budget": BUDGET})
    argv = [sys.executable, "-c", SCRIPT, "serve", str(target), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
            "--enforce-eager", "--served-model-name", SERVED, "--speculative-config", spec]
    env = subprocess_env(v2=True, extra={"VLLM_USE_V2_MODEL_RUNNER": "1"})
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"],
                                         str(checkout_entry_points(tmp_path / "site"))])
    env = server_env(**env)
    with served(argv, port, tmp_path / "server.log", env=env, cwd=tmp_path,
                start_timeout=600) as server:
        for prompt in trained.heldout_prompts(2):
            status, body = server.post("/v1/completions", {
                "model": SERVED, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True})
            assert status == 200 and body["usage"]["completion_tokens"] == 24, body
        after = _steady(server)
        log = server.log()
    assert "DDTree speculator (Model Runner V2)" in log  # the runner vLLM chose

    def get(name, labels=""):
        return after.get((name, labels), 0.0)

    steps = get("vllm:ddtree_verification_steps_total")
    assert steps > 0 and get("vllm:ddtree_accepted_tokens_total") > steps  # deep paths
    assert get("vllm:ddtree_tree_nodes_total") == BUDGET * steps  # padding rows not counted
    assert get("vllm:spec_decode_num_draft_tokens_total") == BUDGET * steps
    assert get("vllm:ddtree_node_budget") == BUDGET
    per_depth = [get("vllm:ddtree_accepted_tokens_per_depth_total", f'depth="{d}"')
                 for d in range(1, HORIZON + 1)]
    assert sum(per_depth) == get("vllm:ddtree_accepted_tokens_total")
    commits = get("vllm:ddtree_kv_compactions_total")
    assert abs(commits - steps) <= 2 and get("vllm:ddtree_tree_builds_total") >= commits > 0
    assert get("vllm:ddtree_tree_build_seconds_total") > 0
    assert get("vllm:ddtree_kv_compaction_seconds_total") > 0
