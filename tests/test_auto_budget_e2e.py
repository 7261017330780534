"""``"ddtree_budget": "auto"`` through vLLM (V1 runner, fp32) on the shipped trained pair.

The controller changes each tree's size from step to step and across the requests of one batch;
greedy output must still equal target-only decoding token for token.
"""

from __future__ import annotations

from vllm import SamplingParams

from tests.support import trained
from tests.support.models import make_llm, release_llm
from tests.support.recorder import recorded_verification
from vllm_ddtree.budget import StepCostModel

PROMPTS = trained.heldout_prompts(4)
PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
TARGET, DRAFTER = trained.require()
B_MAX = 32
ENGINE = dict(dtype="float32", max_num_seqs=4)


class _CpuLikeCost(StepCostModel):
    """The engine's own step timings are still recorded, but the cost curve is fixed and steep
    (10 ms + 2 ms per verified row): on this tiny pair the measured cost is almost flat, and
    the controller would choose B_max for every request, which would not exercise sizes that
    change from step to step and across the requests of one step."""

    def coefficients(self, requests=1):
        return 0.01, 0.002


def _use_cpu_like_cost(worker):
    """Run in the worker (``collective_rpc``)."""
    ctl = worker.model_runner.drafter.controller
    ctl.cost = _CpuLikeCost()
    return True


def _controller(worker):
    """Run in the worker (``collective_rpc``): the proposer's controller state."""
    ctl = worker.model_runner.drafter.controller
    return None if ctl is None else dict(
        steps=ctl.stats.steps, trees=ctl.stats.trees,
        predicted=ctl.stats.predicted_accepted, observed=ctl.stats.observed_accepted,
        cost_observations=ctl.cost.num_observations, max_budget=ctl.max_budget)


