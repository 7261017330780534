"""The monkeypatches of vLLM internals, bound to their register entries: version-fenced and
idempotent.

vLLM 0.32 has no hook for a new speculative method, for tree verification or for KV compaction
(``../shared/research/vllm-integration.md`` §3.4–3.5), so DDTree wraps these methods. Each wrapper
falls through to vLLM's original unchanged unless DDTree is configured for the engine
(``additional_config["ddtree"]``), so plain vLLM use in the same process is untouched.

Front end (process that builds the config / accepts requests):
  * ``EngineArgs.create_speculative_config``: ``{"method": "ddtree", ...}`` -> vLLM's ``dflash``
    config + ``additional_config["ddtree"]`` (:func:`vllm_ddtree.config.translate_speculative_config`).
  * ``InputProcessor._validate_params``: refuse sampling options DDTree cannot honour exactly;
    let min-p through (vLLM refuses it for chain speculative decoding only).
  * ``EngineArgs.create_engine_config``: the tree-attention backend (``TRITON_ATTN`` on CUDA) is
    selected, a user-named other one refused (:mod:`vllm_ddtree.attention.selection`).
  * ``Scheduler.make_spec_decoding_stats`` (engine core) and ``PrometheusStatLogger.__init__``:
    spec-decode counters per tree depth, sized by the drafter horizon L
    (:mod:`vllm_ddtree.metrics`).
Worker (Model Runner V2: the primary adapter, :mod:`vllm_ddtree.runners.v2`):
  * ``init_speculator``, ``resolve_model_state_cls``, ``GPUModelRunner.initialize_kv_cache``:
    V2's speculator, model-state and KV-cache seams pointed at the DDTree speculator.
Model Runner V1 (vLLM 0.32/0.33): its hooks live in the legacy adapter,
:mod:`vllm_ddtree.runners.v1.hooks`, loaded with this module only where V1 exists.
Hybrid targets: vLLM's recurrent kernels (CPU and CUDA) and state shapes, stepped over the tree
as the sequential oracle (:mod:`vllm_ddtree.hybrid`).

Each patch is an entry of the register (:mod:`vllm_ddtree.integration`, kind ``"patch"``): the
:func:`patch` decorator binds the wrapper to that entry (or adds the entry from its ``why`` and
``signatures`` arguments).
:func:`apply_patches` is called by the plugin in every process; it first checks the whole register
against the installed vLLM (:func:`vllm_ddtree.integration.verify_installed`: a supported version,
every target present with the recorded signature) and patches nothing otherwise, in which case the
plugin installs only :func:`apply_version_guard` so that a ``ddtree`` request fails with that
error.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import logging
from typing import Any, Callable, Iterator

import torch

from vllm_ddtree import integration
from vllm_ddtree.config import (
    ADDITIONAL_CONFIG_KEY,
    AUTO_BUDGET,
    DEFAULT_MAX_BUDGET,
    DDTreeConfigError,
    check_recurrent_kernels,
    check_tree_fits_step,
    draft_concurrency_warning,
    get_ddtree_config,
    translate_speculative_config,
)
# Re-exported: the version fence lives with the register.
from vllm_ddtree.integration import (  # noqa: F401
    UnsupportedVLLMVersion,
    check_vllm_version,
    installed_vllm_version,
)

# A child of vLLM's logger, so our messages use vLLM's handlers and VLLM_LOGGING_LEVEL.
logger = logging.getLogger("vllm.ddtree")

_MARK = "__vllm_ddtree_patch__"


def patch(
    module: str, qualname: str, cpu_only: bool = False, *, why: str | None = None,
    signatures: dict[str, str | None] | None = None,
) -> Callable[[Callable[[Callable], Callable]], Callable]:
    """Bind ``make_wrapper(original) -> wrapper`` for ``module.qualname`` (``Class.method``) to
    its register entry; :func:`apply_patches` installs it.

    ``cpu_only`` patches are installed on the CPU platform only (they wrap CPU kernels). A
    target not yet listed in :data:`vllm_ddtree.integration.REGISTER` gets an entry from
    ``why`` and ``signatures`` (supported vLLM version -> expected signature); without them
    the install check fails naming the target (see
    :func:`vllm_ddtree.integration.bind_patch`).

    Raises:
        KeyError: the target is registered with another kind.
        ValueError: ``cpu_only`` disagrees with the entry, the target is patched twice, or it
            is declared twice.
    """

    def deco(make_wrapper: Callable[[Callable], Callable]) -> Callable:
        integration.bind_patch(module, qualname, make_wrapper, cpu_only, why=why,
                               signatures=signatures)
        return make_wrapper

    return deco


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _install(module: str, qualname: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    owner: Any = importlib.import_module(module)
    *path, attr = qualname.split(".")
    for p in path:
        owner = getattr(owner, p)
    original = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    if original is None:
        raise UnsupportedVLLMVersion(f"vLLM has no {module}.{qualname} to patch")
    bound = isinstance(original, classmethod)  # wrapped as the function, re-bound after
    func = original.__func__ if bound else original
    if getattr(func, _MARK, False):
        return False  # idempotent: already ours
    wrapper = make_wrapper(func)
    functools.update_wrapper(wrapper, func)
    setattr(wrapper, _MARK, True)
    setattr(owner, attr, classmethod(wrapper) if bound else wrapper)
    return True


def apply_patches() -> int:
    """Check the register against the installed vLLM, then install every bound patch once per
    process; returns how many were new.

    Raises:
        UnsupportedVLLMVersion: the installed vLLM is not a supported version, or a register
            entry is missing or has another signature (nothing is patched then).
        KeyError: a ``"patch"`` entry of the register has no wrapper bound.
    """
    integration.verify_installed()
    platform = "cpu" if _on_cpu() else "cuda"
    version = integration.installed_vllm_version()
    count = 0
    for change in integration.entries("patch"):
        if platform not in change.platforms or not change.present(version, platform):
            continue  # another platform's, or gone in this vLLM (V1's in 0.34)
        if change.make_wrapper is None:
            raise KeyError(f"register entry {change.target} has no patch bound to it")
        count += _install(change.module, change.qualname, change.make_wrapper)
    return count


def apply_version_guard(error: UnsupportedVLLMVersion) -> bool:
    """When the plugin cannot install: only make a ``ddtree`` request fail, with ``error``
    (plain vLLM use stays untouched). Returns whether the guard was newly installed."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.__dict__["create_speculative_config"]
    if getattr(original, _MARK, False):
        return False

    def create_speculative_config(self, *args, **kwargs):
        if _wants_ddtree(self):
            raise UnsupportedVLLMVersion(str(error))
        return original(self, *args, **kwargs)

    functools.update_wrapper(create_speculative_config, original)
    setattr(create_speculative_config, _MARK, True)
    EngineArgs.create_speculative_config = create_speculative_config
    return True


