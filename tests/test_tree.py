"""Tests for vllm_ddtree.tree: DDTree draft-tree construction (paper Alg. 1) and the walk."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.tree_checks import follow_trees, validate_draft_tree
from vllm_ddtree.tree import (
    DraftTree,
    build_draft_tree,
    build_draft_trees,
    chain_tree,
    follow_tree,
)

NEG_INF = float("-inf")
# Dyadic values: sums are exact, so ties between different paths are real ties.
TIE_VALUES = [0.0, -0.5, -1.0, -1.5, -2.0, -3.0, NEG_INF]


def _lists(tree: DraftTree) -> tuple[list[int], list[int], list[int]]:
    return tree.token_ids.tolist(), tree.parents.tolist(), tree.depths.tolist()


def _prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token tuple of every non-root node, in node order."""
    toks, pars, _ = _lists(tree)
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, tree.num_nodes + 1):
        paths.append(paths[pars[i]] + (toks[i - 1],))
    return paths[1:]


def _brute_force(rows: list[list[float]]) -> list[tuple[float, tuple[int, ...]]]:
    """All finite-probability prefixes up to depth L with their path scores (depth-order sums).

    ``rows[d]`` is the list of allowed ``(value)`` per token at depth d+1; a None entry marks a
    token excluded from the search.
    """
    out = []
    for depth in range(1, len(rows) + 1):
        for toks in itertools.product(*[range(len(r)) for r in rows[:depth]]):
            score = 0.0
            ok = True
            for d, t in enumerate(toks):
                v = rows[d][t]
                if v is None or v == NEG_INF:
                    ok = False
                    break
                score += v
            if ok:
                out.append((score, toks))
    out.sort(key=lambda x: -x[0])
    return out


def _f32(xs: list[float]) -> list[float]:
    return torch.tensor(xs, dtype=torch.float32).tolist()


@st.composite
def _draft_inputs(draw):
    depth_l = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 5))
    if draw(st.booleans()):
        elem = st.sampled_from(TIE_VALUES)
    else:
        elem = st.floats(-8.0, 0.0, allow_nan=False, width=32)
    vals = draw(st.lists(st.lists(elem, min_size=vocab, max_size=vocab), min_size=depth_l,
                         max_size=depth_l))
    budget = draw(st.integers(0, 12))
    max_children = draw(st.one_of(st.none(), st.integers(1, 3)))
    return torch.tensor(vals, dtype=torch.float32), budget, max_children


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_draft_inputs())
def test_tree_is_the_most_probable_prefixes(args):
    log_probs, budget, max_children = args
    depth_l, vocab = log_probs.shape
    tree = build_draft_tree(log_probs, budget, max_children)
    validate_draft_tree(tree, max_depth=depth_l)

    rows = log_probs.tolist()
    if max_children is not None:
        # Keep only the top-max_children values per depth (ties at the cut: any of them).
        capped = []
        for r in rows:
            keep = sorted(range(vocab), key=lambda t: (-r[t], t))[:max_children]
            capped.append([r[t] if t in keep else None for t in range(vocab)])
        rows_search = capped
    else:
        rows_search = rows
    brute = _brute_force(rows_search)
    want = brute[:budget]
    assert tree.num_nodes == len(want)

    scores = tree.path_log_probs.tolist()
    assert scores[0] == 0.0
    # Same multiset of path scores as the best `budget` prefixes.
    assert sorted(scores[1:], reverse=True) == _f32([s for s, _ in want])
    # Node order is pop order: non-increasing path log-probs, all finite.
    assert all(a >= b for a, b in zip(scores, scores[1:]))
    assert all(math.isfinite(s) for s in scores)

    # Each node's score is the depth-order sum of its tokens' per-depth log-probs.
    prefixes = _prefixes(tree)
    for i, path in enumerate(prefixes, start=1):
        total = 0.0
        for d, t in enumerate(path):
            total += rows[d][t]
        assert _f32([total])[0] == scores[i]
        assert len(path) == tree.depths[i].item()

    # Without a tie at the cut-off the optimal set is unique: compare it exactly.
    if max_children is None and (
        budget == 0 or len(brute) <= budget or brute[budget - 1][0] != brute[budget][0]
    ):
        assert set(prefixes) == {p for _, p in want}

    # The batched builder gives the same trees.
    batch = build_draft_trees(torch.stack([log_probs, log_probs.flip(-1)]), budget, max_children)
    assert _lists(batch[0]) == _lists(tree)
    assert torch.equal(batch[0].ancestor_mask, tree.ancestor_mask)
    assert _lists(batch[1]) == _lists(build_draft_tree(log_probs.flip(-1), budget, max_children))


