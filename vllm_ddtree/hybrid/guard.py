"""The hybrid guard: a recurrent layer never runs a draft tree it cannot run exactly.

Checked at start-up on the loaded target (:meth:`DDTreeProposer.load_model`), on the layer
classes themselves rather than on architecture names, so a new model that reuses a supported
layer works and one that brings another recurrent kind stops with a clear error.
"""

from __future__ import annotations

import logging
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


#: Platforms whose recurrent kernels the oracle is wired into (CPU: vLLM's C++ ops; CUDA:
#: vLLM's Triton ops, :mod:`vllm_ddtree.hybrid.gdn_cuda` and :mod:`vllm_ddtree.hybrid.mamba2`).
ORACLE_PLATFORMS = ("cpu", "cuda")


def check_recurrent_layers(model: Any, hybrid_mode: str, platform: str) -> list[str]:
    """Refuse a target whose recurrent layers the tree oracle cannot run.

    Args:
        model: the loaded target ``nn.Module``.
        hybrid_mode: ``ddtree_hybrid`` (``"oracle"`` or ``"shadow_linear"``).
        platform: ``"cpu"``, ``"cuda"`` or another vLLM platform name.

    Returns:
        the recurrent layer kinds found (e.g. ``["GatedDeltaNet"]``), empty for a pure
        attention target.

    Raises:
        DDTreeConfigError: in ``"oracle"`` mode, a recurrent layer of a kind not in
            :data:`SUPPORTED_RECURRENT_LAYERS`, or any recurrent layer on a platform outside
            :data:`ORACLE_PLATFORMS` (ROCm, XPU: vLLM runs other GDN kernels there).
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
    if kinds and platform not in ORACLE_PLATFORMS:
        raise DDTreeConfigError(
            f"speculative method 'ddtree' runs the recurrent tree oracle ({sorted(kinds)}) on "
            f"{' and '.join(ORACLE_PLATFORMS)} only, not on {platform!r}; {way_out}"
        )
    return sorted(kinds)


def fit_recurrent_state_shapes(model: Any, state_tokens: int) -> int:
    """Size the conv windows of ``model``'s recurrent layers for DDTree's state layout.

    vLLM's GatedDeltaNet and Mamba2 layers size their conv state ``[dim, W - 1 + num_spec]``
    from ``num_spec`` (``num_speculative_tokens``, ``max(B, L)`` for DDTree;
    ``vllm/model_executor/layers/mamba/gdn/base.py``, ``mamba_mixer2.py``), and their only other
    use of it is ``num_spec > 0`` (and ReplaySSM, which DDTree does not use). The tree oracle
    writes at most ``L + 1`` accepted inputs after the committed window, so ``num_spec`` is set
    to ``state_tokens`` (``DDTreeConfig.num_recurrent_state_blocks``) before vLLM asks the
    layers for their KV-cache spec; the page size is computed for the same width (the
    ``Platform._align_hybrid_block_size`` patch).

    Args:
        model: the loaded target ``nn.Module``.
        state_tokens: the speculative tokens a layer's conv window holds.

    Returns:
        the number of layers changed.
    """
    changed = 0
    for _, layer in recurrent_layers(model):
        if (_qualified(type(layer)) in SUPPORTED_RECURRENT_LAYERS
                and getattr(layer, "num_spec", 0) > state_tokens):
            layer.num_spec = state_tokens
            changed += 1
    return changed


def hybrid_cudagraph_mode(vllm_config: Any, hybrid_mode: str, platform: str | None = None) -> bool:
    """Keep full CUDA graphs away from a hybrid target's recurrent layers (CUDA, oracle mode).

    The tree oracle lays out each step's trees in Python inside the recurrent layers' cores
    (``vllm::qwen_gdn_attention_core``, ``vllm::mamba_mixer2``): a full graph of a decode batch
    would replay the trees of the capture. Those cores are splitting ops of vLLM's piecewise
    graphs (``CompilationConfig._attention_ops``), so under ``PIECEWISE`` they run eagerly
    every step while the rest of the model stays in graphs. A mode with full graphs
    (``FULL_AND_PIECEWISE``, vLLM's default; ``FULL_DECODE_ONLY``) becomes ``PIECEWISE`` here,
    before the runner resolves its graph sizes, as vLLM's runners themselves downgrade modes an
    attention backend cannot capture.

    Args:
        vllm_config: the engine's config; ``compilation_config.cudagraph_mode`` changes in place.
        hybrid_mode: ``ddtree_hybrid``.
        platform: default :func:`vllm_ddtree.integration.platform_name`.

    Returns:
        True if the mode was changed (logged).
    """
    from vllm.config.compilation import CUDAGraphMode

    from vllm_ddtree.integration import platform_name

    cc = vllm_config.compilation_config
    mode = cc.cudagraph_mode
    platform = platform_name() if platform is None else platform
    if (platform != "cuda" or hybrid_mode != "oracle" or mode is None
            or not mode.has_full_cudagraphs()):
        return False
    cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    logging.getLogger("vllm.ddtree").info(
        "DDTree: cudagraph_mode %s -> PIECEWISE for the hybrid target (its recurrent layers "
        "verify draft trees outside CUDA graphs)", mode.name)
    return True
