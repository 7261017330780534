"""Recurrent-state memory per request of a hybrid target, vLLM's speculative layout vs DDTree.

Prints the tables of ``docs/hybrid_state_memory.md`` from the model config numbers below, so
they can be checked and redone for another model. Pure arithmetic, no torch::

    python benchmarks/hybrid_state_memory.py [--budget-gib 40]

vLLM's layout (``vllm/v1/kv_cache_interface.py`` ``MambaSpec``; shapes from
``vllm/model_executor/layers/mamba/mamba_utils.py``): every recurrent layer gives each request
``1 + num_speculative_blocks`` state blocks (``K + 1`` with ``K`` speculative tokens), and every
block holds *both* parts of the layer's state:

* the conv window ``[conv_dim, W - 1 + K]`` (model dtype; only the request's first block's is
  read, but all blocks have that shape),
* the recurrent state: GatedDeltaNet ``[HV, V, K_head]``, Mamba2 ``[H, P, N]`` (``mamba_ssm_cache
  _dtype``: Qwen3.5/3.6 configs set ``mamba_ssm_dtype: float32``, which vLLM applies).

So per request: ``layers * (K + 1) * (conv_dim * (W - 1 + K) * conv_bytes + state * ssm_bytes)``;
the conv part grows as K^2. A DFlash chain of L drafts uses K = L; DDTree asks K = max(B, L).

The O(tree width) alternative (analysis only, nothing implements it): keep one committed state
and a ``W - 1 + L`` conv window per request and layer; during the tree step keep only the
states of two adjacent depth levels of the layer being computed (a scratch reused by every
layer, at most ``B + 1`` states per request); after verification re-feed the accepted path
(<= L + 1 tokens) as a chain to rebuild the committed state.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class HybridModel:
    name: str
    layers: int  # recurrent layers
    conv_dim: int
    conv_width: int  # W
    state_elems: int  # recurrent state elements per layer
    attn_kv_bytes_per_token: int  # one attention layer's K + V per token (bf16)
    source: str


def qwen36_27b() -> HybridModel:
    # Qwen/Qwen3.6-27B text config: 64 layers = 16 x (3 GatedDeltaNet + 1 attention);
    # linear_num_key_heads 16, linear_num_value_heads 48, linear_key_head_dim 128,
    # linear_value_head_dim 128, linear_conv_kernel_dim 4.
    hk, hv, dk, dv, w = 16, 48, 128, 128, 4
    return HybridModel(
        "Qwen3.6-27B (GatedDeltaNet)", layers=48, conv_dim=2 * hk * dk + hv * dv, conv_width=w,
        state_elems=hv * dv * dk, attn_kv_bytes_per_token=2 * 4 * 256 * 2,  # 4 KV heads x 256
        source="model card (hidden layout, 48 V / 16 QK heads, head dim 128) + config.json")


def nemotron_h_8b() -> HybridModel:
    # nvidia/Nemotron-H-8B: 52 layers, pattern with 24 Mamba2 layers; mamba_num_heads 128,
    # mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4.
    h, p, n, g, w = 128, 64, 128, 8, 4
    return HybridModel(
        "Nemotron-H-8B (Mamba2)", layers=24, conv_dim=h * p + 2 * g * n, conv_width=w,
        state_elems=h * p * n, attn_kv_bytes_per_token=2 * 8 * 128 * 2,  # 8 KV heads x 128
        source="NVIDIA Megatron-Bridge Nemotron-H page + HF config")


def vllm_layout_bytes(m: HybridModel, k: int, ssm_bytes: int, conv_bytes: int = 2) -> int:
    """Per request: ``K + 1`` blocks per layer, each a conv window of ``W - 1 + K`` + a state."""
    return m.layers * (k + 1) * page_bytes(m, k, ssm_bytes, conv_bytes)


def page_bytes(m: HybridModel, k: int, ssm_bytes: int, conv_bytes: int = 2) -> int:
    """One state block of one layer (vLLM's Mamba page)."""
    return m.conv_dim * (m.conv_width - 1 + k) * conv_bytes + m.state_elems * ssm_bytes


def attn_block_tokens(m: HybridModel, k: int, ssm_bytes: int, align: int = 16) -> int:
    """The attention block size vLLM picks so an attention page is >= the Mamba page
    (``vllm/platforms/interface.py``; alignment 16 assumed)."""
    page = page_bytes(m, k, ssm_bytes)
    return align * -(-page // (align * m.attn_kv_bytes_per_token))


def width_alt_bytes(m: HybridModel, b: int, l: int, ssm_bytes: int, conv_bytes: int = 2):
    """O(tree width): (persistent per request, transient scratch per request in the step)."""
    conv = m.conv_dim * (m.conv_width - 1 + l) * conv_bytes
    persistent = m.layers * (m.state_elems * ssm_bytes + conv)
    transient = (b + 1) * m.state_elems * ssm_bytes  # two adjacent levels of one layer
    return persistent, transient


def fmt(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.1f} MiB" if nbytes < 100 * MIB else f"{nbytes / MIB:.0f} MiB"


def tables(budget_gib: float = 40.0, l: int = 16) -> str:
    budget = budget_gib * GIB
    cases = [("no speculation", 0), (f"DFlash chain L={l}", l)] + [
        (f"DDTree B={b} (K=max(B,L))", max(b, l)) for b in (16, 64, 256)]
    out = [
        f"vLLM's layout: per request, K + 1 blocks per recurrent layer, each block = conv window "
        f"[conv_dim, W - 1 + K] (bf16) + recurrent state; requests that fit in {budget_gib:g} GiB "
        "of recurrent-state memory (attention KV cache not counted).",
        "",
        "| model | case | K | blocks/layer | per request, fp32 state | fit | "
        "per request, bf16 state | fit |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in (qwen36_27b(), nemotron_h_8b()):
        for name, k in cases:
            f32, b16 = vllm_layout_bytes(m, k, 4), vllm_layout_bytes(m, k, 2)
            out.append(f"| {m.name} | {name} | {k} | {k + 1} | {fmt(f32)} | "
                       f"{int(budget // f32)} | {fmt(b16)} | {int(budget // b16)} |")
    out += [
        "",
        f"O(tree width) alternative (analysis): persistent = 1 state + a W - 1 + L conv window per "
        f"layer (L = {l}); transient = the states of two adjacent levels of the layer in flight, "
        "at most B + 1 per request, one scratch reused by all layers. fp32 state.",
        "",
        "| model | B | persistent per request | fit (persistent) | "
        "transient per request (worst case) |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in (qwen36_27b(), nemotron_h_8b()):
        for b in (16, 64, 256):
            per, tr = width_alt_bytes(m, b, l, 4)
            out.append(f"| {m.name} | {b} | {fmt(per)} | {int(budget // per)} | {fmt(tr)} |")
    out += [
        "",
        "vLLM unifies page sizes: the attention block grows until one attention page (one "
        "layer's K + V for block_size tokens, bf16) holds one Mamba page. fp32 state.",
        "",
        "| model | K | Mamba page (one layer, one block) | attention block size (tokens) |",
        "|---|---:|---:|---:|",
    ]
    for m in (qwen36_27b(), nemotron_h_8b()):
        for k in (0, l, 64, 256):
            out.append(f"| {m.name} | {k} | {fmt(page_bytes(m, k, 4))} | "
                       f"{attn_block_tokens(m, k, 4)} |")
    out += ["", "Per-layer sizes:"]
    for m in (qwen36_27b(), nemotron_h_8b()):
        out.append(f"- {m.name}: {m.layers} recurrent layers, conv_dim {m.conv_dim}, "
                   f"W {m.conv_width}, state {m.state_elems} elements "
                   f"({fmt(m.state_elems * 4)} fp32) per layer; source: {m.source}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-gib", type=float, default=40.0)
    p.add_argument("--draft-len", type=int, default=16, help="L of the DFlash chain")
    args = p.parse_args(argv)
    print(tables(args.budget_gib, args.draft_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
