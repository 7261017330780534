"""The legacy adapter's hooks on Model Runner V1 (``vllm/v1/worker/gpu_model_runner.py``; the
CPU runner subclasses it), vLLM 0.32 and 0.33 only: 0.34 deleted V1, the register marks these
targets absent there, and :mod:`vllm_ddtree.patches` neither imports this module nor
patches them there.

The step, in the order V1 calls it:

  * ``VllmConfig._validate_v1_model_runner`` (front end): refuse a drafter only V2 can run
    (mixed sliding/full attention) with a :class:`DDTreeConfigError` saying how to get V2.
  * ``GPUModelRunner.__init__``: build :class:`~vllm_ddtree.runners.v1.proposer.DDTreeProposer`
    where vLLM builds ``DFlashProposer`` (a subclass, so vLLM's ``isinstance`` checks hold).
  * ``GPUModelRunner._prepare_inputs``: lay this step's trees onto the token batch
    (:func:`vllm_ddtree.runners.v1.step.plan_tree_step`).
  * ``GPUModelRunner._model_forward``: depth positions in the positions buffer the model reads,
    tree attention active (CUDA: the static tree-mask buffers written before and cleared after),
    capture slot mappings and tapped hidden states.
  * ``GPUModelRunner._sample``: verification (:mod:`.verify`), then the commit (KV compaction,
    drafter context, recurrent state: :func:`vllm_ddtree.commit.commit_tree_step`), then the
    ``auto`` feedback.
  * ``GPUModelRunner._input_fits_in_drafter``: the drafter's length check past what was
    committed.
  * ``GPUModelRunner._bookkeeping_sync`` (CPU): a seeded request's draw discarded during a
    chunked prefill is undone by restoring its generator's saved state, where vLLM's offset
    rewind would raise on a CPU generator and kill the engine.

Each wrapper falls through to vLLM's original unless the engine runs DDTree.
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_ddtree import integration
from vllm_ddtree.config import DDTreeConfigError, get_ddtree_config
from vllm_ddtree.patches import patch
from vllm_ddtree.runners.v1.state import engine_state

_RUNNER = "vllm.v1.worker.gpu_model_runner"

# --------------------------------------------------------------------------- front end

@patch("vllm.config.vllm", "VllmConfig._validate_v1_model_runner")
def _validate_v1_model_runner(original: Callable) -> Callable:
    # vLLM calls this exactly when the engine will run Model Runner V1, while it builds the
    # VllmConfig in the front end: the one place that knows the runner before any worker starts.
    def _validate_v1_model_runner(self):
        ddtree = get_ddtree_config(self)
        draft = getattr(self.speculative_config, "draft_model_config", None)
        if ddtree is not None and draft is not None:
            check_drafter_on_v1_runner(ddtree.drafter, getattr(draft.hf_config, "layer_types", None))
        return original(self)

    return _validate_v1_model_runner


def check_drafter_on_v1_runner(drafter: str, layer_types: Any) -> None:
    """Refuse, before the engine starts, a drafter vLLM can only run on Model Runner V2.

    vLLM 0.32 gives a DFlash drafter whose ``layer_types`` mix ``"sliding_attention"`` and
    ``"full_attention"`` one KV-cache group per attention kind, which only Model Runner V2 has
    (``VllmConfig._get_v1_model_runner_unsupported_features``; ``qwen3_dflash.py``
    ``_resolve_layer_attention``). Called when the engine's config selects V1.

    Args:
        drafter: ``speculative_config['model']``, for the message.
        layer_types: the drafter config's ``layer_types`` (``None`` or a list of strings).

    Raises:
        DDTreeConfigError: some but not all layers are ``"sliding_attention"``; the message
            names the drafter, its layer types and how to get Model Runner V2.
    """
    types = list(layer_types or ())
    num_sliding = sum(t == "sliding_attention" for t in types)
    if not 0 < num_sliding < len(types):
        return
    raise DDTreeConfigError(
        f"speculative_config['model']={drafter!r} is a DFlash drafter mixing sliding-window and "
        f"full attention (layer_types={types}); vLLM runs such drafters only on Model Runner V2 "
        "(vLLM: 'DFlash drafters with mixed sliding/full attention require the V2 model "
        "runner'), and this engine would run Model Runner V1. Use Model Runner V2: vLLM's default "
        "wherever Triton runs (every CUDA GPU), or set VLLM_USE_V2_MODEL_RUNNER=1 (do not set it "
        "to 0); a CPU-only vLLM has it only with a Triton CPU backend (triton-cpu). Or use a "
        "drafter whose layer_types are all 'full_attention'."
    )


# --------------------------------------------------------------------------- worker


@patch(_RUNNER, "GPUModelRunner.__init__")
def _runner_init(original: Callable) -> Callable:
    def __init__(self, vllm_config, device, *args, **kwargs):
        from vllm_ddtree.runners.v1.state import V1EngineState

        ddtree = get_ddtree_config(vllm_config)
        self._ddtree = None if ddtree is None else V1EngineState(
            ddtree, hybrid=bool(getattr(vllm_config.model_config, "is_hybrid", False)))
        if ddtree is None:
            return original(self, vllm_config, device, *args, **kwargs)
        from vllm_ddtree.runners.v1.proposer import DDTreeProposer

        # Only while vLLM builds its drafter.
        with integration.swapped(_RUNNER, "DFlashProposer", DDTreeProposer):
            original(self, vllm_config, device, *args, **kwargs)
        if not isinstance(getattr(self, "drafter", None), DDTreeProposer):
            raise RuntimeError("DDTree: vLLM did not build the DFlash drafter for this engine")
        from vllm_ddtree.attention.cuda import (
            allocate_engine_tree_masks,
            check_cudagraph_mode,
            engine_uses_tree_mask_buffers,
            install_tree_mask_buffers,
        )

        if self._ddtree.hybrid:
            from vllm_ddtree.hybrid.guard import hybrid_cudagraph_mode

            hybrid_cudagraph_mode(vllm_config, ddtree.hybrid)
        # The Triton tree backend (CUDA) reads static mask buffers, allocated before any
        # CUDA-graph capture.
        self._ddtree.tree_masks = engine_uses_tree_mask_buffers()
        if self._ddtree.tree_masks:
            check_cudagraph_mode(vllm_config.compilation_config.cudagraph_mode)
            sched = vllm_config.scheduler_config
            install_tree_mask_buffers(allocate_engine_tree_masks(
                sched.max_num_seqs, ddtree.budget, device,
                max_tree_tokens=sched.max_num_batched_tokens))

    return __init__


@patch(_RUNNER, "GPUModelRunner._input_fits_in_drafter")
def _input_fits_in_drafter(original: Callable) -> Callable:
    def _input_fits_in_drafter(self, common_attn_metadata):
        state = engine_state(self)
        if state is None or common_attn_metadata is None:
            return original(self, common_attn_metadata)
        # vLLM sizes this by num_speculative_tokens = max(B, L) on top of the optimistic length
        # (all B drafts accepted); the next DFlash block [bonus, MASK x L] only has to fit past
        # what this step actually committed.
        committed, state.committed_max = state.committed_max, None
        if committed is None:
            committed = common_attn_metadata.max_seq_len
        return (committed + state.config.drafter_horizon + 1
                <= self.effective_drafter_max_model_len)

    return _input_fits_in_drafter


@patch(_RUNNER, "GPUModelRunner._prepare_inputs")
def _prepare_inputs(original: Callable) -> Callable:
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        result = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        state = engine_state(self)
        if state is None:
            return result
        from vllm_ddtree.runners.v1.step import plan_tree_step

        state.hybrid_done = False  # this step's target forward is still to come
        state.step_index += 1
        # auto's cost model learns from decode steps only: a prefill chunk costs far less per
        # row than a tree node (one attention wave per chain), and would flatten the slope.
        spec = scheduler_output.scheduled_spec_decode_tokens
        decode_only = all(n == 1 + len(spec.get(r, ()))
                          for r, n in scheduler_output.num_scheduled_tokens.items())
        state.step_rows = int(scheduler_output.total_num_scheduled_tokens) if decode_only else 0
        state.step_requests = len(scheduler_output.num_scheduled_tokens)
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        trees = self.drafter.trees
        state.step = plan_tree_step(
            req_ids,
            scheduler_output.scheduled_spec_decode_tokens,
            scheduler_output.num_scheduled_tokens,
            self.query_start_loc.np[: num_reqs + 1],
            self.input_batch.num_computed_tokens_cpu[:num_reqs],
            trees,
            device=self.device,
        )
        for req_id in scheduler_output.scheduled_spec_decode_tokens:
            trees.pop(req_id, None)  # a tree is verified at most once
        self.drafter.forget(set(self.requests))
        from vllm_ddtree.runners.v1.state import save_discarded_generators

        # Before this step samples anything.
        state.discarded_generators = save_discarded_generators(
            self.input_batch.generators, self.discard_request_mask.np[:num_reqs])
        return result

    return _prepare_inputs


@patch(_RUNNER, "GPUModelRunner._model_forward")
def _model_forward(original: Callable) -> Callable:
    def _model_forward(self, *args, **kwargs):
        state = engine_state(self)
        if state is None:
            return original(self, *args, **kwargs)
        step = state.step
        if step is not None and getattr(step, "forwarded", False):
            step = None  # a second forward of the step is the drafter's, not the target's
        hybrid = state.hybrid and not state.hybrid_done
        if step is None and not hybrid:
            return original(self, *args, **kwargs)
        from vllm.forward_context import get_forward_context

        from vllm_ddtree.attention.common import tree_attention_active
        from vllm_ddtree.hybrid.context import HybridTreeContext, hybrid_tree_active

        ctx = None
        if hybrid:  # every target forward: vLLM's speculative recurrent path is replaced
            parents = {r.batch_index: r.tree.parents for r in (step.requests if step else [])
                       if r.is_tree}
            ctx = state.hybrid_ctx = HybridTreeContext.for_step(
                parents, self.input_batch.num_computed_tokens_cpu[: self.input_batch.num_reqs])
            state.hybrid_done = True
        if step is None:
            with hybrid_tree_active(ctx):
                return original(self, *args, **kwargs)
        rows = step.position_rows
        moved = rows.numel() > 0
        if moved:  # in place: the model (and a captured graph) reads this buffer
            self.positions[rows] = step.tree_positions
        step.slot_mappings = get_forward_context().slot_mapping
        tree_masks = state.tree_masks
        try:
            if tree_masks:  # in place, before the forward: a captured graph reads these buffers
                from vllm_ddtree.attention.cuda import clear_tree_masks, publish_tree_masks

                num_reqs = self.input_batch.num_reqs
                publish_tree_masks(step.attn_batch.requests,
                                   self.query_start_loc.np[: num_reqs + 1].tolist(), num_reqs)
                step.cache_layers = _target_cache_layers(self)
            with tree_attention_active(step.attn_batch if step.attn_batch.requests else None), \
                    hybrid_tree_active(ctx):
                out = original(self, *args, **kwargs)
        finally:
            if moved:
                self.positions[rows] = step.chain_positions
            if tree_masks:
                clear_tree_masks()
        if self.use_aux_hidden_state_outputs and isinstance(out, tuple):
            step.aux_hidden_states = out[1]
        step.forwarded = True
        return out

    return _model_forward


def _target_cache_layers(self) -> dict:
    """``name -> (impl, kv_cache)`` of the target's tree-attention layers that own a KV cache
    (CUDA KV compaction); the drafter's layers and KV-sharing layers are left out."""
    state = engine_state(self)
    if state.cache_layers is None:
        from vllm.forward_context import get_forward_context

        from vllm_ddtree.attention.cuda import target_cache_layers

        state.cache_layers = target_cache_layers(
            get_forward_context().no_compile_layers,
            set(getattr(self.drafter, "_draft_attn_layer_names", ()) or ()))
    return state.cache_layers