# --------------------------------------------------------------------------- front end


def check_target_supported(target_model_config: Any) -> None:
    """Target checks at start-up (the recurrent-layer guard runs on the loaded model, see
    :func:`vllm_ddtree.hybrid.guard.check_recurrent_layers`).

    Raises:
        DDTreeConfigError: the target uses M-RoPE (tree positions are 1-D).
    """
    if getattr(target_model_config, "uses_mrope", False):
        raise DDTreeConfigError(
            "speculative method 'ddtree' does not support M-RoPE targets (tree positions are 1-D)"
        )


def check_hybrid_prefix_caching(engine_args: Any, target_model_config: Any) -> None:
    """Hybrid targets: prefix caching is switched off (with a warning naming the option).

    With speculative decoding vLLM caches a hybrid request's recurrent state per block from a
    chain slot (``mamba_cache_mode="align"``), not the accepted path's, and on CPU that path
    needs a Triton kernel the CPU lacks (it dies deep in the engine). vLLM has already resolved
    its default by the time this runs (``EngineArgs.create_engine_config``, before the cache
    config is built), so an explicit ``True`` cannot be told from the default.
    """
    if not getattr(target_model_config, "is_hybrid", False):
        return
    if getattr(engine_args, "enable_prefix_caching", None):
        logger.warning(
            "DDTree: enable_prefix_caching is switched off for the hybrid target %s (the cached "
            "recurrent state must be the accepted path's)",
            getattr(target_model_config, "architectures", None))
    engine_args.enable_prefix_caching = False


