"""The legacy V1 adapter's register entries: everything of vLLM it patches or uses that only
Model Runner V1 needs (:mod:`vllm_ddtree.integration` adds them to its ``REGISTER`` when this
package is present).

Every entry in a module of :data:`V1_MODULES` is :data:`~vllm_ddtree.changes.ABSENT` in vLLM
0.34, which deleted them: the checks then require the target *not* to exist there.
"""

from __future__ import annotations

from vllm_ddtree.changes import (
    ABSENT,
    Change,
    attributes as _attrs,
    both,
    entry as _c,
    until_033,
)

#: Model Runner V1's modules that vLLM 0.34 deleted: every entry in them is absent in 0.34.
V1_MODULES = (
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu_input_batch",
    "vllm.v1.spec_decode.dflash", "vllm.v1.spec_decode.metadata", "vllm.v1.sample.sampler",
    "vllm.v1.sample.metadata", "vllm.v1.sample.logits_processor",
    "vllm.v1.sample.logits_processor.builtin",
)

_RUNNER = "vllm.v1.worker.gpu_model_runner"
_BATCH = "vllm.v1.worker.gpu_input_batch"
_DFLASH = "vllm.v1.spec_decode.dflash"
_SAMPLER = "vllm.v1.sample.sampler"
_H, _PR, _VR = ("vllm_ddtree/runners/v1/hooks.py", "vllm_ddtree/runners/v1/proposer.py",
                "vllm_ddtree/runners/v1/verify.py")
_CPU = ("cpu",)

