"""The sequential tree oracle for recurrent layers (GatedDeltaNet, Mamba2), as pure torch.

A recurrent layer advances one state in token order, so an attention mask cannot keep sibling
branches of a draft tree apart. Here every tree node ``t`` gets its own state,
``S_t = step(S_parent(t), x_t)`` (the root starts from the committed state), and its causal-conv
window is the inputs along its **ancestor path**, continuing into the committed conv state past
the root. Nodes of one tree depth are independent, so a layer runs one batched one-token step
per depth level (design: ``shared/research/vllm-integration.md`` §6.5).

Storage follows vLLM's speculative layout for hybrid models (``vllm/v1/kv_cache_interface.py``
``MambaSpec.num_speculative_blocks``; ``vllm/model_executor/layers/mamba/ops/cpu/
gdn_attention.py`` ``_spec_forward``), so vLLM's own bookkeeping (``num_accepted_tokens``, the
prefill path, preemption) stays valid:

* recurrent state: row ``t`` of a request's ``state_indices[K + 1]`` holds the state after node
  ``t``; a step starts from slot ``num_accepted - 1`` of the previous step;
* conv state: one rolling buffer per request (slot ``state_indices[0]``, ``[dim, W - 1 + K]``);
  a step reads its committed window at columns ``[num_accepted - 1, num_accepted - 1 + W - 1)``.

Our forward writes the buffer as ``[window[1:], x_0 … x_n]`` (node ``i`` at column ``W - 2 + i``);
after verification :func:`relayout_conv_buffer` / :func:`relayout_recurrent_state` move the
accepted path ``[0, n_1 … n_a]`` into chain order (column ``W - 2 + j`` ← node ``n_j``; slot ``a`` ←
slot ``n_a``), which is exactly what a chain of ``a`` accepted drafts would have left.

The ``*_reference`` steps are plain fp32 formulas of each layer kind, used by the tests as the
oracle that vLLM's kernels (and this module's tree walk) are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F


@dataclass
class RecurrentTreeLayout:
    """The draft trees of one recurrent layer call, flattened over its speculative rows.

    ``T`` tokens (all speculative rows of the call, sequence after sequence, node order inside
    a sequence) in ``N`` sequences.

    Attributes:
        seq_starts: ``[N]`` first token of each sequence.
        seq_lens: ``[N]`` tokens (tree nodes incl. the root) of each sequence.
        batch_index: ``[N]`` each sequence's row in the step's input batch.
        parents: ``[T]`` long, flat index of each token's parent, ``-1`` for a root.
        depths: ``[T]`` long, tree depth (root 0).
        levels: flat token indices of each depth, roots first; parents precede children.
        src_slots: ``[T]`` long, state slot holding the state *before* the token (the parent's
            slot, or the committed slot ``state_indices[n, num_accepted[n] - 1]`` for a root).
        dst_slots: ``[T]`` long, state slot receiving the state *after* the token
            (``state_indices[n, local index]``).
        conv_slots: ``[N]`` long, the conv buffer slot of each sequence (``state_indices[n, 0]``).
        read_offsets: ``[N]`` long, ``num_accepted - 1``: where the committed conv window starts.
        is_tree: ``[N]`` bool, False where the sequence is a plain chain.
    """

    seq_starts: list[int]
    seq_lens: list[int]
    batch_index: list[int]
    parents: torch.Tensor
    depths: torch.Tensor
    levels: list[torch.Tensor]
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    conv_slots: torch.Tensor
    read_offsets: torch.Tensor
    is_tree: list[bool]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_lens))


def build_recurrent_layout(
    seq_lens: Sequence[int],
    batch_index: Sequence[int],
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    tree_parents: Mapping[int, torch.Tensor],
) -> RecurrentTreeLayout:
    """Flatten the speculative rows of one layer call into a :class:`RecurrentTreeLayout`.

    Args:
        seq_lens: tokens of each speculative sequence (``spec_query_start_loc`` differences).
        batch_index: input-batch row of each sequence.
        state_indices: ``[N, K + 1]`` int, each sequence's state slots (vLLM's
            ``spec_state_indices_tensor`` / ``state_indices_tensor_d``).
        num_accepted: ``[N]`` int, vLLM's ``num_accepted_tokens`` (tokens committed by the
            previous step, ≥ 1).
        tree_parents: ``batch_index -> [n + 1]`` parents (``-1`` first) of the sequences that
            verify a draft tree; any other sequence is a chain.

    Returns:
        the layout (CPU tensors).

    Raises:
        RuntimeError: a tree's node count differs from the tokens vLLM scheduled for it, or a
            sequence has more tokens than state slots.
    """
    idx = state_indices.to("cpu", torch.long)
    acc = num_accepted.to("cpu", torch.long)
    parents, depths, src, dst, starts, is_tree = [], [], [], [], [], []
    start = 0
    for n, (q, b) in enumerate(zip(seq_lens, batch_index)):
        q = int(q)
        if q > idx.shape[1]:
            raise RuntimeError(
                f"DDTree hybrid: {q} tokens for a request with {idx.shape[1]} state slots")
        local = tree_parents.get(int(b))
        if local is not None and local.numel() != q:
            raise RuntimeError(
                f"DDTree hybrid: batch row {b} verifies a tree of {local.numel()} nodes but "
                f"the recurrent layer sees {q} tokens")
        is_tree.append(local is not None)
        if local is None:
            local = torch.arange(-1, q - 1)
        local = local.to("cpu", torch.long)
        d = torch.zeros(q, dtype=torch.long)
        for t in range(1, q):
            d[t] = d[local[t]] + 1
        row = idx[n, :q]
        committed = idx[n, int(acc[n]) - 1]
        src.append(torch.where(local >= 0, row[local.clamp(min=0)], committed))
        dst.append(row)
        parents.append(torch.where(local >= 0, local + start, local))
        depths.append(d)
        starts.append(start)
        start += q
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
    depth = cat(depths)
    num_levels = int(depth.max()) + 1 if depth.numel() else 0
    return RecurrentTreeLayout(
        seq_starts=starts,
        seq_lens=[int(q) for q in seq_lens],
        batch_index=[int(b) for b in batch_index],
        parents=cat(parents),
        depths=depth,
        levels=[torch.nonzero(depth == lv).flatten() for lv in range(num_levels)],
        src_slots=cat(src),
        dst_slots=cat(dst),
        conv_slots=idx[:, 0].clone() if idx.numel() else torch.zeros(0, dtype=torch.long),
        read_offsets=acc[: len(seq_lens)] - 1,
        is_tree=is_tree,
    )


def conv_window_index(layout: RecurrentTreeLayout, width: int) -> torch.Tensor:
    """Where each token's ``W - 1`` conv inputs come from, oldest first.

    Returns:
        ``[T, W - 1]`` long into the source rows of :func:`gather_conv_windows`: ``< T`` is a
        token of this call (an ancestor), ``T + n * (W - 1) + c`` is column ``c`` of sequence
        ``n``'s committed window.
    """
    T, m = layout.num_tokens, width - 1
    parents = layout.parents.tolist()
    seq_of = [n for n, q in enumerate(layout.seq_lens) for _ in range(q)]
    out = torch.empty(T, m, dtype=torch.long)
    for t in range(T):
        cur, back = parents[t], 0
        for c in range(m - 1, -1, -1):  # nearest ancestor last
            if cur >= 0:
                out[t, c] = cur
                cur = parents[cur]
            else:
                back += 1
                out[t, c] = T + seq_of[t] * m + (m - back)
    return out


def gather_conv_windows(x: torch.Tensor, prior: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The conv inputs before each token along its ancestor path.

    Args:
        x: ``[T, dim]`` the layer's pre-conv inputs of this call's speculative tokens.
        prior: ``[N, dim, W - 1]`` each sequence's committed conv window (oldest first).
        index: ``[T, W - 1]`` from :func:`conv_window_index`.

    Returns:
        ``[T, dim, W - 1]`` in ``prior``'s dtype.
    """
    n, dim, m = prior.shape
    rows = torch.cat([x.to(prior.dtype), prior.transpose(1, 2).reshape(n * m, dim)])
    return rows.index_select(0, index.flatten().to(rows.device)).view(-1, m, dim).transpose(1, 2)


