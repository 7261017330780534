"""DDTree on vLLM's Model Runner V2 (CPU harness, Triton interpreted): every path equal to
target-only decoding on the same model, with drafts that are accepted.

A random drafter accepts nothing, so most configs draft from the target's own continuation
(``oracle``: :mod:`tests.support.oracle_drafts`, installed in the V2 subprocess by
:mod:`tests.support.v2_run`), with the target's token at rank 1 every third token so that
accepted paths leave the top-1 spine and KV compaction / the recurrent re-layout have work to
do. Power checks: the same configs with the commit disabled must differ from target-only.
All configs of a module run in one subprocess (V2 is chosen before vLLM is imported).
"""

from __future__ import annotations

import time

import pytest

from tests.support.v2_run import V2_RUNNER, run_v2

PROMPTS = ["def main():\n", "import os\nimport sys\n", "class Foo:\n    def __init__(self):",
           "x = [i * 2 for i in range(10)]\nprint("]
ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 256}
TOKENS = 24
GREEDY = {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True}
# Seeded sampling: V2 draws a node's token from (seed, position) as target-only decoding does,
# so the outputs are equal token for token. No top-k/top-p: vLLM's Triton top-k/top-p kernel
# does not run under Triton's interpreter.
SEEDED = {"temperature": 0.9, "min_p": 0.02, "seed": 1234, "max_tokens": TOKENS, "ignore_eos": True}
ORACLE = {"from": None, "sidestep": 3}


def _ddtree(name, target, drafter, budget, ref, dtype="float32", sampling=GREEDY,
            max_budget=None, **extra):
    spec = {"method": "ddtree", "model": str(drafter), "ddtree_budget": budget}
    if max_budget is not None:
        spec["ddtree_max_budget"] = max_budget
    return {"name": name, "target": str(target), "prompts": PROMPTS, "dtype": dtype,
            "sampling": sampling, **ENGINE, "speculative_config": spec,
            "oracle": {**ORACLE, "from": ref}, **extra}


def _target(name, target, dtype="float32", sampling=GREEDY, **extra):
    return {"name": name, "target": str(target), "prompts": PROMPTS, "dtype": dtype,
            "sampling": sampling, **ENGINE, **extra}


def _ok(r: dict) -> dict:
    assert r["error"] is None, f"[{r['name']}] {r['error']}"
    assert r["runners"] == [V2_RUNNER], r["runners"]
    return r


def _deep(spec: dict) -> bool:
    """Accepted paths of two or more drafts. With the target's token at rank 1 every third
    position, most such paths pass a rank-1 node: they leave the top-1 spine."""
    per_pos = spec["accepted_per_pos"]
    return spec["num_accepted_tokens"] > 0 and len(per_pos) > 1 and per_pos[1] > 0


@pytest.fixture(scope="module")
def attention_runs(qwen3_target, dflash_drafter) -> dict:
    t, d = qwen3_target, dflash_drafter
    configs = [
        _target("ref", t, sampling={**GREEDY, "logprobs": 2}),
        _ddtree("B16", t, d, 16, "ref", sampling={**GREEDY, "logprobs": 2}),
        _ddtree("B9-padded", t, d, 9, "ref"),  # K = max(B, L) = 15 rows: 6 padding rows
        _ddtree("B16-no-compaction", t, d, 16, "ref", disable=["kv_compaction"]),
        _target("ref-seeded", t, sampling=SEEDED),
        _ddtree("B16-seeded", t, d, 16, "ref-seeded", sampling=SEEDED),
        _ddtree("B16-triton-tree", t, d, 16, "ref", triton_tree_backend=True),
        _ddtree("auto", t, d, "auto", "ref", max_budget=16, fixed_cost=5e-5, record_rows=True),
        _ddtree("auto-seeded", t, d, "auto", "ref-seeded", sampling=SEEDED, max_budget=16,
                fixed_cost=5e-5, record_rows=True),
    ]
    t0 = time.perf_counter()
    out = {c["name"]: c for c in run_v2({"configs": configs}, timeout=1800)["configs"]}
    print(f"\nV2 attention runs: {time.perf_counter() - t0:.0f} s; " + ", ".join(
        f"{n} ({c['build_s']}, {c['generate_s']})" for n, c in out.items()))
    return out


