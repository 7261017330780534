"""The sequential tree oracle for recurrent layers (GatedDeltaNet, Mamba2), as pure torch.

A recurrent layer advances one state in token order, so an attention mask cannot keep sibling
branches of a draft tree apart. Here every tree node ``t`` gets its own state,
``S_t = step(S_parent(t), x_t)`` (the root starts from the committed state), and its causal-conv
window is the inputs along its **ancestor path**, continuing into the committed conv state past
the root. Nodes of one tree depth are independent, so a layer runs one batched one-token step
per depth level.

Storage. vLLM keeps ``1 + num_speculative_blocks`` state blocks per request and layer
(``vllm/v1/kv_cache_interface.py`` ``MambaSpec``) and reads them as a chain
(``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py`` ``_spec_forward``): a step starts
from the recurrent state in block ``num_accepted - 1`` of the previous step and from the conv
window at columns ``[num_accepted - 1, num_accepted - 1 + W - 1)`` of the request's conv buffer
(block 0, ``[dim, W - 1 + L]`` for a DDTree engine). The oracle leaves vLLM's blocks alone
during the forward:

* every node's state lives in a per-layer-call **level scratch**: rows ``1 … N`` hold copies of
  the committed states, in which the roots advance; the nodes of depth ``d >= 1`` take rows of
  region ``(d - 1) % 2`` (two alternating regions, each as large as the widest odd / even
  level), so a layer keeps the states of two adjacent levels at a time, not one per node;
* each layer call keeps its tokens' recurrent inputs and pre-conv inputs
  (:class:`~vllm_ddtree.hybrid.context.RecurrentRecord`);
* after verification :func:`commit_states` **replays** each accepted path
  ``[0, n_1 … n_a]`` from the committed state with the same one-token calls (so the state is
  bit-identical to the node's state in the forward) and writes it to block ``a``, and
  :func:`commit_conv_buffer` lays the path's conv inputs into the buffer in chain order
  (column ``W - 2 + j`` ← node ``n_j``): what a chain of ``a`` accepted drafts would have left,
  where vLLM's chain bookkeeping reads it.

Only the accepted path is written, so vLLM needs ``L + 1`` state blocks per request (the
drafter horizon) with ``W - 1 + L`` conv windows, not ``max(B, L) + 1`` blocks of
``W - 1 + max(B, L)`` (:mod:`vllm_ddtree.patches.hybrid` and
:func:`vllm_ddtree.hybrid.guard.fit_recurrent_state_shapes` size them).

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
    a sequence) in ``N`` sequences. States advance in a level scratch (module docstring):
    ``[num_scratch_rows, *state]``, row 0 unused (vLLM's null slot), rows ``1 … N`` the
    committed states.

    Attributes:
        seq_starts: ``[N]`` first token of each sequence.
        seq_lens: ``[N]`` tokens (tree nodes incl. the root) of each sequence.
        batch_index: ``[N]`` each sequence's row in the step's input batch.
        parents: ``[T]`` long, flat index of each token's parent, ``-1`` for a root.
        depths: ``[T]`` long, tree depth (root 0).
        levels: flat token indices of each depth, roots first; parents precede children.
        src_slots: ``[T]`` long, scratch row holding the state *before* the token (the parent's
            row, or ``1 + n`` — the committed copy — for the root of sequence ``n``, which
            advances in place there); ``-1`` for a token outside ``levels``.
        dst_slots: ``[T]`` long, scratch row receiving the state *after* the token (``-1``
            outside ``levels``).
        num_scratch_rows: rows of the level scratch.
        state_indices: ``[N, C]`` long, each sequence's vLLM state blocks (CPU).
        committed_slots: ``[N]`` long, ``state_indices[n, num_accepted[n] - 1]``.
        conv_slots: ``[N]`` long, the conv buffer slot of each sequence (``state_indices[n, 0]``).
        read_offsets: ``[N]`` long, ``num_accepted - 1``: where the committed conv window starts.
        is_tree: ``[N]`` bool, False where the sequence is a plain chain.
        fresh: ``[N]`` bool, True where the request has no recurrent state yet: its committed
            state and conv window are zeros, not its blocks' (recycled) contents.
    """

    seq_starts: list[int]
    seq_lens: list[int]
    batch_index: list[int]
    parents: torch.Tensor
    depths: torch.Tensor
    levels: list[torch.Tensor]
    src_slots: torch.Tensor
    dst_slots: torch.Tensor
    num_scratch_rows: int
    state_indices: torch.Tensor
    committed_slots: torch.Tensor
    conv_slots: torch.Tensor
    read_offsets: torch.Tensor
    is_tree: list[bool]
    fresh: list[bool]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.seq_lens))


