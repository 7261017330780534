"""DDTree on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``), through V2's own seams.

V2 is vLLM's default runner wherever Triton runs (every CUDA GPU). It keeps draft tokens on the
device (``req_states.draft_tokens``), lays each decoding request out as ``1 + K`` rows
``[bonus, draft_1 … draft_K]`` (``K = num_speculative_tokens = max(B, L)``), and after the
forward calls, in order: the rejection sampler, ``postprocess_sampled`` (chain bookkeeping from
``num_sampled`` / ``num_rejected``) and the speculator's ``propose``. DDTree plugs into three
objects V2 builds for it:

* :class:`DDTreeSpeculator` — V2's ``DFlashSpeculator`` run with ``L`` mask tokens (the drafter
  horizon, not ``K``); from the drafter's logits it builds one draft tree per request (best-first,
  node budget B; paper §3.2) and returns the tree's node tokens in node order as the request's
  draft tokens. Before drafting it gathers the accepted path's hidden states to the first rows of
  each request, where DFlash reads the committed context (``num_rejected`` rows are dropped from
  the end, as for a chain).
* :class:`DDTreeModelStateMixin` — mixed into the model state vLLM resolves for the target
  (``vllm/v1/worker/gpu/model_states``): ``prepare_attn`` pairs the scheduled draft rows with the
  trees (:func:`vllm_ddtree.step.lay_out_step`) and keeps the step's slot mappings;
  ``prepare_inputs`` writes depth positions into the position buffer and publishes the tree
  batch to the tree-attention backends; ``custom_sampler`` replaces the rejection sampler by
  :class:`DDTreeVerifier`.
* :class:`DDTreeVerifier` — verification (paper §3.4): the target's choice at every node is
  vLLM's own ``Sampler.sample`` over the node's logits at its depth position (greedy argmax, or
  a Gumbel sample keyed by the request's seed and the position, as target-only decoding draws
  it); the walk follows the choices down the tree. It restores chain positions, commits (KV
  compaction) and returns the accepted path's tokens plus the bonus token in V2's
  ``SamplerOutput`` layout, so V2's chain bookkeeping stays valid.

V2's factory functions are wrapped in :mod:`vllm_ddtree.patches.v2` (``init_speculator`` where
the runner imports it, ``resolve_model_state_cls``), and ``GPUModelRunner.initialize_kv_cache``
installs ``ddtree_budget="auto"``'s verification budget in V2's adaptive-verification seam.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import numpy as np
import torch
from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.output import SamplerOutput
from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.budget import ENGINE_ROW_MULTIPLE, ENGINE_SIZES_PER_OCTAVE, BudgetController
from vllm_ddtree.config import DDTreeConfig, check_budget_runs, get_ddtree_config
from vllm_ddtree.integration import installed_vllm_version
from vllm_ddtree.metrics import WorkerFigures
from vllm_ddtree.shadow import ShadowAcceptance
from vllm_ddtree.step import ScheduledDrafts, TreeStep, lay_out_step
from vllm_ddtree.tree import DraftTree, build_draft_trees
from vllm_ddtree.verify import walk_step

logger = logging.getLogger("vllm.ddtree")

__all__ = ["DDTreeModelStateMixin", "DDTreeSpeculator", "DDTreeVerifier", "ddtree_model_state_cls"]


class DDTreeSpeculator(DFlashSpeculator):
    """V2's DFlash speculator drafting with L mask tokens; returns one draft tree per request.

    Mirrors ``vllm/v1/worker/gpu/spec_decode/dflash/speculator.py`` (``DFlashSpeculator``), whose
    input preparation, context-KV precompute and drafter forward run unchanged.

    Attributes:
        ddtree: the engine's :class:`~vllm_ddtree.config.DDTreeConfig`.
        num_verify_slots: ``K = max(B, L)``, draft rows per request in V2's batch.
        trees: ``req_id -> DraftTree`` of the last ``propose`` (node tokens = the request's
            draft tokens; rows past ``B`` are padding).
        last_step: the step verified last, consumed by the next ``propose`` (accepted paths).
        last_log_probs: ``[R, L, V]`` float32 drafter log-probs of the last pass.
        ddtree_figures: :class:`~vllm_ddtree.metrics.WorkerFigures` (tree-build and
            KV-compaction times, padding rows, the shadow measurement) for the metrics.
        shadow: ``ddtree_hybrid="shadow_linear"``: the
            :class:`~vllm_ddtree.shadow.ShadowAcceptance` of the unverified trees (else
            ``None``); the top-1 chain of ``L`` nodes is what V2 verifies then.

    Raises:
        DDTreeConfigError: the budget cannot run with these scheduler settings.
    """

    def __init__(self, vllm_config: Any, device: torch.device):
        ddtree = get_ddtree_config(vllm_config)
        if ddtree is None:
            raise ValueError("DDTreeSpeculator needs additional_config['ddtree']")
        self.ddtree: DDTreeConfig = ddtree
        #: Recurrent layers run the sequential tree oracle (every speculative row of the target).
        self.hybrid = bool(getattr(vllm_config.model_config, "is_hybrid", False))
        self.num_verify_slots = int(vllm_config.speculative_config.num_speculative_tokens)
        # Again with the engine's final settings (the front end may not know vLLM's defaults).
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        check_budget_runs(ddtree, vllm_config.model_config.get_vocab_size(), max_tokens,
                          installed_vllm_version())
        # The drafter runs L mask tokens; V2's runner keeps K = max(B, L) draft rows.
        spec = copy.copy(vllm_config.speculative_config)
        object.__setattr__(spec, "num_speculative_tokens", ddtree.drafter_horizon)
        drafter_config = copy.copy(vllm_config)
        drafter_config.speculative_config = spec
        super().__init__(drafter_config, device)
        self.trees: dict[str, DraftTree] = {}
        self.last_step: TreeStep | None = None
        self.last_log_probs: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        #: Tree-build / KV-compaction times and the shadow measurement, for the metrics.
        self.ddtree_figures = WorkerFigures()
        #: ``shadow_linear``: the top-1 chain is verified, the trees are measured against the
        #: committed output, which V2 does not keep on the host: :meth:`record_output` does.
        self.shadow: ShadowAcceptance | None = None
        self._outputs: dict[str, list[int]] = {}
        if ddtree.hybrid == "shadow_linear":
            self.shadow = ShadowAcceptance(ddtree.drafter_horizon, figures=self.ddtree_figures)
        #: ``ddtree_budget="auto"``: each step's per-request tree sizes; V2 verifies only those
        #: rows through :class:`DDTreeVerificationBudget` (installed as the runner's
        #: ``adaptive_verification``).
        self.controller: BudgetController | None = (
            BudgetController(ddtree.budget, figures=self.ddtree_figures,
                             row_multiple=ENGINE_ROW_MULTIPLE,
                             sizes_per_octave=ENGINE_SIZES_PER_OCTAVE)
            if ddtree.auto_budget else None)
        if self.controller is not None:
            from vllm_ddtree.runners import rank_agreement

            self.controller.agree = rank_agreement()  # tensor parallel: rank 0's sizes
        #: Auto's step timer: real steps prepared so far, and the last one's verified rows
        #: (0 with a prefill chunk) and requests (:meth:`note_step`).
        self.step_index = 0
        self.step_rows = 0
        self.step_requests = 1
        #: req_id -> tokens left to generate, noted as each step is prepared
        #: (:meth:`note_remaining`).
        self._remaining: dict[str, int] = {}
        self._max_tokens = max_tokens
        self._tree_tokens = torch.zeros(self.max_num_reqs, self.num_verify_slots,
                                        dtype=torch.int64, device=device)
        self._cache_layers: dict[str, tuple[Any, torch.Tensor]] | None = None
        from vllm_ddtree.attention.cuda import (
            allocate_engine_tree_masks,
            check_cudagraph_mode,
            engine_uses_tree_mask_buffers,
            install_tree_mask_buffers,
        )

        if self.hybrid:
            from vllm_ddtree.hybrid.guard import hybrid_cudagraph_mode

            hybrid_cudagraph_mode(vllm_config, ddtree.hybrid)
        # The Triton tree backend (CUDA) reads static mask buffers, allocated here, before any
        # CUDA-graph capture (the runner builds its speculator in __init__).
        self.uses_tree_mask_buffers = engine_uses_tree_mask_buffers()
        if self.uses_tree_mask_buffers:
            check_cudagraph_mode(vllm_config.compilation_config.cudagraph_mode)
            sched = vllm_config.scheduler_config
            install_tree_mask_buffers(allocate_engine_tree_masks(
                sched.max_num_seqs, ddtree.budget, device,
                max_tree_tokens=sched.max_num_batched_tokens))
        logger.info("DDTree speculator (Model Runner V2): node budget B=%s, drafter horizon "
                    "L=%d, %d draft rows per request",
                    f"auto (1..{ddtree.budget})" if ddtree.auto_budget else ddtree.budget,
                    ddtree.drafter_horizon, self.num_verify_slots)

    def load_model(self, target_model: Any) -> None:
        """The hybrid guard on the loaded target, then vLLM's DFlash drafter load.

        Raises:
            DDTreeConfigError: a recurrent layer (:func:`vllm_ddtree.hybrid.guard.check_recurrent_layers`).
        """
        from vllm_ddtree.hybrid.guard import check_recurrent_layers, fit_recurrent_state_shapes
        from vllm_ddtree.integration import platform_name

        check_recurrent_layers(target_model, self.ddtree.hybrid, platform=platform_name())
        fit_recurrent_state_shapes(target_model, self.ddtree.num_recurrent_state_blocks)
        super().load_model(target_model)

    def init_cudagraph_manager(self, cudagraph_mode: Any) -> None:
        """The drafter runs without full CUDA graphs: the trees need the ``[R * L, V]`` logits
        in Python, which a replayed graph would leave in capture-time memory."""
        from vllm.config.compilation import CUDAGraphMode

        super().init_cudagraph_manager(CUDAGraphMode.NONE)

    def set_attn(self, model_state: Any, *args: Any, **kwargs: Any) -> None:
        """vLLM's attention set-up, then link the target's model state to this speculator."""
        super().set_attn(model_state, *args, **kwargs)
        if isinstance(model_state, DDTreeModelStateMixin):
            model_state.ddtree_speculator = self

    def _generate_draft(self, num_reqs: int, num_tokens_padded: int, attn_metadata: Any,
                        slot_mappings: Any, num_tokens_across_dp: Any,
                        cudagraph_runtime_mode: Any = None) -> None:
        """The drafter forward of ``DFlashSpeculator._generate_draft``, keeping the logits of
        every mask position (``[num_reqs * L, V]``) instead of sampling one token each."""
        from vllm.config.compilation import CUDAGraphMode

        hidden = self._run_model(num_tokens_padded, attn_metadata, slot_mappings,
                                 num_tokens_across_dp,
                                 cudagraph_runtime_mode or CUDAGraphMode.NONE)
        num_sample = num_reqs * self.num_speculative_steps
        self._logits = self.model.compute_logits(hidden[self.sample_indices[:num_sample]])

    @torch.inference_mode()
    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any,
                last_hidden_states: torch.Tensor, aux_hidden_states: Any, num_sampled: torch.Tensor,
                num_rejected: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Commit the drafter context of the accepted paths, one DFlash pass, one tree each.

        Returns:
            ``[num_reqs, K]`` int64: each request's tree node tokens in node (pop) order, then
            zeros (padding rows when ``B < K``).
        """
        step, self.last_step = self.last_step, None
        if step is not None and not kwargs.get("dummy_run", False):
            from vllm_ddtree.commit import gather_accepted_rows

            gather_accepted_rows(aux_hidden_states or [last_hidden_states], step.requests)
        t0 = time.perf_counter()
        super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                        aux_hidden_states, num_sampled, num_rejected, *args, **kwargs)
        num_reqs = input_batch.num_reqs
        logits, self._logits = self._logits, None
        out = self._tree_tokens[:num_reqs]
        out.zero_()
        if logits is None or kwargs.get("dummy_run", False):
            return out
        L = self.ddtree.drafter_horizon
        log_probs = torch.log_softmax(logits.float().view(num_reqs, L, -1), dim=-1)
        req_ids = list(input_batch.req_ids[:num_reqs])
        trees = self.build_trees(req_ids, log_probs)
        if self.shadow is not None:
            trees = self._shadow_chains(req_ids, log_probs, trees)
        if self.controller is not None:
            # What a target-only step would not pay (the drafter pass and the trees; the tree
            # build's device->host copy waits for the pass on a GPU).
            self.controller.observe_drafter(time.perf_counter() - t0)
            self.controller.step_finished(self.step_index, self.step_rows, self.step_requests,
                                          time.perf_counter())
            left = [self._remaining.get(r) for r in req_ids]
            trees = self.controller.size_trees(
                req_ids, trees, self._max_tokens,
                None if any(x is None for x in left) else left)
        host = torch.zeros(num_reqs, self.num_verify_slots, dtype=torch.int64)
        for i, (req_id, tree) in enumerate(zip(req_ids, trees)):
            n = L if self.shadow is not None else self.ddtree.budget
            if self.controller is not None:
                n = tree.num_nodes  # the size auto chose (its tree was built in full)
            elif tree.num_nodes != n:  # only possible with -inf drafts
                raise RuntimeError(
                    f"DDTree built {tree.num_nodes} nodes for request {req_id}, expected {n}")
            host[i, :n] = tree.token_ids
            self.trees[req_id] = tree
        live = set(req_ids)
        for req_id in [r for r in self.trees if r not in live]:
            del self.trees[req_id]  # finished, aborted or preempted requests
        if self.controller is not None:
            self.controller.forget(live)
        if self.shadow is not None:
            self.shadow.forget(live)
            for req_id in [r for r in self._outputs if r not in live]:
                del self._outputs[req_id]
        out.copy_(host)
        return out

    def _shadow_chains(self, req_ids: list[str], log_probs: torch.Tensor,
                       trees: list[DraftTree]) -> list[DraftTree]:
        """``shadow_linear``: each request's top-1 chain (DFlash's argmax per depth, ``L``
        nodes) to verify; its tree is kept for :class:`~vllm_ddtree.shadow.ShadowAcceptance`."""
        from vllm_ddtree.tree import chain_tree

        spine = log_probs.argmax(dim=-1).cpu()  # [R, L]
        chains = []
        for i, (req_id, tree) in enumerate(zip(req_ids, trees)):
            chain = chain_tree(spine[i])
            output = self._outputs.get(req_id, [])
            self.shadow.update(req_id, output)
            # The root is the token committed last (this step's bonus token).
            self.shadow.add(req_id, tree, chain, root=len(output) - 1 if output else None)
            chains.append(chain)
        return chains

    def note_step(self, input_batch: Any) -> None:
        """``ddtree_budget="auto"``: one real step is being prepared; its verified rows (after
        :class:`DDTreeVerificationBudget` trimmed them) time it at the next :meth:`propose`.
        Steps with a prefill chunk are not timed: a prefill row costs far less than a tree node
        and would flatten the cost slope."""
        self.step_index += 1
        self.step_rows = 0 if input_batch.has_prefill else int(input_batch.num_tokens)
        self.step_requests = int(input_batch.num_reqs)

    def note_remaining(self, input_batch: Any, req_states: Any) -> None:
        """``ddtree_budget="auto"``: each request's tokens left to generate, for the step's
        allocation (``remaining_tokens`` of :meth:`BudgetController.allocate
        <vllm_ddtree.budget.BudgetController.allocate>`): V2's ``RequestState.max_seq_len``
        (prompt + ``max_tokens``) less what this step leaves computed or sampled: the tokens
        computed before it and the one sampled last, or, in a prefill step, the prefill
        (``RequestState.prefill_len``; vllm/v1/worker/gpu/states.py)."""
        prefill = getattr(getattr(req_states, "prefill_len", None), "np", None)
        if prefill is None or getattr(req_states, "max_seq_len", None) is None:
            self._remaining = {}  # a vLLM without these fields: every request alike
            return
        idx = input_batch.idx_mapping_np[: input_batch.num_reqs]
        done = np.maximum(req_states.num_computed_tokens_np[idx] + 1, prefill[idx])
        left = req_states.max_seq_len[idx] - done
        self._remaining = dict(zip(input_batch.req_ids[: input_batch.num_reqs], left.tolist()))

    def record_output(self, req_ids: list[str], sampled: torch.Tensor,
                      num_sampled: list[int]) -> None:
        """``shadow_linear``: append each request's committed tokens of this step.

        Args:
            req_ids: the batch's request ids, in batch order.
            sampled: ``[num_reqs, K + 1]`` int64 (host), tokens emitted per request, in order.
            num_sampled: tokens each request committed this step (0 during a chunked prefill).
        """
        for b, req_id in enumerate(req_ids):
            if num_sampled[b]:
                self._outputs.setdefault(req_id, []).extend(sampled[b, : num_sampled[b]].tolist())

    def target_cache_layers(self) -> dict[str, tuple[Any, torch.Tensor]]:
        """The target's layers for KV compaction inside the caches (CUDA), found once
        (:func:`vllm_ddtree.attention.cuda.target_cache_layers`)."""
        if self._cache_layers is None:
            from vllm_ddtree.attention.cuda import target_cache_layers

            self._cache_layers = target_cache_layers(
                self.vllm_config.compilation_config.static_forward_context,
                self.draft_attn_layer_names)
        return self._cache_layers

    def build_trees(self, req_ids: list[str], log_probs: torch.Tensor) -> list[DraftTree]:
        """Best-first draft trees (paper Alg. 1) from ``[R, L, V]`` float32 drafter log-probs."""
        self.last_log_probs = log_probs
        budget = (self.ddtree.budget if self.controller is None
                  else self.controller.build_caps(req_ids))
        with self.ddtree_figures.timed("tree_build"):
            return build_draft_trees(log_probs, budget, self.ddtree.max_children)


