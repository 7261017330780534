"""DDTree under tensor parallelism (vLLM's ``mp`` executor, TP=2 on CPU) equals target-only decoding
(TP=1; TP=2 for the bf16 Qwen3-Next, see the hybrid test).

Every rank builds the same tree from the all-gathered (global-vocabulary) drafter logits, walks
it with the same target choices and compacts its own KV heads; hybrid targets also run the tree
oracle on their local recurrent-state shards (Mamba2 / GDN heads, conv channels) and re-lay them
out along the same accepted path. Drafts are injected in the spawned workers (the subprocess gets
``tests/support/site`` on ``PYTHONPATH``, whose ``sitecustomize`` installs
:mod:`tests.support.oracle_drafts` in every worker) so accepted paths are deep and leave the
spine.

Off-spine acceptance is proved by counting: the injected drafts rank the target's token second
at every output index ``i`` with ``i % P == P // 2`` (``P`` = sidestep period) and first
elsewhere, so a path confined to the top-1 spine stops before the next such index: at most
``P - 1`` accepted drafts per step, i.e. τ ≤ P. A measured τ > P means accepted paths took
second-ranked branches.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.support.oracle_drafts import reference_drafts, subprocess_env

PROMPTS = ["def main():\n", "import os\nimport sys\n", "class Foo:\n    def __init__(self):",
           "x = 1"]
MAX_TOKENS = 40

SCRIPT = r"""
import json, os, sys
from tests.support.models import NEAR_TIE_LOGPROBS, greedy_mismatches, make_llm, release_llm
from tests.support.oracle_drafts import DRAFTS_ENV, write_drafts_file
from vllm import SamplingParams
if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
    tp2 = dict(tensor_parallel_size=2, distributed_executor_backend="mp")
    if args["reference_tp2"]:  # target-only reference at TP=2; drafts file written from it
        llm = make_llm(args["target"], **tp2)
        ref = llm.generate(args["prompts"], SamplingParams(
            temperature=0, max_tokens=args["max_tokens"], ignore_eos=True, logprobs=NEAR_TIE_LOGPROBS),
            use_tqdm=False)
        release_llm(llm)
        del llm
        write_drafts_file(os.environ[DRAFTS_ENV],
                          {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ref},
                          sidestep_period=args["sidestep_period"])
        print("REFERENCE " + json.dumps([list(o.outputs[0].token_ids) for o in ref]))
    llm = make_llm(args["target"], speculative_config=args["spec"], **tp2)
    if args.get("rank_slopes"):
        from functools import partial
        from tests.support.auto_cost import fixed_cost
        print("FIXED COSTS", llm.collective_rpc(partial(fixed_cost, rank_slopes=args["rank_slopes"])))
    outs = llm.generate(args["prompts"], params, use_tqdm=False)
    m = {x.name: x.value for x in llm.get_metrics() if x.name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}
    problems = (greedy_mismatches(ref, outs, near_tie=args["near_tie"])
                if args["reference_tp2"] else [])
    print("RESULT " + json.dumps({"ids": [list(o.outputs[0].token_ids) for o in outs],
                                  "metrics": m, "problems": problems}))
