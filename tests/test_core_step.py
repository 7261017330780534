"""Unit tests of the runner-independent step core on synthetic tensors (no engine, no vLLM):
laying trees onto a flat batch (:func:`vllm_ddtree.step.lay_out_step`), the walk and the emitted
tokens (:func:`vllm_ddtree.verify.walk_step`), and the commit moves (:mod:`vllm_ddtree.commit`)."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.commit import compact_kv_in_cache, gather_accepted_rows, path_moves
from vllm_ddtree.runners.v1.step import plan_tree_step
from vllm_ddtree.step import ScheduledDrafts, lay_out_step
from vllm_ddtree.tree import build_draft_tree
from vllm_ddtree.verify import walk_step


def _tree(seed: int = 0, budget: int = 6, L: int = 3, V: int = 5):
    g = torch.Generator().manual_seed(seed)
    return build_draft_tree(torch.log_softmax(torch.randn(L, V, generator=g), -1), budget)


def test_lay_out_step_rows_positions_and_padding():
    tree = _tree()
    # V2: 8 draft rows scheduled for a 6-node tree -> 2 padding rows outside the tree.
    step = lay_out_step([ScheduledDrafts("a", 0, 10, 40, 8)], {"a": tree})
    (r,) = step.requests
    assert r.is_tree and r.tree.num_nodes == 6 and r.root_row == 10 and r.context_len == 40
    (att,) = step.attn_batch.requests
    assert att.num_rows == 7 and att.query_start == 10
    assert step.attn_batch.tree_rows.tolist() == list(range(10, 17))
    moved = tree.depths != torch.arange(7)
    assert step.position_rows.tolist() == (10 + torch.arange(7)[moved]).tolist()
    assert step.tree_positions.tolist() == (40 + tree.depths[moved]).tolist()
    assert step.chain_positions.tolist() == (40 + torch.arange(7)[moved]).tolist()


def test_lay_out_step_truncates_and_falls_back_to_chains():
    tree = _tree()
    trees = {"a": tree, "b": tree}
    step = lay_out_step([
        ScheduledDrafts("a", 0, 0, 5, 3),  # fewer rows than nodes: the first 3 nodes
        ScheduledDrafts("b", 1, 4, 9, 6, tokens=[1, 2, 3, 4, 0, 1]),  # not the tree: a chain
        ScheduledDrafts("c", 2, 11, 9, 2, tokens=[3, 3]),  # no tree: a chain
    ], trees)
    a, b, c = step.requests
    assert a.tree.num_nodes == 3 and a.tree.token_ids.tolist() == tree.token_ids[:3].tolist()
    assert not b.is_tree and b.tree.token_ids.tolist() == [1, 2, 3, 4, 0, 1]
    assert not c.is_tree and c.tree.parents.tolist() == [-1, 0, 1]
    with pytest.raises(ValueError, match="no draft tree and no draft tokens"):
        lay_out_step([ScheduledDrafts("d", 0, 0, 0, 2)], trees)


def test_plan_tree_step_v1_view_matches_lay_out_step():
    tree = _tree(1)
    toks = tree.token_ids.tolist()
    v1 = plan_tree_step(["x"], {"x": toks}, {"x": len(toks) + 1}, [0, len(toks) + 1], [7],
                        {"x": tree})
    v2 = lay_out_step([ScheduledDrafts("x", 0, 0, 7, len(toks))], {"x": tree})
    assert torch.equal(v1.position_rows, v2.position_rows)
    assert torch.equal(v1.tree_positions, v2.tree_positions)
    assert v1.requests[0].is_tree and v2.requests[0].is_tree


def test_walk_step_follows_target_choices_and_reorders_rows():
    tree = _tree(2)
    # The target agrees with node 0's child at depth 1, then with that node's first child.
    child = next(iter(tree.child_maps[0].items()))  # (token, node)
    grandchild = next(iter(tree.child_maps[child[1]].items()), None)
    choices_a = [7] * (tree.num_nodes + 1)
    choices_a[0] = child[0]
    want = [0, child[1]]
    if grandchild is not None:
        choices_a[child[1]] = grandchild[0]
        want.append(grandchild[1])
        choices_a[grandchild[1]] = 4
        bonus = 4
    else:
        choices_a[child[1]] = 4
        bonus = 4
    pad = [9, 9]  # V2 padding rows after the tree: never read
    step = lay_out_step([ScheduledDrafts("a", 1, 1, 3, tree.num_nodes + 2)], {"a": tree})
    choices = [2] + choices_a + pad  # request 0: one prefill row
    cu = [0, 1, 1 + tree.num_nodes + 3]
    sampled, emitted, rows = walk_step(choices, cu, {1: step.requests[0]}, width=tree.num_nodes + 3)
    assert step.requests[0].accepted == want
    assert emitted == [1, len(want)]
    assert sampled[0, 0] == 2
    assert sampled[1, : len(want)].tolist() == [choices_a[a] for a in want]
    assert sampled[1, len(want) - 1] == bonus
    assert rows[1 : 1 + len(want)] == [1 + a for a in want]
    assert rows[1 + len(want):] == list(range(1 + len(want), cu[-1]))


def test_walk_step_rejects_a_too_narrow_output():
    tree = _tree(3, budget=3, L=3, V=2)
    step = lay_out_step([ScheduledDrafts("a", 0, 0, 0, 3)], {"a": tree})
    spine = [0]
    while spine[-1] in range(tree.num_nodes + 1) and tree.child_maps[spine[-1]]:
        spine.append(next(iter(tree.child_maps[spine[-1]].values())))
    choices = [0] * 4
    for a, nxt in zip(spine, spine[1:]):
        choices[a] = int(tree.token_ids[nxt - 1])
    with pytest.raises(ValueError, match="exceed width"):
        walk_step(choices, [0, 4], {0: step.requests[0]}, width=len(spine) - 1)


def test_commit_moves_gather_and_in_cache_copy():
    tree = _tree(4)
    step = lay_out_step([ScheduledDrafts("a", 0, 2, 10, tree.num_nodes)], {"a": tree})
    r = step.requests[0]
    leaf = max(range(tree.num_nodes + 1), key=lambda i: int(tree.depths[i]))
    path = [leaf]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    r.accepted = path[::-1]
    moves = path_moves([r])
    assert moves == [(0, a, j) for j, a in enumerate(r.accepted) if a != j]

    hidden = torch.arange(20, dtype=torch.float32).view(20, 1).repeat(1, 3)
    before = hidden.clone()
    gather_accepted_rows([hidden], [r])
    for j, a in enumerate(r.accepted):
        assert torch.equal(hidden[2 + j], before[2 + a])

    class Impl:  # copies slot contents in a flat [slots, D] cache
        def copy_kv_slots(self, cache, src, dst):
            cache[dst] = cache[src].clone()

    cache = torch.randn(64, 2)
    orig = cache.clone()
    slots = torch.arange(20) + 30  # row i of the batch was written to slot 30 + i
    n = compact_kv_in_cache({"l0": (Impl(), cache)}, [r], {"l0": slots})
    assert n == len(moves)
    for j, a in enumerate(r.accepted):
        assert torch.equal(cache[30 + 2 + j], orig[30 + 2 + a])