def _wants_ddtree(engine_args: Any) -> bool:
    spec = engine_args.speculative_config
    return getattr(engine_args, "spec_method", None) == "ddtree" or (
        isinstance(spec, dict) and spec.get("method") == "ddtree")


@patch("vllm.engine.arg_utils", "EngineArgs.create_engine_config")
def _create_engine_config(original: Callable) -> Callable:
    def create_engine_config(self, *args, **kwargs):
        if _wants_ddtree(self):
            from vllm_ddtree.attention.selection import (
                check_tree_attention_backend,
                current_platform_name,
            )

            check_tree_attention_backend(self, current_platform_name())
            if self.enable_prefix_caching is not False:
                check_hybrid_prefix_caching(self, self.create_model_config())
            spec = self.speculative_config if isinstance(self.speculative_config, dict) else {}
            budget = spec.get("ddtree_budget")
            if budget == AUTO_BUDGET:  # the slots are sized by the largest tree auto may choose
                budget = ("ddtree_max_budget", spec.get("ddtree_max_budget", DEFAULT_MAX_BUDGET))
            try:
                config = original(self, *args, **kwargs)
            except ValueError as e:
                ours = _ddtree_error_in(e) or _slots_error_in(e, budget)
                if ours is None:
                    raise
                raise ours from None
            ddtree = get_ddtree_config(config)
            if ddtree is not None:  # the scheduler limits are final only now
                check_recurrent_kernels(ddtree, config.cache_config.use_replayssm)
                sched = config.scheduler_config
                version = installed_vllm_version()
                for message in (
                        check_tree_fits_step(ddtree, sched.max_num_batched_tokens, version),
                        draft_concurrency_warning(ddtree, sched.max_num_batched_tokens,
                                                  sched.max_num_seqs, version)):
                    if message:
                        logger.warning("%s", message)
            return config
        return original(self, *args, **kwargs)

    return create_engine_config


def _ddtree_error_in(error: ValueError) -> DDTreeConfigError | None:
    """Our own error inside pydantic's ``ValidationError`` (``VllmConfig`` wraps what its
    ``__post_init__`` raises), so that the user sees a ``DDTreeConfigError``."""
    errors = getattr(error, "errors", None)
    if not callable(errors):
        return None
    for item in errors():
        inner = (item.get("ctx") or {}).get("error")
        if isinstance(inner, DDTreeConfigError):
            return inner
    return None


def _slots_error_in(error: ValueError, budget: Any) -> DDTreeConfigError | None:
    """vLLM's own "not enough slots" check (``VllmConfig``: ``max_num_batched_tokens`` below the
    tokens one speculative step schedules per request) fails before the plugin can check the
    budget against vLLM's *default* token budget: say which option that is."""
    text = str(error)
    if "enough slots" not in text:
        return None
    key, value = budget if isinstance(budget, tuple) else ("ddtree_budget", budget)
    vllm_says = next((ln.strip() for ln in text.splitlines() if "enough slots" in ln), text)
    return DDTreeConfigError(
        f"speculative_config['{key}']={value!r} does not fit in one scheduler step: "
        f"DDTree verifies max({key}, num_speculative_tokens) + 1 tokens per request and "
        f"step; lower {key} or raise max_num_batched_tokens (vLLM: "
        f"{vllm_says})")


