"""DDTree proposer: one DFlash drafter pass per step, then one draft tree per request.

Built on vLLM's own DFlash drafter (``vllm/v1/spec_decode/dflash.py``, ``DFlashProposer``) and
model code (``vllm/model_executor/models/qwen3_dflash.py``): context K/V from the target's
tapped hidden states, the query block ``[bonus, MASK × L]``, one forward. Where DFlash takes the
argmax per position (a chain), DDTree keeps the per-depth distributions ``[L, V]`` and builds the
best-first draft tree of the B most probable prefixes (paper §4, Algorithm 1;
:func:`vllm_ddtree.tree.build_draft_trees`). The node tokens, in tree (pop) order, are returned to
vLLM as the request's draft tokens; the tree topology stays here, keyed by request id, for the
next step's verification (:mod:`vllm_ddtree.step`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.budget import ENGINE_ROW_MULTIPLE, ENGINE_SIZES_PER_OCTAVE, BudgetController
from vllm_ddtree.config import DDTreeConfig, check_budget_runs, get_ddtree_config
from vllm_ddtree.integration import installed_vllm_version
from vllm_ddtree.metrics import WorkerFigures
from vllm_ddtree.shadow import ShadowAcceptance
from vllm_ddtree.step import TreeStep
from vllm_ddtree.tree import DraftTree, build_draft_trees, chain_tree

logger = logging.getLogger("vllm.ddtree")


class DDTreeProposer(DFlashProposer):
    """DFlash drafter pass + per-request draft trees.

    vLLM's ``num_speculative_tokens`` is set to ``max(B, L)`` by the config translation (the
    verification slots and drafter lookahead slots vLLM must reserve); this proposer runs the
    drafter with L mask tokens and returns B node tokens per request.

    Attributes:
        ddtree: the validated :class:`~vllm_ddtree.config.DDTreeConfig`.
        trees: ``req_id -> DraftTree`` proposed in the last step and not yet verified.
        last_log_probs: ``[R, L, V]`` float32 drafter log-probs the last trees were built from
            (:meth:`build_trees`).
        controller: ``ddtree_budget="auto"``: the :class:`~vllm_ddtree.budget.BudgetController`
            choosing each request's tree size per step (``None`` for a fixed budget); its
            ``stats``, ``chain_fallback`` and ``speculation_pays`` are what it decided.
        ddtree_figures: :class:`~vllm_ddtree.metrics.WorkerFigures` (tree-build and
            KV-compaction times, the shadow measurement, auto's decisions) for the metrics.
        shadow: ``ddtree_hybrid="shadow_linear"``: the
            :class:`~vllm_ddtree.shadow.ShadowAcceptance` of the unverified trees, else ``None``.

    Raises:
        ValueError: the node budget cannot fit in one scheduled batch
            (``B + 1 > max_num_batched_tokens``), or exceeds the number of distinct prefixes
            of depth <= L over the vocabulary (normally refused earlier, in the front end).
    """

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None):
        ddtree = get_ddtree_config(vllm_config)
        if ddtree is None:
            raise ValueError("DDTreeProposer needs additional_config['ddtree']")
        super().__init__(vllm_config, device, runner)
        self.ddtree: DDTreeConfig = ddtree
        self._ddtree_runner = runner
        self.trees: dict[str, DraftTree] = {}
        self.last_log_probs: torch.Tensor | None = None
        self._ddtree_logits: torch.Tensor | None = None
        #: Tree-build / KV-compaction times and the shadow measurement, for the metrics.
        self.ddtree_figures = WorkerFigures()
        #: ``shadow_linear``: only the top-1 chain is verified; the trees are measured here.
        self.shadow: ShadowAcceptance | None = (
            ShadowAcceptance(ddtree.drafter_horizon, figures=self.ddtree_figures)
            if ddtree.hybrid == "shadow_linear" else None
        )

        # Checked again here with the final scheduler settings (the front end may not know
        # vLLM's default token budget).
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        check_budget_runs(ddtree, vllm_config.model_config.get_vocab_size(), max_tokens,
                          installed_vllm_version())
        self.controller: BudgetController | None = (
            BudgetController(ddtree.budget, figures=self.ddtree_figures,
                             row_multiple=ENGINE_ROW_MULTIPLE,
                             sizes_per_octave=ENGINE_SIZES_PER_OCTAVE)
            if ddtree.auto_budget and self.shadow is None
            else None)
        if self.controller is not None:
            from vllm_ddtree.runners import rank_agreement

            self.controller.agree = rank_agreement()  # tensor parallel: rank 0's sizes
        self._max_tokens = max_tokens
        logger.info(
            "DDTree proposer ready in pid %d: node budget B=%s, drafter horizon L=%d",
            os.getpid(), f"auto (1..{ddtree.budget})" if ddtree.auto_budget else ddtree.budget,
            ddtree.drafter_horizon,
        )

    def load_model(self, target_model: Any) -> None:
        """vLLM's DFlash drafter load, then the hybrid guard on the loaded target.

        Raises:
            DDTreeConfigError: a recurrent layer the tree oracle cannot run exactly
                (:func:`vllm_ddtree.hybrid.guard.check_recurrent_layers`).
        """
        from vllm_ddtree.hybrid.guard import check_recurrent_layers, fit_recurrent_state_shapes
        from vllm_ddtree.integration import platform_name

        kinds = check_recurrent_layers(target_model, self.ddtree.hybrid,
                                       platform=platform_name())
        fit_recurrent_state_shapes(target_model, self.ddtree.num_recurrent_state_blocks)
        if kinds:
            logger.info("DDTree: recurrent layers %s verify trees through the %s", kinds,
                        "top-1 chain (shadow_linear)" if self.ddtree.hybrid == "shadow_linear"
                        else "sequential tree oracle")
        super().load_model(target_model)

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any):
        """Keep the drafter logits ``[R * L, V]``; return placeholder draft tokens ``[R * L]``
        int64 (zeros).

        DFlash drafts in parallel (one pass), so vLLM's ``propose``
        (vllm/v1/spec_decode/llm_base_proposer.py) only reshapes what this returns, and
        :meth:`propose` replaces it with the trees' tokens: the argmax vLLM's DFlash takes here
        (as long as the drafter pass's top-k on the shipped pair) would be thrown away. Were the
        drafter ever run step by step, the tokens would feed the next step: then the argmax.
        """
        logits = self.model.compute_logits(hidden_states)
        self._ddtree_logits = logits
        if not getattr(self, "parallel_drafting", False):
            return logits.argmax(dim=-1), None
        return torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device), None

    def propose(self, num_speculative_tokens: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One DFlash pass with L = ``drafter_horizon`` mask tokens, then one tree per request.

        Mirrors ``SpecDecodeBaseProposer.propose`` (vllm/v1/spec_decode/llm_base_proposer.py).

        Returns:
            ``[R, B]`` int64 node tokens of each request's draft tree, in node (pop) order; with
            ``ddtree_budget="auto"`` one list of node tokens per request, each of the size the
            controller chose (:meth:`_propose_auto`).
        """
        L = self.ddtree.drafter_horizon
        t0 = time.perf_counter()
        super().propose(L, *args, **kwargs)
        # vLLM's other code paths (dummy runs) read the slot count.
        self.num_speculative_tokens = self.ddtree.num_verify_slots
        logits = self._ddtree_logits
        self._ddtree_logits = None
        assert logits is not None
        num_reqs = logits.shape[0] // L
        log_probs = torch.log_softmax(logits.float().view(num_reqs, L, -1), dim=-1)
        req_ids = list(self._ddtree_runner.input_batch.req_ids[:num_reqs])
        trees = self.build_trees(req_ids, log_probs)
        if self.controller is not None:
            # What a target-only step would not pay (the drafter pass and the trees; the tree
            # build's device->host copy waits for the pass on a GPU).
            self.controller.observe_drafter(time.perf_counter() - t0)
        if self.shadow is not None:
            # The chain comes from the distributions the trees were built from.
            return self._propose_shadow(req_ids, self.last_log_probs, trees).to(logits.device)
        if self.controller is not None:
            return self._propose_auto(req_ids, trees)
        B = self.ddtree.budget
        out = torch.zeros(num_reqs, B, dtype=torch.int64)
        for i, (req_id, tree) in enumerate(zip(req_ids, trees)):
            n = tree.num_nodes
            if n != B:  # only possible with -inf drafts; pad as a chain is NOT valid: refuse
                raise RuntimeError(
                    f"DDTree built {n} nodes for request {req_id}, expected the budget {B}"
                )
            out[i] = tree.token_ids
            self.trees[req_id] = tree
        return out.to(logits.device)

    def _propose_auto(self, req_ids: list[str], trees: list[DraftTree]) -> list[list[int]]:
        """``ddtree_budget="auto"``: each tree cut to the size the controller chooses
        (:meth:`BudgetController.size_trees <vllm_ddtree.budget.BudgetController.size_trees>`),
        returned as one list per request (vLLM's V1 runner schedules a list of any length, as
        for its n-gram drafter); each request then verifies its own number of rows."""
        state = getattr(self._ddtree_runner, "_ddtree", None)
        self.controller.step_finished(getattr(state, "step_index", None),
                                      getattr(state, "step_rows", 0),
                                      getattr(state, "step_requests", 1), time.perf_counter())
        out = []
        sized = self.controller.size_trees(req_ids, trees, self._max_tokens,
                                           remaining_tokens(self._ddtree_runner, req_ids))
        for req_id, tree in zip(req_ids, sized):
            self.trees[req_id] = tree
            out.append(tree.token_ids.tolist())
        return out

    def observe_verified(self, step: TreeStep) -> None:
        """``ddtree_budget="auto"``: calibrate the controller with what this step accepted
        (:meth:`BudgetController.observe_verified
        <vllm_ddtree.budget.BudgetController.observe_verified>`)."""
        if self.controller is not None:
            self.controller.observe_verified(step)

    def build_trees(self, req_ids: list[str], log_probs: torch.Tensor) -> list[DraftTree]:
        """Best-first draft trees (paper Alg. 1), one per request.

        Args:
            req_ids: the requests of the drafter batch, in row order.
            log_probs: ``[R, L, V]`` float32 drafter log-probs, row ``i`` for ``req_ids[i]``.

        Returns:
            one :class:`~vllm_ddtree.tree.DraftTree` per request (B nodes each; with
            ``ddtree_budget="auto"`` each request's :meth:`BudgetController.build_caps
            <vllm_ddtree.budget.BudgetController.build_caps>` nodes); ``log_probs`` is kept as
            :attr:`last_log_probs`.
        """
        self.last_log_probs = log_probs
        budget = (self.ddtree.budget if self.controller is None
                  else self.controller.build_caps(req_ids))
        with self.ddtree_figures.timed("tree_build"):
            return build_draft_trees(log_probs, budget, self.ddtree.max_children)

    def _propose_shadow(self, req_ids: list[str], log_probs: torch.Tensor,
                        trees: list[DraftTree]) -> torch.Tensor:
        """``shadow_linear``: return the top-1 chain (DFlash's argmax per depth, ``[R, L]``)
        for verification and keep each tree for :class:`ShadowAcceptance`."""
        spine = log_probs.argmax(dim=-1)  # [R, L]
        requests = getattr(self._ddtree_runner, "requests", {})
        for i, (req_id, tree) in enumerate(zip(req_ids, trees)):
            chain = chain_tree(spine[i])
            state = requests.get(req_id)
            if state is not None:
                self.shadow.update(req_id, list(state.output_token_ids))
            self.shadow.add(req_id, tree, chain)
            self.trees[req_id] = chain
        return spine

    def forget(self, live_req_ids: set[str]) -> None:
        """Drop trees of requests that are gone (finished or aborted)."""
        for req_id in [r for r in self.trees if r not in live_req_ids]:
            del self.trees[req_id]
        if self.controller is not None:
            self.controller.forget(live_req_ids)
        if self.shadow is not None:
            self.shadow.forget(live_req_ids)


def remaining_tokens(runner: Any, req_ids: list[str]) -> list[int] | None:
    """Per request, the tokens it may still generate (``max_tokens`` minus its output so far),
    from the V1 runner's ``CachedRequestState`` (vllm/v1/worker/gpu_input_batch.py:
    ``sampling_params``, ``output_token_ids``); ``None`` when a request lacks them (pooling,
    a state vLLM has not filled)."""
    requests = getattr(runner, "requests", None) or {}
    out = []
    for r in req_ids:
        state = requests.get(r)
        params = getattr(state, "sampling_params", None)
        if params is None or getattr(params, "max_tokens", None) is None:
            return None
        out.append(params.max_tokens - len(state.output_token_ids))
    return out