@pytest.mark.parametrize("name", ["B16", "B9-padded", "B16-triton-tree"])
def test_v2_greedy_equals_target_only(attention_runs, name):
    """Greedy DDTree on V2 = target-only, with deep accepted paths off the spine; node budgets
    above and below the drafter horizon (padding rows); the CUDA tree backend's code path (its
    Triton kernel interpreted, KV compaction inside the cache) as well as the CPU one."""
    ref, got = _ok(attention_runs["ref"]), _ok(attention_runs[name])
    assert got["token_ids"] == ref["token_ids"]
    assert _deep(got["spec"]), got["spec"]


def test_v2_auto_budget_verifies_only_each_trees_rows(attention_runs):
    """``ddtree_budget="auto"`` on V2: V2 schedules K = 16 draft rows per request, the
    controller (a fixed cost of 10 ms + 50 µs per row, so that only some nodes pay) sizes each
    tree, and only the trees' rows are verified (V2's adaptive-verification seam). Greedy
    output equals target-only, with deep accepted paths."""
    ref, got = _ok(attention_runs["ref"]), _ok(attention_runs["auto"])
    assert got["token_ids"] == ref["token_ids"]
    assert _deep(got["spec"]), got["spec"]
    f, rows, spec = got["figures"], got["rows"], got["spec"]
    assert 0 < f["auto_nodes"] < 16 * f["auto_trees"], f  # smaller trees than B_max
    assert rows and all(verified <= scheduled for verified, scheduled, _ in rows), rows
    assert sum(v for v, _, _ in rows) < 0.8 * sum(s for _, s, _ in rows), rows  # rows were cut
    assert f["auto_observed_accepted"] > 0, f  # the calibration saw the verified trees
    # The scheduler's draft counts are corrected for the rows it booked and V2 did not verify:
    # the draft tokens reported are the tree nodes verified (every verified row but one root
    # per request and step).
    assert spec["num_draft_tokens"] == sum(v - n for v, _, n in rows), (spec, rows)


def test_v2_logprobs_equal_target_only(attention_runs):
    """Logprobs of every emitted token (sampled + top-2) equal target-only's."""
    ref, got = _ok(attention_runs["ref"]), _ok(attention_runs["B16"])
    for a, b in zip(ref["logprobs"], got["logprobs"]):
        assert len(a) == len(b) == TOKENS
        for pa, pb in zip(a, b):
            assert [t for t, _ in pa] == [t for t, _ in pb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(pa, pb)) < 1e-4


@pytest.mark.parametrize("name", ["B16-seeded", "auto-seeded"])
def test_v2_seeded_sampling_equals_target_only(attention_runs, name):
    """T > 0 with seeds: the same tokens as target-only decoding (V2 keys each draw by the
    request's seed and the position, and a node is drawn at its depth position), also with the
    tree sizes ``auto`` chooses and the rows it cuts."""
    ref, got = _ok(attention_runs["ref-seeded"]), _ok(attention_runs[name])
    assert ref["token_ids"] != _ok(attention_runs["ref"])["token_ids"]  # really sampled
    assert got["token_ids"] == ref["token_ids"]
    assert got["spec"]["num_accepted_tokens"] > 0, got["spec"]
    if got["rows"] is not None:
        assert any(verified < scheduled for verified, scheduled, _ in got["rows"]), got["rows"]


def test_v2_step_figures_reach_the_front_end(attention_runs):
    """Tree-build and KV-compaction times ride from the V2 worker to the front end's stats
    (``vllm:ddtree_tree_build_seconds`` …): one build per drafting step, one commit per
    verifying step, so about as many as the engine steps that verified trees."""
    got = _ok(attention_runs["B16"])
    f, steps = got["figures"], got["spec"]["num_drafts"]
    assert f["tree_builds"] > 0 and f["kv_compactions"] > 0, f
    assert f["tree_build_seconds"] > 0 and f["kv_compaction_seconds"] > 0, f
    # Batch of 4 prompts: each engine step verifies up to 4 trees and builds once.
    assert steps / len(PROMPTS) <= f["kv_compactions"] <= steps, (f, steps)
    assert f["shadow_steps"] == 0


