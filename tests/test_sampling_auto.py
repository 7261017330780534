"""Lossless sampling with ``"ddtree_budget": "auto"``: the same two-sample chi-square test as
``tests/test_sampling.py`` (its tiny 32-token pair, seeded requests), with tree sizes that change
from step to step and across the requests of one batch.

A module of its own because an in-process engine's shutdown tears down state that other engines
still alive in the process need: here the target-only engine is shut down before the DDTree one
is made.
"""

from __future__ import annotations

from collections import Counter

from tests.support.auto_cost import fixed_cost
from tests.support.models import make_llm, release_llm
from tests.test_sampling import ALPHA, CONFIGS, ENGINE, _draw, _p_values, small_pair  # noqa: F401


def test_sampled_distribution_with_auto_budget_equals_target_only(small_pair):
    """Tree sizes change from step to step and across the requests of one batch; the sampled
    distribution must not (T = 1)."""
    from tests.support.recorder import recorded_verification

    target, drafter = small_pair
    llm = make_llm(target, **ENGINE)
    try:
        reference = _draw(llm, **CONFIGS[1])
    finally:
        release_llm(llm)
    del llm
    llm = make_llm(target, speculative_config={
        "method": "ddtree", "model": str(drafter), "ddtree_budget": "auto",
        "ddtree_max_budget": 16, "num_speculative_tokens": 3}, **dict(ENGINE, max_num_seqs=16))
    try:
        assert llm.collective_rpc(fixed_cost) == [True]
        with recorded_verification() as rec:
            ours = _draw(llm, **CONFIGS[1])
    finally:
        release_llm(llm)
    sizes: dict[int, set[int]] = {}
    for r in rec.records:
        sizes.setdefault(r["step"], set()).add(r["tree"].num_nodes)
    counts = Counter(r["tree"].num_nodes for r in rec.records)
    assert len(counts) >= 3, f"tree sizes hardly changed: {counts}"
    assert any(len(s) > 1 for s in sizes.values()), "one size for every request of every step"
    # Measured: a quarter of the steps accept a draft (sizes 3 … 16, most 16).
    assert sum(len(r["accepted"]) > 1 for r in rec.records) > 0.15 * len(rec.records), counts
    p = _p_values(ours, reference)
    assert min(p.values()) > ALPHA, p


def test_seeded_requests_reproduce_whatever_auto_chooses(small_pair):
    """A seeded request's output must not depend on the tree sizes ``auto`` chooses (which follow
    measured step times): the same seeded batch under a cost that makes trees as large as the
    controller's ladder of row counts allows (8 trees of B_max = 16 would be 136 rows, off it:
    128, trees of 9 … 16 nodes) and under one that makes every tree a one-node chain gives the
    same tokens."""
    from functools import partial

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.support.recorder import recorded_verification
    from tests.test_sampling import PROMPT

    target, drafter = small_pair
    llm = make_llm(target, speculative_config={
        "method": "ddtree", "model": str(drafter), "ddtree_budget": "auto",
        "ddtree_max_budget": 16, "num_speculative_tokens": 3}, **dict(ENGINE, max_num_seqs=16))
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=s)
              for s in range(8)]
    prompts = [TokensPrompt(prompt_token_ids=PROMPT)] * len(params)
    outs, sizes = [], []
    try:
        for slope in (0.0, 1.0):  # trees up to B_max, then every tree one node
            assert llm.collective_rpc(partial(fixed_cost, slope=slope)) == [True]
            with recorded_verification() as rec:
                got = llm.generate(prompts, params, use_tqdm=False)
            outs.append([list(o.outputs[0].token_ids) for o in got])
            sizes.append({r["tree"].num_nodes for r in rec.records})
    finally:
        release_llm(llm)
    assert max(sizes[0]) == 16 and min(sizes[0]) > 1 and sizes[1] == {1}, sizes
    assert outs[0] == outs[1]
    assert len({tuple(o) for o in outs[0]}) > 1  # different seeds, different samples