def test_hand_worked_example():
    # depth 1 ranks: tok1 (-0.25), tok0 (-1), tok2 (-3)
    # depth 2 ranks: tok2 (-0.5), tok0 (-2), tok1 (-4)
    # depth 3 ranks: tok0 (-0.125), tok1 (-5), tok2 (-6)
    # best prefixes: (1) -.25, (1,2) -.75, (1,2,0) -.875, (0) -1, (0,2) -1.5, (0,2,0) -1.625,
    #                (1,0) -2.25, (1,0,0) -2.375, (2) -3, ...
    log_probs = torch.tensor(
        [[-1.0, -0.25, -3.0], [-2.0, -4.0, -0.5], [-0.125, -5.0, -6.0]]
    )
    tree = build_draft_tree(log_probs, 5)
    assert tree.token_ids.tolist() == [1, 2, 0, 0, 2]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 4]
    assert tree.depths.tolist() == [0, 1, 2, 3, 1, 2]
    assert tree.path_log_probs.tolist() == [0.0, -0.25, -0.75, -0.875, -1.0, -1.5]
    assert tree.num_nodes == 5 and tree.max_depth == 3
    assert tree.token_ids.dtype == torch.long and tree.path_log_probs.dtype == torch.float32
    assert tree.child_maps == [{1: 1, 0: 4}, {2: 2}, {0: 3}, {}, {2: 5}, {}]
    expected_mask = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 0, 0, 0, 1, 0],
            [1, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestor_mask, expected_mask)
    # bf16 input (these values are exact in bf16) gives the same tree.
    tree_bf16 = build_draft_tree(log_probs.bfloat16(), 5)
    assert tree_bf16.token_ids.tolist() == [1, 2, 0, 0, 2]


def test_budget_zero_is_root_only():
    for lp in (torch.randn(3, 4).log_softmax(-1), torch.empty(0, 4), torch.empty(3, 0)):
        tree = build_draft_tree(lp, 0)
        assert tree.num_nodes == 0 and tree.max_depth == 0
        assert tree.token_ids.tolist() == [] and tree.token_ids.dtype == torch.long
        assert tree.parents.tolist() == [-1]
        assert tree.depths.tolist() == [0]
        assert tree.ancestor_mask.tolist() == [[True]]
        assert tree.path_log_probs.tolist() == [0.0]
        assert tree.child_maps == [{}]
        validate_draft_tree(tree, max_depth=0)
        assert follow_tree(tree, [7]) == ([0], 7)
    assert build_draft_trees(torch.empty(0, 3, 4), 5) == []


def test_dominant_top1_gives_chain():
    depth_l, vocab = 5, 6
    top = [3, 0, 5, 5, 2]
    lp = torch.full((depth_l, vocab), -30.0)
    for d, t in enumerate(top):
        lp[d, t] = 0.0
    chain = build_draft_tree(lp, depth_l)
    assert chain.token_ids.tolist() == top
    assert chain.parents.tolist() == list(range(-1, depth_l))
    assert chain.depths.tolist() == list(range(depth_l + 1))
    ref = chain_tree(top)
    assert torch.equal(chain.ancestor_mask, ref.ancestor_mask)
    assert torch.equal(chain.ancestor_mask, torch.ones(6, 6, dtype=torch.bool).tril())

    wide = build_draft_tree(lp, 3 * depth_l)
    validate_draft_tree(wide, max_depth=depth_l)
    assert wide.token_ids[:depth_l].tolist() == top
    assert wide.parents[: depth_l + 1].tolist() == list(range(-1, depth_l))
    assert wide.num_nodes == 3 * depth_l