@patch("vllm.engine.arg_utils", "EngineArgs.create_speculative_config")
def _create_speculative_config(original: Callable) -> Callable:
    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = dict(self.speculative_config or {})
        if spec.get("method") != "ddtree" and getattr(self, "spec_method", None) != "ddtree":
            return original(self, target_model_config, target_parallel_config)
        # vLLM's top-level aliases (--spec-method/--spec-model/--spec-tokens), merged as vLLM does.
        for attr, key in (("spec_method", "method"), ("spec_model", "model"),
                          ("spec_tokens", "num_speculative_tokens")):
            value = getattr(self, attr, None)
            if value is None:
                continue
            if key in spec:
                raise DDTreeConfigError(
                    f"--{attr.replace('_', '-')} and --speculative-config['{key}'] "
                    "are mutually exclusive"
                )
            spec[key] = value
            setattr(self, attr, None)

        vllm_spec, ddtree = translate_speculative_config(
            spec,
            vocab_size=target_model_config.get_vocab_size(),
            max_num_batched_tokens=getattr(self, "max_num_batched_tokens", None),
            vllm_version=installed_vllm_version(),
        )
        check_target_supported(target_model_config)
        if self.async_scheduling:
            raise DDTreeConfigError(
                "async_scheduling=True is not supported with speculative method 'ddtree' "
                "(tree positions need the committed length of every request)"
            )
        self.async_scheduling = False
        if getattr(self, "logits_processors", None):
            raise DDTreeConfigError(
                "logits_processors are not supported with speculative method 'ddtree' (their "
                "per-request state cannot be mapped onto draft-tree nodes)"
            )
        logprobs_mode = getattr(self, "logprobs_mode", "raw_logprobs")
        if logprobs_mode not in ("raw_logprobs", "raw_logits"):
            raise DDTreeConfigError(
                f"logprobs_mode={logprobs_mode!r} is not supported with speculative method "
                "'ddtree' (supported: 'raw_logprobs', 'raw_logits')"
            )
        extra = dict(self.additional_config or {})
        if ADDITIONAL_CONFIG_KEY in extra and extra[ADDITIONAL_CONFIG_KEY] != ddtree.to_dict():
            raise DDTreeConfigError(
                f"additional_config['{ADDITIONAL_CONFIG_KEY}'] is set by the plugin from "
                "speculative_config; do not set it by hand"
            )
        extra[ADDITIONAL_CONFIG_KEY] = ddtree.to_dict()
        self.additional_config = extra
        self.speculative_config = vllm_spec
        logger.info("DDTree: node budget B=%s, drafter horizon L=%d, drafter %s",
                    f"auto (1..{ddtree.budget})" if ddtree.auto_budget else ddtree.budget,
                    ddtree.drafter_horizon, ddtree.drafter)
        return original(self, target_model_config, target_parallel_config)

    return create_speculative_config


@patch("vllm.v1.engine.input_processor", "InputProcessor._validate_params")
def _validate_params(original: Callable) -> Callable:
    def _validate_params(self, params, *args, **kwargs):
        from vllm import SamplingParams

        if isinstance(params, SamplingParams) and get_ddtree_config(self.vllm_config):
            from vllm_ddtree.verify import validate_sampling_params

            validate_sampling_params(params)
            if params.min_p:
                # vLLM refuses min-p under any speculative decoding because its rejection
                # sampler ignores it on draft rows; DDTree applies vLLM's min-p processor at
                # every node (vllm_ddtree.verify), so only that check is skipped.
                min_p, params.min_p = params.min_p, 0.0
                try:
                    return original(self, params, *args, **kwargs)
                finally:
                    params.min_p = min_p
        return original(self, params, *args, **kwargs)

    return _validate_params


@patch("vllm.v1.core.sched.scheduler", "Scheduler.make_spec_decoding_stats")
def _make_spec_decoding_stats(original: Callable) -> Callable:
    def make_spec_decoding_stats(self, spec_decoding_stats, num_draft_tokens,
                                 num_accepted_tokens, num_invalid_spec_tokens, request_id):
        ddtree = get_ddtree_config(self.vllm_config)
        if ddtree is None:
            return original(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens,
                            num_invalid_spec_tokens, request_id)
        if not self.log_stats or not num_draft_tokens:
            # vLLM returns None here, dropping what earlier requests of the step recorded.
            return spec_decoding_stats
        from vllm_ddtree.metrics import carry_figures, observe_tree

        # Per-depth counters sized by L, not vLLM's max(B, L) slots (structured outputs, the
        # only source of invalid drafts, are refused for DDTree).
        stats = observe_tree(spec_decoding_stats, ddtree.drafter_horizon, num_draft_tokens,
                             num_accepted_tokens)
        if spec_decoding_stats is None:  # the step's stats: they carry the worker's figures
            carry_figures(stats, self.__dict__.pop("_ddtree_figures", None))
        return stats

    return make_spec_decoding_stats


