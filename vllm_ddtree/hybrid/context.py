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
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from vllm_ddtree.hybrid.oracle import (
    Advance,
    RecurrentTreeLayout,
    build_recurrent_layout,
    commit_conv_buffer,
    commit_single_tokens,
    commit_states,
    conv_window_index,
)


@dataclass
class RecurrentRecord:
    """What one recurrent layer call needs to commit the accepted paths after verification.

    The forward writes no vLLM state block or conv column of a multi-token sequence (its nodes
    live in a level scratch); :meth:`commit` writes the accepted path's.

    Attributes:
        layout: the speculative rows' trees and slots.
        width: conv kernel width W (0 without a conv part).
        conv_buf: ``[slots, dim, W - 1 + K']`` the layer's conv cache (a view), or ``None``
            when this record is only the recurrent state (Mamba2 runs conv and SSM apart).
        prior: ``[N, dim, W - 1]`` the committed conv windows read in the forward.
        conv_inputs: ``[T, dim]`` the call's pre-conv inputs (a copy: vLLM's Triton conv
            overwrites its input).
        states: ``[slots, ...]`` the layer's recurrent-state cache (a view), or ``None``.
        advance: the layer call's replay of a layout in a level scratch (it holds the call's
            recurrent inputs), see :data:`~vllm_ddtree.hybrid.oracle.Advance`.
        done: sequence indices already committed (one token: nothing to verify).
    """

    layout: RecurrentTreeLayout
    width: int = 0
    conv_buf: torch.Tensor | None = None
    prior: torch.Tensor | None = None
    conv_inputs: torch.Tensor | None = None
    states: torch.Tensor | None = None
    advance: Advance | None = None
    done: frozenset[int] = frozenset()

    def commit(self, paths: Mapping[int, Sequence[int]],
               chains: RecurrentTreeLayout | None = None) -> None:
        """Write the accepted paths (sequence index -> ``[0, n_1 … n_a]``) into vLLM's conv
        buffer and state blocks (:func:`~vllm_ddtree.hybrid.oracle.commit_conv_buffer`,
        :func:`~vllm_ddtree.hybrid.oracle.commit_states`); ``chains``: the paths' replay
        layout, when the caller shares it between records of one layout."""
        if self.conv_buf is not None:
            commit_conv_buffer(self.conv_buf, self.layout, self.prior, self.conv_inputs, paths)
        if self.states is not None:
            commit_states(self.states, self.layout, paths, self.advance, chains)


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
        fresh_rows: input-batch rows of requests with no computed tokens before this step.
            vLLM's scheduler pads a one-token prompt with placeholder drafts (to keep decode
            batches uniform) and such a row reaches the speculative path; its state blocks
            hold a finished request's state, so the oracle starts it from zeros, as a prefill.
    """

    tree_parents: dict[int, torch.Tensor]
    records: list[RecurrentRecord] = field(default_factory=list)
    cache: dict[Any, Any] = field(default_factory=dict)
    gdn_call: tuple[Any, Any] | None = None
    fresh_rows: frozenset[int] = frozenset()

    @classmethod
    def for_step(cls, tree_parents: dict[int, torch.Tensor],
                 num_computed_tokens: Any) -> "HybridTreeContext":
        """The context of one target forward: ``num_computed_tokens`` ``[num_reqs]`` (numpy,
        before this step) marks the fresh rows."""
        fresh = frozenset(int(b) for b in (num_computed_tokens == 0).nonzero()[0])
        return cls(tree_parents, fresh_rows=fresh)

    def record(self, rec: RecurrentRecord, scratch: torch.Tensor | None = None) -> None:
        """Keep ``rec`` for the commit after verification, committing its one-token sequences
        now (their path ``[0]`` needs no verification; steps without drafts have no commit).

        Args:
            scratch: the forward's level scratch of ``rec.states`` (required with states).
        """
        single = {n: [0] for n, q in enumerate(rec.layout.seq_lens) if q == 1}
        if rec.conv_buf is not None:
            commit_conv_buffer(rec.conv_buf, rec.layout, rec.prior, rec.conv_inputs, single)
        if rec.states is not None:
            commit_single_tokens(rec.states, rec.layout, scratch)
        rec.done = frozenset(single)
        self.records.append(rec)

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
            layout = build_recurrent_layout(*build(), self.tree_parents, self.fresh_rows)
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
