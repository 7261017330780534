"""DDTree draft-tree construction and the verification walk (pure torch; no vLLM import).

One DFlash drafter pass yields per-depth log-probabilities ``log_probs[L, V]`` for the ``L``
positions below the root (the last committed / bonus token ``b``; depth ``d`` is row ``d - 1``).
Because the drafter's distribution factorises over depths, a prefix ``u = (u_1..u_d)`` has
probability ``q(u) = prod_i q_i(u_i)``, and the tree of ``B`` non-root nodes that maximises the
expected acceptance length is the set of the ``B`` most probable prefixes (Ringel & Romano 2026,
arXiv 2604.12989, §4, Prop. 2).  It is found by the best-first search of Algorithm 1 over the
top-``K`` tokens of every depth, ``K = min(B, V)`` (Lemma 1).

This module mirrors the reference implementation's ``build_ddtree_tree`` (construction,
node order, tie-breaking) and ``follow_verified_tree`` (the walk).  Conventions:

* Node 0 is the root ``b``; nodes ``1..n`` are the drafted tokens in heap-pop order, so every
  parent index is smaller than its children's and path log-probabilities are non-increasing in
  node order.
* Inputs are **log-probabilities** (the caller passes ``torch.log_softmax(drafter_logits, -1)``,
  untempered); raw logits are rejected when a row's maximum is positive.
* Within one depth, tokens with equal log-probability are ranked by ascending token id, so trees
  are reproducible.  Among equal path scores the heap pops the lexicographically smaller rank
  tuple first (the reference's tuple comparison).  Which of several tokens tied exactly at the
  ``K``-th place of a row enters the top-``K`` is left to ``torch.topk``.
* ``-inf`` entries are zero-probability tokens and never become nodes, so a tree can be smaller
  than its budget.
* All :class:`DraftTree` tensors live on the CPU.
"""

from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = [
    "DraftTree",
    "build_draft_tree",
    "build_draft_trees",
    "chain_tree",
    "follow_tree",
]