def test_v2_power_check_without_kv_compaction(attention_runs):
    """Without KV compaction the same run leaves target-only (the equality tests can fail)."""
    assert _ok(attention_runs["B16-no-compaction"])["token_ids"] != attention_runs["ref"]["token_ids"]


SHADOW_L = 6  # drafter horizon of the shadow_linear config: its verified chains have 6 nodes


@pytest.fixture(scope="module")
def hybrid_runs(nemotron_h_pair, qwen3_next_target, qwen3_next_dflash_drafter) -> dict:
    nt, nd = nemotron_h_pair
    qt, qd = qwen3_next_target, qwen3_next_dflash_drafter
    configs = [
        _target("nemotron-ref", nt),
        _ddtree("nemotron-B16", nt, nd, 16, "nemotron-ref"),
        _ddtree("nemotron-B16-no-relayout", nt, nd, 16, "nemotron-ref",
                disable=["recurrent_relayout"]),
        {**_ddtree("nemotron-B16-shadow", nt, nd, 16, "nemotron-ref"),
         "speculative_config": {"method": "ddtree", "model": str(nd), "ddtree_budget": 16,
                                "num_speculative_tokens": SHADOW_L,
                                "ddtree_hybrid": "shadow_linear"}},
        _ddtree("nemotron-auto", nt, nd, "auto", "nemotron-ref", max_budget=16,
                fixed_cost=5e-5, record_rows=True),
        _target("qwen3next-ref", qt, dtype="bfloat16"),
        _ddtree("qwen3next-B9", qt, qd, 9, "qwen3next-ref", dtype="bfloat16"),
        _ddtree("qwen3next-auto", qt, qd, "auto", "qwen3next-ref", dtype="bfloat16",
                max_budget=16, fixed_cost=5e-5, record_rows=True),
    ]
    t0 = time.perf_counter()
    out = {c["name"]: c for c in run_v2({"configs": configs}, timeout=1800)["configs"]}
    print(f"\nV2 hybrid runs: {time.perf_counter() - t0:.0f} s; " + ", ".join(
        f"{n} ({c['build_s']}, {c['generate_s']})" for n, c in out.items()))
    return out


@pytest.mark.parametrize("model,name", [("nemotron", "nemotron-B16"), ("qwen3next", "qwen3next-B9"),
                                        ("nemotron", "nemotron-auto"),
                                        ("qwen3next", "qwen3next-auto")])
def test_v2_hybrid_equals_target_only(hybrid_runs, model, name):
    """Hybrid targets on V2 (Mamba2: Nemotron-H fp32; GatedDeltaNet: Qwen3-Next bf16, B < K so
    padding rows reach the recurrent layers; ``auto``: rows V2 booked and did not verify): the
    sequential tree oracle keeps greedy output equal to target-only with accepted paths off the
    spine."""
    ref, got = _ok(hybrid_runs[f"{model}-ref"]), _ok(hybrid_runs[name])
    assert got["token_ids"] == ref["token_ids"]
    assert got["spec"]["num_accepted_tokens"] > 0, got["spec"]
    if got["rows"] is not None:
        assert any(verified < scheduled for verified, scheduled, _ in got["rows"]), got["rows"]


def test_v2_hybrid_power_check_without_relayout(hybrid_runs):
    """Without the recurrent re-layout of the accepted path the output leaves target-only."""
    got = _ok(hybrid_runs["nemotron-B16-no-relayout"])
    assert got["token_ids"] != hybrid_runs["nemotron-ref"]["token_ids"]