def test_ties_follow_rank_tuple_rule():
    # All scores 0: rank tuples pop in lexicographic order, a prefix before its extensions.
    tree = build_draft_tree(torch.zeros(2, 2), 6)
    assert tree.token_ids.tolist() == [0, 0, 1, 1, 0, 1]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0, 4, 4]

    # Equal values in a row rank by ascending token id.
    # depth 1 ranks: tok1 (0), tok2 (0), tok0 (-1); depth 2 ranks: tok2 (0), tok0 (-1), tok1 (-1)
    # score 0 : (0,)=[1] (0,0)=[1,2] (1,)=[2] (1,0)=[2,2]
    # score -1: (0,1)=[1,0] (0,2)=[1,1] (1,1)=[2,0] (1,2)=[2,1] (2,)=[0] (2,0)=[0,2]
    lp = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, -1.0, 0.0]])
    tree = build_draft_tree(lp, 7)
    assert tree.token_ids.tolist() == [1, 2, 2, 2, 0, 1, 0]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3, 1, 1, 3]
    assert tree.depths.tolist() == [0, 1, 2, 1, 2, 2, 2, 2]
    full = build_draft_tree(lp, 20)
    assert full.num_nodes == 12
    assert full.token_ids.tolist()[7:] == [1, 0, 2, 0, 1]  # (1,2) (2,) (2,0), then (2,1) (2,2)

    # torch.topk itself returns tied entries in no fixed order (e.g. [2, 4, 3, 0, 1] here).
    assert build_draft_tree(torch.zeros(1, 5), 5).token_ids.tolist() == [0, 1, 2, 3, 4]
    assert build_draft_tree(torch.zeros(2, 5), 6).token_ids.tolist() == [0, 0, 1, 2, 3, 4]

    # Deterministic: repeated calls (and the batched form) agree exactly.
    g = torch.Generator().manual_seed(0)
    rnd = torch.tensor(TIE_VALUES[:-1])[torch.randint(0, 6, (4, 8), generator=g)]
    first = _lists(build_draft_tree(rnd, 30))
    for _ in range(5):
        assert _lists(build_draft_tree(rnd, 30)) == first
    assert _lists(build_draft_trees(rnd[None].expand(3, 4, 8), 30)[2]) == first


def test_batched_ties_ranked_per_row():
    """Rows with ties and rows without, in one batched build: ties are ranked by token id only
    where a row holds them; every tree equals the one built from its own log-probs alone."""
    g = torch.Generator().manual_seed(3)
    tied = torch.tensor(TIE_VALUES[:-1])[torch.randint(0, 6, (5, 9), generator=g)]
    untied = torch.log_softmax(torch.randn(5, 9, generator=g) * 3, dim=-1)
    mixed = untied.clone()
    mixed[1] = tied[1]  # one depth tied, the others not
    lp = torch.stack([untied, tied, mixed, tied.flip(-1)])
    # Per-request budgets share one top-k (k <= 16): request 3's (tied) budget is the shared
    # k, so no tie sits at its cut, where the token kept would be torch.topk's pick.
    for budget in (1, 7, 30, [4, 30, 12, 9]):
        got = build_draft_trees(lp, budget)
        for r, tree in enumerate(got):
            b = budget[r] if isinstance(budget, list) else budget
            assert _lists(tree) == _lists(build_draft_tree(lp[r], b)), (budget, r)
            assert torch.equal(tree.path_log_probs, build_draft_tree(lp[r], b).path_log_probs)
    # The tied rows follow the rule shown above (ascending token id among equal values).
    one = build_draft_tree(tied[:1], 9)
    order = sorted(range(9), key=lambda t: (-tied[0, t].item(), t))
    assert one.token_ids.tolist() == order


