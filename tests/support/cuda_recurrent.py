"""Test-only: run the CUDA code path of vLLM's recurrent layers inside a CPU engine.

On a GPU, vLLM's GatedDeltaNet layer runs ``forward_cuda`` (its core ``_forward_core`` calls the
Triton ``causal_conv1d_update`` / ``causal_conv1d_fn`` and the FLA Triton recurrence kernels),
and the Mamba2 mixer calls the Triton ``causal_conv1d_update`` and the Triton SSU backend. On
this CPU machine vLLM picks ``forward_cpu`` and binds the CPU kernels instead. :func:`install`
switches a CPU process to the CUDA choices, so the plugin's CUDA oracle
(:mod:`vllm_ddtree.hybrid.gdn_cuda`, :mod:`vllm_ddtree.hybrid.mamba2`) runs through vLLM's
Triton kernels, interpreted (``TRITON_INTERPRET=1``, :mod:`tests.support.v2_cpu`):

* every ``QwenGatedDeltaNetAttention`` dispatches to ``forward_cuda`` (plain decode rows through
  the fused GDN update, not the packed FLA decode kernel);
* the GDN module's and the Mamba2 mixer's ``causal_conv1d_update`` are vLLM's Triton op (the
  CPU build replaces it at import; the Triton definition is rebuilt from the module's source);
  the prefill conv ``causal_conv1d_fn`` stays the CPU build's (its Triton kernel does not run
  under the interpreter);
* the Mamba2 SSU dispatch returns vLLM's ``TritonSSUBackend``.

Prefill is not the oracle's and stays off Triton where the interpreter cannot run vLLM's kernels:
GDN prefill takes the CPU build's conv and :func:`chunk_gated_delta_rule_torch` in place of the
FLA chunk kernels; Mamba2 prefill takes vLLM's CPU kernels. Target-only engines in
the same process take the same kernels, so greedy outputs are compared like for like.

Triton's interpreter (3.x) rejects the int64 mask that ``_causal_conv1d_update_kernel`` builds
(``(coord < num_cache_lines) & …``, an int1 on GPUs); masked loads and stores get the mask as
bool here, which is what the compiled kernel computes.

Must run in the worker process before the plugin installs its patches (it rebinds the module
globals those patches wrap): :mod:`tests.support.v2_run` calls it first when a spec has
``"cuda_recurrent": true``. Slow: tiny models and few tokens only.
"""

from __future__ import annotations

from typing import Any

_INSTALLED = False


def _bool_masks() -> None:
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder

    def as_bool(handle):
        if handle is None or handle.data.dtype == np.bool_:
            return handle
        return interpreter.TensorHandle(handle.data.astype(np.bool_), handle.dtype)

    load, store = builder.create_masked_load, builder.create_masked_store

    def create_masked_load(self, ptrs, mask, other, *args, **kwargs):
        return load(self, ptrs, as_bool(mask), other, *args, **kwargs)

    def create_masked_store(self, ptrs, value, mask, *args, **kwargs):
        return store(self, ptrs, value, as_bool(mask), *args, **kwargs)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store


def _first_config_only() -> None:
    """Autotuned kernels (vLLM's FLA chunk kernels, GDN prefill) run their first config: the
    stand-in backend cannot benchmark, and timings mean nothing interpreted."""
    from triton.runtime.autotuner import Autotuner

    prune = Autotuner.prune_configs

    def prune_configs(self, kwargs):
        return prune(self, kwargs)[:1]

    Autotuner.prune_configs = prune_configs


def _register_binds_triton_conv() -> None:
    """The register expects the CPU build's conv where the GDN module and the mixer import it
    on CPU; in this process they hold the Triton op, as on CUDA."""
    from vllm_ddtree import integration

    for module in ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
                   "vllm.model_executor.layers.mamba.mamba_mixer2"):
        change = integration.get(f"{module}:causal_conv1d_update")
        change.platform_signatures = {}


def chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_state, output_final_state,
                                 cu_seqlens=None, scale=None, core_attn_out=None, **_ignored):
    """Torch stand-in for vLLM's FLA ``chunk_gated_delta_rule`` (GDN prefill), whose Triton
    kernels do not run under the interpreter: the same recurrence token by token, in fp32.

    Args:
        q, k: ``[1, T, H, K]`` (already L2-normalised by vLLM); v: ``[1, T, HV, V]``;
        g: ``[1, T, HV]`` log decay; beta: ``[1, T, HV]``; initial_state: ``[N, HV, V, K]``;
        cu_seqlens: ``[N + 1]``.

    Returns:
        ``(o [1, T, HV, V] in q's dtype, final_state [N, HV, V, K] fp32)``.
    """
    import torch

    HV, K = v.shape[2], q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    rep = HV // q.shape[2]
    qf = q[0].float().repeat_interleave(rep, dim=1) * scale
    kf = k[0].float().repeat_interleave(rep, dim=1)
    vf, gf, bf = v[0].float(), g[0].float(), beta[0].float()
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, q.shape[1]]
    o = torch.empty_like(vf)
    final = initial_state.float().clone()
    for n in range(len(bounds) - 1):
        h = final[n]  # [HV, V, K]
        for t in range(bounds[n], bounds[n + 1]):
            h = h * torch.exp(gf[t])[:, None, None]
            delta = (vf[t] - torch.einsum("hvk,hk->hv", h, kf[t])) * bf[t][:, None]
            h = h + delta[:, :, None] * kf[t][:, None, :]
            o[t] = torch.einsum("hvk,hk->hv", h, qf[t])
        final[n] = h
    o = o.unsqueeze(0).to(q.dtype)
    if core_attn_out is not None:
        core_attn_out.reshape(-1)[: o.numel()].copy_(o.reshape(-1))
    return o, final if output_final_state else None


def triton_conv_ops() -> dict[str, Any]:
    """vLLM's Triton ``causal_conv1d_fn`` / ``causal_conv1d_update``, which a CPU build of
    ``vllm/model_executor/layers/mamba/ops/causal_conv1d.py`` replaces at its end."""
    import vllm.model_executor.layers.mamba.ops.causal_conv1d as cc

    source = open(cc.__file__).read()
    cut = source.rindex("if current_platform.is_cpu():")
    namespace: dict[str, Any] = {"__name__": cc.__name__ + "_triton"}
    exec(compile(source[:cut], cc.__file__, "exec"), namespace)
    return {n: namespace[n] for n in ("causal_conv1d_fn", "causal_conv1d_update")}


def install() -> None:
    """Switch this process's recurrent layers to their CUDA code path (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    _bool_masks()
    _first_config_only()
    _register_binds_triton_conv()
    conv = triton_conv_ops()

    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer2
    import vllm.model_executor.layers.mamba.ops.ssu_dispatch as ssu

    gdn.causal_conv1d_update = conv["causal_conv1d_update"]
    gdn.fla_chunk_gated_delta_rule = chunk_gated_delta_rule_torch
    mixer2.causal_conv1d_update = conv["causal_conv1d_update"]

    init = gdn.QwenGatedDeltaNetAttention.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._forward_method = self.forward_cuda
        # The packed FLA decode kernel does not run interpreted: plain decode rows take the
        # fused GDN update instead (vLLM's path with VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=0).
        self.enable_packed_recurrent_decode = False

    gdn.QwenGatedDeltaNetAttention.__init__ = __init__

    backend: list[Any] = []

    def get_mamba_ssu_backend():
        if not backend:  # the engine's MambaConfig, from the CPU backend vLLM initialised
            backend.append(ssu.TritonSSUBackend(ssu._mamba_ssu_backend._mamba_config))
        return backend[0]

    ssu.get_mamba_ssu_backend = get_mamba_ssu_backend
