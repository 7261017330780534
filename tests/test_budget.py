"""``"ddtree_budget": "auto"``: the runner-independent controller on synthetic numbers."""

from __future__ import annotations

import itertools
import logging
import math

import pytest
import torch

from vllm_ddtree.budget import (
    ENGINE_ROW_MULTIPLE,
    ENGINE_SIZES_PER_OCTAVE,
    AcceptanceCalibrator,
    BudgetController,
    StepCostModel,
    allocate_budgets,
    marginal_values,
)
from vllm_ddtree.step import truncate_tree
from tests.support.tree_checks import validate_draft_tree
from vllm_ddtree.tree import build_draft_tree, follow_tree


def geometric(r: float, n: int = 64) -> torch.Tensor:
    """Marginal values of a drafter whose j-th node is reached with probability r**j."""
    return torch.tensor([r ** j for j in range(1, n + 1)], dtype=torch.float64)


def flat(rows):  # GPU-like: verifying a few hundred rows costs as much as one
    return 0.02


def cpu_like(rows):  # cost linear in verified rows, small fixed part
    return 0.002 + 0.004 * rows


# ------------------------------------------------------------------ allocation


def test_flat_cost_gives_large_trees():
    a = allocate_budgets([geometric(0.9)], flat, max_budget=64)
    assert a.budgets == [64] and not a.chain_fallback and a.speculation_pays
    a = allocate_budgets([geometric(0.9)] * 4, flat, max_budget=32)
    assert a.budgets == [32] * 4


