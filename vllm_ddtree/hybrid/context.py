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
from typing import Any, Iterator

import torch

from vllm_ddtree.hybrid.oracle import RecurrentTreeLayout


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
    """

    tree_parents: dict[int, torch.Tensor]
    records: list[RecurrentRecord] = field(default_factory=list)
    cache: dict[Any, Any] = field(default_factory=dict)


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