def _level_rows(levels: Sequence[torch.Tensor], parents: torch.Tensor, seq_of: torch.Tensor,
                num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Scratch rows of the tokens in ``levels``: ``(src_rows [T], dst_rows [T], num_rows)``,
    ``-1`` outside ``levels``. A root advances in place in its committed copy (row ``1 + n``,
    kept for the whole call); depth ``d >= 1`` takes region ``(d - 1) % 2`` after those."""
    T = parents.numel()
    src = torch.full((T,), -1, dtype=torch.long)
    dst = torch.full((T,), -1, dtype=torch.long)
    widths = [int(lv.numel()) for lv in levels[1:]]
    region = [max(widths[0::2], default=0), max(widths[1::2], default=0)]
    base = [1 + num_seqs, 1 + num_seqs + region[0]]
    for d, lv in enumerate(levels):
        if d == 0:
            dst[lv] = src[lv] = 1 + seq_of[lv]
            continue
        dst[lv] = base[(d - 1) % 2] + torch.arange(lv.numel())
        src[lv] = dst[parents[lv]]
    return src, dst, 1 + num_seqs + region[0] + region[1]


def build_recurrent_layout(
    seq_lens: Sequence[int],
    batch_index: Sequence[int],
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    tree_parents: Mapping[int, torch.Tensor],
    fresh_rows: frozenset[int] = frozenset(),
) -> RecurrentTreeLayout:
    """Flatten the speculative rows of one layer call into a :class:`RecurrentTreeLayout`.

    Args:
        seq_lens: tokens of each speculative sequence (``spec_query_start_loc`` differences).
        batch_index: input-batch row of each sequence.
        state_indices: ``[N, C]`` int, each sequence's state blocks (vLLM's
            ``spec_state_indices_tensor`` / ``state_indices_tensor_d``; ``C = L + 1`` for a
            DDTree engine, fewer than a tree's nodes).
        num_accepted: ``[N]`` int, vLLM's ``num_accepted_tokens`` (tokens committed by the
            previous step, ≥ 1).
        tree_parents: ``batch_index -> [n + 1]`` parents (``-1`` first) of the sequences that
            verify a draft tree; any other sequence is a chain.
        fresh_rows: input-batch rows of requests without recurrent state yet (no computed
            tokens before this step; see :class:`~vllm_ddtree.hybrid.context.HybridTreeContext`).

    Returns:
        the layout (CPU tensors).

    Raises:
        RuntimeError: a tree's node count differs from the tokens vLLM scheduled for it, or a
            sequence's committed block lies outside its state blocks.
    """
    idx = state_indices.to("cpu", torch.long)
    acc = num_accepted.to("cpu", torch.long)
    parents, depths, committed, starts, is_tree, seq_of = [], [], [], [], [], []
    start = 0
    for n, (q, b) in enumerate(zip(seq_lens, batch_index)):
        q = int(q)
        if not 1 <= int(acc[n]) <= idx.shape[1]:
            raise RuntimeError(
                f"DDTree hybrid: num_accepted_tokens {int(acc[n])} for a request with "
                f"{idx.shape[1]} state blocks")
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
        committed.append(int(idx[n, int(acc[n]) - 1]))
        parents.append(torch.where(local >= 0, local + start, local))
        depths.append(d)
        seq_of.append(torch.full((q,), n, dtype=torch.long))
        starts.append(start)
        start += q
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)  # noqa: E731
    depth, parent = cat(depths), cat(parents)
    num_levels = int(depth.max()) + 1 if depth.numel() else 0
    levels = [torch.nonzero(depth == lv).flatten() for lv in range(num_levels)]
    src, dst, rows = _level_rows(levels, parent, cat(seq_of), len(starts))
    return RecurrentTreeLayout(
        seq_starts=starts,
        seq_lens=[int(q) for q in seq_lens],
        batch_index=[int(b) for b in batch_index],
        parents=parent,
        depths=depth,
        levels=levels,
        src_slots=src,
        dst_slots=dst,
        num_scratch_rows=rows,
        state_indices=idx[: len(starts)],
        committed_slots=torch.tensor(committed, dtype=torch.long),
        conv_slots=idx[: len(starts), 0].clone() if idx.numel() else torch.zeros(0, dtype=torch.long),
        read_offsets=acc[: len(seq_lens)] - 1,
        is_tree=is_tree,
        fresh=[int(b) in fresh_rows for b in batch_index],
    )


def path_layout(layout: RecurrentTreeLayout, paths: Mapping[int, Sequence[int]]) -> RecurrentTreeLayout:
    """The accepted paths of some sequences of ``layout`` as chains, for the replay.

    Args:
        layout: the layer call's tree layout.
        paths: sequence index ``n`` -> its accepted path ``[0, n_1 … n_a]`` (local node indices,
            each node's parent the one before it).

    Returns:
        a layout over the same ``T`` tokens whose ``levels`` hold path position ``j`` of every
        path (tokens off the paths are in no level); every token of sequence ``n``'s path reads
        and writes scratch row ``1 + n`` (its committed copy), so the final state ends there;
        everything else is ``layout``'s.

    Raises:
        ValueError: a path does not start at the root or does not follow the tree.
    """
    T = layout.num_tokens
    parents = torch.full((T,), -1, dtype=torch.long)
    by_pos: list[list[int]] = []
    for n, path in paths.items():
        s = layout.seq_starts[n]
        prev = -1
        for j, node in enumerate(path):
            t = s + int(node)
            if (j == 0) != (node == 0) or (j > 0 and int(layout.parents[t]) != prev):
                raise ValueError(f"sequence {n}: {list(path)} is not a root-to-node path")
            parents[t] = prev
            prev = t
            if j == len(by_pos):
                by_pos.append([])
            by_pos[j].append(t)
    levels = [torch.tensor(sorted(ts), dtype=torch.long) for ts in by_pos]
    # A chain advances in place in its committed copy: O(1) scratch rows per sequence, and
    # the final state is still there when the shorter paths are done.
    seq_of = torch.repeat_interleave(torch.arange(len(layout.seq_lens)),
                                     torch.tensor(layout.seq_lens, dtype=torch.long))
    rows = torch.full((T,), -1, dtype=torch.long)
    for lv in levels:
        rows[lv] = 1 + seq_of[lv]
    return RecurrentTreeLayout(
        layout.seq_starts, layout.seq_lens, layout.batch_index, parents, layout.depths, levels,
        rows, rows.clone(), 1 + len(layout.seq_lens), layout.state_indices,
        layout.committed_slots, layout.conv_slots, layout.read_offsets, layout.is_tree,
        layout.fresh)


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
    """``[N, dim, W - 1]`` committed conv windows (copies) from ``conv_buf [slots, dim, S]``;
    zeros for a fresh request."""
    m = width - 1
    cols = layout.read_offsets.view(-1, 1) + torch.arange(m).view(1, -1)
    slots = layout.conv_slots.view(-1, 1)
    dev = conv_buf.device
    prior = conv_buf[slots.to(dev), :, cols.to(dev)].permute(0, 2, 1).clone()
    fresh = [i for i, f in enumerate(layout.fresh) if f]
    if fresh:
        prior[fresh] = 0  # a prompt's conv starts from zeros, as vLLM's prefill
    return prior


def load_committed(layout: RecurrentTreeLayout, states: torch.Tensor) -> torch.Tensor:
    """A level scratch for ``layout``, rows ``1 … N`` holding each sequence's committed state.

    Args:
        states: ``[slots, ...]`` the layer's recurrent-state cache (read only).

    Returns:
        ``[layout.num_scratch_rows, ...]`` in ``states``' dtype and device (a fresh request's
        committed row is zeros); rows past ``N`` are uninitialised (each level writes its rows
        before they are read).
    """
    scratch = states.new_empty((layout.num_scratch_rows, *states.shape[1:]))
    n = len(layout.seq_lens)
    if n:
        scratch[1 : n + 1] = states.index_select(0, layout.committed_slots.to(states.device))
        fresh = [1 + i for i, f in enumerate(layout.fresh) if f]
        if fresh:
            scratch[fresh] = 0  # a prompt starts from a zero state, as vLLM's prefill
    return scratch


def run_tree_levels(
    layout: RecurrentTreeLayout,
    states: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """Advance every node's recurrent state from its parent's, one depth level at a time.

    For each level: copy ``states[src] -> states[dst]`` for the level's tokens, then
    ``step(tokens, dst)`` must advance ``states[dst[i]]`` in place by token ``tokens[i]`` (and
    write its output). Nodes of one level never share a row, and their parents' rows were
    finished at the previous level.

    Args:
        states: ``[rows, ...]`` the level scratch (:func:`load_committed`).
        step: the layer kind's batched one-token update (vLLM's kernel, or a reference).
    """
    dev = states.device
    for level in layout.levels:
        src = layout.src_slots[level].to(dev)
        dst = layout.dst_slots[level].to(dev)
        states.index_copy_(0, dst, states.index_select(0, src))
        step(level, dst)


#: ``advance(layout, scratch)``: run every token of ``layout.levels`` through the layer kind's
#: one-token update in the level scratch (:func:`run_tree_levels`, or one kernel call per
#: level that reads the parent's row and writes the node's).
Advance = Callable[[RecurrentTreeLayout, torch.Tensor], None]


def _check_path_fits(layout: RecurrentTreeLayout, n: int, path: Sequence[int]) -> None:
    if len(path) > layout.state_indices.shape[1]:
        raise RuntimeError(
            f"DDTree hybrid: an accepted path of {len(path)} tokens for a request with "
            f"{layout.state_indices.shape[1]} state blocks (sequence {n})")


def commit_states(
    states: torch.Tensor,
    layout: RecurrentTreeLayout,
    paths: Mapping[int, Sequence[int]],
    advance: Advance,
    chains: RecurrentTreeLayout | None = None,
) -> None:
    """Write each accepted path's final state to block ``a`` of its sequence (``a + 1`` tokens),
    where vLLM's chain bookkeeping (``num_accepted_tokens = a + 1``) reads it next step.

    The path is replayed from the committed state through ``advance`` — the same one-token
    calls the forward made, on the same inputs — so the state is the forward's node state bit
    for bit.

    Args:
        states: ``[slots, ...]`` the layer's recurrent-state cache (written in place).
        layout: the layer call's tree layout; paths: sequence index -> ``[0, n_1 … n_a]``.
        advance: the layer call's replay (it holds the call's recurrent inputs).
        chains: ``path_layout(layout, paths)`` when the caller has it (layers that share a
            layout share it).

    Raises:
        RuntimeError: a path is longer than the sequence's state blocks.
        ValueError: a path is not a root-to-node path of the tree.
    """
    if not paths:
        return
    for n, path in paths.items():
        _check_path_fits(layout, n, path)
    chains = path_layout(layout, paths) if chains is None else chains
    scratch = load_committed(chains, states)
    advance(chains, scratch)
    rows = [1 + n for n in paths]  # a path's final state stays in its committed copy's row
    slots = [int(layout.state_indices[n, len(p) - 1]) for n, p in paths.items()]
    dev = states.device
    states.index_copy_(0, torch.tensor(slots, device=dev),
                       scratch.index_select(0, torch.tensor(rows, device=dev)))


def commit_single_tokens(states: torch.Tensor, layout: RecurrentTreeLayout,
                         scratch: torch.Tensor) -> list[int]:
    """Commit the sequences of one token (no drafts: the path is known before verification)
    from the forward's scratch to block 0; returns their sequence indices."""
    single = [n for n, q in enumerate(layout.seq_lens) if q == 1]
    if single:
        dev = states.device
        rows = layout.dst_slots[[layout.seq_starts[n] for n in single]]
        slots = layout.state_indices[single, 0]
        states.index_copy_(0, slots.to(dev), scratch.index_select(0, rows.to(dev)))
    return single