def tree_causal_conv(
    x: torch.Tensor,
    windows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
) -> torch.Tensor:
    """One causal depthwise conv output per token, over its ancestor window plus itself.

    Mirrors the per-sequence torch conv of vLLM's CPU speculative path
    (``ops/cpu/gdn_attention.py`` ``_spec_forward``: ``F.conv1d(cat(prior, x), w, bias,
    groups=dim)`` then SiLU).

    Args:
        x: ``[T, dim]``; windows: ``[T, dim, W - 1]``; weight: ``[dim, W]``; bias: ``[dim]``.
        activation: ``"silu"``/``"swish"`` or ``None``.

    Returns:
        ``[T, dim]`` in ``x``'s dtype.
    """
    conv_in = torch.cat([windows, x.unsqueeze(-1).to(windows.dtype)], dim=-1)
    out = F.conv1d(conv_in, weight.unsqueeze(1).to(conv_in.dtype), bias, groups=x.shape[-1])
    out = out[..., -1]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    return out.to(x.dtype)


def conv_through_kernel(
    kernel: Callable[..., torch.Tensor],
    x: torch.Tensor,
    windows: torch.Tensor,
    like: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | bool | None,
) -> torch.Tensor:
    """Each token's conv output through the one-token update target-only decoding calls.

    Every token gets its own scratch conv state holding its ancestor window, and ``kernel``
    (vLLM's ``causal_conv1d_update``: the Triton op on CUDA, ``causal_conv1d_update_cpu`` on
    CPU) runs once for all of them as a batch of one-token decode rows, so each output is
    computed exactly as a plain decode step computes it.

    Args:
        x: ``[T, dim]`` the tokens' pre-conv inputs.
        windows: ``[T, dim, W - 1]`` from :func:`gather_conv_windows`.
        like: the layer's conv cache view (``[slots, dim, S]``): the scratch copies its dtype
            and storage order (vLLM's "DS" or "SD" conv layout).
        weight: ``[dim, W]``; bias: ``[dim]`` or ``None``; activation: as vLLM passes it.

    Returns:
        ``[T, dim]`` conv outputs (activation applied), what ``kernel`` returns. vLLM's Triton
        op writes them into ``x`` when ``x`` is contiguous (as it does for vLLM's own call).
    """
    T, dim, m = windows.shape
    # Row 0 stays unused: slot 0 is vLLM's null block, which the kernels skip.
    if like.stride(-2) == 1:
        scratch = torch.zeros(T + 1, m, dim, dtype=like.dtype, device=x.device).transpose(1, 2)
    else:
        scratch = torch.zeros(T + 1, dim, m, dtype=like.dtype, device=x.device)
    scratch[1:] = windows
    return kernel(x.contiguous(), scratch, weight, bias, activation,
                  conv_state_indices=torch.arange(1, T + 1, dtype=torch.int32, device=x.device))