@pytest.mark.slow
def test_v2_preemption_and_tensor_parallel(qwen3_target, dflash_drafter):
    """A KV cache too small for the batch (vLLM preempts and recomputes) and TP = 2 (mp
    executor, harness in the spawned workers), with a fixed budget and with ``auto`` (each
    rank's controller with its own cost, so the ranks would size trees differently and must
    verify rank 0's sizes; also under preemption): DDTree on V2 stays equal to target-only."""
    t, d = qwen3_target, dflash_drafter
    small = {"block_size": 32, "num_gpu_blocks_override": 12}
    long_greedy = {**GREEDY, "max_tokens": 100}
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
           "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    configs = [
        _target("ref-small", t, sampling=long_greedy, **small),
        _ddtree("B16-small", t, d, 16, "ref-small", sampling=long_greedy, **small),
        _ddtree("auto-small", t, d, "auto", "ref-small", sampling=long_greedy, max_budget=16,
                fixed_cost=5e-5, record_rows=True, **small),
        _target("ref", t),
        _ddtree("tp2-B16", t, d, 16, "ref", **tp2),
        _ddtree("tp2-auto", t, d, "auto", "ref", max_budget=16, fixed_cost=[5e-5, 1e-3],
                **tp2),
    ]
    out = {c["name"]: c for c in run_v2({"configs": configs}, timeout=2400)["configs"]}
    for name in ("B16-small", "auto-small"):
        ref, got = _ok(out["ref-small"]), _ok(out[name])
        assert got["token_ids"] == ref["token_ids"], name
        assert got["spec"]["num_preemptions"] > 0, f"{name}: the KV cache did not force preemption"
    for name in ("tp2-B16", "tp2-auto"):
        tp = out[name]
        assert tp["error"] is None and len(tp["runners"]) == 2, tp
        assert tp["token_ids"] == _ok(out["ref"])["token_ids"], name
        assert tp["spec"]["num_accepted_tokens"] > 0, name
    f = out["tp2-auto"]["figures"]  # rank 0's: trees smaller than B_max were verified
    assert 0 < f["auto_nodes"] < 16 * f["auto_trees"], f


@pytest.mark.slow
def test_v2_sampling_distribution_chi_square(tmp_path):
    """T > 0 on V2 without seeds (independent draws in the two engines): the distribution of
    DDTree's tokens 1-3 equals target-only's (two-sample chi-square, as tests/test_sampling.py on
    V1), on the 32-token model where several continuations are likely."""
    from tests.support.models import build_dflash_drafter, build_qwen3_target, build_small_vocab_tokenizer
    from tests.test_sampling import ALPHA, PROMPT, V, _statistics, chi2_two_sample

    tok = build_small_vocab_tokenizer(tmp_path / "tok", vocab_size=V)
    target = build_qwen3_target(tmp_path / "target", vocab_size=V, num_layers=2, tokenizer_dir=tok,
                                lm_head_std=0.15, seed=3)
    drafter = build_dflash_drafter(tmp_path / "drafter", target, target_layer_ids=[0])
    n = 400  # the interpreter makes V2 slow: 400 draws per engine (V1's test takes 2000)
    engine = {"max_model_len": 128, "max_num_seqs": 128, "max_num_batched_tokens": 4096}
    sampling = {"temperature": 1.0, "max_tokens": 4, "ignore_eos": True}
    configs = [
        {"name": "ref", "target": str(target), "prompts": [PROMPT] * n, "sampling": sampling,
         **engine},
        {"name": "ddtree", "target": str(target), "prompts": [PROMPT] * n, "sampling": sampling,
         "speculative_config": {"method": "ddtree", "model": str(drafter), "ddtree_budget": 8,
                                "num_speculative_tokens": 3}, **engine},
    ]
    out = {c["name"]: c for c in run_v2({"configs": configs}, timeout=2400)["configs"]}
    ref, got = _ok(out["ref"]), _ok(out["ddtree"])
    assert got["spec"]["num_accepted_tokens"] > 0, got["spec"]
    a = [tuple(t) for t in ref["token_ids"]]
    b = [tuple(t) for t in got["token_ids"]]
    assert len(set(a)) > 20  # several continuations are likely: the test can see a bias
    for stat, (xa, xb) in {k: (v, _statistics(b)[k]) for k, v in _statistics(a).items()}.items():
        assert chi2_two_sample(xa, xb) > ALPHA, stat


