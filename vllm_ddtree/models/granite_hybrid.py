"""GraniteMoeHybrid (Granite-4) with the EAGLE3 auxiliary-hidden-state interface DFlash needs.

vLLM 0.32's ``GraniteMoeHybridForCausalLM`` does not implement ``SupportsEagle3``, so
``speculative_config={"method": "dflash", ...}`` stops with "Model does not support EAGLE3
interface" (``vllm/v1/worker/gpu_model_runner.py`` ``_setup_eagle3_aux_hidden_state_outputs``).
:class:`GraniteMoeHybridEagle3ForCausalLM` adds it:

* the CausalLM class also derives from ``SupportsEagle3`` (``set_aux_hidden_state_layers`` and
  ``get_eagle3_default_aux_hidden_state_layers`` are the interface's defaults, which act on
  ``self.model``);
* after vLLM's ``__init__`` builds the decoder, its class is switched to
  :class:`GraniteMoeHybridEagle3Model`, which adds ``EagleModelMixin`` (the aux-layer bookkeeping)
  and a ``forward`` that also returns ``(hidden_states, aux_hidden_states)`` when aux layers are set.
  Switching the class (rather than building a second decoder) keeps vLLM's construction, weight
  names, static forward context and ``@support_torch_compile`` state untouched: the compile wrapper
  reads ``type(self).forward`` at call time.

The decoder ``forward`` is replicated (about 20 lines of vLLM's ``GraniteMoeHybridModel.forward``)
because its layer loop has no hook point, and forward hooks would hand the aux tensors out by side
effect, which vLLM's torch.compile / CUDA-graph capture does not preserve. The aux hidden state "at
layer i" is the residual stream entering layer i (0 = scaled embeddings), as in vLLM's Llama/Qwen
and Nemotron-H models; Granite decoder layers return the stream already summed, so nothing is added
to it. Without aux layers the forward computes exactly what vLLM's does (same ops, same order).
"""

from __future__ import annotations

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM, GraniteMoeHybridModel
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
from vllm.sequence import IntermediateTensors

from vllm_ddtree import integration


class GraniteMoeHybridEagle3Model(GraniteMoeHybridModel, EagleModelMixin):
    """vLLM's Granite decoder plus aux hidden-state outputs (installed by class switch, never built)."""

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            hidden_states *= self.embedding_multiplier
            residual = None
        else:
            if intermediate_tensors is None:
                raise RuntimeError("Intermediate tensors may not be None!")
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]

        aux_hidden_states = self._maybe_add_hidden_state([], 0, hidden_states, None)
        for idx, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions=positions, hidden_states=hidden_states, residual=residual)
            # Granite layers return the full residual stream in hidden_states (residual is internal).
            self._maybe_add_hidden_state(aux_hidden_states, idx + 1, hidden_states, None)

        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})

        hidden_states = self.norm(hidden_states)
        if aux_hidden_states:
            return hidden_states, aux_hidden_states
        return hidden_states


class GraniteMoeHybridEagle3ForCausalLM(GraniteMoeHybridForCausalLM, SupportsEagle3):
    """``GraniteMoeHybridForCausalLM`` that supports EAGLE3-style aux hidden states (DFlash, EAGLE3)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if type(self.model) is not GraniteMoeHybridModel:  # pragma: no cover - a vLLM change
            raise TypeError(f"expected vLLM's GraniteMoeHybridModel, got {type(self.model).__name__}")
        integration.switch_class(self.model, GraniteMoeHybridEagle3Model)