def read_conv_windows(conv_buf: torch.Tensor, layout: RecurrentTreeLayout, width: int) -> torch.Tensor:
    """``[N, dim, W - 1]`` committed conv windows (copies) from ``conv_buf [slots, dim, S]``."""
    m = width - 1
    cols = layout.read_offsets.view(-1, 1) + torch.arange(m).view(1, -1)
    slots = layout.conv_slots.view(-1, 1)
    dev = conv_buf.device
    return conv_buf[slots.to(dev), :, cols.to(dev)].permute(0, 2, 1).clone()


def write_conv_buffer(
    conv_buf: torch.Tensor, layout: RecurrentTreeLayout, prior: torch.Tensor, x: torch.Tensor
) -> None:
    """Lay this step's conv inputs into each sequence's rolling buffer, in node order.

    Column ``c < W - 2`` gets ``prior[..., c + 1]``; column ``W - 2 + i`` gets node ``i``'s input.
    For a chain this is the layout vLLM's CPU speculative path leaves for ``q = K + 1`` tokens.

    Args:
        conv_buf: ``[slots, dim, W - 1 + K]`` the layer's conv cache (a view; written in place).
        prior: ``[N, dim, W - 1]`` from :func:`read_conv_windows` (read before this call).
        x: ``[T, dim]`` pre-conv inputs.
    """
    m = prior.shape[-1]
    for n, (s, q) in enumerate(zip(layout.seq_starts, layout.seq_lens)):
        buf = conv_buf[int(layout.conv_slots[n])]
        if m > 1:
            buf[:, : m - 1] = prior[n, :, 1:]
        buf[:, m - 1 : m - 1 + q] = x[s : s + q].transpose(0, 1).to(buf.dtype)