@patch("vllm.v1.core.sched.scheduler", "Scheduler.update_from_output")
def _update_from_output(original: Callable) -> Callable:
    def update_from_output(self, scheduler_output, model_runner_output):
        from vllm_ddtree.metrics import OUTPUT_ATTR, merge_figures

        figures = getattr(model_runner_output, OUTPUT_ATTR, None)
        if figures:  # kept until a step's spec-decode stats can carry them to the front end
            self._ddtree_figures = merge_figures(getattr(self, "_ddtree_figures", None), figures)
        return original(self, scheduler_output, model_runner_output)

    return update_from_output


@patch("vllm.v1.worker.gpu_worker", "Worker.sample_tokens")
def _worker_sample_tokens(original: Callable) -> Callable:
    def sample_tokens(self, grammar_output, *args, **kwargs):
        from vllm_ddtree.metrics import attach_figures, worker_figures

        output = original(self, grammar_output, *args, **kwargs)
        figures = worker_figures(self.model_runner)
        return output if figures is None else attach_figures(output, figures)

    return sample_tokens


@patch("vllm.v1.metrics.loggers", "PrometheusStatLogger.__init__")
def _prometheus_stat_logger_init(original: Callable) -> Callable:
    def __init__(self, vllm_config, engine_indexes=None):
        ddtree = get_ddtree_config(vllm_config)
        if ddtree is not None:
            from vllm_ddtree.metrics import HorizonView

            base = type(self)._spec_decoding_cls

            def per_depth(speculative_config, *args, **kwargs):
                return base(HorizonView(speculative_config, ddtree.drafter_horizon),
                            *args, **kwargs)

            # This logger only: vLLM's per-position counters, one per tree depth 1..L.
            self._spec_decoding_cls = per_depth
        original(self, vllm_config, engine_indexes)

    return __init__


# --------------------------------------------------------------------------- hybrid targets


@patch("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_spec_forward", cpu_only=True)
def _gdn_spec_forward(original: Callable) -> Callable:
    def _spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                      ssm_state, width, state_len):
        from vllm_ddtree.hybrid.context import active_hybrid_context

        ctx = active_hybrid_context()
        if ctx is None:
            return original(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec, conv_buf,
                            ssm_state, width, state_len)
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

        from vllm_ddtree.hybrid.gdn_cpu import tree_spec_forward

        return tree_spec_forward(ctx, layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec,
                                 conv_buf, ssm_state, width,
                                 gdn_attention._unpacked_conv_weight(layer))

    return _spec_forward


#: While vLLM sizes a DDTree engine's Mamba page from the model config (before the layers
#: exist; the layers' own windows are set by ``hybrid.guard.fit_recurrent_state_shapes``): the
#: speculative tokens its conv windows hold (``DDTreeConfig.num_recurrent_state_blocks``).
_CONV_SPEC_TOKENS: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "ddtree_conv_spec_tokens", default=None)


@contextlib.contextmanager
def _recurrent_state_shapes_of(vllm_config: Any) -> Iterator[None]:
    """Within: vLLM's state-shape calculators size conv windows for ``vllm_config``'s DDTree
    engine (``W - 1 + L`` in oracle mode), not for its ``num_speculative_tokens``."""
    ddtree = get_ddtree_config(vllm_config)
    token = _CONV_SPEC_TOKENS.set(None if ddtree is None else ddtree.num_recurrent_state_blocks)
    try:
        yield
    finally:
        _CONV_SPEC_TOKENS.reset(token)


def _conv_spec_tokens(num_spec: int) -> int:
    limit = _CONV_SPEC_TOKENS.get()
    return num_spec if limit is None else min(num_spec, limit)


