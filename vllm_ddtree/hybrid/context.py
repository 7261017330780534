"""The per-step channel between the DDTree runner hooks and the recurrent-layer oracle.

Published by the runner hook for the duration of a hybrid target's forward (every step of a
DDTree engine, also steps without drafts: vLLM's own speculative recurrent path is replaced for
all speculative rows, see :mod:`vllm_ddtree.hybrid.oracle`). Outside that window — other
engines in the process, the drafter, dummy runs — the patched layer functions behave exactly as
vLLM's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from vllm_ddtree.hybrid.oracle import RecurrentTreeLayout, build_recurrent_layout, conv_window_index


@dataclass
class RecurrentRecord:
    """What one recurrent layer wrote this step, for the re-layout after verification.

    Attributes:
        conv_buf: ``[slots, dim, W - 1 + K]`` the layer's conv cache (a view), or ``None``
            when this record is only the recurrent state (Mamba2 runs conv and SSM apart).
        states: ``[slots, ...]`` the layer's recurrent-state cache (a view), or ``None``.
        layout: the speculative rows' trees and slots.
        width: conv kernel width W.
    """

    conv_buf: torch.Tensor | None
    states: torch.Tensor | None
    layout: RecurrentTreeLayout
    width: int


@dataclass
class HybridTreeContext:
    """Trees of this step by input-batch row, and what the recurrent layers recorded.

    Attributes:
        tree_parents: ``batch_index -> [n + 1]`` long parents of each request that verifies a
            draft tree (not a chain); every other speculative row is run as a chain.
        records: one :class:`RecurrentRecord` per recurrent layer call of the forward.
        cache: per-step memo (layouts and conv window indices shared by layers).
        gdn_call: ``(layer, GDNAttentionMetadata)`` of the GatedDeltaNet layer whose CUDA core
            (``_forward_core``) is running, or ``None`` (see :mod:`vllm_ddtree.hybrid.gdn_cuda`).
    """

    tree_parents: dict[int, torch.Tensor]
    records: list[RecurrentRecord] = field(default_factory=list)
    cache: dict[Any, Any] = field(default_factory=dict)
    gdn_call: tuple[Any, Any] | None = None

    def layout(self, key: Any, build: Callable[[], tuple], width: int | None = None,
               keep: Any = None) -> tuple[RecurrentTreeLayout, torch.Tensor | None]:
        """The step's layout of one recurrent metadata object, memoised under ``key``.

        Layers of one KV-cache group share their metadata, so the layout (host work) is built
        once per step.

        Args:
            key: identifies the metadata (ids or data pointers).
            build: returns the arguments ``(seq_lens, batch_index, state_indices,
                num_accepted)`` of :func:`~vllm_ddtree.hybrid.oracle.build_recurrent_layout`;
                called on the first use of ``key`` only.
            width: conv width W, for the conv window index.
            keep: objects that make up ``key``, held for the step (ids stay unique).

        Returns:
            ``(layout, index)``: ``index`` is :func:`~vllm_ddtree.hybrid.oracle.conv_window_index`
            for ``width`` (``None`` without a width).
        """
        hit = self.cache.get(key)
        if hit is None:
            layout = build_recurrent_layout(*build(), self.tree_parents)
            hit = self.cache[key] = (layout, {}, keep)
        layout, windows, _ = hit
        if width is None:
            return layout, None
        if width not in windows:
            windows[width] = conv_window_index(layout, width)
        return layout, windows[width]


_ACTIVE: HybridTreeContext | None = None


@contextlib.contextmanager
def hybrid_tree_active(ctx: HybridTreeContext | None) -> Iterator[None]:
    """Publish ``ctx`` to the recurrent-layer oracle for the enclosed target forward."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, ctx
    try:
        yield
    finally:
        _ACTIVE = prev


def active_hybrid_context() -> HybridTreeContext | None:
    """The hybrid context of the DDTree target forward now running, or ``None``."""
    return _ACTIVE


def publish_hybrid_context(ctx: HybridTreeContext | None) -> None:
    """Publish ``ctx`` (``None``: none) until the next call, for runners whose target forward
    the plugin cannot wrap (Model Runner V2: published in ``ModelState.prepare_inputs`` of a
    real step, cleared at verification and before every attention-metadata build)."""
    global _ACTIVE
    _ACTIVE = ctx