def run_tree_levels(
    layout: RecurrentTreeLayout,
    states: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Advance every node's recurrent state from its parent's, one depth level at a time.

    For each level: copy ``states[src] -> states[dst]`` for the level's tokens, then
    ``step(tokens, dst)`` must advance ``states[dst[i]]`` in place by token ``tokens[i]`` (and
    write its output). Nodes of one level never share a slot, and their parents' slots were
    finished at the previous level.

    Args:
        states: ``[slots, ...]`` the layer's recurrent-state cache (one entry per slot).
        step: the layer kind's batched one-token update (vLLM's kernel, or a reference).
    """
    dev = states.device
    for level in layout.levels:
        src = layout.src_slots[level].to(dev)
        dst = layout.dst_slots[level].to(dev)
        states.index_copy_(0, dst, states.index_select(0, src))
        step(level, dst)


def relayout_conv_buffer(buf: torch.Tensor, accepted: Sequence[int], width: int) -> None:
    """Put the accepted path's conv inputs in chain order, in place.

    Args:
        buf: ``[dim, W - 1 + K]`` one request's conv buffer after :func:`write_conv_buffer`.
        accepted: node indices of the accepted path ``[0, n_1 … n_a]`` (increasing).
    """
    base = width - 2
    for j, node in enumerate(accepted):
        if node != j:  # node >= j, and columns > base + j are not written yet: in-place safe
            buf[:, base + j] = buf[:, base + node]


def relayout_recurrent_state(states: torch.Tensor, slots: Sequence[int], accepted: Sequence[int]) -> None:
    """Copy the accepted path's final state to slot ``a`` (where the next step resumes).

    Args:
        states: ``[slots, ...]`` recurrent-state cache.
        slots: the request's ``state_indices`` row (``[K + 1]``).
        accepted: ``[0, n_1 … n_a]``.
    """
    a, last = len(accepted) - 1, accepted[-1]
    if last != a:
        states[int(slots[a])] = states[int(slots[last])]


# ----------------------------------------------------------------------------- references


def gated_delta_step_reference(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One GatedDeltaNet token (fp32), as vLLM's ``fused_sigmoid_gating_delta_rule_update``.

    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, q/k L2-normalised,
    ``q`` scaled by ``K**-0.5``; ``S = S * exp(g)``; ``S += k ⊗ beta (v - S^T k)``;
    ``o = S^T q`` (``third_party/flash_linear_attention/ops/fused_sigmoid_gating.py``).

    Args:
        state: ``[B, H, K, V]``; q, k: ``[B, H, K]`` (k/q heads already expanded to H);
        v: ``[B, H, V]``; a, b: ``[B, H]``; A_log, dt_bias: ``[H]``.

    Returns:
        ``(new_state [B, H, K, V], o [B, H, V])``, fp32.
    """
    state, q, k, v = state.float(), q.float(), k.float(), v.float()
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    q = F.normalize(q, dim=-1) * q.shape[-1] ** -0.5
    k = F.normalize(k, dim=-1)
    state = state * torch.exp(g)[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return state, torch.einsum("bhkv,bhk->bhv", state, q)


def mamba2_step_reference(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
    B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Mamba2 SSM token (fp32), as vLLM's ``selective_state_update`` with ``dt_softplus``.

    ``dt' = softplus(dt + dt_bias)``; ``S = S * exp(dt' A) + dt' x ⊗ B``; ``y = S C + D x``
    (``vllm/model_executor/layers/mamba/ops/mamba_ssm.py``), B/C shared by the heads of a group.

    Args:
        state: ``[Bt, H, P, N]``; x: ``[Bt, H, P]``; dt: ``[Bt, H]``; A, D, dt_bias: ``[H]``;
        B, C: ``[Bt, G, N]``.

    Returns:
        ``(new_state, y [Bt, H, P])``, fp32.
    """
    h, g = x.shape[1], B.shape[1]
    Bh = B.float().repeat_interleave(h // g, dim=1)
    Ch = C.float().repeat_interleave(h // g, dim=1)
    dt = F.softplus(dt.float() + dt_bias.float())
    state = state.float() * torch.exp(dt * A.float())[..., None, None]
    state = state + (dt[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, Ch) + D.float()[None, :, None] * x.float()
    return state, y