@patch("vllm.model_executor.layers.mamba.abstract", "MambaBase.get_kv_cache_spec")
def _recurrent_state_blocks(original: Callable) -> Callable:
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        ddtree = get_ddtree_config(vllm_config)
        blocks = getattr(spec, "num_speculative_blocks", None)
        if ddtree is None or blocks is None or blocks <= ddtree.num_recurrent_state_blocks:
            return spec
        return dataclasses.replace(spec, num_speculative_blocks=ddtree.num_recurrent_state_blocks)

    return get_kv_cache_spec


@patch("vllm.platforms.interface", "Platform._align_hybrid_block_size")
def _hybrid_page_size(original: Callable) -> Callable:
    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        with _recurrent_state_shapes_of(vllm_config):  # the Mamba page of W - 1 + L windows
            return original(cls, vllm_config, backend_cls)

    return _align_hybrid_block_size


_SHAPES = "vllm.model_executor.layers.mamba.mamba_utils"


@patch(_SHAPES, "MambaStateShapeCalculator.gated_delta_net_state_shape")
def _gdn_state_shape(original: Callable) -> Callable:
    def gated_delta_net_state_shape(cls, tp_world_size, num_k_heads, num_v_heads, head_k_dim,
                                    head_v_dim, conv_kernel_size, num_spec=0):
        return original(cls, tp_world_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                        conv_kernel_size, _conv_spec_tokens(num_spec))

    return gated_delta_net_state_shape


@patch(_SHAPES, "MambaStateShapeCalculator.mamba2_state_shape")
def _mamba2_state_shape(original: Callable) -> Callable:
    def mamba2_state_shape(cls, tp_world_size, intermediate_size, n_groups, num_heads, head_dim,
                           state_size, conv_kernel, num_spec=0):
        return original(cls, tp_world_size, intermediate_size, n_groups, num_heads, head_dim,
                        state_size, conv_kernel, _conv_spec_tokens(num_spec))

    return mamba2_state_shape


@patch("vllm.v1.attention.backends.mamba_attn",
       "BaseMambaAttentionMetadataBuilder._compute_common_metadata")
def _padded_prompt_rows(original: Callable) -> Callable:
    def _compute_common_metadata(self, common_attn_metadata, *, num_accepted_tokens=None,
                                 num_decode_draft_tokens_cpu=None):
        m = common_attn_metadata
        if (num_decode_draft_tokens_cpu is not None and m.is_prefilling is not None
                and _oracle_engine(self.vllm_config)):
            # vLLM's scheduler pads a one-token prompt with placeholder drafts; vLLM sends such
            # a row to its prefill kernels when the request is new, which fold the placeholders
            # into the state. As a speculative row it goes through the tree oracle (from a zero
            # state, HybridTreeContext.fresh_rows) and only the accepted path is committed.
            query_lens = torch.diff(m.query_start_loc_cpu)
            n = min(len(query_lens), len(num_decode_draft_tokens_cpu), len(m.is_prefilling))
            padded = torch.zeros_like(m.is_prefilling)
            drafts = num_decode_draft_tokens_cpu[:n]
            padded[:n] = (m.is_prefilling[:n] & (drafts > 0) & (query_lens[:n] == drafts + 1)
                          & (m.seq_lens_cpu_upper_bound[:n] <= query_lens[:n]))
            if bool(padded.any()):
                m = m.replace(is_prefilling=m.is_prefilling & ~padded)
        return original(self, m, num_accepted_tokens=num_accepted_tokens,
                        num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu)

    return _compute_common_metadata


def _oracle_engine(vllm_config: Any) -> bool:
    ddtree = get_ddtree_config(vllm_config)
    return ddtree is not None and ddtree.hybrid == "oracle"