def test_v2_shadow_linear_verifies_chains_and_measures_trees(hybrid_runs):
    """``ddtree_hybrid="shadow_linear"`` on V2: only each tree's top-1 chain (L nodes) is
    verified, the output equals target-only, and the trees' would-be τ (measured against the
    realised output, sent to the front end as ``vllm:ddtree_shadow_*``) beats the chains' with
    drafts whose second choice is right every third token."""
    ref, got = _ok(hybrid_runs["nemotron-ref"]), _ok(hybrid_runs["nemotron-B16-shadow"])
    assert got["token_ids"] == ref["token_ids"]
    spec, f = got["spec"], got["figures"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == SHADOW_L * spec["num_drafts"]
    assert f["shadow_steps"] > 20, f
    tree_tau = 1 + f["shadow_tree_accepted"] / f["shadow_steps"]
    chain_tau = 1 + f["shadow_chain_accepted"] / f["shadow_steps"]
    assert tree_tau > chain_tau + 0.2, (tree_tau, chain_tau)


def test_verification_budget_keeps_each_requests_tree_rows():
    """The stand-in for V2's adaptive-verification manager (no engine): each request keeps
    its tree's draft rows (all scheduled rows without a tree, the scheduled ones when V2
    booked fewer than the tree has), prefill chunks keep theirs; host and device counts agree;
    a batch order other than V2's is refused."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    from vllm_ddtree.runners.v2 import DDTreeVerificationBudget
    from vllm_ddtree.tree import chain_tree

    K = 8
    trees = {r: chain_tree(torch.arange(1, n + 1)) for r, n in (("a", 3), ("b", 1), ("d", 8))}
    qsl = torch.zeros(9, dtype=torch.int32)
    budget = DDTreeVerificationBudget(SimpleNamespace(trees=trees, max_num_reqs=8), qsl, K + 1,
                                      torch.device("cpu"), admitted_counts=False)
    # p: a prefill chunk; c: no tree (e.g. resumed); d: V2 booked 4 rows, its tree has 8.
    tokens = {"p": 20, "a": K + 1, "b": K + 1, "c": K + 1, "d": 5}
    drafts = {r: [-1] * K for r in "abc"} | {"d": [-1] * 4}
    kept = {"p": 0, "a": 3, "b": 1, "c": K, "d": 4}
    assert budget.get_num_tokens(tokens, drafts) == 20 + sum(n + 1 for n in kept.values()) - 1
    order = sort_batch_req_ids(tokens, drafts, K + 1)
    scheduled = np.array([tokens[r] for r in order], np.int32)
    num_drafts = np.array([len(drafts.get(r, ())) for r in order], np.int32)
    cu0 = np.concatenate([[0], np.cumsum(num_drafts + 1)]).astype(np.int32)
    rows, cu = budget.compact_batch(num_drafts, scheduled, cu0)
    assert rows.tolist() == [20 if r == "p" else kept[r] + 1 for r in order]
    assert np.diff(cu).tolist() == [kept[r] + 1 for r in order]
    cu_dev, loc, n = budget.reallocate_drafts(order, torch.arange(len(order)))
    assert cu_dev.tolist() == cu.tolist() and loc is qsl and n == sum(kept.values())
    budget.admitted_counts = True  # vLLM 0.33: a fourth item, None (host counts exact)
    budget.get_num_tokens(tokens, drafts)
    budget.compact_batch(num_drafts, scheduled, cu0)
    assert budget.reallocate_drafts(order, torch.arange(len(order)))[3] is None
    with pytest.raises(RuntimeError, match="batch order"):
        budget.reallocate_drafts(order[::-1], torch.arange(len(order)))
    with pytest.raises(RuntimeError, match="batch order"):
        budget.compact_batch(num_drafts[::-1], scheduled[::-1], cu0)