def test_neg_inf_tokens_never_become_nodes():
    lp = torch.tensor([[0.0, NEG_INF, NEG_INF], [NEG_INF, -1.0, NEG_INF]])
    tree = build_draft_tree(lp, 10)
    assert tree.token_ids.tolist() == [0, 1]
    assert tree.parents.tolist() == [-1, 0, 1]
    # A depth with no finite token stops the tree there.
    lp = torch.tensor([[0.0, -1.0], [NEG_INF, NEG_INF], [0.0, 0.0]])
    tree = build_draft_tree(lp, 10)
    assert tree.token_ids.tolist() == [0, 1] and tree.max_depth == 1
    assert build_draft_tree(torch.full((2, 3), NEG_INF), 4).num_nodes == 0


def test_max_children_caps_children():
    lp = torch.tensor([[-1.0, -0.5, -3.0, -0.25]] * 3)
    tree = build_draft_tree(lp, 100, max_children=2)
    validate_draft_tree(tree, max_depth=3)
    assert tree.num_nodes == 2 + 4 + 8
    counts = [0] * (tree.num_nodes + 1)
    for p in tree.parents.tolist()[1:]:
        counts[p] += 1
    assert max(counts) == 2
    assert set(tree.token_ids.tolist()) == {3, 1}  # the top-2 tokens of every depth
    assert build_draft_tree(lp, 5, max_children=2).num_nodes == 5  # budget still binds
    # Which of several tokens tied at the cut enters is torch.topk's choice; the count is not.
    assert build_draft_tree(torch.zeros(3, 4), 100, max_children=2).num_nodes == 14
    one = build_draft_tree(torch.randn(4, 9).log_softmax(-1), 50, max_children=1)
    assert one.parents.tolist() == [-1, 0, 1, 2, 3]


def test_small_positive_rounding_is_clamped():
    lp = torch.tensor([[1e-5, -1.0], [-0.5, 2e-6]])
    tree = build_draft_tree(lp, 3)
    validate_draft_tree(tree, max_depth=2)
    assert tree.token_ids.tolist() == [0, 1, 0]
    assert tree.path_log_probs.tolist() == [0.0, 0.0, 0.0, -0.5]


@pytest.mark.parametrize(
    "log_probs, budget, max_children, match",
    [
        (torch.zeros(4), 2, None, r"log_probs must be 2-D"),
        (torch.zeros(1, 2, 3), 2, None, r"log_probs must be 2-D"),
        ([[0.0]], 2, None, r"log_probs must be a torch.Tensor"),
        (torch.zeros(2, 3, dtype=torch.long), 2, None, r"log_probs must be a floating"),
        (torch.empty(0, 3), 1, None, r"log_probs must have L >= 1"),
        (torch.empty(2, 0), 1, None, r"log_probs must have L >= 1 depths and V >= 1"),
        (torch.tensor([[0.0, -1.0], [-1.0, math.nan]]), 2, None, r"log_probs contains NaN"),
        (torch.tensor([[0.0, -1.0], [math.inf, -1.0]]), 2, None, r"log_probs contains \+inf"),
        (torch.tensor([[3.0, 1.0]]), 1, None, r"log_probs must be log-probabilities"),
        (torch.zeros(2, 3), -1, None, r"budget must be a non-negative int"),
        (torch.zeros(2, 3), 2.0, None, r"budget must be a non-negative int"),
        (torch.zeros(2, 3), True, None, r"budget must be a non-negative int"),
        (torch.zeros(2, 3), "4", None, r"budget"),
        (torch.zeros(2, 3), 2, 0, r"max_children must be None or an int >= 1"),
        (torch.zeros(2, 3), 2, 1.5, r"max_children"),
    ],
)
def test_build_rejects_bad_arguments(log_probs, budget, max_children, match):
    with pytest.raises(ValueError, match=match):
        build_draft_tree(log_probs, budget, max_children)