def commit_conv_buffer(
    conv_buf: torch.Tensor,
    layout: RecurrentTreeLayout,
    prior: torch.Tensor,
    x: torch.Tensor,
    paths: Mapping[int, Sequence[int]],
) -> None:
    """Lay each accepted path's conv inputs into its sequence's conv buffer in chain order.

    Column ``c < W - 2`` gets ``prior[..., c + 1]``; column ``W - 2 + j`` gets path node
    ``n_j``'s input. The next step reads its window at ``[a, a + W - 1)``: the last ``W - 1``
    inputs of the committed chain, what vLLM's chain path leaves for ``a`` accepted drafts.

    Args:
        conv_buf: ``[slots, dim, W - 1 + K']`` the layer's conv cache (a view; written in place).
        prior: ``[N, dim, W - 1]`` from :func:`read_conv_windows` (read in the forward).
        x: ``[T, dim]`` the call's pre-conv inputs.
        paths: sequence index -> ``[0, n_1 … n_a]``.

    Raises:
        RuntimeError: a path does not fit the buffer or the state blocks.
    """
    m = prior.shape[-1]
    for n, path in paths.items():
        _check_path_fits(layout, n, path)
        buf = conv_buf[int(layout.conv_slots[n])]
        if m - 1 + len(path) > buf.shape[-1]:
            raise RuntimeError(
                f"DDTree hybrid: an accepted path of {len(path)} tokens does not fit a conv "
                f"buffer of {buf.shape[-1]} columns (conv width {m + 1})")
        if m > 1:
            buf[:, : m - 1] = prior[n, :, 1:]
        rows = torch.tensor([layout.seq_starts[n] + int(p) for p in path], device=x.device)
        buf[:, m - 1 : m - 1 + len(path)] = x.index_select(0, rows).transpose(0, 1).to(buf.dtype)


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
