"""Model Runner V2 patches (the primary runner): V2 builds its speculator and the target's model
state through factory functions, which return :mod:`vllm_ddtree.runners.v2`'s classes for DDTree
engines."""

from __future__ import annotations

from typing import Callable

from vllm_ddtree import integration
from vllm_ddtree.config import DDTreeConfigError, get_ddtree_config
from vllm_ddtree.patches import logger, patch


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
