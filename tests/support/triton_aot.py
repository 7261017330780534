"""Ahead-of-time compilation of Triton kernels for real GPU targets, on a machine without a GPU.

Triton's NVIDIA backend and its bundled ``ptxas`` run without a driver:
``triton.compile(ASTSource(...), target=GPUTarget("cuda", capability, 32))`` lowers a kernel to a
cubin for that architecture and reports the shared memory one program needs
(``metadata.shared``, what Triton checks against the device at launch and raises
``OutOfResources`` for). The registers per thread and the spilled bytes come from the cubin,
read with the ``cuobjdump`` that ships with Triton.

The kernel's signature is specialised exactly as a launch would (Triton's own binder: ints equal
to 1 become constants, pointers and ints divisible by 16 get the divisibility attribute), with
:class:`triton.runtime.jit.MockTensor` in place of tensors (data pointer 0, i.e. 16-byte
aligned, as vLLM's caches and activations are). The binder and ``JITFunction._pack_args`` are
Triton 3.9's internals (the version the ``cpu`` extra pins); another Triton may move them.

Compile in processes that never had ``TRITON_INTERPRET`` set (:func:`compile_all`): under the
interpreter ``@triton.jit`` gives interpreted functions, which do not lower to GPU code.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import MockTensor, create_function_from_signature

from vllm_ddtree.attention import triton_tree

#: The architectures the tree kernel must launch on (compute capability -> its shared-memory
#: limit per block), from the package's own table.
ARCHITECTURES = {cap: triton_tree.SHARED_MEMORY_PER_BLOCK[cap] for cap in (80, 86, 89, 90, 100, 120)}
#: Head sizes vLLM serves with its Triton attention backend.
HEAD_SIZES = (64, 80, 96, 128, 192, 256)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@dataclass(frozen=True)
class Resources:
    """What one compiled program needs: shared memory (bytes), registers per thread, and bytes
    per thread spilled to local memory (cuobjdump's ``STACK``)."""

    shared: int
    registers: int
    spill: int


def compile_resources(kernel, capability: int, args: tuple, constexprs: dict,
                      num_warps: int, num_stages: int) -> Resources:
    """Compile ``kernel`` for ``sm_<capability>`` as a launch with these arguments would.

    Args:
        kernel: a ``@triton.jit`` function.
        capability: compute capability, e.g. 90.
        args: the kernel's leading positional arguments (tensors as ``MockTensor``).
        constexprs: the other arguments by name (the ``tl.constexpr`` ones and any runtime
            argument not in ``args``; omitted ones take their defaults).
        num_warps, num_stages: launch options.

    Raises:
        triton.runtime.errors.OutOfResources, CompilationError: as Triton raises them.
    """
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(constexprs, num_warps=num_warps, num_stages=num_stages, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, consts, attrs = kernel._pack_args(backend, kwargs, bound, specialization,
                                                          options)
    compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=target,
                              options=options.__dict__)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert m, usage
    return Resources(shared=int(compiled.metadata.shared), registers=int(m[1]), spill=int(m[2]))


@dataclass(frozen=True)
class TreeShape:
    """One attention layer's shape and a step's row count, as the tree kernel sees them."""

    dtype: torch.dtype
    head_size: int
    group: int
    rows: int
    num_kv_heads: int = 8
    block_size: int = 16


def tree_kernel_launch(shape: TreeShape, capability: int,
                       config: triton_tree.TreeKernelConfig | None = None) -> tuple:
    """``(args, constexprs, num_warps, num_stages)`` of the tree kernel for ``shape`` on
    ``sm_<capability>``, with the parameters :func:`tree_attention_paged` would choose there
    (or ``config``). Strides are those of vLLM's layouts: the query a view of the fused QKV
    projection, the cache ``[num_blocks, 2, block_size, num_kv_heads, head_size]``."""
    if config is None:
        config = triton_tree.choose_tree_kernel_config(
            shape.dtype, shape.head_size, shape.group, shape.rows, ARCHITECTURES[capability])
    d, hkv, bs = shape.head_size, shape.num_kv_heads, shape.block_size
    h = hkv * shape.group
    group_pad = triton.next_power_of_2(shape.group)
    data = [MockTensor(shape.dtype) for _ in range(4)]
    meta = [MockTensor(torch.int32) for _ in range(6)]
    cache = (2 * bs * hkv * d, hkv * d, d, 1)
    args = (*data, *meta, math.log2(math.e) / math.sqrt(d),
            (h + 2 * hkv) * d, d, 1, *cache, *cache, h * d, d, 1, 512)
    constexprs = dict(
        GROUP=shape.group, GROUP_PAD=group_pad, HEAD_SIZE=d,
        HEAD_PAD=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=bs,
        BLOCK_Q=max(config.block_m, group_pad) // group_pad, TILE_N=config.tile_n,
        DOT_PRECISION="ieee", DOT_UPCAST=False,
    )
    return args, constexprs, config.num_warps, config.num_stages


def tree_kernel_resources(shape: TreeShape, capability: int,
                          config: triton_tree.TreeKernelConfig | None = None) -> Resources:
    """Compile the tree kernel for ``shape`` on ``sm_<capability>`` (see :func:`tree_kernel_launch`)."""
    args, constexprs, warps, stages = tree_kernel_launch(shape, capability, config)
    return compile_resources(triton_tree._tree_attention_kernel, capability, args, constexprs,
                             warps, stages)


def compile_all(fn: Callable, cases: Sequence, workers: int = 2) -> list:
    """``[fn(case) for case in cases]``, in ``workers`` fresh processes without
    ``TRITON_INTERPRET`` (``ptxas`` is single-threaded; two processes use both cores here).
    ``fn`` must be importable by name (a module-level function)."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            return list(pool.map(fn, cases))
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