CHANGES: list[Change] = [
    _c("vllm.config.vllm:VllmConfig._validate_v1_model_runner", "patch",
       "vLLM calls it exactly when the engine will run Model Runner V1, while the front end "
       "builds the VllmConfig: a drafter only V2 can run (mixed sliding/full attention) is "
       "refused there with a DDTreeConfigError saying how to get V2. Gone with V1 in 0.34.",
       until_033("(self)"), _H),
    _c(f"{_RUNNER}:GPUModelRunner.__init__", "patch",
       "Builds DDTreeProposer where vLLM builds DFlashProposer and allocates the CUDA tree-mask "
       "buffers before any CUDA-graph capture.",
       both("(self, vllm_config, device)"), _H),
    _c(f"{_RUNNER}:GPUModelRunner._input_fits_in_drafter", "patch",
       "vLLM sizes the drafter check by num_speculative_tokens = max(B, L) on top of all B "
       "drafts accepted; the next DFlash block only has to fit past what was committed.",
       both("(self, common_attn_metadata)"), _H),
    _c(f"{_RUNNER}:GPUModelRunner._prepare_inputs", "patch",
       "Lays this step's draft trees onto vLLM's token batch (runners/v1/step.py: plan_tree_step).",
       both("(self, scheduler_output, num_scheduled_tokens)"), _H),
    _c(f"{_RUNNER}:GPUModelRunner._model_forward", "patch",
       "Depth positions in the positions buffer, tree attention active, tree masks published "
       "(CUDA), slot mappings and tapped hidden states captured, hybrid tree context.",
       both("(self, input_ids=None, positions=None, intermediate_tensors=None, "
            "inputs_embeds=None, **model_kwargs)"), _H),
    _c(f"{_RUNNER}:GPUModelRunner._sample", "patch",
       "Tree verification instead of vLLM's rejection sampler, then KV compaction, the drafter "
       "context of the accepted path and the recurrent-state re-layout.",
       both("(self, logits, spec_decode_metadata)"), _H),
    _c(f"{_RUNNER}:GPUModelRunner._bookkeeping_sync", "patch",
       "A seeded request's sample discarded during a chunked prefill is undone by restoring "
       "its CPU generator's state (saved in _prepare_inputs): vLLM rewinds it with "
       "Generator.set_offset, which a CPU generator refuses (RuntimeError 'CPU Generator does "
       "not use offset' kills the engine).",
       both("(self, scheduler_output, sampler_output, logits, hidden_states, "
            "num_scheduled_tokens)"), _H, _CPU),
    _c(f"{_RUNNER}:GPUModelRunner._ddtree", "instance attribute",
       "The V1 adapter's per-engine state (state.V1EngineState, None without DDTree), set in "
       "__init__ and read by every hook; a new attribute vLLM ignores.",
       both(None), _H),
    _c(f"{_RUNNER}:DFlashProposer", "global swap",
       "The runner module's DFlashProposer name is DDTreeProposer while the patched "
       "GPUModelRunner.__init__ calls vLLM's (so vLLM's own drafter set-up builds the DDTree "
       "proposer), then restored.",
       both(None), _H),
    _c("vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor", "bare instance",
       "Built through __new__ with min_p / min_p_count set per tree-node row, so vLLM's own "
       "min-p processing applies at every node (vLLM does not build it under speculative "
       "decoding).",
       both(None), _VR),
    _c("vllm.v1.outputs:SamplerOutput", "dependency",
       "What the _sample patch returns (sampled_token_ids, logprobs_tensors).",
       both(None), _H),
    _c("vllm.v1.outputs:LogprobsTensors", "dependency",
       "Logprobs of the emitted tokens, as vLLM's rejection sampler returns them.",
       both(None), _VR),
    _c("vllm.v1.sample.logits_processor:LogitsProcessors.__init__", "dependency",
       "Per-node logits processors (min-p) handed to vLLM's sampler.",
       both("(self, logitsprocs=None)"), _VR),
    _c(f"{_SAMPLER}:Sampler.sample", "dependency",
       "Samples every tree node from its processed distribution (temperature, top-k/p, min-p, "
       "seeds) as target-only decoding does.",
       both("(self, logits, sampling_metadata, logprobs_mode_override=None)"), _VR),
    _c(f"{_SAMPLER}:Sampler.greedy_sample", "dependency",
       "The target's argmax at every node for greedy batches.",
       both("(logits)"), _VR),
    _c(f"{_SAMPLER}:Sampler.compute_logprobs", "dependency",
       "Logprobs of the emitted tokens.",
       both("(logits)"), _VR),
    _c(f"{_SAMPLER}:Sampler.gather_logprobs", "dependency",
       "Top-k logprobs of the emitted tokens.",
       both("(logprobs, num_logprobs, token_ids)"), _VR),
    _c("vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor.apply", "dependency",
       "vLLM's min-p filter, applied with per-node thresholds.",
       both("(self, logits)"), _VR),
    _c(f"{_DFLASH}:DFlashProposer", "dependency",
       "DDTreeProposer subclasses vLLM's DFlash drafter (context K/V from tapped target hidden "
       "states, one block pass), so vLLM's isinstance checks hold.",
       both(None), _PR),
    _c(f"{_DFLASH}:DFlashProposer.__init__", "dependency",
       "Called by DDTreeProposer.__init__ with (vllm_config, device, runner).",
       both("(self, vllm_config, device, runner=None)"), _PR),
    _c(f"{_DFLASH}:DFlashProposer.load_model", "dependency",
       "Overridden: the hybrid guard runs on the loaded target, then vLLM's load.",
       both("(self, target_model)"), _PR),
    _c(f"{_DFLASH}:DFlashProposer.propose", "dependency",
       "Overridden: vLLM's pass with L mask tokens, then one draft tree per request.",
       both("(self, num_speculative_tokens, target_token_ids, target_positions, "
            "target_hidden_states, next_token_ids, token_indices_to_sample, "
            "common_attn_metadata, sampling_metadata, mm_embed_inputs=None, "
            "num_rejected_tokens_gpu=None, slot_mappings=None)"), _PR),
    _c(f"{_DFLASH}:DFlashProposer._sample_draft_tokens", "dependency",
       "Overridden: keeps the drafter logits [R*L, V] the trees are built from.",
       both("(self, hidden_states, sampling_metadata)"), _PR),
    *_attrs(f"{_RUNNER}:GPUModelRunner",
            "drafter input_batch requests query_start_loc positions device sampler "
            "optimistic_seq_lens_cpu effective_drafter_max_model_len "
            "use_aux_hidden_state_outputs discard_request_mask",
            "Read by the runner patches: the batch layout, the positions buffer the model "
            "reads (tree depths written in place), the drafter and its length limit, the sampler.",
            _H),
    *_attrs(f"{_BATCH}:InputBatch", "req_ids num_reqs num_computed_tokens_cpu sampling_metadata",
            "The step's requests, their committed lengths and sampling state.", _H),
    *_attrs(f"{_BATCH}:InputBatch", "generators",
            "Seeded requests' generators (batch index -> torch.Generator): the states of those "
            "whose sample this step discards are saved and restored on CPU.", _H, _CPU),
    *_attrs("vllm.v1.utils:CpuGpuBuffer", "np",
            "The host view of the runner's discard_request_mask (partial prefills this step).",
            _H, _CPU),
    *_attrs(f"{_BATCH}:CachedRequestState", "sampling_params output_token_ids",
            "Per-request min-p and seed, and the tokens the shadow_linear measurement walks.",
            _PR),
    _c(f"{_RUNNER}:GPUModelRunner._get_draft_token_ids_cpu", "dependency",
       "Relied on, not called: with ddtree_budget='auto' the proposer returns one list of node "
       "tokens per request (each tree its own size), which this method hands to the scheduler "
       "as is.",
       both("(self)"), _PR),
    *_attrs("vllm.v1.spec_decode.metadata:SpecDecodeMetadata", "num_draft_tokens",
            "Node rows per request in the target's logits.", _H),
    *_attrs("vllm.v1.attention.backend:CommonAttentionMetadata", "max_seq_len",
            "Drafter length check when no step was committed yet.", _H),
    *_attrs("vllm.forward_context:ForwardContext", "slot_mapping no_compile_layers",
            "KV slots of the tree rows, and the attention layers whose caches are compacted.", _H),
    *_attrs(f"{_DFLASH}:DFlashProposer", "model num_speculative_tokens",
            "The drafter model (logits), and the slot count vLLM's dummy runs read.", _PR),
    *_attrs(f"{_DFLASH}:DFlashProposer", "_draft_attn_layer_names",
            "The drafter's layers, left out of KV compaction.", _H),
    *_attrs("vllm.v1.sample.metadata:SamplingMetadata",
            "all_greedy temperature top_k top_p generators max_num_logprobs logprob_token_ids "
            "logitsprocs",
            "Expanded from requests to tree-node rows (dataclasses.replace) for vLLM's sampler.",
            _VR),
    *_attrs(f"{_SAMPLER}:Sampler", "logprobs_mode", "raw logits or raw logprobs.", _VR),
    *_attrs("vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor", "min_p min_p_count",
            "The state apply() reads, set by the plugin on the bare instance.", _VR),
    *_attrs("vllm.v1.sample.logits_processor:LogitsProcessors", "argmax_invariant",
            "Custom argmax-invariant processors are refused on tree rows.", _VR),
    *_attrs("vllm.sampling_params:SamplingParams", "seed",
            "A seeded request's tree-node noise is keyed by (seed, token position).", _H),
    *_attrs("vllm.config.speculative:SpeculativeConfig", "draft_model_config",
            "The drafter's ModelConfig (its hf_config.layer_types).", _H),
    *_attrs("vllm.v1.core.sched.output:SchedulerOutput",
            "scheduled_spec_decode_tokens num_scheduled_tokens",
            "Which requests carry draft trees this step, and how many rows each has.", _H),
    *_attrs("vllm.v1.core.sched.output:SchedulerOutput", "total_num_scheduled_tokens",
            "The rows of each step, for ddtree_budget='auto''s step-cost model.", _H),
]


def _absent_in_034(changes: list[Change]) -> None:
    """Model Runner V1 is deleted in vLLM 0.34: every entry in its modules is absent there."""
    for change in changes:
        if change.module in V1_MODULES and change.signatures.get("0.34.0") != ABSENT:
            change.signatures = {**change.signatures, "0.34.0": ABSENT}
            change.platform_signatures = {
                p: {**sigs, "0.34.0": ABSENT} for p, sigs in change.platform_signatures.items()}


_absent_in_034(CHANGES)
