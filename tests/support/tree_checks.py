"""Test-only checks on draft trees: the batched walk and the structural validator.

Kept out of the package (nothing in it needs them): the tests use them to check
:mod:`vllm_ddtree.tree`'s trees and walk from outside.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_ddtree.tree import DraftTree, _ancestor_mask, _as_int_list, _walk, follow_tree


def follow_trees(
    trees: Sequence[DraftTree],
    target_token_ids_list: Sequence[Sequence[int] | torch.Tensor] | torch.Tensor,
) -> list[tuple[list[int], int]]:
    """Batched :func:`follow_tree`.

    ``target_token_ids_list`` is one of:

    * a sequence with one ``[n_r + 1]`` tensor/sequence per tree;
    * a 1-D integer tensor of all trees' choices concatenated (length ``sum(n_r + 1)``), the
      layout of a flattened verify batch;
    * a 2-D integer tensor ``[R, W]`` with ``W >= max(n_r + 1)``, row ``r`` padded after
      ``n_r + 1`` entries.

    Tensors are copied to the host once.  Returns ``[(accepted, next_token)]`` per tree.

    Raises:
        ValueError: the number of rows or entries does not match ``trees``, or a tensor is not
            integer.
    """
    sizes = [t.num_nodes + 1 for t in trees]
    name = "target_token_ids_list"
    per_tree: list[Sequence[int]]
    if isinstance(target_token_ids_list, torch.Tensor):
        flat = target_token_ids_list
        host = _as_int_list(flat, name)
        if flat.dim() == 1:
            if len(host) != sum(sizes):
                raise ValueError(
                    f"{name} (1-D, concatenated) must have sum(n + 1) = {sum(sizes)} entries, "
                    f"got {len(host)}"
                )
            per_tree, start = [], 0
            for s in sizes:
                per_tree.append(host[start : start + s])
                start += s
        elif flat.dim() == 2:
            if flat.shape[0] != len(trees) or (sizes and flat.shape[1] < max(sizes)):
                raise ValueError(
                    f"{name} (2-D, padded) must be [{len(trees)}, >= {max(sizes, default=0)}], "
                    f"got {tuple(flat.shape)}"
                )
            per_tree = [row[:s] for row, s in zip(host, sizes)]
        else:
            raise ValueError(f"{name} tensor must be 1-D or 2-D, got {flat.dim()}-D")
    else:
        if len(target_token_ids_list) != len(trees):
            raise ValueError(
                f"{name} must have one entry per tree ({len(trees)}), "
                f"got {len(target_token_ids_list)}"
            )
        return [follow_tree(t, c) for t, c in zip(trees, target_token_ids_list)]
    return [_walk(t.child_maps, c) for t, c in zip(trees, per_tree)]




def validate_draft_tree(tree: DraftTree, max_depth: int | None = None) -> None:
    """Check every structural invariant of a :class:`DraftTree`.

    Rules (the ``ValueError`` message names the one broken): tensor dtypes (int64 ids, parents,
    depths; bool mask; float32 path log-probs); consistent shapes ``[n]``, ``[n+1]``,
    ``[n+1, n+1]``; non-negative token ids; ``parents[0] == -1`` and ``depths[0] == 0``;
    parents before children (``0 <= parents[i] < i``), which also makes the node set
    prefix-closed; ``depths[i] == depths[parents[i]] + 1``; ``depth <= max_depth`` when given;
    distinct tokens among siblings; ``ancestor_mask`` equal to the ancestor-or-self relation.

    Raises:
        ValueError: on the first rule broken.
    """
    expected = {
        "token_ids": torch.long,
        "parents": torch.long,
        "depths": torch.long,
        "ancestor_mask": torch.bool,
        "path_log_probs": torch.float32,
    }
    for attr, dtype in expected.items():
        val = getattr(tree, attr)
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"dtype: {attr} must be a torch.Tensor, got {type(val)}")
        if val.dtype != dtype:
            raise ValueError(f"dtype: {attr} must be {dtype}, got {val.dtype}")
    if tree.token_ids.dim() != 1:
        raise ValueError(f"shape: token_ids must be 1-D [n], got {tuple(tree.token_ids.shape)}")
    n = tree.token_ids.shape[0]
    for attr in ("parents", "depths", "path_log_probs"):
        if tuple(getattr(tree, attr).shape) != (n + 1,):
            raise ValueError(
                f"shape: {attr} must be [n + 1] = [{n + 1}], "
                f"got {tuple(getattr(tree, attr).shape)}"
            )
    if tuple(tree.ancestor_mask.shape) != (n + 1, n + 1):
        raise ValueError(
            f"shape: ancestor_mask must be [n + 1, n + 1] = [{n + 1}, {n + 1}], "
            f"got {tuple(tree.ancestor_mask.shape)}"
        )
    toks = tree.token_ids.tolist()
    pars = tree.parents.tolist()
    deps = tree.depths.tolist()
    if any(t < 0 for t in toks):
        raise ValueError("token ids: token_ids must be non-negative")
    if pars[0] != -1:
        raise ValueError(f"root: parents[0] must be -1, got {pars[0]}")
    if deps[0] != 0:
        raise ValueError(f"root: depths[0] must be 0, got {deps[0]}")
    seen: set[tuple[int, int]] = set()
    for i in range(1, n + 1):
        p = pars[i]
        if not 0 <= p < i:
            raise ValueError(
                f"parents before children: parents[{i}] = {p} must satisfy 0 <= parent < {i}"
            )
        if deps[i] != deps[p] + 1:
            raise ValueError(
                f"depth: depths[{i}] = {deps[i]} must equal depths[parent {p}] + 1 = {deps[p] + 1}"
            )
        if max_depth is not None and deps[i] > max_depth:
            raise ValueError(f"max depth: depths[{i}] = {deps[i]} exceeds max_depth {max_depth}")
        key = (p, toks[i - 1])
        if key in seen:
            raise ValueError(
                f"distinct sibling tokens: token {toks[i - 1]} appears twice under node {p}"
            )
        seen.add(key)
    want = _ancestor_mask(tree.parents.cpu(), max(deps))
    if not torch.equal(tree.ancestor_mask.cpu(), want):
        bad = (tree.ancestor_mask.cpu() != want).nonzero()[0].tolist()
        raise ValueError(
            f"ancestor mask: ancestor_mask must be the ancestor-or-self relation "
            f"(first mismatch at row {bad[0]}, column {bad[1]})"
        )