# A rank-0 log-prob above this is taken as "the caller passed logits"; values in (0, tol] are
# rounding noise of log_softmax in low precision and are clamped to 0.
_POSITIVE_TOL = 1e-3
_NEG_INF = float("-inf")


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A draft tree: the root (index 0) plus ``n`` drafted nodes (indices ``1..n``).

    Attributes (all CPU tensors):
        token_ids: ``[n]`` int64, token of node ``i`` at ``token_ids[i - 1]``.
        parents: ``[n + 1]`` int64, ``parents[0] == -1``, ``parents[i] < i``.
        depths: ``[n + 1]`` int64, root depth 0, ``depths[i] == depths[parents[i]] + 1``.
        ancestor_mask: ``[n + 1, n + 1]`` bool, row ``i`` is true at ``j`` iff ``j`` is ``i`` or
            an ancestor of ``i`` (the reference's ``visibility``; tree-attention mask).
        path_log_probs: ``[n + 1]`` float32, log ``q`` of the path root->node (root 0.0).

    ``child_maps`` (list of ``{token: child index}``, one dict per node) is built by
    :func:`build_draft_tree` or computed on first use; treat it as read-only.  Instances compare by
    identity (tensor fields make value equality ambiguous).
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    path_log_probs: torch.Tensor
    _child_maps: list[dict[int, int]] | None = field(default=None, repr=False)

    @property
    def num_nodes(self) -> int:
        """Number of non-root nodes ``n`` (the verify width is ``n + 1``)."""
        return int(self.token_ids.shape[0])

    @property
    def max_depth(self) -> int:
        """Largest node depth (0 for a root-only tree)."""
        return int(self.depths.max().item()) if self.depths.numel() else 0

    @property
    def child_maps(self) -> list[dict[int, int]]:
        """``[n + 1]`` dicts mapping a child's token id to its node index, per node."""
        if self._child_maps is None:
            maps: list[dict[int, int]] = [{} for _ in range(self.num_nodes + 1)]
            for idx, (par, tok) in enumerate(
                zip(self.parents.tolist()[1:], self.token_ids.tolist()), start=1
            ):
                maps[par][tok] = idx
            # Frozen dataclass: cache through object.__setattr__.
            object.__setattr__(self, "_child_maps", maps)
        return self._child_maps  # type: ignore[return-value]


def _ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self relation ``[n+1, n+1]`` bool from ``parents`` (``parents[0] == -1``).

    Vectorised over nodes: one pass per depth level instead of one per node, in numpy (a step
    builds a tree per request, and torch's per-op cost was most of this function's time).
    """
    par = parents.numpy().copy()
    size = par.shape[0]
    mask = np.zeros((size, size), dtype=bool)
    rows = np.arange(size)
    par[0] = 0  # the root is its own "parent" so the pointer chase saturates there
    cur = rows
    for _ in range(max_depth + 1):
        mask[rows, cur] = True
        cur = par[cur]
    return torch.from_numpy(mask)


def _make_tree(
    tokens: list[int],
    parents: list[int],
    depths: list[int],
    scores: list[float],
    child_maps: list[dict[int, int]] | None,
) -> DraftTree:
    # Through numpy: torch.tensor on a list costs several times np.array's per call.
    parents_t = torch.from_numpy(np.array(parents, dtype=np.int64))
    return DraftTree(
        token_ids=torch.from_numpy(np.array(tokens, dtype=np.int64)),
        parents=parents_t,
        depths=torch.from_numpy(np.array(depths, dtype=np.int64)),
        ancestor_mask=_ancestor_mask(parents_t, max(depths)),
        path_log_probs=torch.from_numpy(np.array(scores, dtype=np.float32)),
        _child_maps=child_maps,
    )


def _root_only() -> DraftTree:
    return _make_tree([], [-1], [0], [0.0], [{}])


def _check_budget(budget: object, max_children: object) -> tuple[int, int | None]:
    if isinstance(budget, bool):
        raise ValueError(f"budget must be a non-negative int, got {budget!r}")
    try:
        b = operator.index(budget)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"budget must be a non-negative int, got {budget!r}") from None
    if b < 0:
        raise ValueError(f"budget must be a non-negative int, got {b}")
    if max_children is None:
        return b, None
    if isinstance(max_children, bool):
        raise ValueError(f"max_children must be None or an int >= 1, got {max_children!r}")
    try:
        c = operator.index(max_children)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"max_children must be None or an int >= 1, got {max_children!r}"
        ) from None
    if c < 1:
        raise ValueError(f"max_children must be None or an int >= 1, got {c}")
    return b, c


def _best_first(lp: list[list[float]], ids: list[list[float]], budget: int) -> DraftTree:
    """Algorithm 1 on one request's sorted top-K rows (host lists, ``lp`` values <= 0).

    Heap entries are ``(-score, rank tuple, parent, depth, rank, score)``; the rank tuple is
    unique per prefix, so the remaining fields never take part in comparisons.
    """
    depth_l = len(lp)
    k = len(lp[0])
    tokens: list[int] = []
    parents = [-1]
    depths = [0]
    scores = [0.0]
    child_maps: list[dict[int, int]] = [{}]
    heap: list[tuple] = []
    first = lp[0][0]
    if first != _NEG_INF:
        heap.append((-first, (0,), 0, 1, 0, 0.0 + first))
    push, pop = heapq.heappush, heapq.heappop
    while heap and len(tokens) < budget:
        _, ranks, par, dep, rank, score = pop(heap)
        idx = len(tokens) + 1
        tok = int(ids[dep - 1][rank])
        tokens.append(tok)
        parents.append(par)
        depths.append(dep)
        scores.append(score)
        child_maps[par][tok] = idx
        child_maps.append({})
        # Next sibling: same parent, next rank.  Scores are always parent score + row value (not
        # the reference's score - lp[r] + lp[r+1]) so equal paths give bit-equal sums.
        if rank + 1 < k:
            val = lp[dep - 1][rank + 1]
            if val != _NEG_INF:  # sorted row: everything after is -inf too
                s = scores[par] + val
                push(heap, (-s, ranks[:-1] + (rank + 1,), par, dep, rank + 1, s))
        # First child: rank-0 token one depth down.
        if dep < depth_l:
            val = lp[dep][0]
            if val != _NEG_INF:
                s = score + val
                push(heap, (-s, ranks + (0,), idx, dep + 1, 0, s))
    return _make_tree(tokens, parents, depths, scores, child_maps)


def _build_batch(
    log_probs: torch.Tensor, budget: object, max_children: object, batched: bool
) -> list[DraftTree]:
    """Shared body of the single and batched builders; ``log_probs`` is ``[R, L, V]``;
    ``budget`` one int, or (batched) one per request."""
    name = "log_probs"
    num_req, depth_l, vocab = log_probs.shape
    per_request = None
    if batched and isinstance(budget, (list, tuple)):
        if len(budget) != num_req:
            raise ValueError(f"{len(budget)} budgets for {num_req} requests")
        per_request = [_check_budget(x, max_children)[0] for x in budget]
        budget = max(per_request, default=0)
    b, c = _check_budget(budget, max_children)
    if b == 0 or num_req == 0:
        return [_root_only() for _ in range(num_req)]
    if depth_l == 0 or vocab == 0:
        raise ValueError(
            f"{name} must have L >= 1 depths and V >= 1 tokens when budget > 0, "
            f"got shape {tuple(log_probs.shape)}"
        )
    # A tree of b nodes is at most b deep and needs at most the top b tokens of a depth:
    # deeper rows and lower ranks are never read. topk over the [R, L, V] drafter output is
    # most of a small tree's build (~4.5 us a row of 4096 on this CPU at k <= 8, growing with
    # k), so with one budget per request each request's own rows go through a top-k sized
    # for it.
    budgets_r = [b] * num_req if per_request is None else per_request
    depths = [min(depth_l, x) for x in budgets_r]
    ks = [min(x, vocab) if c is None else min(x, vocab, c) for x in budgets_r]
    # Requests share a top-k per power-of-two class of k (each call has a fixed cost of
    # ~70 us, so one call per distinct k cost more than it saved), at the class's largest k;
    # every k <= 16 is one class (a row's top-16 costs ~15 % more than its top-8, less than a
    # second call).
    classes = [max(k - 1, 8).bit_length() for k in ks]
    host_vals: list[list[list[float]]] = [[] for _ in range(num_req)]
    host_ids: list[list[list[float]]] = [[] for _ in range(num_req)]
    for cls in sorted(set(classes)):
        group = [r for r in range(num_req) if classes[r] == cls and depths[r]]
        if not group:
            continue
        k = max(ks[r] for r in group)
        if len(group) == num_req and min(depths) == max(depths):
            rows = log_probs[:, :depths[0]].reshape(-1, vocab)
        else:
            pick = [r * log_probs.shape[1] + d for r in group for d in range(depths[r])]
            rows = log_probs.reshape(-1, vocab).index_select(
                0, torch.tensor(pick, device=log_probs.device))
        with torch.no_grad():
            vals, ids = torch.topk(rows, k, dim=-1, largest=True, sorted=True)
            # One device->host copy: token ids (< 2**53) and fp32/bf16 values are exact in
            # float64.
            hv, hi = torch.stack((vals.to(torch.float64), ids.to(torch.float64))).cpu().numpy()
        # Rank equal values by ascending token id. Only rows with a tie need it (rare outside
        # -inf), so they are found and re-sorted on the host. A row holding NaN keeps topk's
        # order, NaN first, for the check below.
        tied = np.flatnonzero((hv[:, 1:] == hv[:, :-1]).any(1) & ~np.isnan(hv).any(1))
        if tied.size:
            order = np.lexsort((hi[tied], -hv[tied]), axis=-1)
            hv[tied] = np.take_along_axis(hv[tied], order, -1)
            hi[tied] = np.take_along_axis(hi[tied], order, -1)
        gv, gi = hv.tolist(), hi.tolist()
        at = 0
        for r in group:
            host_vals[r], host_ids[r] = gv[at:at + depths[r]], gi[at:at + depths[r]]
            at += depths[r]
    trees = []
    for r in range(num_req):
        lp = host_vals[r]
        where = f"{name}[{r}]" if batched else name
        for d in range(depths[r]):
            # topk ranks NaN and +inf first, so the rank-0 entry exposes them.
            top = lp[d][0]
            if math.isnan(top):
                raise ValueError(f"{where} contains NaN (depth {d + 1})")
            if top == math.inf:
                raise ValueError(f"{where} contains +inf (depth {d + 1})")
            if top > 0.0:
                if top > _POSITIVE_TOL:
                    raise ValueError(
                        f"{where} must be log-probabilities (<= 0), got {top} at depth {d + 1}; "
                        "pass log_softmax(logits)"
                    )
                lp[d] = [min(v, 0.0) for v in lp[d]]
        trees.append(_best_first(lp, host_ids[r], budgets_r[r]) if depths[r] else _root_only())
    return trees


def _check_log_probs(log_probs: object, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(log_probs, torch.Tensor):
        raise ValueError(f"log_probs must be a torch.Tensor {shape_doc}, got {type(log_probs)}")
    if log_probs.dim() != ndim:
        raise ValueError(
            f"log_probs must be {ndim}-D {shape_doc}, got shape {tuple(log_probs.shape)}"
        )
    if not log_probs.is_floating_point():
        raise ValueError(f"log_probs must be a floating tensor, got {log_probs.dtype}")
    return log_probs


def build_draft_tree(
    log_probs: torch.Tensor, budget: int, max_children: int | None = None
) -> DraftTree:
    """Build the DDTree draft tree of the ``budget`` most probable prefixes.

    Paper §4 Algorithm 1 (best-first search, optimal by Prop. 2 and Lemma 1); node order,
    tie-breaking and outputs follow the reference ``build_ddtree_tree``.

    Args:
        log_probs: ``[L, V]`` floating tensor (any device, any float dtype) of per-depth
            **log-probabilities** from one drafter pass, depth ``d`` in row ``d - 1``; pass
            ``torch.log_softmax(drafter_logits, -1)``.  ``-inf`` marks zero-probability tokens,
            which never become nodes.
        budget: number of non-root nodes ``B >= 0``; 0 gives the root alone (values are then not
            inspected).  If fewer finite-probability prefixes exist the tree is smaller.
        max_children: optional cap ``>= 1`` on the children of any node (top-``max_children``
            tokens per depth); the tree is then the best ``B`` prefixes over that restricted set.

    Returns:
        A :class:`DraftTree` with ``min(B, #candidates)`` non-root nodes, on the CPU.

    Raises:
        ValueError: ``log_probs`` is not a 2-D floating tensor, has ``L == 0`` or ``V == 0``
            with ``budget > 0``, contains NaN or ``+inf``, or has a positive row maximum
            (logits rather than log-probabilities) in one of its first ``min(L, budget)``
            depths (a tree of ``budget`` nodes never reaches deeper ones, so they are not
            read); ``budget`` is negative or not an int; ``max_children`` is not ``None`` or
            an int ``>= 1``.
    """
    lp = _check_log_probs(log_probs, 2, "[L, V]")
    return _build_batch(lp.unsqueeze(0), budget, max_children, batched=False)[0]


def build_draft_trees(
    log_probs: torch.Tensor, budget: int | Sequence[int], max_children: int | None = None
) -> list[DraftTree]:
    """Batched :func:`build_draft_tree`: one tree per request from ``log_probs [R, L, V]``.

    One ``topk`` over the whole batch and one device->host copy; the heaps then run per request
    on the host.  Same arguments, semantics and ``ValueError`` cases as :func:`build_draft_tree`
    (messages name ``log_probs[r]`` for per-request value errors), except that ``budget`` may
    also be a list or tuple of ``R`` budgets, one per request: each request's first
    ``min(L, budget[r])`` depths go through one ``topk`` shared by the requests whose
    ``K = budget[r]`` falls in the same power-of-two class (``K`` ≤ 16, 17–32, 33–64, …; run at
    the class's largest ``K``, one call and one copy per class) and each heap stops at its own
    budget, so tree ``r`` is the best-first tree of ``budget[r]`` nodes, as built alone at
    ``budget[r]`` (log-probs tied exactly at its ``K``-th place: the tied token ``torch.topk``
    picks), and the value checks cover those depths only; a list of another length raises
    ``ValueError``.  ``R == 0`` gives ``[]``.
    """
    lp = _check_log_probs(log_probs, 3, "[R, L, V]")
    return _build_batch(lp, budget, max_children, batched=True)


def chain_tree(
    token_ids: Sequence[int] | torch.Tensor, token_log_probs: Sequence[float] | None = None
) -> DraftTree:
    """A chain tree: node ``i`` (token ``token_ids[i-1]``) is the child of node ``i - 1``.

    Used for linear DFlash comparisons and tests.  ``token_log_probs`` (same length, optional)
    gives each node's own log-prob; ``path_log_probs`` are their running sums (all 0.0 if
    omitted).

    Raises:
        ValueError: ``token_ids`` is not 1-D, or ``token_log_probs`` has a different length.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        toks = [int(t) for t in token_ids.tolist()]
    else:
        toks = [int(t) for t in token_ids]
    n = len(toks)
    if token_log_probs is None:
        per = [0.0] * n
    else:
        per = [float(v) for v in token_log_probs]
        if len(per) != n:
            raise ValueError(
                f"token_log_probs must have len(token_ids) = {n} entries, got {len(per)}"
            )
    scores = [0.0]
    for v in per:
        scores.append(scores[-1] + v)
    child_maps = [{toks[i]: i + 1} for i in range(n)] + [{}]
    return _make_tree(toks, list(range(-1, n)), list(range(n + 1)), scores, child_maps)


def _as_int_list(choices: object, name: str) -> list[int]:
    if isinstance(choices, torch.Tensor):
        if choices.is_floating_point() or choices.is_complex():
            raise ValueError(f"{name} must hold integer token ids, got {choices.dtype}")
        return choices.tolist()
    return [int(t) for t in choices]  # type: ignore[union-attr]


def _walk(maps: list[dict[int, int]], choices: Sequence[int]) -> tuple[list[int], int]:
    cur = 0
    nxt = int(choices[0])
    accepted = [0]
    while True:
        child = maps[cur].get(nxt)
        if child is None:
            return accepted, nxt
        accepted.append(child)
        cur = child
        nxt = int(choices[child])


def follow_tree(
    tree: DraftTree, target_token_ids: Sequence[int] | torch.Tensor
) -> tuple[list[int], int]:
    """Walk the verified tree (reference ``follow_verified_tree``; spec §3.4).

    Args:
        tree: the drafted tree.
        target_token_ids: ``[n + 1]`` integer tensor or sequence: the target's choice (argmax or
            sample) at every node, in node order.

    Returns:
        ``(accepted, next_token)``: ``accepted`` are node indices starting with 0, each the child
        of the previous whose token equals the target's choice there; ``next_token`` is the
        target's choice at the last accepted node (the bonus token of the next round).  The
        round commits ``len(accepted)`` tokens (root plus ``len(accepted) - 1`` drafts).

    Raises:
        ValueError: ``target_token_ids`` is a float tensor, not 1-D, or not of length ``n + 1``.
    """
    if isinstance(target_token_ids, torch.Tensor) and target_token_ids.dim() != 1:
        raise ValueError(
            f"target_token_ids must be 1-D [n + 1], got shape {tuple(target_token_ids.shape)}"
        )
    choices = _as_int_list(target_token_ids, "target_token_ids")
    if len(choices) != tree.num_nodes + 1:
        raise ValueError(
            f"target_token_ids must have n + 1 = {tree.num_nodes + 1} entries, got {len(choices)}"
        )
    return _walk(tree.child_maps, choices)


def accepted_along(tree: DraftTree, continuation: Sequence[int]) -> int:
    """How many draft nodes the walk accepts when the target emits ``continuation``.

    ``continuation`` are the tokens the target actually produced after the tree's root (the
    bonus token); the walk follows them down the tree until a token has no child. Used to
    measure a tree's would-be acceptance length from realised output (``shadow_linear``).

    Returns:
        accepted drafts (τ - 1 for this step), ``0 .. min(len(continuation), depth)``.
    """
    node, accepted = 0, 0
    for tok in continuation:
        child = tree.child_maps[node].get(int(tok))
        if child is None:
            break
        node, accepted = child, accepted + 1
    return accepted
