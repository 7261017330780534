"""TEST-ONLY: a Qwen3-Next whose recurrent layers are of a class the hybrid guard does not know.

Registered by :func:`tests.support.hybrid_models.register_unknown_recurrent_model`; the
layers keep GatedDeltaNet's math, only their type is new, which is what the guard keys on.
"""

from __future__ import annotations

from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM


class TestOnlyRecurrentLayer(QwenGatedDeltaNetAttention):
    """A recurrent layer kind unknown to the hybrid guard (test-only)."""


class UnknownRecurrentForCausalLM(Qwen3NextForCausalLM):
    """Qwen3-Next with every GatedDeltaNet layer retyped as :class:`TestOnlyRecurrentLayer`."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        for module in self.modules():
            if type(module) is QwenGatedDeltaNetAttention:
                module.__class__ = TestOnlyRecurrentLayer