def test_depths_beyond_the_budget_are_not_read():
    """A tree of B nodes is at most B deep: rows below depth B (here NaN, +inf, positive) do not
    change the tree and raise nothing; the same rows within depth B do raise."""
    torch.manual_seed(4)
    lp = torch.log_softmax(torch.randn(2, 6, 9) * 3, dim=-1)
    bad = lp.clone()
    bad[:, 3:] = float("nan")
    bad[1, 4, 0] = math.inf
    for budget in (1, 2, 3):
        want = build_draft_trees(lp, budget)
        got = build_draft_trees(bad, budget)
        for w, g in zip(want, got):
            assert torch.equal(w.token_ids, g.token_ids) and torch.equal(w.parents, g.parents)
            assert torch.equal(w.path_log_probs, g.path_log_probs)
    with pytest.raises(ValueError, match=r"log_probs\[0\] contains NaN \(depth 4\)"):
        build_draft_trees(bad, 4)


def test_per_request_budgets_give_each_tree_its_own_size():
    """A list of budgets: tree r equals the tree built from its own log-probs at budget[r]
    (the batch's top-k runs at the largest budget; random values, so no ties at the K-th
    place); a list of the wrong length raises."""
    torch.manual_seed(5)
    lp = torch.log_softmax(torch.randn(3, 7, 11) * 2, dim=-1)
    budgets = [2, 9, 0]
    for max_children in (None, 3):
        got = build_draft_trees(lp, budgets, max_children)
        for r, b in enumerate(budgets):
            want = build_draft_tree(lp[r], b, max_children)
            assert got[r].num_nodes == want.num_nodes == b
            assert torch.equal(got[r].token_ids, want.token_ids)
            assert torch.equal(got[r].parents, want.parents)
            assert torch.equal(got[r].path_log_probs, want.path_log_probs)
    # Budgets in several top-k classes (k <= 16 shares one, then 17-32, 33-64).
    wide = torch.log_softmax(torch.randn(5, 7, 64) * 2, dim=-1)
    sizes = [2, 9, 0, 20, 40]
    got = build_draft_trees(wide, sizes)
    for r, b in enumerate(sizes):
        want = build_draft_tree(wide[r], b)
        assert got[r].num_nodes == b
        assert _lists(got[r]) == _lists(want)
        assert torch.equal(got[r].path_log_probs, want.path_log_probs)
    # Each request's top-k reads its own min(L, budget) depths: rows deeper than a request's
    # budget (here NaN) raise nothing, the same rows within it do.
    bad = lp.clone()
    bad[0, 2:] = float("nan")
    got = build_draft_trees(bad, budgets)
    assert torch.equal(got[0].token_ids, build_draft_tree(lp[0], 2).token_ids)
    assert torch.equal(got[1].token_ids, build_draft_tree(lp[1], 9).token_ids)
    with pytest.raises(ValueError, match=r"log_probs\[0\] contains NaN \(depth 3\)"):
        build_draft_trees(bad, [3, 9, 0])
    with pytest.raises(ValueError, match="2 budgets for 3 requests"):
        build_draft_trees(lp, [2, 3])
    with pytest.raises(ValueError, match="budget must be a non-negative int"):
        build_draft_trees(lp, [2, -1, 3])


def test_batched_build_errors():
    with pytest.raises(ValueError, match=r"log_probs must be 3-D"):
        build_draft_trees(torch.zeros(2, 3), 2)
    lp = torch.zeros(3, 2, 4)
    lp[1, 1, 2] = math.nan
    with pytest.raises(ValueError, match=r"log_probs\[1\] contains NaN"):
        build_draft_trees(lp, 2)
    with pytest.raises(ValueError, match=r"budget"):
        build_draft_trees(lp, -2)