"""


def tp2_ddtree_vs_target_only(target, drafter, tmp_path, *, prompts, max_tokens,
                              sidestep_period, reference_tp=1, near_tie=0.0, rank_slopes=None,
                              **spec):
    """Greedy DDTree at TP=2 (mp executor, injected drafts) and target-only greedy output.

    The target-only reference (and the injected drafts built from it) comes from an in-process
    TP=1 engine (``reference_tp=1``) or, in the same subprocess, from a TP=2 engine
    (``reference_tp=2``). Returns ``(target-only token ids, DDTree token ids, τ, combined
    output)``; fails if the TP=2 run fails or not every rank started a proposer, and with
    ``reference_tp=2`` if a token differs other than at a ``near_tie`` (see
    :func:`~tests.support.models.greedy_mismatches`). ``rank_slopes``: ``ddtree_budget="auto"``
    with a fixed step-cost slope per rank (:func:`tests.support.auto_cost.fixed_cost`).
    """
    drafts = str(tmp_path / "drafts.json")
    if reference_tp == 1:
        want, drafts = reference_drafts(target, prompts, max_tokens, drafts,
                                        sidestep_period=sidestep_period)
    script = tmp_path / "tp2.py"
    script.write_text(SCRIPT)
    args = dict(target=str(target), prompts=list(prompts), max_tokens=max_tokens,
                reference_tp2=reference_tp == 2, sidestep_period=sidestep_period, near_tie=near_tie,
                rank_slopes=rank_slopes, spec=dict(method="ddtree", model=str(drafter), **spec))
    env = subprocess_env(drafts, VLLM_ENABLE_V1_MULTIPROCESSING="1",
                         VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE="1")
    if rank_slopes:  # collective_rpc of a test function through the engine-core process
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    proc = subprocess.run([sys.executable, str(script), json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    if reference_tp == 2:
        want = json.loads(out.split("REFERENCE ", 1)[1].splitlines()[0])
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    m = result["metrics"]
    tau = 1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"]
    assert out.count("DDTree proposer ready in pid") >= 2, "expected one proposer per TP rank"
    # Two workers may print at once and merge their lines, so match messages, not lines.
    injected = set(re.findall(r"oracle drafts \(V1\) from \S+ installed in pid (\d+)", out))
    assert len(injected) >= 2, "the oracle drafts were not installed in every TP worker"
    assert not result["problems"], result["problems"]
    return want, result["ids"], tau, out


def test_tp2_greedy_equals_tp1_target_only(qwen3_target, dflash_drafter, tmp_path):
    want, got, tau, _ = tp2_ddtree_vs_target_only(
        qwen3_target, dflash_drafter, tmp_path, prompts=PROMPTS, max_tokens=MAX_TOKENS,
        sidestep_period=3, ddtree_budget=40)
    print(f"qwen3 TP=2 tau {tau:.2f}")
    assert got == want
    assert tau > 3, f"no off-spine acceptance in the TP workers (tau {tau:.2f})"


def test_tp2_auto_budget_ranks_verify_rank_0s_sizes(qwen3_target, dflash_drafter, tmp_path):
    """``ddtree_budget="auto"`` at TP=2 whose two ranks would choose different tree sizes (each
    rank's controller gets its own fixed step cost: rank 0 gentle, rank 1 steep): every rank
    verifies rank 0's sizes, so output equals target-only with deep accepted paths. (Without the
    agreement the ranks lay out different trees; measured: the output left target-only.)"""
    want, got, tau, out = tp2_ddtree_vs_target_only(
        qwen3_target, dflash_drafter, tmp_path, prompts=PROMPTS, max_tokens=MAX_TOKENS,
        sidestep_period=3, ddtree_budget="auto", ddtree_max_budget=16,
        rank_slopes=[5e-5, 1e-3])
    print(f"qwen3 TP=2 auto tau {tau:.2f}")
    assert "FIXED COSTS [True, True]" in out
    assert got == want
    assert tau > 2, f"accepted paths too short to tell the ranks' trees apart (tau {tau:.2f})"


HYBRID_PROMPTS = ["def main():\n", "import os\nimport sys\n", "x = [1, 2, 3]\n"]
HYBRID_MAX_TOKENS = 24
#: B=16 > L=6: the trees branch; the target's token ranks second at every 3rd output index
#: (τ ≤ 3 on the spine alone).
HYBRID_TREE = dict(ddtree_budget=16, num_speculative_tokens=6)
HYBRID_SIDESTEP = 3


def _qwen3_next(request):
    return (request.getfixturevalue("qwen3_next_target"),
            request.getfixturevalue("qwen3_next_dflash_drafter"))


# Qwen3-Next is bf16 (vLLM's CPU GDN kernel asserts "CPU GDN attention requires BF16."), and in
# bf16 stock vLLM's own TP=2 target-only output already differs from TP=1, with or without this
# plugin loaded (row-parallel partial sums are rounded to bf16 before the all-reduce; on this tiny
# MoE model a prompt diverges at its 4th token by a 0.5 logprob gap, and even the plain Qwen3
# target in bf16 diverges at TP=2). Its reference is therefore TP=2 target-only, a second TP=2
# engine: ~140 s on 2 cores, hence slow. Even then the verifier's multi-row forward rounds
# differently from one-row decoding, so a token may differ at a one-ulp bf16 logit tie (top-2
# gap 0 or 0.125 seen); BF16_LOGIT_ULP explains those. Where that happens the injected drafts stop
# for that request and τ no longer proves off-spine acceptance (seen, deterministically, when an
# in-process engine ran earlier in the pytest process: τ 2.19; alone: exact, τ 4.00).
# Nemotron-H is fp32: TP=2 equals TP=1 exactly.
BF16_LOGIT_ULP = 0.13


@pytest.mark.parametrize("name, pair, reference_tp, near_tie", [
    pytest.param("nemotron_h", lambda request: request.getfixturevalue("nemotron_h_pair"), 1, 0.0,
                 id="nemotron_h"),
    pytest.param("qwen3_next", _qwen3_next, 2, BF16_LOGIT_ULP, marks=pytest.mark.slow,
                 id="qwen3_next"),
])
def test_tp2_hybrid_greedy_equals_target_only(name, pair, reference_tp, near_tie, request,
                                              tmp_path):
    """Hybrid target: every rank runs the tree oracle on its own recurrent-state shards (Mamba2 /
    GDN heads, conv channels) and re-lays them out along the same accepted path."""
    target, drafter = pair(request)
    want, got, tau, _ = tp2_ddtree_vs_target_only(
        target, drafter, tmp_path, prompts=HYBRID_PROMPTS, max_tokens=HYBRID_MAX_TOKENS,
        sidestep_period=HYBRID_SIDESTEP, reference_tp=reference_tp, near_tie=near_tie,
        **HYBRID_TREE)
    print(f"{name} TP=2 tau {tau:.2f}")
    if not near_tie:
        assert got == want, f"{name}: TP=2 DDTree differs from TP={reference_tp} target-only"
    if got == want:  # a near-tie divergence ends the injection for that request (no proof then)
        assert tau > HYBRID_SIDESTEP, f"{name}: no off-spine acceptance (tau {tau:.2f})"
