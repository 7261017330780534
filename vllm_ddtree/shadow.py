"""``ddtree_hybrid="shadow_linear"``: verify the top-1 chain, measure what the trees would accept.

Runner-independent: both runner adapters (V1 ``vllm_ddtree/runners/v1/proposer.py``, V2
``vllm_ddtree/runners/v2.py``) hand each step's trees and chains here, with the output tokens the
target committed so far.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_ddtree.tree import DraftTree, accepted_along

logger = logging.getLogger("vllm.ddtree")


class ShadowAcceptance:
    """What the unverified trees would have accepted, next to the verified chains.

    Each step's tree is kept with its root's place in the request's output; once the target has
    produced enough tokens after it to settle both walks (trees of requests that end first are
    not counted), the tree and the verified chain are both walked along those realised tokens
    (:func:`vllm_ddtree.tree.accepted_along`), so the two acceptance lengths are measured the
    same way. Exact for greedy decoding (the realised tokens are the target's own choices); an
    estimate at T > 0.

    Args:
        horizon: drafter horizon L (the deepest a walk can go).
        log_every: log τ of both every this many measured trees.
        figures: optional sink with ``add(**amounts)`` (:class:`vllm_ddtree.metrics.WorkerFigures`):
            each measured tree adds ``shadow_steps=1`` and both acceptance counts, for
            ``vllm:ddtree_shadow_*`` in ``/metrics``.

    Attributes:
        steps: trees measured.
        tree_accepted, chain_accepted: drafts the trees / the verified chains accept in total.
    """

    def __init__(self, horizon: int, log_every: int = 256, figures: Any = None):
        self.horizon, self.log_every, self.figures = horizon, log_every, figures
        self.steps = self.tree_accepted = self.chain_accepted = 0
        #: req_id -> [root output index or None (not known yet), tree, chain]
        self._pending: dict[str, list[list[Any]]] = {}

    @property
    def tree_tau(self) -> float:
        """Would-be mean acceptance length τ of the trees (1 + accepted drafts per step)."""
        return 1.0 + self.tree_accepted / max(self.steps, 1)

    @property
    def chain_tau(self) -> float:
        """Mean acceptance length τ of the verified chains, measured the same way."""
        return 1.0 + self.chain_accepted / max(self.steps, 1)

    def add(self, req_id: str, tree: DraftTree, chain: DraftTree, root: int | None = None) -> None:
        """Keep one step's tree and verified chain.

        Args:
            root: index of the tree's root token in the request's output, when the caller
                knows it; ``None``: the last token of the output passed to the next
                :meth:`update` (V1, whose output lags one step behind the proposal).
        """
        self._pending.setdefault(req_id, []).append([root, tree, chain])

    def update(self, req_id: str, output: list[int], final: bool = False) -> None:
        """Resolve and measure ``req_id``'s pending trees against its output so far.

        Args:
            output: the request's output token ids committed so far (vLLM's
                ``CachedRequestState.output_token_ids`` on V1, where the last one is the root of
                the tree proposed in the previous step).
            final: the request is done: measure what is left with the tokens there are.
        """
        entries = self._pending.get(req_id)
        if not entries:
            return
        if entries[-1][0] is None and output:
            entries[-1][0] = len(output) - 1
        keep = []
        for entry in entries:
            root, tree, chain = entry
            if root is None:
                keep.append(entry)
                continue
            after = output[root + 1 :]
            t, c = accepted_along(tree, after), accepted_along(chain, after)
            # Settled once both walks stopped before the realised tokens ran out.
            if len(after) < self.horizon and not final and max(t, c) >= len(after):
                keep.append(entry)
                continue
            self.steps += 1
            self.tree_accepted += t
            self.chain_accepted += c
            if self.figures is not None:
                self.figures.add(shadow_steps=1, shadow_tree_accepted=t, shadow_chain_accepted=c)
            if self.steps % self.log_every == 0:
                self.log()
        if keep and not final:
            self._pending[req_id] = keep
        else:
            self._pending.pop(req_id, None)

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop the pending trees of requests that are gone (finished, aborted, preempted)."""
        for req_id in [r for r in self._pending if r not in live_req_ids]:
            self._pending.pop(req_id, None)

    def log(self) -> None:
        logger.info(
            "DDTree shadow_linear: verified chain τ=%.2f; the draft trees would reach τ=%.2f "
            "(%d steps measured)", self.chain_tau, self.tree_tau, self.steps)
