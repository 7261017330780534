"""Front-end patches (the process that builds the engine config and accepts requests): the
``ddtree`` speculative config, backend selection, start-up refusals and request checks."""

from __future__ import annotations

from typing import Any, Callable

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
from vllm_ddtree.patches import logger, patch


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


def wants_ddtree(engine_args: Any) -> bool:
    """Whether ``engine_args`` ask for speculative method ``ddtree``."""
    spec = engine_args.speculative_config
    return getattr(engine_args, "spec_method", None) == "ddtree" or (
        isinstance(spec, dict) and spec.get("method") == "ddtree")


@patch("vllm.engine.arg_utils", "EngineArgs.create_engine_config")
def _create_engine_config(original: Callable) -> Callable:
    def create_engine_config(self, *args, **kwargs):
        if wants_ddtree(self):
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
                version = integration.installed_vllm_version()
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
            vllm_version=integration.installed_vllm_version(),
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
                # every node (the runners' verification), so only that check is skipped.
                min_p, params.min_p = params.min_p, 0.0
                try:
                    return original(self, params, *args, **kwargs)
                finally:
                    params.min_p = min_p
        return original(self, params, *args, **kwargs)

    return _validate_params
