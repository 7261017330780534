"""Recurrent-state memory per request of a hybrid target, vLLM's speculative layout vs DDTree.

Prints the tables of ``docs/hybrid_state_memory.md`` from the model config numbers below, so
they can be checked and redone for another model. Pure arithmetic, no torch::

    python benchmarks/hybrid_state_memory.py [--budget-gib 40] [--draft-len 16] [--batch 8]
                                             [--gpu-gib 140]

vLLM's layout (``vllm/v1/kv_cache_interface.py`` ``MambaSpec``; shapes from
``vllm/model_executor/layers/mamba/mamba_utils.py``): every recurrent layer gives each request
``1 + num_speculative_blocks`` state blocks (``K + 1`` with ``K`` speculative tokens), and every
block holds *both* parts of the layer's state:

* the conv window ``[conv_dim, W - 1 + K]`` (model dtype; only the request's first block's is
  read, but all blocks have that shape),
* the recurrent state: GatedDeltaNet ``[HV, V, K_head]``, Mamba2 ``[H, P, N]`` (``mamba_ssm_cache
  _dtype``: Qwen3.5/3.6 configs set ``mamba_ssm_dtype: float32``, which vLLM applies).

So per request: ``layers * (K + 1) * (conv_dim * (W - 1 + K) * conv_bytes + state * ssm_bytes)``;
the conv part grows as K^2. A DFlash chain of L drafts uses K = L; DDTree asks vLLM for
K = max(B, L) speculative tokens.

DDTree's layout (``ddtree_hybrid="oracle"``): the plugin sets ``num_speculative_blocks = L``, so
``L + 1`` blocks per request and layer, each still with vLLM's ``W - 1 + max(B, L)`` conv window
(vLLM derives it, and the page size, from num_speculative_tokens). Per step and request it adds
transient memory vLLM's profiling does not see:

* the level scratch of the layer call in flight (one layer at a time): ``1 + widest odd level +
  widest even level`` states, at most ``B + 1`` (a star tree);
* the kept inputs of every recurrent layer of the forward, until the accepted path is replayed:
  ``layers * (B + 1)`` tokens of pre-conv and recurrent inputs (model dtype), plus the committed
  conv windows (``W - 1`` columns) the forward read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GIB = 1024**3
MIB = 1024**2
KIB = 1024


@dataclass(frozen=True)
class HybridModel:
    name: str
    layers: int  # recurrent layers
    conv_dim: int
    conv_width: int  # W
    state_elems: int  # recurrent state elements per layer
    attn_kv_bytes_per_token: int  # one attention layer's K + V per token (bf16)
    kept_elems_per_token: int  # inputs DDTree keeps per token and layer until the commit
    kept_breakdown: str
    source: str


def qwen36_27b() -> HybridModel:
    # Qwen/Qwen3.6-27B text config: 64 layers = 16 x (3 GatedDeltaNet + 1 attention);
    # linear_num_key_heads 16, linear_num_value_heads 48, linear_key_head_dim 128,
    # linear_value_head_dim 128, linear_conv_kernel_dim 4.
    hk, hv, dk, dv, w = 16, 48, 128, 128, 4
    conv_dim = 2 * hk * dk + hv * dv
    return HybridModel(
        "Qwen3.6-27B (GatedDeltaNet)", layers=48, conv_dim=conv_dim, conv_width=w,
        state_elems=hv * dv * dk, attn_kv_bytes_per_token=2 * 4 * 256 * 2,  # 4 KV heads x 256
        # pre-conv mixed qkv + post-conv q, k, v + a, b (one gate value per value head each)
        kept_elems_per_token=conv_dim + conv_dim + 2 * hv,
        kept_breakdown=f"pre-conv {conv_dim} + post-conv q,k,v {conv_dim} + a,b 2*{hv}",
        source="model card (hidden layout, 48 V / 16 QK heads, head dim 128) + config.json")


def nemotron_h_8b() -> HybridModel:
    # nvidia/Nemotron-H-8B: 52 layers, pattern with 24 Mamba2 layers; mamba_num_heads 128,
    # mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4.
    h, p, n, g, w = 128, 64, 128, 8, 4
    conv_dim = h * p + 2 * g * n
    return HybridModel(
        "Nemotron-H-8B (Mamba2)", layers=24, conv_dim=conv_dim, conv_width=w,
        state_elems=h * p * n, attn_kv_bytes_per_token=2 * 8 * 128 * 2,  # 8 KV heads x 128
        # pre-conv xBC + x [H, P] + dt (vLLM passes it expanded to [T, H, P]; the copy
        # materialises all H * P) + B, C [G, N] each
        kept_elems_per_token=conv_dim + h * p + h * p + 2 * g * n,
        kept_breakdown=(f"pre-conv {conv_dim} + x {h * p} + dt as [H, P] {h * p} + "
                        f"B,C 2*{g * n}"),
        source="NVIDIA Megatron-Bridge Nemotron-H page + HF config")


def vllm_layout_bytes(m: HybridModel, k: int, ssm_bytes: int, conv_bytes: int = 2) -> int:
    """Per request: ``K + 1`` blocks per layer, each a conv window of ``W - 1 + K`` + a state."""
    return m.layers * (k + 1) * page_bytes(m, k, ssm_bytes, conv_bytes)


def ddtree_layout_bytes(m: HybridModel, k: int, l: int, ssm_bytes: int,
                        conv_bytes: int = 2) -> int:
    """Per request under DDTree: ``min(K, L) + 1`` blocks per layer (``num_speculative_blocks
    = L``), each a page for ``min(K, L)`` (a ``W - 1 + L`` conv window + a state): the layers'
    ``num_spec`` and vLLM's page alignment are set to L."""
    return m.layers * (min(k, l) + 1) * page_bytes(m, min(k, l), ssm_bytes, conv_bytes)


