"""vLLM model classes the plugin registers in place of vLLM's own (see :func:`register_models`)."""

from __future__ import annotations

#: Architecture name -> ``"module:Class"`` registered with vLLM's ``ModelRegistry`` (lazily imported).
MODEL_OVERRIDES: dict[str, str] = {
    "GraniteMoeHybridForCausalLM": "vllm_ddtree.models.granite_hybrid:GraniteMoeHybridEagle3ForCausalLM",
}


def register_models() -> None:
    """Register :data:`MODEL_OVERRIDES` with ``vllm.ModelRegistry`` (idempotent, imports no model code).

    Call it in every process that builds a model (the plugin's ``register()`` does): the string form
    is resolved lazily when vLLM first inspects or loads the architecture. Each is a
    ``"registration"`` entry of :mod:`vllm_ddtree.integration`.
    """
    from vllm_ddtree import integration

    for arch, target in MODEL_OVERRIDES.items():
        integration.register_model(arch, target)