@patch(_RUNNER, "GPUModelRunner._sample")
def _sample(original: Callable) -> Callable:
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        state = engine_state(self)
        if state is None or spec_decode_metadata is None:
            if state is not None:
                state.step = None
            return original(self, logits, spec_decode_metadata, *args, **kwargs)
        step, state.step = state.step, None
        from vllm.v1.outputs import SamplerOutput

        from vllm_ddtree.commit import commit_tree_step
        from vllm_ddtree.runners.v1.verify import verify_tree_step

        # Steps without any draft (e.g. all requests prefilling) also sample here, so every
        # token of a DDTree engine goes through the same processing (min-p included).
        num_reqs = self.input_batch.num_reqs
        params = [self.requests[r].sampling_params for r in self.input_batch.req_ids[:num_reqs]]
        min_p = [getattr(p, "min_p", 0.0) or 0.0 for p in params]
        seeds = [p.seed for p in params]  # seeded tree rows: noise keyed by token position
        by_batch = {r.batch_index: r for r in step.requests} if step is not None else {}
        sampled, logprobs = verify_tree_step(
            logits, spec_decode_metadata.num_draft_tokens, by_batch,
            self.input_batch.sampling_metadata, self.sampler, min_p if any(min_p) else None,
            seeds if any(s is not None for s in seeds) else None,
        )
        if step is None:
            return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)
        hybrid_ctx, state.hybrid_ctx = state.hybrid_ctx, None
        with self.drafter.ddtree_figures.timed("kv_compaction"):
            commit_tree_step(step, hybrid_ctx)
        self.drafter.observe_verified(step)  # ddtree_budget="auto" learns what was accepted
        committed = self.optimistic_seq_lens_cpu[: self.input_batch.num_reqs].clone()
        for r in step.requests:
            committed[r.batch_index] = r.context_len + len(r.accepted)
        state.committed_max = int(committed.max())
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    return _sample


@patch(_RUNNER, "GPUModelRunner._bookkeeping_sync", cpu_only=True)
def _bookkeeping_sync(original: Callable) -> Callable:
    def _bookkeeping_sync(self, *args, **kwargs):
        state = engine_state(self)
        saved = {} if state is None else state.discarded_generators
        if not saved:
            return original(self, *args, **kwargs)
        state.discarded_generators = {}
        generators = self.input_batch.generators
        for i, (gen, gen_state) in saved.items():
            gen.set_state(gen_state)  # the discarded draw undone
            generators.pop(i)  # hidden from vLLM's offset rewind, which CPU generators refuse
        try:
            return original(self, *args, **kwargs)
        finally:
            generators.update({i: gen for i, (gen, _) in saved.items()})

    return _bookkeeping_sync