_BATCH_ORDER_CHANGED = (
    "DDTree auto budget: V2's batch order differs from sort_batch_req_ids "
    "(vllm/v1/worker/gpu/model_runner.py); this vLLM version needs a plugin update")


class DDTreeVerificationBudget:
    """``ddtree_budget="auto"`` on V2: each request verifies only its tree's rows.

    V2's scheduler books ``K = max(B_max, L)`` draft rows for every request (async scheduling
    books them before the drafter has run), so a smaller tree alone would leave padding rows
    that cost as much as nodes. V2 has one seam to verify fewer rows than were scheduled: the
    runner's ``adaptive_verification`` object, which vLLM uses for DSpark
    (``AdaptiveVerificationManager``, ``vllm/v1/worker/gpu/spec_decode/adaptive_verification.py``):
    the runner asks it for the step's token count, the per-request row counts and the device
    ``cu_num_logits`` / ``query_start_loc``, and trims the batch to them. This class answers
    with each request's tree size (the controller's choice, :attr:`DDTreeSpeculator.trees`) and
    keeps the host-side counts exact, so the tree layout, the verifier and the attention
    metadata read the rows actually run. It is installed after ``initialize_kv_cache``
    (:mod:`vllm_ddtree.patches`), so V2 keeps the CUDA-graph mode it chose; a trimmed batch is
    not a uniform decode batch and does not replay V2's uniform-decode graphs.

    Args:
        speculator: the engine's :class:`DDTreeSpeculator` (its ``trees`` give the sizes).
        query_start_loc: the runner's ``input_buffers.query_start_loc`` (device, int32).
        decode_query_len: the runner's ``decode_query_len`` (``K + 1``), for V2's batch order.
        device: where ``cu_num_logits`` lives.
        admitted_counts: vLLM 0.33's ``reallocate_drafts`` also returns the admitted draft
            counts (``None`` when the host counts are exact, as here); 0.32's does not.

    Raises:
        RuntimeError: the runner's batch order differs from ``sort_batch_req_ids``'s (a vLLM
            change this class must follow).
    """

    def __init__(self, speculator: DDTreeSpeculator, query_start_loc: torch.Tensor,
                 decode_query_len: int, device: torch.device, admitted_counts: bool):
        from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

        self.speculator = speculator
        self.query_start_loc = query_start_loc
        self.decode_query_len = int(decode_query_len)
        self.admitted_counts = admitted_counts
        self._sort = sort_batch_req_ids
        self._cu = torch.zeros(speculator.max_num_reqs + 1, dtype=torch.int32, device=device)
        #: The step being prepared: request order, draft rows kept, other rows (host).
        self._req_ids: list[str] = []
        self._kept = np.zeros(0, dtype=np.int32)
        self._other = np.zeros(0, dtype=np.int32)
        self._cu_np = np.zeros(1, dtype=np.int32)

    def get_num_tokens(self, num_tokens_per_req: dict[str, int],
                       draft_tokens: dict[str, list[int]]) -> int:
        """Rows of this step once each request's draft rows are cut to its tree's size.

        Args:
            num_tokens_per_req: scheduled tokens per request id (the scheduler's, untrimmed).
            draft_tokens: scheduled draft tokens per request id (placeholders under V2).

        Returns:
            the step's token count.
        """
        order = self._sort(num_tokens_per_req, draft_tokens, self.decode_query_len)
        trees = self.speculator.trees
        scheduled = np.fromiter((len(draft_tokens.get(r, ())) for r in order), np.int32,
                                len(order))
        tree_sizes = np.fromiter((trees[r].num_nodes if r in trees else n
                                  for r, n in zip(order, scheduled.tolist())), np.int32,
                                 len(order))
        self._req_ids = order
        self._kept = np.minimum(scheduled, tree_sizes)
        self._other = np.fromiter(map(num_tokens_per_req.__getitem__, order), np.int32,
                                  len(order)) - scheduled
        return int(self._other.sum() + self._kept.sum())

    def compact_batch(self, num_draft_tokens_per_req: np.ndarray,
                      num_scheduled_tokens: np.ndarray,
                      cu_num_logits_np: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The host-side per-request row counts and ``cu_num_logits`` after the cut (exact).

        Args:
            num_draft_tokens_per_req, num_scheduled_tokens: ``[num_reqs]`` int32, batch order,
                as scheduled.
            cu_num_logits_np: ``[num_reqs + 1]`` int32 as scheduled (replaced).
        """
        if len(num_scheduled_tokens) != len(self._kept) or not np.array_equal(
                num_scheduled_tokens - num_draft_tokens_per_req, self._other):
            raise RuntimeError(_BATCH_ORDER_CHANGED)
        cu = np.zeros(len(self._kept) + 1, dtype=cu_num_logits_np.dtype)
        np.cumsum(self._kept + 1, out=cu[1:])
        self._cu_np = cu
        return self._other + self._kept, cu

    def reallocate_drafts(self, req_ids: list[str], idx_mapping: torch.Tensor) -> tuple:
        """The device ``cu_num_logits`` and ``query_start_loc`` of the cut batch.

        ``query_start_loc`` is the runner's buffer, already written from the exact host counts
        of :meth:`compact_batch`; only ``cu_num_logits`` is copied here.

        Returns:
            ``(cu_num_logits [num_reqs + 1] int32, query_start_loc, draft rows kept)``, and on
            vLLM 0.33 a fourth ``None`` (the host counts are exact).

        Raises:
            RuntimeError: ``req_ids`` is not the order :meth:`get_num_tokens` computed.
        """
        if list(req_ids) != self._req_ids:
            raise RuntimeError(_BATCH_ORDER_CHANGED)
        cu = self._cu[: len(self._cu_np)]
        cu.copy_(torch.from_numpy(self._cu_np))  # pageable host memory: a synchronous copy
        out = (cu, self.query_start_loc, int(self._kept.sum()))
        return (*out, None) if self.admitted_counts else out

    # The rest of the interface the runner calls: no confidences to record and no cost
    # profile to take (the controller measures real steps).
    def add_request(self, req_idx: int) -> None:
        """Nothing to reset per request."""

    def record_confidences(self, confidence_probs: Any, input_batch: Any) -> None:
        """The trees carry their own path probabilities."""

    def batches_to_profile(self, capture_sizes: list[int]) -> Any:
        """No dummy batches to time (``[]``)."""
        return iter(())

    def set_initial_cost_curves(self, samples: Any) -> None:
        """The controller learns step costs from real steps."""


class DDTreeModelStateMixin:
    """Tree layout of each step for the target's model state (any V2 ``ModelState`` subclass).

    ``ddtree_speculator`` is set by :meth:`DDTreeSpeculator.set_attn`; ``ddtree_step`` holds the
    step being run, from ``prepare_attn`` until :class:`DDTreeVerifier` consumes it.
    """

    ddtree_speculator: DDTreeSpeculator | None = None
    ddtree_step: TreeStep | None = None
    ddtree_hybrid_ctx: Any = None
    _ddtree_real_step = False

    def preprocess_state(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's hook, run on real batches only (never dummy or capture runs): marks the
        step's forward as one that verifies (``ModelState.preprocess_state``, V2)."""
        super().preprocess_state(*args, **kwargs)  # type: ignore[misc]
        self._ddtree_real_step = True

    def prepare_attn(self, input_batch: Any, cudagraph_mode: Any, block_tables: Any,
                     slot_mappings: torch.Tensor, attn_groups: Any, kv_cache_config: Any,
                     for_capture: bool = False, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """vLLM's metadata, then this step's plan (``ModelState.prepare_attn``, V2)."""
        from vllm_ddtree.attention.common import publish_tree_batch
        from vllm_ddtree.hybrid.context import publish_hybrid_context

        publish_tree_batch(None)  # a forward never inherits an earlier step's trees
        publish_hybrid_context(None)
        self.ddtree_step = self.ddtree_hybrid_ctx = None
        real, self._ddtree_real_step = self._ddtree_real_step, False
        spec = self.ddtree_speculator
        if spec is not None and spec.uses_tree_mask_buffers:
            from vllm_ddtree.attention.cuda import clear_tree_masks

            clear_tree_masks()
        metadata = super().prepare_attn(input_batch, cudagraph_mode, block_tables,  # type: ignore[misc]
                                        slot_mappings, attn_groups, kv_cache_config,
                                        for_capture, *args, **kwargs)
        if for_capture or not real or spec is None:
            return metadata
        if spec.controller is not None:
            spec.note_step(input_batch)
        step = None
        if input_batch.num_draft_tokens:
            step = plan_v2_step(input_batch, spec.trees, slot_mappings.device)
        if step is not None:
            step.slot_mappings = build_slot_mappings_by_layer(slot_mappings, kv_cache_config)
        self.ddtree_step = step
        if spec.hybrid:  # every real forward: vLLM's speculative recurrent path is replaced
            self.ddtree_hybrid_ctx = hybrid_context(step, input_batch)
        return metadata

    def prepare_inputs(self, input_batch: Any, req_states: Any) -> dict[str, Any]:
        """Depth positions for the tree rows (in place: a captured graph reads this buffer) and
        the tree batch published to the attention backends, for the target's forward."""
        out = super().prepare_inputs(input_batch, req_states)  # type: ignore[misc]
        spec = self.ddtree_speculator
        if spec is not None and spec.controller is not None:
            spec.note_remaining(input_batch, req_states)
        if self.ddtree_hybrid_ctx is not None:
            from vllm_ddtree.hybrid.context import publish_hybrid_context

            publish_hybrid_context(self.ddtree_hybrid_ctx)
        step = self.ddtree_step
        if step is None:
            return out
        from vllm_ddtree.attention.common import publish_tree_batch

        if step.position_rows.numel():
            input_batch.positions[step.position_rows] = step.tree_positions
        if step.attn_batch.requests:
            publish_tree_batch(step.attn_batch)
            spec = self.ddtree_speculator
            if spec is not None and spec.uses_tree_mask_buffers:
                from vllm_ddtree.attention.cuda import publish_tree_masks

                # In place, before the forward: a captured graph reads these buffers.
                num_reqs = input_batch.num_reqs
                publish_tree_masks(step.attn_batch.requests,
                                   input_batch.query_start_loc_np[: num_reqs + 1].tolist(),
                                   num_reqs)
                step.cache_layers = spec.target_cache_layers()
        return out

    def custom_sampler(self, sampler: Any) -> tuple[Any, Any]:
        """Keep vLLM's sampler; verification is :class:`DDTreeVerifier` (V2 ``custom_sampler``)."""
        return sampler, DDTreeVerifier(sampler, self)


def hybrid_context(step: TreeStep | None, input_batch: Any) -> Any:
    """The recurrent-layer oracle's context for one V2 forward: each tree request's parents,
    with V2's padding rows past the tree (``B < K``) as never-accepted children of the root."""
    from vllm_ddtree.hybrid.context import HybridTreeContext

    parents = {}
    cu = input_batch.cu_num_logits_np
    for r in (step.requests if step is not None else []):
        if not r.is_tree:
            continue
        rows = int(cu[r.batch_index + 1] - cu[r.batch_index])
        pad = torch.zeros(rows - r.num_rows, dtype=r.tree.parents.dtype)
        parents[r.batch_index] = torch.cat([r.tree.parents, pad])
    return HybridTreeContext.for_step(
        parents, input_batch.num_computed_tokens_np[: input_batch.num_reqs])


def plan_v2_step(input_batch: Any, trees: dict[str, DraftTree],
                 device: torch.device) -> TreeStep | None:
    """This step's :class:`~vllm_ddtree.step.TreeStep` from V2's ``InputBatch``.

    A request's draft rows follow its root row; V2 schedules ``K`` rows (fewer near
    ``max_model_len`` or the token budget; with ``ddtree_budget="auto"``
    :class:`DDTreeVerificationBudget` keeps only the tree's) and feeds the speculator's tokens
    itself, so the tree is matched by request id (:func:`vllm_ddtree.step.lay_out_step`). The
    verified draft rows are read from ``cu_num_logits_np`` (one bonus row per request), which
    counts the rows kept, where ``num_draft_tokens_per_req`` counts the rows scheduled.
    """
    if input_batch.num_draft_tokens_per_req is None:
        return None
    qsl = input_batch.query_start_loc_np
    cu = input_batch.cu_num_logits_np
    computed = input_batch.num_computed_tokens_np
    scheduled = []
    for b, req_id in enumerate(input_batch.req_ids[: input_batch.num_reqs]):
        n = int(cu[b + 1] - cu[b]) - 1
        if n <= 0:
            continue
        rows = int(qsl[b + 1] - qsl[b])
        root = int(qsl[b + 1]) - (n + 1)
        tokens = None
        if req_id not in trees:  # rare (e.g. a resumed request): verify its tokens as a chain
            tokens = input_batch.input_ids[root + 1 : root + 1 + n].tolist()
        scheduled.append(ScheduledDrafts(req_id, b, root, int(computed[b]) + rows - (n + 1), n,
                                         tokens))
    return lay_out_step(scheduled, trees, device)


class DDTreeVerifier:
    """Tree verification in place of V2's ``RejectionSampler`` (same call, same output).

    Mirrors ``vllm/v1/worker/gpu/spec_decode/rejection_sampler.py`` (``RejectionSampler.__call__``)
    for the output layout and logprobs; the acceptance rule is DDTree's walk (paper §3.4), which
    commits exactly what target-only decoding would emit.
    """

    def __init__(self, sampler: Any, model_state: DDTreeModelStateMixin):
        self.sampler = sampler
        self.model_state = model_state

    def __call__(self, logits: torch.Tensor, input_batch: Any, draft_logits: Any = None,
                 invalid_drafts: Any = None) -> SamplerOutput:
        """Verify this step's trees.

        Args:
            logits: ``[num_logits, V]`` target logits, request after request, node order.
            input_batch: V2's ``InputBatch`` of the step.
            draft_logits, invalid_drafts: unused (grammar-constrained drafts are refused at the
                front end for DDTree).

        Returns:
            ``SamplerOutput`` with ``sampled_token_ids`` ``[num_reqs, K + 1]`` (accepted path's
            tokens then the bonus token), ``num_sampled`` and ``num_rejected`` per request.
        """
        from vllm.v1.worker.gpu.metrics.logits import get_num_nans

        from vllm_ddtree.attention.common import publish_tree_batch
        from vllm_ddtree.hybrid.context import publish_hybrid_context

        publish_tree_batch(None)
        publish_hybrid_context(None)
        step, self.model_state.ddtree_step = self.model_state.ddtree_step, None
        hybrid_ctx, self.model_state.ddtree_hybrid_ctx = self.model_state.ddtree_hybrid_ctx, None
        spec = self.model_state.ddtree_speculator
        if spec is not None and spec.uses_tree_mask_buffers:
            from vllm_ddtree.attention.cuda import clear_tree_masks

            clear_tree_masks()
        sampler = self.sampler
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        rows = input_batch.logits_indices
        pos = input_batch.positions[rows]  # depth positions: a node's draw is keyed as in a chain
        max_logprobs = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
        choices, _ = sampler.sample(
            logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping,
            input_batch.idx_mapping_np, pos, input_batch.input_ids[rows],
            input_batch.expanded_local_pos, input_batch.seq_lens_cpu_upper_bound.numpy(),
            return_logprobs=max_logprobs != NO_LOGPROBS)
        if step is not None and step.position_rows.numel():
            input_batch.positions[step.position_rows] = step.chain_positions
        cu = input_batch.cu_num_logits_np
        num_reqs = input_batch.num_reqs
        width = spec.num_verify_slots + 1 if spec is not None else int(np.max(np.diff(cu)))
        by_batch = {r.batch_index: r for r in step.requests} if step is not None else {}
        sampled, emitted, perm = walk_step(choices.view(-1).tolist(), cu, by_batch, width)
        if step is not None and spec is not None and spec.controller is not None:
            spec.controller.observe_verified(step)  # auto learns what was accepted
        device = logits.device
        # Chunked-prefill rows emit nothing yet (seq_len < prefill_len), as in vLLM's samplers.
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            torch.tensor(emitted, dtype=torch.int32, device=device), input_batch.seq_lens,
            input_batch.cu_num_logits, input_batch.idx_mapping, sampler.req_states.prefill_len.gpu)
        logprobs = None
        if max_logprobs != NO_LOGPROBS:
            # As RejectionSampler._get_logprobs_tensors, with the accepted path's logits rows
            # moved to the front of each request: the emitted tokens' rows in emission order.
            flat = torch.zeros(logits.shape[0], dtype=torch.int64)
            for b, n in enumerate(emitted):
                flat[int(cu[b]) : int(cu[b]) + n] = sampled[b, :n]
            expanded = logits.shape[0] != num_reqs
            logprobs = compute_topk_scores(
                logits[torch.tensor(perm, device=device)], max_logprobs, flat.to(device),
                cu.tolist() if expanded else None,
                logits_mode=sampler.logprobs_mode in ("raw_logits", "processed_logits"))
        if spec is not None and spec.shadow is not None:
            spec.record_output(list(input_batch.req_ids[:num_reqs]), sampled,
                               num_sampled.tolist())
        sampled = sampled.to(device)
        if step is not None:
            from vllm_ddtree.commit import commit_tree_step

            # KV compaction and the recurrent re-layout; the drafter context is gathered by
            # DDTreeSpeculator.propose, where V2 hands over the hidden states.
            if spec is not None:
                with spec.ddtree_figures.timed("kv_compaction"):
                    commit_tree_step(step, hybrid_ctx)
                spec.last_step = step
                # V2 schedules K rows per request: the rows past a smaller tree (padding, or
                # rows auto did not verify) are not draft tokens; the scheduler's counts are
                # corrected with this.
                per_req = input_batch.num_draft_tokens_per_req
                spec.ddtree_figures.add(padding_rows=sum(
                    int(per_req[r.batch_index]) - (r.num_rows - 1) for r in step.requests))
            else:
                commit_tree_step(step, hybrid_ctx)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs,
                             num_nans=num_nans, num_sampled=num_sampled, num_rejected=num_rejected)


_CLASSES: dict[type, type] = {}


def ddtree_model_state_cls(base: type) -> type:
    """``base`` (the model state vLLM resolved for the target) with :class:`DDTreeModelStateMixin`."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"DDTree{base.__name__}", (DDTreeModelStateMixin, base), {})
        _CLASSES[base] = cls
    return cls