def _example_tree() -> DraftTree:
    # Nodes: 1 (1), 2 (1,2), 3 (1,2,0), 4 (0), 5 (0,2), 6 (0,2,0), 7 (1,0), 8 (1,0,0).
    lp = torch.tensor([[-1.0, -0.25, -3.0], [-2.0, -4.0, -0.5], [-0.125, -5.0, -6.0]])
    tree = build_draft_tree(lp, 8)
    assert _prefixes(tree) == [(1,), (1, 2), (1, 2, 0), (0,), (0, 2), (0, 2, 0), (1, 0), (1, 0, 0)]
    return tree


def test_follow_tree_off_the_top1_spine():
    tree = _example_tree()
    choices = [2] * 9
    choices[0], choices[1], choices[7], choices[8] = 1, 0, 0, 2
    assert follow_tree(tree, choices) == ([0, 1, 7, 8], 2)
    # Second best depth-1 token, stopped at depth 2 by a mismatch.
    choices = [1] * 9
    choices[0], choices[4], choices[5] = 0, 2, 1
    assert follow_tree(tree, torch.tensor(choices)) == ([0, 4, 5], 1)


def test_follow_tree_root_only_and_full_depth():
    tree = _example_tree()
    assert follow_tree(tree, [2] + [0] * 8) == ([0], 2)
    choices = [0, 2, 2, 2, 2, 0, 9, 2, 2]
    assert follow_tree(tree, choices) == ([0, 4, 5, 6], 9)
    chain = chain_tree([5, 6, 7])
    assert follow_tree(chain, [5, 6, 7, 8]) == ([0, 1, 2, 3], 8)
    assert follow_tree(chain, [5, 6, 3, 8]) == ([0, 1, 2], 3)
    with pytest.raises(ValueError, match=r"target_token_ids must have n \+ 1 = 4"):
        follow_tree(chain, [5, 6, 7])
    with pytest.raises(ValueError, match=r"target_token_ids must hold integer"):
        follow_tree(chain, torch.zeros(4))


def test_follow_trees_matches_single_form():
    trees = [_example_tree(), chain_tree([5, 6, 7]), build_draft_tree(torch.zeros(2, 2), 0)]
    choices = [[1, 0, 2, 2, 2, 2, 2, 0, 2], [5, 6, 3, 8], [4]]
    want = [follow_tree(t, c) for t, c in zip(trees, choices)]
    assert want == [([0, 1, 7, 8], 2), ([0, 1, 2], 3), ([0], 4)]
    assert follow_trees(trees, choices) == want
    assert follow_trees(trees, [torch.tensor(c) for c in choices]) == want
    flat = torch.tensor([t for c in choices for t in c])
    assert follow_trees(trees, flat) == want
    padded = torch.full((3, 10), -1, dtype=torch.long)
    for r, c in enumerate(choices):
        padded[r, : len(c)] = torch.tensor(c)
    assert follow_trees(trees, padded) == want
    with pytest.raises(ValueError, match=r"target_token_ids_list"):
        follow_trees(trees, flat[:-1])
    with pytest.raises(ValueError, match=r"target_token_ids_list"):
        follow_trees(trees, choices[:2])
    with pytest.raises(ValueError, match=r"target_token_ids_list"):
        follow_trees(trees, padded[:, :5])


def _tree(tokens, parents, depths, mask=None) -> DraftTree:
    parents_t = torch.tensor(parents, dtype=torch.long)
    if mask is None:
        mask = torch.eye(len(parents), dtype=torch.bool)
        for i in range(1, len(parents)):
            j = parents[i]
            for _ in range(len(parents)):  # bounded: broken trees may have cycles
                if j < 0:
                    break
                mask[i, j] = True
                j = parents[j]
    return DraftTree(
        token_ids=torch.tensor(tokens, dtype=torch.long),
        parents=parents_t,
        depths=torch.tensor(depths, dtype=torch.long),
        ancestor_mask=mask,
        path_log_probs=torch.zeros(len(parents), dtype=torch.float32),
    )