def test_auto_budget_is_exact_and_varies_tree_sizes():
    ref_llm = make_llm(TARGET, **ENGINE)
    reference = [list(o.outputs[0].token_ids)
                 for o in ref_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    release_llm(ref_llm)
    del ref_llm

    llm = make_llm(TARGET, speculative_config={
        "method": "ddtree", "model": str(DRAFTER), "ddtree_budget": "auto",
        "ddtree_max_budget": B_MAX}, **ENGINE)
    assert llm.collective_rpc(_use_cpu_like_cost) == [True]
    with recorded_verification() as rec:
        out = [list(o.outputs[0].token_ids)
               for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    (state,) = llm.collective_rpc(_controller)
    release_llm(llm)
    del llm

    for i, (ref, got) in enumerate(zip(reference, out)):
        assert got == ref, f"prompt {i}: DDTree auto differs from target-only"

    sizes = [r["tree"].num_nodes for r in rec.records]
    assert sizes and max(sizes) < B_MAX
    assert len(set(sizes)) >= 3, f"tree sizes never changed: {sorted(set(sizes))}"
    # Within one step the requests' sizes differ at least once (shared by marginal value).
    by_step: dict[int, list[int]] = {}
    for r in rec.records:
        by_step.setdefault(r["step"], []).append(r["tree"].num_nodes)
    assert any(len(set(s)) > 1 for s in by_step.values())
    # Trees really accepted drafts (the controller did not collapse to one-node chains).
    assert sum(len(r["accepted"]) - 1 for r in rec.records) > len(rec.records)
    # The controller saw every verified tree and timed the steps.
    assert state is not None and state["max_budget"] == B_MAX
    assert state["trees"] >= len(rec.records) and state["cost_observations"] > 0
    assert state["observed"] == sum(len(r["accepted"]) - 1 for r in rec.records)


def _bare_proposer(max_budget: int, max_tokens: int = 512):
    """A DDTreeProposer without an engine: only what the auto path reads."""
    from types import SimpleNamespace

    from vllm_ddtree.budget import BudgetController
    from vllm_ddtree.runners.v1.proposer import DDTreeProposer

    p = DDTreeProposer.__new__(DDTreeProposer)
    p.controller = BudgetController(max_budget)
    p.trees = {}
    p._max_tokens = max_tokens
    p._ddtree_runner = SimpleNamespace(_ddtree=SimpleNamespace(step_index=0, step_rows=0,
                                                               step_requests=2))
    return p


def test_proposer_auto_path_cuts_trees_to_prefixes_and_learns():
    import torch

    from vllm_ddtree.step import StepRequest, TreeStep
    from tests.support.tree_checks import validate_draft_tree
    from vllm_ddtree.tree import build_draft_trees, chain_tree

    p = _bare_proposer(max_budget=24)
    p.controller.cost = _CpuLikeCost()
    g = torch.Generator().manual_seed(0)
    confident = torch.full((6, 12), -9.0)
    confident[:, 0] = 0.0
    unsure = torch.randn(6, 12, generator=g)
    log_probs = torch.log_softmax(torch.stack((confident, unsure)), -1)
    full = build_draft_trees(log_probs, 24)
    out = p._propose_auto(["a", "b"], full)
    assert isinstance(out, list) and len(out) == 2
    for req_id, tokens, tree in zip(["a", "b"], out, full):
        cut = p.trees[req_id]
        assert 1 <= len(tokens) == cut.num_nodes < 24
        assert tokens == tree.token_ids[: len(tokens)].tolist()  # a prefix of the pop order
        validate_draft_tree(cut)
    assert len(out[0]) > len(out[1])  # the confident request gets the larger tree

    # Step timing: only consecutive engine steps are a step's cost.
    state = p._ddtree_runner._ddtree  # the propose above ran in step 0
    state.step_index, state.step_rows = 2, 30  # an idle gap (no step 1): not a step's cost
    p._propose_auto(["a", "b"], full)
    assert p.controller.cost.num_observations == 0
    state.step_index = 3  # consecutive, but the first step of 30 rows: its one-time costs
    p._propose_auto(["a", "b"], full)
    assert p.controller.cost.num_observations == 0
    state.step_index = 4
    p._propose_auto(["a", "b"], full)
    assert p.controller.cost.num_observations == 1
    state.step_index, state.step_rows = 5, 0  # a step with prefill chunks: not timed
    p._propose_auto(["a", "b"], full)
    assert p.controller.cost.num_observations == 1

    # Calibration from a verified step: the proposer's trees count, a chain built from the
    # scheduled tokens (drafter probabilities unknown) does not.
    before = p.controller.calibrator.n.sum().item()
    step = TreeStep(
        requests=[StepRequest("a", 0, 0, 5, p.trees["a"], True, accepted=[0, 1]),
                  StepRequest("b", 1, 9, 5, chain_tree([1, 2]), False, accepted=[0],
                              proposed=False)],
        position_rows=torch.zeros(0), tree_positions=torch.zeros(0),
        chain_positions=torch.zeros(0), attn_batch=None)
    p.observe_verified(step)
    assert p.controller.calibrator.n.sum().item() == before + p.trees["a"].num_nodes
    assert p.controller.stats.observed_accepted == 1


def test_each_runner_hands_auto_the_tokens_each_request_has_left():
    """V1: ``max_tokens`` less the output so far, from the runner's request states (None when
    a request has no sampling params); V2: ``RequestState.max_seq_len`` less the tokens computed
    and the one sampled last. The proposer passes them to the allocation (two requests alike
    but for their work left: the one with more left gets the larger tree)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from vllm_ddtree.runners.v1.proposer import remaining_tokens
    from vllm_ddtree.runners.v2 import DDTreeSpeculator
    from vllm_ddtree.tree import build_draft_trees

    def state(max_tokens, out):
        return SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=max_tokens),
                               output_token_ids=list(range(out)))

    runner = SimpleNamespace(requests={"a": state(64, 10), "b": state(64, 61)})
    assert remaining_tokens(runner, ["a", "b"]) == [54, 3]
    runner.requests["c"] = SimpleNamespace(sampling_params=None, output_token_ids=[])
    assert remaining_tokens(runner, ["a", "c"]) is None

    spec = DDTreeSpeculator.__new__(DDTreeSpeculator)
    batch = SimpleNamespace(num_reqs=3, idx_mapping_np=np.array([3, 0, 1]),
                            req_ids=["a", "b", "new"])
    # "new" is in its prefill step (2000-token prompt, nothing computed yet, max_tokens 100):
    # what it has left is its max_tokens less the token this step samples, not the prompt too.
    req_states = SimpleNamespace(max_seq_len=np.array([100, 2100, 0, 90]),
                                 num_computed_tokens_np=np.array([98, 0, 0, 20]),
                                 prefill_len=SimpleNamespace(np=np.array([50, 2000, 0, 15])))
    spec.note_remaining(batch, req_states)
    assert spec._remaining == {"a": 69, "b": 1, "new": 100}

    class MildCost(StepCostModel):  # 10 ms + 0.3 ms per verified row
        def coefficients(self, requests=1):
            return 0.01, 0.0003

    p = _bare_proposer(max_budget=24)
    p.controller.cost = MildCost()
    p.controller.probe_every = 0
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 6, 12, generator=g)
    logits[..., 0] += 3.0  # a drafter that is right about two times in three
    row = torch.log_softmax(logits, -1)
    full = build_draft_trees(row.expand(2, 6, 12).contiguous(), 24)
    p._ddtree_runner.requests = {"a": state(64, 10), "b": state(64, 10)}
    even = [len(t) for t in p._propose_auto(["a", "b"], full)]
    assert even[0] == even[1] > 1
    p._ddtree_runner.requests["b"] = state(64, 62)
    more, less = (len(t) for t in p._propose_auto(["a", "b"], full))
    assert more > even[0] and less < even[1]
