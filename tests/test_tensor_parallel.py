"""DDTree under tensor parallelism (vLLM's ``mp`` executor, TP=2 on CPU) equals TP=1 target-only.

Every rank builds the same tree from the all-gathered (global-vocabulary) drafter logits, walks
it with the same target choices and compacts its own KV heads; drafts are injected in the
spawned workers (``VLLM_DDTREE_TEST_DRAFTS``) so accepted paths are deep and leave the spine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from vllm_ddtree.testing.injection import TEST_DRAFTS_ENV, reference_drafts

PROMPTS = ["def main():\n", "import os\nimport sys\n", "class Foo:\n    def __init__(self):",
           "x = 1"]
MAX_TOKENS = 40

SCRIPT = r"""
import json, sys
from vllm_ddtree.testing.models import make_llm
from vllm import SamplingParams
if __name__ == "__main__":
    target, drafter, prompts, max_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    llm = make_llm(target, tensor_parallel_size=2, distributed_executor_backend="mp",
                   speculative_config={"method": "ddtree", "model": drafter, "ddtree_budget": 40})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True), use_tqdm=False)
    m = {x.name: x.value for x in llm.get_metrics() if x.name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    print("RESULT " + json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                                  "metrics": m}))
"""


def test_tp2_greedy_equals_tp1_target_only(qwen3_target, dflash_drafter, tmp_path):
    want, drafts = reference_drafts(qwen3_target, PROMPTS, MAX_TOKENS, tmp_path / "drafts.json")
    script = tmp_path / "tp2.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_CPU_KVCACHE_SPACE="1", **{TEST_DRAFTS_ENV: drafts})
    proc = subprocess.run(
        [sys.executable, str(script), str(qwen3_target), str(dflash_drafter),
         json.dumps(PROMPTS), str(MAX_TOKENS)],
        env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert result["ids"] == want
    m = result["metrics"]
    tau = 1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"]
    assert tau > 3, f"injected drafts were not accepted in the TP workers (tau {tau:.2f})"
    assert out.count("DDTree proposer ready in pid") >= 2, "expected one proposer per TP rank"
