"""The trained tiny pair shipped in ``models/`` (docs/trained-pair.md).

Greedy DDTree output equals target-only output on held-out standard-library prompts at two node
budgets, and the drafter really drafts: τ (from vLLM's spec-decode counters) stays above a floor
well above what a random or mis-wired drafter gets (τ ≈ 1.0), for DDTree and for vLLM's own
DFlash chain with the same drafter. The floors are about 80 % of the τ measured on these prompts
with the shipped pair (DDTree 3.64 at B=8, 5.02 at B=64; DFlash 3.47), so a drafter whose inputs
no longer match vLLM's (τ ≈ 1) fails here.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from tests.support import trained
from tests.support.models import make_llm, release_llm

PROMPTS = trained.heldout_prompts(4)
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
TARGET, DRAFTER = trained.require()

#: τ floors: (method, budget) -> minimum mean acceptance length on PROMPTS.
FLOORS = {("dflash", None): 2.8, ("ddtree", 8): 2.9, ("ddtree", 64): 4.0}


def _counts(llm) -> tuple[int, int]:
    drafts = accepted = 0
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = int(m.value)
    return drafts, accepted


def _run(spec=None) -> tuple[list[list[int]], float]:
    llm = make_llm(TARGET, **({"speculative_config": spec} if spec else {}))
    d0, a0 = _counts(llm)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    d1, a1 = _counts(llm)
    release_llm(llm)
    del llm
    tau = (a1 - a0 + d1 - d0) / (d1 - d0) if d1 > d0 else 1.0
    return [list(o.outputs[0].token_ids) for o in outs], tau


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _run()[0]


@pytest.mark.parametrize("budget", [8, 64])
def test_ddtree_on_trained_pair_is_exact_and_accepts(reference, budget):
    out, tau = _run({"method": "ddtree", "model": str(DRAFTER), "ddtree_budget": budget})
    for i, (ref, got) in enumerate(zip(reference, out)):
        assert got == ref, f"prompt {i}: DDTree B={budget} differs from target-only"
    assert tau >= FLOORS[("ddtree", budget)], f"DDTree B={budget}: τ={tau:.2f} below the floor"


def test_vllm_dflash_chain_accepts_with_trained_drafter(reference):
    out, tau = _run({"method": "dflash", "model": str(DRAFTER), "num_speculative_tokens": 15})
    assert tau >= FLOORS[("dflash", None)], f"vLLM DFlash: τ={tau:.2f} below the floor"
    assert sum(a == b for a, b in zip(out, reference)) >= len(reference) - 1