def test_validate_accepts_good_trees():
    validate_draft_tree(_tree([5, 6, 5], [-1, 0, 0, 1], [0, 1, 1, 2]), max_depth=2)
    validate_draft_tree(chain_tree(torch.tensor([1, 2, 3]), [-0.5, -0.25, -1.0]))
    assert chain_tree([1, 2, 3], [-0.5, -0.25, -1.0]).path_log_probs.tolist() == [
        0.0, -0.5, -0.75, -1.75
    ]
    # Lazily built child maps on a hand-made tree.
    assert _tree([5, 6, 5], [-1, 0, 0, 1], [0, 1, 1, 2]).child_maps == [
        {5: 1, 6: 2}, {5: 3}, {}, {}
    ]


@pytest.mark.parametrize(
    "tree, max_depth, match",
    [
        (_tree([5, 6], [-1, 2, 0], [0, 2, 1]), None, r"parents before children"),
        (_tree([5, 6], [-1, 0, 1], [0, 1, 1]), None, r"depth: depths\[2\]"),
        (_tree([5, 5], [-1, 0, 0], [0, 1, 1]), None, r"distinct sibling tokens"),
        (
            _tree([5, 6], [-1, 0, 1], [0, 1, 2], torch.eye(3, dtype=torch.bool)),
            None,
            r"ancestor mask",
        ),
        (_tree([5, 6, 7], [-1, 0, 1, 2], [0, 1, 2, 3]), 2, r"max depth"),
        (_tree([5], [0, 0], [0, 1]), None, r"root: parents\[0\] must be -1"),
        (_tree([5], [-1, 0], [1, 2]), None, r"root: depths\[0\] must be 0"),
        (_tree([-3], [-1, 0], [0, 1]), None, r"non-negative"),
    ],
)
def test_validate_rejects_broken_trees(tree, max_depth, match):
    with pytest.raises(ValueError, match=match):
        validate_draft_tree(tree, max_depth=max_depth)


def test_validate_rejects_bad_shapes_and_dtypes():
    good = _tree([5, 6], [-1, 0, 1], [0, 1, 2])
    fields = dict(
        token_ids=good.token_ids,
        parents=good.parents,
        depths=good.depths,
        ancestor_mask=good.ancestor_mask,
        path_log_probs=good.path_log_probs,
    )
    cases = [
        ("depths", torch.tensor([0, 1], dtype=torch.long), r"shape: depths must be \[n \+ 1\]"),
        ("ancestor_mask", torch.ones(3, 2, dtype=torch.bool), r"shape: ancestor_mask"),
        ("token_ids", torch.tensor([[5, 6]]), r"shape: token_ids must be 1-D"),
        ("parents", good.parents.int(), r"dtype: parents must be torch.int64"),
        ("ancestor_mask", good.ancestor_mask.long(), r"dtype: ancestor_mask must be torch.bool"),
        ("path_log_probs", good.path_log_probs.double(), r"dtype: path_log_probs"),
    ]
    for name, value, match in cases:
        with pytest.raises(ValueError, match=match):
            validate_draft_tree(DraftTree(**{**fields, name: value}))


def test_realistic_size_is_valid():
    g = torch.Generator().manual_seed(1)
    lp = (torch.randn(2, 15, 4096, generator=g) * 3).log_softmax(-1)
    trees = build_draft_trees(lp, 256)
    for r, tree in enumerate(trees):
        validate_draft_tree(tree, max_depth=15)
        assert tree.num_nodes == 256
        s = tree.path_log_probs
        assert bool((s[1:] <= s[:-1]).all())
        assert _lists(tree) == _lists(build_draft_tree(lp[r], 256))