def page_bytes(m: HybridModel, k: int, ssm_bytes: int, conv_bytes: int = 2) -> int:
    """One state block of one layer (vLLM's Mamba page)."""
    return m.conv_dim * (m.conv_width - 1 + k) * conv_bytes + m.state_elems * ssm_bytes


def attn_block_tokens(m: HybridModel, k: int, ssm_bytes: int, align: int = 16) -> int:
    """The attention block size vLLM picks so an attention page is >= the Mamba page
    (``vllm/platforms/interface.py``; alignment 16 assumed)."""
    page = page_bytes(m, k, ssm_bytes)
    return align * -(-page // (align * m.attn_kv_bytes_per_token))


def level_scratch_bytes(m: HybridModel, b: int, ssm_bytes: int) -> int:
    """Worst-case level scratch of one layer call, per request: ``B + 1`` states (the committed
    copy the root advances in + a star tree's ``B`` children on level 1; in general the widest
    odd and the widest even level together hold at most the ``B`` non-root nodes)."""
    return (b + 1) * m.state_elems * ssm_bytes


def kept_inputs_bytes(m: HybridModel, b: int, in_bytes: int = 2) -> int:
    """Inputs kept for the replay, every recurrent layer of the forward, per request:
    ``layers * (B + 1)`` tokens of pre-conv + recurrent inputs, plus the committed conv windows
    (``W - 1`` columns) each layer read."""
    tokens = m.layers * (b + 1) * m.kept_elems_per_token * in_bytes
    windows = m.layers * m.conv_dim * (m.conv_width - 1) * in_bytes
    return tokens + windows


def transient_bytes(m: HybridModel, b: int, ssm_bytes: int) -> int:
    """Peak transient per request in a DDTree step: all layers' kept inputs + one layer's
    level scratch (the replay after verification needs one state per request and layer call)."""
    return kept_inputs_bytes(m, b) + level_scratch_bytes(m, b, ssm_bytes)


def one_block_bytes(m: HybridModel, l: int, ssm_bytes: int, conv_bytes: int = 2) -> int:
    """Further step (not implemented): one block per request and layer, a state + a
    ``W - 1 + L`` conv window."""
    conv = m.conv_dim * (m.conv_width - 1 + l) * conv_bytes
    return m.layers * (m.state_elems * ssm_bytes + conv)


def fmt(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.1f} MiB" if nbytes < 100 * MIB else f"{nbytes / MIB:.0f} MiB"


def tables(budget_gib: float = 40.0, l: int = 16, batch: int = 8, gpu_gib: float = 140.0) -> str:
    budget = budget_gib * GIB
    models = (qwen36_27b(), nemotron_h_8b())
    budgets = (16, 64, 256)
    cases = [("no speculation", 0), (f"DFlash chain L={l}", l)] + [
        (f"DDTree B={b} (K=max(B,L))", max(b, l)) for b in budgets]
    header = ["| model | case | K | blocks/layer | per request, fp32 state | fit | "
              "per request, bf16 state | fit |", "|---|---|---:|---:|---:|---:|---:|---:|"]

    def table(per_request, blocks) -> list[str]:
        rows = []
        for m in models:
            for name, k in cases:
                f32, b16 = per_request(m, k, 4), per_request(m, k, 2)
                rows.append(f"| {m.name} | {name} | {k} | {blocks(k)} | {fmt(f32)} | "
                            f"{int(budget // f32)} | {fmt(b16)} | {int(budget // b16)} |")
        return rows

    out = [
        f"Before (vLLM's layout if asked for K = max(B, L) blocks): per request, K + 1 blocks per "
        f"recurrent layer, each block = conv window [conv_dim, W - 1 + K] (bf16) + recurrent "
        f"state; requests that fit in {budget_gib:g} GiB of recurrent-state memory (attention KV "
        "cache not counted).",
        "",
        *header,
        *table(vllm_layout_bytes, lambda k: k + 1),
        "",
        f"DDTree's layout (L = {l}): per request, L + 1 blocks per recurrent layer "
        f"(num_speculative_blocks = L), each block [conv_dim, W - 1 + L] (bf16) + "
        f"recurrent state; requests that fit in {budget_gib:g} GiB.",
        "",
        *header,
        *table(lambda m, k, b: ddtree_layout_bytes(m, k, l, b), lambda k: min(k, l) + 1),
    ]
    out += [
        "",
        "DDTree's transient memory per request and step (not seen by vLLM's memory profiling). "
        "Level scratch: one layer call at a time, worst case B + 1 states (a star tree; no "
        "typical-tree estimate without measured tree shapes). Kept inputs: every recurrent "
        "layer, (B + 1) tokens of bf16 inputs + the committed conv windows. Peak = kept inputs "
        "+ one layer's scratch.",
        "",
        "| model | B | level scratch, one layer (fp32 / bf16 state) | kept inputs, all layers | "
        "peak, fp32 state | peak, bf16 state |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in models:
        for b in budgets:
            out.append(f"| {m.name} | {b} | {fmt(level_scratch_bytes(m, b, 4))} / "
                       f"{fmt(level_scratch_bytes(m, b, 2))} | {fmt(kept_inputs_bytes(m, b))} | "
                       f"{fmt(transient_bytes(m, b, 4))} | {fmt(transient_bytes(m, b, 2))} |")
    out += [
        "",
        f"Headroom to leave outside vLLM's profiled budget at batch {batch} (fp32 state), as a "
        f"fraction of a {gpu_gib:g} GiB GPU (lower --gpu-memory-utilization by about that much).",
        "",
        f"| model | B | transient at batch {batch} | fraction of {gpu_gib:g} GiB |",
        "|---|---:|---:|---:|",
    ]
    for m in models:
        for b in budgets:
            t = batch * transient_bytes(m, b, 4)
            out.append(f"| {m.name} | {b} | {fmt(t)} | {t / (gpu_gib * GIB):.3f} |")
    out += [
        "",
        f"Further step (not implemented): one block per request and layer, a state + a "
        f"W - 1 + L conv window (L = {l}); needs vLLM's num_accepted_tokens addressing replaced.",
        "",
        "| model | persistent per request, fp32 state | fit | bf16 state | fit |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in models:
        f32, b16 = one_block_bytes(m, l, 4), one_block_bytes(m, l, 2)
        out.append(f"| {m.name} | {fmt(f32)} | {int(budget // f32)} | {fmt(b16)} | "
                   f"{int(budget // b16)} |")
    out += [
        "",
        "vLLM unifies page sizes: the attention block grows until one attention page (one "
        "layer's K + V for block_size tokens, bf16) holds one Mamba page. fp32 state. "
        "(Under DDTree's layout the page follows L, i.e. the row K = L.)",
        "",
        "| model | K | Mamba page (one layer, one block) | attention block size (tokens) |",
        "|---|---:|---:|---:|",
    ]
    for m in models:
        for k in (0, l, 64, 256):
            out.append(f"| {m.name} | {k} | {fmt(page_bytes(m, k, 4))} | "
                       f"{attn_block_tokens(m, k, 4)} |")
    out += ["", "Per-layer sizes:"]
    for m in models:
        kept = m.kept_elems_per_token * 2
        out.append(f"- {m.name}: {m.layers} recurrent layers, conv_dim {m.conv_dim}, "
                   f"W {m.conv_width}, state {m.state_elems} elements "
                   f"({fmt(m.state_elems * 4)} fp32) per layer; kept inputs per token and layer "
                   f"{m.kept_elems_per_token} elements ({m.kept_breakdown}) = "
                   f"{kept / KIB:.1f} KiB bf16; source: {m.source}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-gib", type=float, default=40.0)
    p.add_argument("--draft-len", type=int, default=16,
                   help="L: the DFlash chain's length, DDTree's drafter horizon")
    p.add_argument("--batch", type=int, default=8,
                   help="requests per step for the transient-headroom table")
    p.add_argument("--gpu-gib", type=float, default=140.0,
                   help="GPU memory for the headroom fraction (an H200 reports ~140 GiB)")
    args = p.parse_args(argv)
    print(tables(args.budget_gib, args.draft_len, args.batch, args.gpu_gib))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
