"""DDTree under vLLM's Ray executor (TP=2) equals TP=1 target-only decoding.

vLLM refuses Ray on the CPU platform, so the run uses the test-only shim
:mod:`tests.support.ray_cpu` (see its docstring), installed with the oracle drafts in every Ray
worker by ``tests/support/site/sitecustomize.py``. Slow (a Ray cluster plus two workers) and
needs ``pip install -e ".[ray]"``: ``pytest -m slow tests/test_ray.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.oracle_drafts import reference_drafts, subprocess_env
from tests.support.ray_cpu import RAY_CPU_ENV

pytest.importorskip("ray")

PROMPTS = ["def main():\n", "import os\nimport sys\n", "class Foo:\n    def __init__(self):",
           "x = 1"]

SCRIPT = r"""
import json, os, sys
if __name__ == "__main__":
    from vllm import SamplingParams
    from tests.support.models import make_llm, release_llm
    target, drafter, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    llm = make_llm(target, tensor_parallel_size=2, distributed_executor_backend="ray",
                   speculative_config={"method": "ddtree", "model": drafter, "ddtree_budget": 16})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    m = {x.name: x.value for x in llm.get_metrics() if x.name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    executor = type(llm.llm_engine.model_executor).__name__
    print("RESULT " + json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                                  "metrics": m, "executor": executor}), flush=True)
    release_llm(llm)
"""


@pytest.mark.slow
def test_ray_tp2_ddtree_equals_target_only(qwen3_target, dflash_drafter, tmp_path):
    want, drafts = reference_drafts(qwen3_target, PROMPTS, 24, tmp_path / "drafts.json")
    script = tmp_path / "ray_tp2.py"
    script.write_text(SCRIPT)
    env = subprocess_env(
        drafts, **{RAY_CPU_ENV: "1"}, RAY_OVERRIDE_RESOURCES=json.dumps({"GPU": 2}),
        RAY_USAGE_STATS_ENABLED="0", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE="1",
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(qwen3_target), str(dflash_drafter),
         json.dumps(PROMPTS)],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert "Ray" in result["executor"], result["executor"]
    assert result["ids"] == want
    m = result["metrics"]
    assert m["vllm:spec_decode_num_accepted_tokens"] > m["vllm:spec_decode_num_drafts"], m
    ready = [line for line in out.splitlines() if "DDTree proposer ready in pid" in line]
    assert len({line.split("in pid ")[1].split(":")[0] for line in ready}) >= 2, ready
    injected = [line for line in out.splitlines() if "tests.support: oracle drafts (V1)" in line]
    assert len({line.split(" in pid ")[1] for line in injected}) >= 2, injected