def test_linear_cost_gives_small_trees():
    small = allocate_budgets([geometric(0.9)], cpu_like, max_budget=64).budgets[0]
    large = allocate_budgets([geometric(0.9)], flat, max_budget=64).budgets[0]
    assert 1 <= small <= 4 < large
    # Steeper cost per row: never a larger tree.
    sizes = [allocate_budgets([geometric(0.9)], lambda t, s=s: 0.01 + s * t, 64).budgets[0]
             for s in (0.0, 1e-4, 1e-3, 1e-2)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 64 and sizes[-1] < sizes[1]


def _rate(values, budgets, cost):
    """Expected committed tokens per second of a step with these budgets."""
    exp = sum(1 + float(v[:b].sum()) for v, b in zip(values, budgets))
    return exp / float(cost(sum(1 + b for b in budgets)))


def test_mixed_batch_shares_the_budget_by_marginal_value():
    confident, unsure = geometric(0.95, 24), geometric(0.3, 24)
    cost = lambda t: 0.05 + 0.002 * t  # noqa: E731
    a = allocate_budgets([confident, unsure], cost, max_budget=24)
    assert a.budgets[0] > a.budgets[1] >= 1
    # Optimal over every pair of budgets (brute force).
    best = max(itertools.product(range(1, 25), repeat=2),
               key=lambda bs: _rate([confident, unsure], bs, cost))
    assert _rate([confident, unsure], a.budgets, cost) == pytest.approx(
        _rate([confident, unsure], best, cost), rel=1e-12)
    # The last node given to either is worth at least the first node refused to either.
    given = min(confident[a.budgets[0] - 1], unsure[a.budgets[1] - 1])
    refused = max(confident[a.budgets[0]], unsure[a.budgets[1]])
    assert given >= refused


def test_weights_give_nodes_to_the_request_with_more_work_left():
    """weights scale what a request's tokens are worth: the optimum over every pair of budgets
    (brute force) of the weighted rate; equal weights are the plain objective; the reported
    expectations stay unweighted. The controller weights by remaining tokens over the batch
    mean, so equal remaining work changes nothing."""
    vals = [geometric(0.6, 24)] * 2
    cost = lambda t: 0.05 + 0.002 * t  # noqa: E731
    plain = allocate_budgets(vals, cost, max_budget=24)
    assert plain.budgets[0] == plain.budgets[1]
    assert allocate_budgets(vals, cost, 24, weights=[1.0, 1.0]).budgets == plain.budgets
    w = [1.6, 0.4]
    a = allocate_budgets(vals, cost, max_budget=24, weights=w)
    assert a.budgets[0] > plain.budgets[0] > a.budgets[1] >= 1

    def weighted(bs):
        return sum(wi * (1 + float(v[:b].sum())) for wi, v, b in zip(w, vals, bs)) / cost(
            sum(1 + b for b in bs))

    best = max(itertools.product(range(1, 25), repeat=2), key=weighted)
    assert weighted(a.budgets) == pytest.approx(weighted(best), rel=1e-12)
    assert a.expected_accepted == [pytest.approx(float(v[:b].sum())) for v, b in
                                   zip(vals, a.budgets)]
    for bad in ([1.0], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="weights"):
            allocate_budgets(vals, cost, 24, weights=bad)
    plp = torch.cat((torch.zeros(1), torch.log(geometric(0.6, 24)).float()))
    ctl = BudgetController(24, cost=StepCostModel(prior_intercept=0.05, prior_slope=0.002),
                           probe_every=0)
    same = ctl.allocate(["a", "b"], [plp, plp])
    assert ctl.allocate(["a", "b"], [plp, plp], remaining_tokens=[40, 40]) == same
    more, less = ctl.allocate(["a", "b"], [plp, plp], remaining_tokens=[60, 4])
    assert more > same[0] > less
    # Finished or unknown-length corner: at least one token left counts.
    assert ctl.allocate(["a", "b"], [plp, plp], remaining_tokens=[0, 0]) == same
    steps = ctl.stats.steps
    with pytest.raises(ValueError, match="weights"):
        ctl.allocate(["a", "b"], [plp, plp], remaining_tokens=[3])
    assert ctl.stats.steps == steps  # a refused call changes nothing


def test_token_budget_and_caps():
    vals = [geometric(0.99)] * 3
    a = allocate_budgets(vals, flat, max_budget=64, token_budget=50, extra_tokens=5)
    assert a.tokens == 5 + sum(1 + b for b in a.budgets) <= 50
    assert a.tokens == 50  # flat cost: fill the step
    # A tree cannot be larger than the nodes its builder found, nor than B_max.
    a = allocate_budgets([geometric(0.9, 3), geometric(0.9, 64)], flat, max_budget=10)
    assert a.budgets == [3, 10]
    assert a.expected_accepted[0] == pytest.approx(float(geometric(0.9, 3).sum()))


def test_no_tree_pays_falls_back_to_the_chain():
    # Cost proportional to rows with no fixed part: one token per row is target-only's rate,
    # and no draft is reached with probability 1.
    a = allocate_budgets([geometric(0.5)] * 8, lambda t: 0.001 * t, max_budget=64)
    assert a.chain_fallback and a.budgets == [1] * 8 and not a.speculation_pays
    # A fixed part big enough makes small trees pay again.
    a = allocate_budgets([geometric(0.5)] * 8, lambda t: 0.05 + 0.001 * t, max_budget=64)
    assert not a.chain_fallback and a.speculation_pays


@pytest.mark.parametrize("values, kw, match", [
    ([], {}, r"values is empty"),
    ([torch.tensor([0.5, 0.6], dtype=torch.float64)], {}, r"non-increasing"),
    ([torch.tensor([float("nan")])], {}, r"probabilities"),
    ([torch.tensor([1.5])], {}, r"probabilities"),
    ([torch.tensor([], dtype=torch.float64)], {}, r"at least one node"),
    ([torch.tensor([1, 0])], {}, r"1-D float"),
    ([[0.5]], {}, r"1-D float"),
    ([geometric(0.5)], {"max_budget": 0}, r"max_budget"),
    ([geometric(0.5)] * 4, {"token_budget": 7}, r"token_budget=7 is too small"),
    ([geometric(0.5)], {"extra_tokens": -1}, r"extra_tokens"),
    ([geometric(0.5)], {"step_seconds": lambda t: 0.0}, r"positive finite"),
    ([geometric(0.5)], {"step_seconds": lambda t: float("nan")}, r"positive finite"),
])
def test_allocation_refuses_bad_input(values, kw, match):
    args = {"step_seconds": flat, "max_budget": 8, **kw}
    with pytest.raises(ValueError, match=match):
        allocate_budgets(values, **args)


# ------------------------------------------------------------------ marginal values


def test_marginal_values_are_the_trees_path_probabilities_and_sum_to_expected_acceptance():
    g = torch.Generator().manual_seed(0)
    L, V = 4, 6
    lp = torch.log_softmax(torch.randn(L, V, generator=g) * 2, -1)
    tree = build_draft_tree(lp, 40)
    v = marginal_values(tree.path_log_probs)
    assert v.shape == (40,) and bool((v[1:] <= v[:-1]).all())
    assert torch.allclose(v, tree.path_log_probs[1:].double().exp())
    # Every prefix of the pop order is a valid tree (what a smaller budget verifies).
    for b in (1, 7, 23):
        validate_draft_tree(truncate_tree(tree, b))
    # Paper's objective: if the target draws from the drafter's distribution, the expected
    # accepted length of the first b nodes is the sum of their path probabilities.
    n = 8000
    draws = torch.multinomial(lp.exp(), n, replacement=True, generator=g)  # [L, n]
    for b in (5, 40):
        small = truncate_tree(tree, b)
        depth_of = small.depths.tolist()
        total = 0
        for s in range(n):
            # The walk reads the target's choice at a node of depth d from depth d + 1's draw.
            choices = [int(draws[d, s]) if d < L else 0 for d in depth_of]
            total += len(follow_tree(small, choices)[0]) - 1
        assert total / n == pytest.approx(float(v[:b].sum()), abs=0.06)


def test_marginal_values_refuse_bad_input():
    with pytest.raises(ValueError, match="path_log_probs"):
        marginal_values(torch.zeros(0))
    with pytest.raises(ValueError, match="path_log_probs"):
        marginal_values(torch.zeros(2, 2))


# ------------------------------------------------------------------ calibration


def test_calibration_starts_at_the_drafter_and_moves_toward_observed_acceptance():
    cal = AcceptanceCalibrator(prior_weight=2.0, decay=1.0)
    q = torch.full((10,), 0.6, dtype=torch.float64)
    assert float(cal.calibrate(q[:1])[0]) == pytest.approx(0.6)  # no data: trust the drafter
    seen = []
    for _ in range(30):  # the drafter says 0.6, the target accepts 20 %
        acc = torch.zeros(10, dtype=torch.bool)
        acc[:2] = True
        cal.observe(q, acc)
        seen.append(float(cal.calibrate(q[:1])[0]))
    assert all(b < a for a, b in zip(seen, seen[1:]))
    assert seen[-1] == pytest.approx(0.6 * (60 + 2) / (180 + 2))
    assert abs(seen[-1] - 0.2) < 0.01
    # Within a bucket the drafter's order is kept (the ratio scales both).
    hi, lo = cal.calibrate(torch.tensor([0.9, 0.55]))
    assert hi / lo == pytest.approx(0.9 / 0.55)
    # An over-cautious drafter is raised toward what is accepted.
    cal2 = AcceptanceCalibrator(decay=1.0)
    low = torch.full((50,), 0.1, dtype=torch.float64)
    cal2.observe(low, torch.ones(50, dtype=torch.bool))
    assert float(cal2.calibrate(low[:1])[0]) > 0.7
    # Other buckets are untouched.
    assert float(cal2.calibrate(torch.tensor([0.6]))[0]) == pytest.approx(0.6)


def test_marginal_values_stay_sorted_under_contradictory_calibration():
    cal = AcceptanceCalibrator(decay=1.0)
    # A low-q bucket accepted far more than the one above it.
    cal.observe(torch.full((100,), 0.3, dtype=torch.float64), torch.zeros(100, dtype=torch.bool))
    cal.observe(torch.full((100,), 0.1, dtype=torch.float64), torch.ones(100, dtype=torch.bool))
    raw = cal.calibrate(torch.tensor([0.3, 0.1]))
    assert raw[1] > raw[0]  # the map itself is not monotone across the bucket edge
    v = marginal_values(torch.log(torch.tensor([1.0, 0.3, 0.1])), cal)
    assert v[1] == v[0] == pytest.approx(float(raw[0]))  # never above a node popped earlier
    lp = torch.log_softmax(torch.randn(5, 8, generator=torch.Generator().manual_seed(1)), -1)
    v = marginal_values(build_draft_tree(lp, 30).path_log_probs, cal)
    assert bool((v[1:] <= v[:-1]).all())


def test_decay_forgets_old_steps():
    cal = AcceptanceCalibrator(prior_weight=1.0, decay=0.9)
    q = torch.full((20,), 0.6, dtype=torch.float64)
    for _ in range(50):
        cal.observe(q, torch.ones(20, dtype=torch.bool))
    for _ in range(50):
        cal.observe(q, torch.zeros(20, dtype=torch.bool))
    assert float(cal.calibrate(q[:1])[0]) < 0.05


@pytest.mark.parametrize("args, match", [
    ((torch.tensor([0.5]), torch.tensor([1])), r"bool"),
    ((torch.tensor([0.5, 0.2]), torch.tensor([True])), r"equal length"),
    ((torch.tensor([1.5]), torch.tensor([True])), r"\[0, 1\]"),
    ((torch.tensor([float("nan")]), torch.tensor([True])), r"\[0, 1\]"),
    (([0.5], [True]), r"torch tensors"),
])
def test_calibrator_refuses_bad_observations(args, match):
    with pytest.raises(ValueError, match=match):
        AcceptanceCalibrator().observe(*args)


@pytest.mark.parametrize("kw, match", [
    ({"num_buckets": 0}, "num_buckets"), ({"prior_weight": 0}, "prior_weight"),
    ({"decay": 1.5}, "decay"), ({"decay": 0}, "decay"),
])
def test_calibrator_refuses_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        AcceptanceCalibrator(**kw)


# ------------------------------------------------------------------ step cost


def test_cost_model_prior_then_fit():
    m = StepCostModel(prior_intercept=0.03, prior_slope=0.0)
    assert m.coefficients() == pytest.approx((0.03, 0.0))
    g = torch.Generator().manual_seed(0)
    for t in [8, 16, 32, 64] * 16:
        noise = float(torch.randn(1, generator=g)) * 1e-4
        m.observe(t, 0.01 + 0.001 * t + noise)
    a, b = m.coefficients()
    assert a == pytest.approx(0.01, rel=0.05) and b == pytest.approx(0.001, rel=0.02)
    assert m.seconds(100) == pytest.approx(a + 100 * b)
    assert torch.allclose(m.seconds(torch.tensor([1.0, 2.0])),
                          torch.tensor([a + b, a + 2 * b], dtype=torch.float64))
    assert m.num_observations == 64 and m.window == 256 and m.spread() == 8.0


def _affine_steps(m, c, steps, a=0.01, sizes=(8, 32)):
    """Feed ``m`` noise-free steps of cost ``a (1 + c t)``, alternating the row counts."""
    for i in range(steps):
        t = sizes[i % len(sizes)]
        m.observe(t, a * (1.0 + c * t))


def test_cost_model_bucket_slope_from_the_last_window_pairs():
    # The ring keeps the last ``window`` pairs: after a change of the cost per row, c is the
    # new one once the old pairs have left the window, whatever the level did.
    m = StepCostModel(window=16)
    _affine_steps(m, 0.01, 40)
    a, b = m.coefficients()
    assert b / a == pytest.approx(0.01, rel=1e-3)
    _affine_steps(m, 0.05, 40, a=0.02)  # a slower machine and a steeper cost
    a, b = m.coefficients()
    assert b / a == pytest.approx(0.05, rel=1e-3) and a == pytest.approx(0.02, rel=1e-3)


def test_cost_model_refits_the_bucket_slope_once_per_16_pairs():
    from vllm_ddtree.budget import _REFIT_ALWAYS_BELOW, _REFIT_EVERY

    m = StepCostModel()
    _affine_steps(m, 0.01, _REFIT_ALWAYS_BELOW + 20)
    a0, b0 = m.coefficients()  # fitted at this many pairs
    _affine_steps(m, 0.05, _REFIT_EVERY - 1)
    a1, b1 = m.coefficients()
    assert b1 / a1 == pytest.approx(b0 / a0, rel=1e-12)  # c kept ...
    assert a1 != a0  # ... the intercept follows the window's mean every step
    _affine_steps(m, 0.05, 1)
    a2, b2 = m.coefficients()
    assert b2 / a2 > 1.05 * (b0 / a0)  # refitted: the steeper pairs pull c up


def test_cost_model_floors():
    m = StepCostModel(min_intercept=1e-3)
    for t in [10, 20, 40]:  # cost falls with size: never a negative slope
        m.observe(t, 0.05 - 0.001 * t)
    assert m.coefficients()[1] == 0.0
    m = StepCostModel(min_intercept=1e-3)
    for t in [10, 20, 40]:  # pure proportional cost: intercept floored, slope kept
        m.observe(t, 0.001 * t)
    a, b = m.coefficients()
    assert a == 1e-3 and b == pytest.approx(0.001, rel=0.1)
    # One size only: the slope stays at the prior (not identified).
    m = StepCostModel(prior_slope=0.0)
    for _ in range(10):
        m.observe(16, 0.05)
    assert m.coefficients()[1] == pytest.approx(0.0, abs=1e-6) and m.spread() == 1.0


@pytest.mark.parametrize("tokens, seconds, match", [
    (0, 0.1, "tokens"), (1.5, 0.1, "tokens"), (4, 0.0, "seconds"), (4, float("inf"), "seconds"),
    (4, "x", "seconds"),
])
def test_cost_model_refuses_bad_observations(tokens, seconds, match):
    with pytest.raises(ValueError, match=match):
        StepCostModel().observe(tokens, seconds)


# ------------------------------------------------------------------ controller


def _simulate(step_cost, steps=200, num_reqs=2, seed=0, row_multiple=1):
    """Run the controller against a synthetic engine: the drafter's path probabilities of a
    geometric tree, a target that accepts each node with its calibrated probability (here half
    the drafter's: the drafter is over-confident), and a step time from ``step_cost``."""
    g = torch.Generator().manual_seed(seed)
    ctl = BudgetController(max_budget=64, probe_every=8, row_multiple=row_multiple)
    plp = torch.cat((torch.zeros(1), torch.log(geometric(0.97, 64)).float()))  # chain-shaped
    ids = [f"r{i}" for i in range(num_reqs)]
    for _ in range(steps):
        budgets = ctl.allocate(ids, [plp] * num_reqs)
        rows = sum(1 + b for b in budgets)
        for r, b in zip(ids, budgets):
            # Chain-shaped tree: accepted depth a with P(a >= j) = 0.5 * 0.97**j.
            u = float(torch.rand(1, generator=g))
            a = sum(1 for j in range(1, b + 1) if u < 0.5 * 0.97 ** j)
            ctl.observe_tree(r, plp[: b + 1], list(range(a + 1)))
        ctl.observe_step(rows, step_cost(rows), num_reqs)
    return ctl


@pytest.mark.parametrize("row_multiple", [1, 8])
@pytest.mark.parametrize("name, step_cost", [
    ("gpu", lambda rows: 0.02),                     # flat: the largest trees
    ("mixed", lambda rows: 0.01 + 0.002 * rows),     # fixed part and a slope: mid-sized trees
    ("cpu", lambda rows: 0.002 + 0.004 * rows),      # nearly proportional: nothing pays
])
def test_controller_learns_the_cost_online_and_reaches_the_optimum(name, step_cost,
                                                                    row_multiple):
    ctl = _simulate(step_cost, row_multiple=row_multiple)
    rows = sum(1 + b for b in ctl.stats.last_budgets)
    # the grid (min(row_multiple, requests)), the chain or every node
    assert rows % min(row_multiple, 2) == 0 or rows in (4, 130)
    # What the controller would choose knowing the true reach probabilities and cost.
    truth = [0.5 * geometric(0.97)] * 2
    best = allocate_budgets(truth, step_cost, 64)
    got = ctl.stats.last_budgets
    assert _rate(truth, got, step_cost) >= 0.98 * _rate(truth, best.budgets, step_cost)
    if name == "gpu":
        # 0 up to the rounding of the running sums (1e-12 s a token is 1 ns a 1000-row step)
        assert got == [64, 64] and ctl.cost.coefficients()[1] == pytest.approx(0.0, abs=1e-12)
    elif name == "mixed":
        assert 4 <= min(got) <= max(got) <= 16
        assert ctl.cost.coefficients() == pytest.approx((0.01, 0.002), rel=0.05)
    else:
        assert got == [1, 1] and ctl.chain_fallback and not ctl.speculation_pays
    # Calibration learned that the drafter is over-confident (reach 0.5 * q). At the CPU-like
    # cost the trees are chains after the first probes, so the top bucket (q in (0.5, 1]) holds
    # mostly the few early large trees' nodes, which share one accepted depth per tree: a
    # looser bound there.
    q = torch.tensor([0.97 ** 2])
    tol = 0.08 if name != "cpu" else 0.15
    assert float(ctl.calibrator.calibrate(q)[0]) == pytest.approx(0.5 * 0.97 ** 2, abs=tol)
    # Predicted vs observed accepted drafts (what the metrics report) agree once calibrated.
    s = ctl.stats
    assert s.trees == 400 and s.observed_accepted > 0
    assert s.predicted_accepted == pytest.approx(s.observed_accepted, rel=0.25)


def test_controller_chain_fallback_flag_and_single_log(caplog):
    ctl = BudgetController(max_budget=16, cost=StepCostModel(prior_intercept=1e-4),
                           probe_every=0)
    for _ in range(20):  # proportional cost, no fixed part: nothing pays
        ctl.observe_step(4, 0.004)
        ctl.observe_step(8, 0.008)
    plp = torch.cat((torch.zeros(1), torch.log(geometric(0.5, 16)).float()))
    with caplog.at_level(logging.WARNING, logger="vllm.ddtree"):
        for _ in range(5):
            assert ctl.allocate(["a", "b"], [plp, plp]) == [1, 1]
    assert ctl.chain_fallback and not ctl.speculation_pays
    assert ctl.stats.chain_fallback_steps == 5
    logs = [r for r in caplog.records if "no tree larger than one node pays" in r.message]
    assert len(logs) == 1 and "turning speculative decoding off" in logs[0].message


def test_controller_refuses_bad_input():
    with pytest.raises(ValueError, match="max_budget"):
        BudgetController(max_budget=0)
    ctl = BudgetController(max_budget=4)
    with pytest.raises(ValueError, match="2 req_ids but 1 trees"):
        ctl.allocate(["a", "b"], [torch.zeros(3)])
    with pytest.raises(ValueError, match="outside a tree of 2 nodes"):
        ctl.observe_tree("a", torch.zeros(3), [0, 3])
    assert math.isfinite(ctl.cost.seconds(10))


def test_target_only_comparison_leaves_out_the_drafter_pass():
    """A step's measured cost includes the drafter pass, which target-only decoding does not
    pay: with it taken off, a tree that beats the drafter-inclusive estimate can still lose to
    target-only, and the controller counts and says so."""
    from vllm_ddtree.budget import BudgetController, StepCostModel, allocate_budgets

    values = [torch.tensor([0.6, 0.3, 0.1])]
    cost = StepCostModel(prior_intercept=0.02)  # flat 20 ms per step
    with_drafter = allocate_budgets(values, cost.seconds, 8)
    assert with_drafter.speculation_pays  # 1.6+ tokens per 20 ms vs 1 token per 20 ms
    without = allocate_budgets(values, cost.seconds, 8, drafter_seconds=0.015)
    assert without.target_only_rate == pytest.approx(1 / 0.005)
    assert not without.speculation_pays and without.budgets == with_drafter.budgets
    ctl = BudgetController(8, cost=cost)
    ctl.observe_drafter(0.015)
    ctl.allocate(["a"], [torch.log(torch.tensor([1.0, 0.6, 0.18, 0.018]))])
    assert ctl.stats.unprofitable_steps == 1 and not ctl.speculation_pays
    with pytest.raises(ValueError):
        ctl.observe_drafter(0.0)


def test_build_cap_follows_the_last_allocation():
    """Trees are built at 1.25 × the last largest budget (8 .. B_max), twice it before a
    doubling probe; B_max before any allocation."""
    from vllm_ddtree.budget import BudgetController, StepCostModel

    ctl = BudgetController(64, cost=StepCostModel(prior_intercept=0.01, prior_slope=0.01),
                           probe_every=0)
    assert ctl.build_cap() == 64
    ctl.allocate(["a"], [torch.log(torch.tensor([1.0, 0.9, 0.5, 0.01, 0.001]))])
    assert max(ctl.stats.last_budgets) <= 4 and ctl.build_cap() == 8
    ctl.stats.last_budgets = [20, 3]
    assert ctl.build_cap() == 25
    ctl.stats.last_budgets = [21]
    assert ctl.build_cap() == 27  # rounded up
    ctl.stats.last_budgets = [6]
    assert ctl.build_cap() == 8
    ctl.stats.last_budgets = [60]
    assert ctl.build_cap() == 64
    ctl.probe_every = 4  # the next allocation (step 8) is a doubling probe
    ctl.stats.steps, ctl.stats.last_budgets = 7, [20]
    assert ctl.build_cap() == 40
    ctl.stats.steps = 3  # step 4: a halving probe
    assert ctl.build_cap() == 25


def test_build_caps_follow_each_request_s_last_budget():
    """Per request: 1.25 × its own last budget (8 .. B_max), twice it before a doubling probe; a
    request without one gets the batch-wide build_cap; a finished request is forgotten."""
    from vllm_ddtree.budget import BudgetController, StepCostModel

    ctl = BudgetController(64, cost=StepCostModel(prior_intercept=0.01, prior_slope=0.01),
                           probe_every=0)
    assert ctl.build_caps(["a", "b"]) == [64, 64]
    lp = [torch.log(torch.tensor([1.0, 0.9, 0.5, 0.01, 0.001])),
          torch.log(torch.tensor([1.0] + [0.99] * 40))]
    budgets = ctl.allocate(["a", "b"], lp)
    assert budgets[0] <= 4 < 21 <= budgets[1]
    want_b = min(64, -(-5 * budgets[1] // 4))
    assert ctl.build_caps(["a", "b", "c"]) == [8, want_b, max(8, want_b)]
    ctl.probe_every = (ctl.stats.steps + 1) // 2  # the next allocation is a doubling probe
    assert ctl.stats.steps + 1 == 2 * ctl.probe_every
    assert ctl.build_caps(["b"]) == [min(64, 2 * budgets[1])]
    ctl.forget({"b"})
    assert ctl.build_caps(["a"]) == [ctl.build_cap()]


def test_cost_model_does_not_read_a_few_noisy_steps_of_a_bucket_as_a_flat_cost():
    """Measured on the shipped pair: after a warm-up the batch-8 bucket held two steps, 32 rows
    in 15.3 ms and 48 in 14.0 (noise), which a weakly regularised fit read as a flat cost;
    every tree then grew to B_max (520-row steps of 84 ms). A bucket's slope now follows the
    pooled slope until its own steps measure it through their noise."""
    g = torch.Generator().manual_seed(0)
    m = StepCostModel()
    for i in range(64):  # batch 1 and 5: 80 us a row, 0.3 / 0.8 ms of noise
        t = (16, 24, 16, 8)[i % 4]
        m.observe(t, 0.0072 + 8e-5 * t + 3e-4 * float(torch.randn(1, generator=g)), 1)
    for i in range(14):
        t = (16, 24, 32, 40)[i % 4]
        m.observe(t, 0.0095 + 8e-5 * t + 8e-4 * float(torch.randn(1, generator=g)), 5)
    pooled = m._pooled_fit()[1]
    assert pooled == pytest.approx(8e-5, rel=0.25)
    m.observe(32, 0.0153, 8)
    m.observe(48, 0.0140, 8)
    a, b, c = m._pooled_fit()
    assert m.coefficients(8) == (a + 8 * c, b)  # 2 steps: the pooled fit
    ctl = BudgetController(64, cost=m, probe_every=0)
    plp = torch.cat((torch.zeros(1), torch.log(geometric(0.9)).float()))
    assert max(ctl.allocate([str(i) for i in range(8)], [plp] * 8)) < 32
    # Two more: the bucket's own fit, its slope still mostly the pooled one (its steps' 16-row
    # spread does not measure a slope through 1 ms of noise).
    m.observe(40, 0.0150, 8)
    m.observe(40, 0.0154, 8)
    assert 0.5 * m._pooled_fit()[1] < m.coefficients(8)[1] < m._pooled_fit()[1]
    # Steps that measure a slope of their own (wide sizes, little noise) set it.
    for i in range(64):
        t = (40, 72, 136, 264)[i % 4]
        m.observe(t, 0.012 + 3.5e-5 * t + 2e-4 * float(torch.randn(1, generator=g)), 8)
    assert m.coefficients(8)[1] == pytest.approx(3.5e-5, rel=0.05)
    with pytest.raises(ValueError, match="min_bucket_steps"):
        StepCostModel(window=3, min_bucket_steps=4)


def test_a_bucket_learns_its_slope_when_the_pooled_slope_is_zero():
    """Found by a reviewer: batch-1 steps flat within noise (a GPU) clamp the pooled slope to
    0; a prior of that scale pinned the batch-8 bucket's slope at 0 however clean its steps."""
    g = torch.Generator().manual_seed(0)
    m = StepCostModel()
    for i in range(64):
        t = 2 + 8 * i
        m.observe(t, 0.015 - 1e-5 * t + 3e-4 * float(torch.randn(1, generator=g)), 1)
    for i in range(32):
        t = (16, 32, 64, 128)[i % 4]
        m.observe(t, 0.015 + 1.3e-4 * t + 5e-5 * float(torch.randn(1, generator=g)), 8)
    assert m._pooled_fit()[1] == 0.0
    assert m.coefficients(8)[1] == pytest.approx(1.3e-4, rel=0.05)


def test_a_slow_spell_on_the_small_steps_does_not_read_as_a_flat_cost():
    """Measured on the shipped pair at batch 8: after one slow pass of the machine the mean
    budget went 5 -> 13 for several passes. A spell slows a step's intercept and slope alike,
    so the bucket's cost per token relative to its intercept comes from the time ratios of
    consecutive steps, which a spell does not change; a fit on the steps' levels reads the
    slow small steps below as a cost falling with size."""
    g = torch.Generator().manual_seed(0)
    m = StepCostModel()
    a_true, b_true = 0.012, 6e-5
    steps = []
    for i in range(64):
        slow, t = (1.5, (40, 48)[i % 2]) if i < 32 else (1.0, (56, 64)[i % 2])
        s = slow * (a_true + b_true * t) * (1 + 0.01 * float(torch.randn(1, generator=g)))
        m.observe(t, s, 8)
        steps.append((t, s))
    t, s = (torch.tensor(v, dtype=torch.float64) for v in zip(*steps))
    level_slope = float(((t - t.mean()) * (s - s.mean())).sum() / ((t - t.mean()) ** 2).sum())
    assert level_slope < 0  # the case: the steps' levels fall with size
    a, b = m.coefficients(8)
    assert b / a == pytest.approx(b_true / a_true, rel=0.15)


def test_cost_model_fits_each_batch_size_apart():
    """Steps at batch 1 then batch 8, trees of several sizes, a cost per token that batching
    amortises: each batch size gets its own intercept and slope, so batch 8's many rows do not
    read as steep tokens (a fit over both made the controller shrink every tree at batch 8)."""
    m = StepCostModel()
    g = torch.Generator().manual_seed(1)

    def truth(t, r):
        return 0.005 + 0.004 * r + (0.0004 if r == 1 else 0.00005) * t

    def feed(r, n):
        for i in range(n):
            t = r * (1 + (4, 8, 16, 32)[i % 4])
            m.observe(t, truth(t, r) + float(torch.randn(1, generator=g)) * 1e-5, requests=r)

    feed(1, 40)
    assert m.coefficients(8)[1] == pytest.approx(0.0004, rel=0.05)  # no batch-8 step yet: pooled
    feed(8, 24)
    for r, slope in ((1, 0.0004), (8, 0.00005)):
        a, b = m.coefficients(r)
        assert b == pytest.approx(slope, rel=0.05), r
        assert m.seconds(72, r) == pytest.approx(truth(72, r), rel=0.01), r
    assert m.coefficients(9) == m.coefficients(8)  # one bucket: 8 .. 15 requests
    assert m.num_observations == 24 and m.spread(8) == m.spread(1) == pytest.approx(33 / 5)
    # The allocation at batch 8 then sees cheap tokens: every tree B_max under these values,
    # while at batch 1 the same trees are cut.
    ctl = BudgetController(32, cost=m, probe_every=0)
    plp = torch.log(torch.linspace(0.9, 0.3, 33)).float()
    plp[0] = 0.0
    assert ctl.allocate([str(i) for i in range(8)], [plp] * 8) == [32] * 8
    assert ctl.allocate(["0"], [plp])[0] < 32
    # Pooled over both sizes, the per-request term is found apart from the per-token one.
    assert m.per_request() > 0.002
    # With one batch size only, the per-request term is not identified and stays 0.
    m1 = StepCostModel()
    for t in (5, 9, 17, 33) * 4:
        m1.observe(t, 0.01 + 0.001 * t, requests=1)
    assert m1.per_request() == pytest.approx(0.0, abs=1e-6)
    assert m1.coefficients() == pytest.approx((0.01, 0.001), rel=0.01)


@pytest.mark.parametrize("call, match", [
    (lambda c: c.allocate(["a"], [torch.tensor([0.0, float("nan"), -1.0])]), "NaN"),
    (lambda c: c.allocate(["a"], [torch.tensor([0.0])]), "at least one node"),
    (lambda c: c.allocate([], []), "no request"),
    (lambda c: c.observe_tree("a", torch.tensor([0.0, -0.1]), [0, -1]), "outside a tree"),
    (lambda c: c.observe_step(10**400, 0.01), "tokens"),
    (lambda c: c.observe_step(10, 0.01, 10**400), "requests"),
    (lambda c: c.cost.coefficients(0), "requests"),
])
def test_controller_refuses_bad_input_with_value_errors(call, match):
    """Found by a tester: these raised IndexError / OverflowError or gave NaN fits."""
    with pytest.raises(ValueError, match=match):
        call(BudgetController(8))


def test_agreed_budgets_replace_the_local_choice():
    """Tensor parallelism: ``agree`` (rank 0's budgets, broadcast) overrides this rank's own
    choice, and what the controller records (predictions, the next build cap) follows the
    agreed sizes; budgets that do not fit this rank's trees are refused."""
    g = torch.Generator().manual_seed(3)
    lps = [build_draft_tree(torch.log_softmax(torch.randn(6, 10, generator=g), -1), 12)
           .path_log_probs for _ in range(2)]
    c = BudgetController(12, probe_every=0)
    seen = []
    c.agree = lambda budgets: seen.append(budgets) or [5, 2]
    assert c.allocate(["a", "b"], lps) == [5, 2]
    assert len(seen) == 1 and len(seen[0]) == 2  # the local choice was offered
    assert c.stats.last_budgets == [5, 2] and c.build_cap() == 8
    assert c._pending["a"] == pytest.approx(float(torch.exp(lps[0][1:6]).sum()), rel=1e-5)
    for bad in ([13, 1], [0, 1], [1]):
        c.agree = lambda budgets, bad=bad: bad
        with pytest.raises(ValueError, match="agreed budgets"):
            c.allocate(["a", "b"], lps)


def test_allocation_keeps_to_the_row_grid():
    """With ``row_multiple`` the step verifies a multiple of it (or one node per request, or
    every candidate), and the choice is the best such step: brute force over every split of the
    nodes at every grid total (greedy by value is optimal at a fixed total)."""
    values = [geometric(0.9, 20), geometric(0.7, 20), geometric(0.5, 20)]
    cost = lambda rows: 0.01 + 0.0004 * rows  # noqa: E731
    free = allocate_budgets(values, cost, 20)
    assert sum(1 + b for b in free.budgets) % 8  # the unconstrained optimum is off the grid
    grid = allocate_budgets(values, cost, 20, row_multiple=8)
    rows = sum(1 + b for b in grid.budgets)
    assert rows % 8 == 0 and grid.tokens == rows
    best = max(_rate(values, split, cost)
               for split in itertools.product(range(1, 21), repeat=3)
               if sum(1 + b for b in split) % 8 == 0 or sum(split) in (3, 60))
    assert _rate(values, grid.budgets, cost) == pytest.approx(best, rel=1e-12)
    # The ends stay reachable: a flat cost takes every node (63 rows), a steep one the chain.
    assert allocate_budgets(values, flat, 20, row_multiple=8).budgets == [20, 20, 20]
    assert allocate_budgets(values, cpu_like, 20, row_multiple=8).budgets == [1, 1, 1]
    with pytest.raises(ValueError, match="row_multiple"):
        allocate_budgets(values, cost, 20, row_multiple=0)


#: Rows a quarter-octave ladder allows on a grid of one row (sizes_per_octave=4), written out.
LADDER_4 = [*range(1, 8), 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128]


@pytest.mark.parametrize("grid", [1, 3])
def test_allocation_keeps_to_the_ladder(grid):
    """With ``sizes_per_octave`` the step verifies a size of the geometric ladder on the grid
    (1 … 7 grid units, then 8, 10, 12, 14, 16, 20, ...), or one node per request, or every
    candidate; the choice is the best such step (brute force over every split)."""
    values = [geometric(0.93, 40), geometric(0.85, 40)]
    cost = lambda rows: 0.01 + 0.00012 * rows  # noqa: E731
    allowed = {grid * u for u in LADDER_4}
    free = allocate_budgets(values, cost, 40, row_multiple=grid)
    assert free.tokens not in allowed, "the grid's optimum lies on the ladder: a blunt test"
    a = allocate_budgets(values, cost, 40, row_multiple=grid, sizes_per_octave=4)
    rows = sum(1 + b for b in a.budgets)
    assert rows == a.tokens and rows in allowed
    best = max(_rate(values, split, cost)
               for split in itertools.product(range(1, 41), repeat=2)
               if sum(1 + b for b in split) in allowed or sum(split) in (2, 80))
    assert _rate(values, a.budgets, cost) == pytest.approx(best, rel=1e-12)
    # 0 is every multiple of the grid; the ends stay reachable.
    assert allocate_budgets(values, cost, 40, row_multiple=grid, sizes_per_octave=0) == free
    assert allocate_budgets(values, flat, 40, sizes_per_octave=4).budgets == [40, 40]
    steep = lambda rows: 0.002 + 0.04 * rows  # noqa: E731
    assert allocate_budgets(values, steep, 40, sizes_per_octave=4).budgets == [1, 1]
    for bad in (3, -1, 2.0):
        with pytest.raises(ValueError, match="sizes_per_octave"):
            allocate_budgets(values, cost, 40, sizes_per_octave=bad)
        with pytest.raises(ValueError, match="sizes_per_octave"):
            BudgetController(40, sizes_per_octave=bad)


def test_controller_allocates_on_its_ladder():
    """The engine's controller (grid min(8, requests), :data:`ENGINE_SIZES_PER_OCTAVE`) at
    batch 1 chooses the best ladder size, which here is not the free optimum."""
    cost = lambda rows: 0.0101 + 0.00012 * rows  # noqa: E731
    ctl = BudgetController(40, cost=StepCostModel(prior_intercept=0.0101, prior_slope=0.00012),
                           probe_every=0, row_multiple=ENGINE_ROW_MULTIPLE,
                           sizes_per_octave=ENGINE_SIZES_PER_OCTAVE)
    plp = torch.cat((torch.zeros(1), torch.log(geometric(0.93, 40)).float()))
    (b,) = ctl.allocate(["r0"], [plp])
    values = [marginal_values(plp, ctl.calibrator)]
    free = allocate_budgets(values, cost, 40)
    assert 1 + b in LADDER_4 and free.tokens not in LADDER_4
    assert [b] == allocate_budgets(values, cost, 40, sizes_per_octave=4).budgets


def test_controller_keeps_to_its_ladder_when_every_node_built_pays():
    """The engine's trees are built to caps (:meth:`BudgetController.build_caps`), so taking
    every node built is an arbitrary row count: the controller does not take it off the ladder
    (``take_all=False``), while :func:`allocate_budgets` by default does. Measured on the
    shipped pair at batch 8: 15 of a pass's 34 steps verified a row count never seen before,
    each paying oneDNN's one-time costs."""
    ctl = BudgetController(64, cost=StepCostModel(prior_slope=0.0), probe_every=0,
                           row_multiple=ENGINE_ROW_MULTIPLE,
                           sizes_per_octave=ENGINE_SIZES_PER_OCTAVE)
    allowed = {8 * u for u in LADDER_4}
    for caps in ([14] * 8, [9, 17, 5, 30, 12, 12, 8, 21]):  # 112 + 8 rows, 114 + 8 rows
        plps = [torch.cat((torch.zeros(1), torch.log(geometric(0.97, c)).float())) for c in caps]
        budgets = ctl.allocate([f"r{i}" for i in range(8)], plps)
        rows = sum(1 + b for b in budgets)
        free = allocate_budgets([marginal_values(p, ctl.calibrator) for p in plps], flat, 64,
                                row_multiple=8, sizes_per_octave=4)
        assert free.budgets == caps and free.tokens not in allowed  # flat cost: every node
        assert rows in allowed and rows == max(r for r in allowed if r <= free.tokens)
    (b,) = ctl.allocate(["r0"], [torch.cat((torch.zeros(1),
                                            torch.log(geometric(0.97, 13)).float()))])
    assert 1 + b == 14 and 1 + b in LADDER_4  # batch 1: 13 nodes is on the ladder itself
    (b,) = ctl.allocate(["r0"], [torch.cat((torch.zeros(1),
                                            torch.log(geometric(0.97, 18)).float()))])
    assert b == 15  # 19 rows is not: 16 is the largest ladder size below


@pytest.mark.parametrize("probe, lo, hi", [(2.0, 1.5, 2.5), (0.5, 0.3, 0.7)])
def test_probe_is_the_best_tree_set_at_another_size(probe, lo, hi):
    """A probe step verifies about ``probe`` × the chosen rows, on the grid, and takes the most
    valuable nodes at that total (each request a prefix of its pop order), while the
    allocation's own figures stay those of the optimum."""
    values = [geometric(0.9, 40), geometric(0.6, 40)]
    cost = lambda rows: 0.01 + 0.0002 * rows  # noqa: E731
    plain = allocate_budgets(values, cost, 40, row_multiple=8)
    a = allocate_budgets(values, cost, 40, row_multiple=8, probe=probe)
    assert a.budgets == plain.budgets and a.tokens == plain.tokens
    rows = sum(1 + b for b in a.probe_budgets)
    assert rows % 8 == 0 and lo * plain.tokens <= rows <= hi * plain.tokens
    # The most valuable nodes at that total: no node left out is worth more than one taken.
    taken = [float(v[b - 1]) for v, b in zip(values, a.probe_budgets) if b > 1]
    left = [float(v[b]) for v, b in zip(values, a.probe_budgets) if b < v.numel()]
    assert min(taken) >= max(left)


def test_controller_probes_on_the_grid():
    """The controller's probe steps (while the cost slope is unidentified) keep to its grid."""
    ctl = BudgetController(64, cost=StepCostModel(prior_intercept=0.01, prior_slope=0.0002),
                           probe_every=2, row_multiple=8)
    plp = torch.cat((torch.zeros(1), torch.log(geometric(0.9, 64)).float()))
    ids = [f"r{i}" for i in range(8)]
    sizes = []
    for _ in range(4):
        budgets = ctl.allocate(ids, [plp] * 8)
        sizes.append(sum(1 + b for b in budgets))
    assert all(r % 8 == 0 for r in sizes)
    assert sizes[3] > sizes[0] > sizes[1]  # step 2 halves, step 4 doubles; steps 1, 3 plain


@pytest.mark.parametrize("num_reqs, grid", [(1, 1), (2, 2), (3, 3), (9, 8)])
def test_controller_grid_is_the_batch_below_row_multiple(num_reqs, grid):
    """Below ``row_multiple`` requests the grid is the batch size: at batch 1 a grid of 8 left
    only B = 7, 15, 23, ... (and the best fixed budget on the shipped pair is B = 16). The
    choice is the best step on that grid (``allocate_budgets``, brute-forced above), here off
    the grid of 8 and off the free optimum where the grid is wider than one row."""
    reach = [0.9, 0.8, 0.85, 0.7, 0.95, 0.75, 0.88, 0.6, 0.82][:num_reqs]
    cost = lambda rows: 0.0101 + 0.0001 * rows  # noqa: E731
    ctl = BudgetController(40, cost=StepCostModel(prior_intercept=0.0101, prior_slope=0.0001),
                           probe_every=0, row_multiple=8)
    plps = [torch.cat((torch.zeros(1), torch.log(geometric(r, 40)).float())) for r in reach]
    budgets = ctl.allocate([f"r{i}" for i in range(num_reqs)], plps)
    rows = sum(1 + b for b in budgets)
    # The values the controller allocates on: the calibrator's (its prior, here).
    values = [marginal_values(p, ctl.calibrator) for p in plps]
    want = allocate_budgets(values, cost, 40, row_multiple=grid)
    assert budgets == want.budgets and rows == want.tokens and rows % grid == 0
    free = allocate_budgets(values, cost, 40)
    if grid == 1:
        assert budgets == free.budgets and rows % 8, "off the 8-row grid, or the test is blunt"
    else:
        assert free.tokens % grid, "the free optimum lies off the grid, or the test is blunt"


def test_first_step_of_each_size_is_not_timed():
    """``step_finished``: consecutive steps feed the cost model, except the first step of each
    ``(rows, requests)``, whose one-time costs (oneDNN primitives, kernel tuning) are not what
    the size costs later; a gap in step indices or a step with prefill (rows 0) is not timed."""
    ctl = BudgetController(8)
    feed = [(0, 16, 1, 0.000), (1, 16, 1, 0.050), (2, 16, 1, 0.060), (3, 24, 1, 0.130),
            (4, 24, 1, 0.140), (5, 16, 2, 0.200), (6, 16, 1, 0.210), (8, 16, 1, 0.300),
            (9, 0, 1, 0.310), (10, 24, 1, 0.320)]
    for i, rows, reqs, now in feed:
        ctl.step_finished(i, rows, reqs, now)
    obs = {k: [(t, r, round(s, 6)) for t, r, s in d] for k, d in ctl.cost._obs.items()}
    # (16, 1) first at step 1, (24, 1) at 3, (16, 2) at 5: not timed; step 8 follows a gap.
    assert obs == {1: [(16.0, 1.0, 0.01), (24.0, 1.0, 0.01), (16.0, 1.0, 0.01),
                       (24.0, 1.0, 0.01)]}


def test_a_probe_of_a_new_size_is_repeated_so_a_new_engine_learns_its_cost():
    """A new engine starts GPU-like (prior slope 0: ``B_max``-node trees) and must learn a
    CPU-like slope from probes; a probe's first step at a new size is not timed, so it is
    repeated at the next allocation, and the first probe halves. Before, the first probe
    (allocation 16) doubled, which cannot grow a ``B_max`` tree, the halving one (32) taught
    nothing, and the trees only shrank after allocation 64 (measured on the shipped pair: ~60
    steps of B = 64 at batch 1)."""
    ctl = BudgetController(64, probe_every=16, row_multiple=ENGINE_ROW_MULTIPLE,
                           sizes_per_octave=ENGINE_SIZES_PER_OCTAVE)
    plp = torch.cat((torch.zeros(1), torch.log(geometric(0.9, 64)).float()))
    cost = lambda rows: 0.01 + 0.0003 * rows  # noqa: E731
    now, rows, seen, sizes = 0.0, 0, set(), []
    for i in range(24):
        ctl.step_finished(i, rows, 1, now)
        (b,) = ctl.allocate(["r0"], [plp])
        rows = 1 + b
        sizes.append(rows)
        now += cost(rows) + (0.04 if rows not in seen else 0.0)  # a new size's one-time cost
        seen.add(rows)
    # B_max = 64 nodes would be 65 rows, off the ladder: the largest ladder size is 64
    assert sizes[:15] == [64] * 15 and sizes[15] == sizes[16] < 64, sizes  # probe, repeated
    truth = allocate_budgets([marginal_values(plp, ctl.calibrator)], cost, 64,
                             sizes_per_octave=4, take_all=False)
    assert sizes[-1] == truth.tokens < 64, sizes  # then the best size for the true cost


@pytest.mark.parametrize("kwargs, match", [
    (dict(probe="2"), None),                      # a numeric string is taken as its number
    (dict(probe=0), "probe"), (dict(probe=float("nan")), "probe"),
    (dict(drafter_seconds=-5.0), "drafter_seconds"),
    (dict(drafter_seconds=float("nan")), "drafter_seconds"),
    (dict(drafter_seconds="x"), "drafter_seconds"),
    (dict(step_seconds=lambda rows: torch.ones(3)), "one value per row count"),
])
def test_allocate_budgets_checks_its_arguments(kwargs, match):
    """Found by a tester: a string probe and a huge one, an unchecked drafter_seconds and a cost
    of the wrong shape gave TypeErrors, NaN rates or numpy's broadcast error."""
    values = [geometric(0.9, 16)] * 3
    args = dict(step_seconds=cpu_like, max_budget=16, row_multiple=8)
    args.update(kwargs)
    if match is None:
        a = allocate_budgets(values, **args)
        assert a.probe_budgets is not None
    else:
        with pytest.raises(ValueError, match=match):
            allocate_budgets(values, **args)


def test_huge_probe_takes_the_largest_step():
    values = [geometric(0.9, 16)] * 3
    a = allocate_budgets(values, lambda rows: 0.01 + 0.0004 * rows, 16, row_multiple=8,
                         probe=1e17)
    assert a.probe_budgets == [16, 16, 16]
    assert allocate_budgets(values, flat, 16, row_multiple=8, probe=1e-17).probe_budgets == [1] * 3