@contextlib.contextmanager
def _target_only_conv_choice() -> Iterator[None]:
    """Make vLLM's speculative-aware CPU GDN prefill pick the conv kernel target-only picks.

    vLLM's non-speculative CPU GDN path runs the C++ causal conv wherever the CPU has BF16 dot
    products (``_cpu_gdn_attention_nonspec``: ``use_cpp_conv``); its speculative-aware path asks
    for AMX tiles instead (``_spec_aware_nonspec``: ``can_use_native_conv``) and otherwise falls
    back to a torch conv whose bf16 rounding differs, so a DDTree prefill would not match
    target-only decoding bit for bit. Both call the same C++ kernel, which handles the wide
    speculative conv buffer; only the predicate is aligned, and only for steps without
    speculative rows: in a step that mixes prefills with speculative rows
    (``_spec_aware_nonspec_subset``) the C++ path gives wrong prefill outputs here, so vLLM's
    torch conv stays (equal up to bf16 rounding).
    """
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    if not (torch.cpu._is_avx512_bf16_supported() or gdn_attention.is_arm_bf16()):
        yield
        return
    with integration.swapped("torch.cpu", "_is_amx_tile_supported", lambda: True):
        yield


def _gdn_prefill(original: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context

        if active_hybrid_context() is None:
            return original(*args, **kwargs)
        with _target_only_conv_choice():
            return original(*args, **kwargs)

    return wrapper


patch("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_spec_aware_nonspec",
      cpu_only=True)(_gdn_prefill)


_MIXER2 = "vllm.model_executor.layers.mamba.mamba_mixer2"


@patch(_MIXER2, "causal_conv1d_update")
def _mamba2_conv_update(original: Callable) -> Callable:
    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.mamba2 import is_speculative_call, tree_conv_update

        ctx = active_hybrid_context()
        indices = kwargs.get("conv_state_indices")
        if ctx is None or args or not is_speculative_call(indices):
            return original(x, conv_state, weight, bias, activation, *args, **kwargs)
        return tree_conv_update(ctx, original, x, conv_state, weight, bias, activation, indices,
                                kwargs["num_accepted_tokens"], kwargs["query_start_loc"])

    return causal_conv1d_update


@patch(_MIXER2, "selective_state_update")
def _mamba2_state_update(original: Callable) -> Callable:
    def selective_state_update(state, x, dt, A, B, C, D=None, dt_bias=None, *args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.mamba2 import is_speculative_call, tree_state_update

        ctx = active_hybrid_context()
        indices = kwargs.get("state_batch_indices")
        if ctx is None or args or not is_speculative_call(indices) or kwargs.get("z") is not None:
            return original(state, x, dt, A, B, C, D, dt_bias, *args, **kwargs)
        kw = dict(kwargs)
        for k in ("state_batch_indices", "dst_state_batch_indices", "out", "num_accepted_tokens",
                  "cu_seqlens", "dt_softplus", "z"):
            kw.pop(k, None)
        return tree_state_update(ctx, original, state, x, dt, A, B, C, D, dt_bias,
                                 kwargs.get("dt_softplus", False), indices, kwargs["out"],
                                 kwargs["num_accepted_tokens"], kwargs["cu_seqlens"], **kw)

    return selective_state_update


# GatedDeltaNet on CUDA (``QwenGatedDeltaNetAttention.forward_cuda``): the core publishes its
# layer for the two Triton kernels it calls on speculative rows, and vLLM's fused MTP op (which
# would run those rows as a chain inside one CUDA op) is never chosen during a DDTree step.

_QWEN_GDN = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"


@patch(_QWEN_GDN, "QwenGatedDeltaNetAttention._forward_core")
def _gdn_forward_core(original: Callable) -> Callable:
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.gdn_cuda import gdn_layer_call

        ctx = active_hybrid_context()
        if ctx is None:
            return original(self, mixed_qkv, b, a, core_attn_out)
        with gdn_layer_call(ctx, self):
            return original(self, mixed_qkv, b, a, core_attn_out)

    return _forward_core


@patch(_QWEN_GDN, "QwenGatedDeltaNetAttention._can_use_fused_gdn_mtp_decode")
def _gdn_no_fused_mtp(original: Callable) -> Callable:
    def _can_use_fused_gdn_mtp_decode(self, attn_metadata):
        from vllm_ddtree.hybrid.context import active_hybrid_context

        if active_hybrid_context() is not None:
            return False
        return original(self, attn_metadata)

    return _can_use_fused_gdn_mtp_decode


@patch(_QWEN_GDN, "causal_conv1d_update")
def _gdn_conv_update(original: Callable) -> Callable:
    def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.gdn_cuda import is_speculative_call, tree_conv_update

        ctx = active_hybrid_context()
        if (ctx is None or ctx.gdn_call is None or args
                or not is_speculative_call(kwargs.get("num_accepted_tokens"))):
            return original(x, conv_state, weight, bias, activation, *args, **kwargs)
        return tree_conv_update(ctx, original, x, conv_state, weight, bias, activation)

    return causal_conv1d_update


@patch(_QWEN_GDN, "fused_sigmoid_gating_delta_rule_update")
def _gdn_recurrent_update(original: Callable) -> Callable:
    def fused_sigmoid_gating_delta_rule_update(*args, **kwargs):
        from vllm_ddtree.hybrid.context import active_hybrid_context
        from vllm_ddtree.hybrid.gdn_cuda import is_speculative_call, tree_gated_delta_update

        ctx = active_hybrid_context()
        if (ctx is None or ctx.gdn_call is None or args
                or not is_speculative_call(kwargs.get("num_accepted_tokens"))):
            return original(*args, **kwargs)
        return tree_gated_delta_update(ctx, original, **kwargs)

    return fused_sigmoid_gating_delta_rule_update


# --------------------------------------------------------------------------- Model Runner V2
# V2 (``vllm/v1/worker/gpu/``) builds its speculator and the target's model state through two
# factory functions; DDTree engines get :mod:`vllm_ddtree.runners.v2`'s classes from them.

_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"


@patch(_V2_RUNNER, "init_speculator")
def _v2_init_speculator(original: Callable) -> Callable:
    def init_speculator(vllm_config, device, *args, **kwargs):
        if get_ddtree_config(vllm_config) is None:
            return original(vllm_config, device, *args, **kwargs)
        from vllm_ddtree.runners.v2 import DDTreeSpeculator

        return DDTreeSpeculator(vllm_config, device)

    return init_speculator


@patch("vllm.v1.worker.gpu.model_states", "resolve_model_state_cls")
def _v2_resolve_model_state_cls(original: Callable) -> Callable:
    def resolve_model_state_cls(vllm_config, model, *args, **kwargs):
        cls = original(vllm_config, model, *args, **kwargs)
        if get_ddtree_config(vllm_config) is None:
            return cls
        from vllm_ddtree.runners.v2 import ddtree_model_state_cls

        return ddtree_model_state_cls(cls)

    return resolve_model_state_cls


@patch(_V2_RUNNER, "GPUModelRunner.initialize_kv_cache")
def _v2_initialize_kv_cache(original: Callable) -> Callable:
    def initialize_kv_cache(self, *args, **kwargs):
        original(self, *args, **kwargs)
        spec = getattr(self, "speculator", None)
        if getattr(spec, "controller", None) is None:
            return  # not a DDTree engine, or a fixed budget
        from vllm_ddtree.runners.v2 import DDTreeSpeculator, DDTreeVerificationBudget

        if not isinstance(spec, DDTreeSpeculator):
            return
        if self.adaptive_verification is not None:
            raise DDTreeConfigError(
                "speculative_config['enable_adaptive_verification'] cannot be combined with "
                "ddtree_budget='auto' (auto sizes each request's tree itself)")
        self.adaptive_verification = DDTreeVerificationBudget(
            spec, self.input_buffers.query_start_loc, self.decode_query_len, self.device,
            admitted_counts=integration.installed_vllm_version() != "0.32.0")
        logger.info("DDTree auto budget (Model Runner V2): each request verifies its own "
                    "tree's rows of the %d V2 schedules", self.decode_query_len - 1)

    return initialize_kv_cache


# --------------------------------------------------------------------------- Model Runner V1
# The legacy adapter's hooks bind themselves to the register on import; only where vLLM still has
# V1 (0.32/0.33), so that nothing of V1 is loaded on 0.34.
if installed_vllm_version() in integration.LEGACY_V1_VERSIONS:
    integration.legacy_v1("hooks")
