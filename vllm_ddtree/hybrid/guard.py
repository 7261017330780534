"""The hybrid guard: a recurrent layer never runs a draft tree it cannot run exactly.

Checked at start-up on the loaded target (:meth:`DDTreeProposer.load_model`), on the layer
classes themselves rather than on architecture names, so a new model that reuses a supported
layer works and one that brings another recurrent kind stops with a clear error.
"""

from __future__ import annotations

from typing import Any, Iterable

from vllm_ddtree.config import DDTreeConfigError

#: vLLM layer classes the tree oracle runs exactly, by ``module:qualname`` -> kind.
SUPPORTED_RECURRENT_LAYERS = {
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:QwenGatedDeltaNetAttention":
        "GatedDeltaNet",
    "vllm.model_executor.layers.mamba.mamba_mixer2:MambaMixer2": "Mamba2",
}


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def recurrent_layers(model: Any) -> Iterable[tuple[str, Any]]:
    """``(name, module)`` of every recurrent layer (vLLM's ``MambaBase``) in ``model``."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    for name, module in model.named_modules():
        if isinstance(module, MambaBase):
            yield name, module


def check_recurrent_layers(model: Any, hybrid_mode: str, on_cpu: bool) -> list[str]:
    """Refuse a target whose recurrent layers the tree oracle cannot run.

    Args:
        model: the loaded target ``nn.Module``.
        hybrid_mode: ``ddtree_hybrid`` (``"oracle"`` or ``"shadow_linear"``).
        on_cpu: the oracle is wired into vLLM's CPU recurrent kernels only.

    Returns:
        the recurrent layer kinds found (e.g. ``["GatedDeltaNet"]``), empty for a pure
        attention target.

    Raises:
        DDTreeConfigError: in ``"oracle"`` mode, a recurrent layer of a kind not in
            :data:`SUPPORTED_RECURRENT_LAYERS`, or any recurrent layer on a non-CPU platform.
            The message names the layer type and the way out (``shadow_linear``).
    """
    kinds: dict[str, str] = {}
    unknown: dict[str, str] = {}
    for name, module in recurrent_layers(model):
        q = _qualified(type(module))
        if q in SUPPORTED_RECURRENT_LAYERS:
            kinds.setdefault(SUPPORTED_RECURRENT_LAYERS[q], name)
        else:
            unknown.setdefault(type(module).__name__, name)
    if hybrid_mode == "shadow_linear":
        return sorted(kinds) + sorted(unknown)
    way_out = ("set speculative_config['ddtree_hybrid']='shadow_linear' (verifies the tree's "
               "top-1 chain only, exact like DFlash) or use method 'dflash'")
    if unknown:
        listed = ", ".join(f"{t} (e.g. {n})" for t, n in sorted(unknown.items()))
        raise DDTreeConfigError(
            f"speculative method 'ddtree' cannot verify draft trees through the recurrent "
            f"layer type {listed}: the sequential tree oracle supports "
            f"{sorted(set(SUPPORTED_RECURRENT_LAYERS.values()))} only; {way_out}"
        )
    if kinds and not on_cpu:
        raise DDTreeConfigError(
            f"speculative method 'ddtree' runs the recurrent tree oracle ({sorted(kinds)}) on "
            f"vLLM's CPU kernels only in this version; {way_out}"
        )
    return sorted(kinds)
