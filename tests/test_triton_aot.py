"""The CUDA tree-attention kernel fits every GPU architecture we serve: ahead-of-time compilation.

The interpreter tests (``test_triton_tree_attention.py``) check the kernel's values; they cannot
see GPU resources. Here Triton's NVIDIA backend and bundled ``ptxas`` compile the kernel for
sm_80, sm_86, sm_89, sm_90, sm_100 and sm_120 on this CPU machine, with exactly the launch
parameters :func:`tree_attention_paged` chooses for each device's shared-memory limit, and the
test asserts that it compiles, that ``metadata.shared`` is within the architecture's limit,
that the package's own estimate (which the engine checks at start-up) is an upper bound, and
and that registers spill at most :data:`MAX_SPILL` bytes per thread to local memory (the
chooser's preferences were picked for none: at the KV block size 16 none spills; ptxas spills 16
bytes in one case found at block size 32).

The default run compiles, per architecture, the shapes whose chosen configuration needs the most
shared memory for each dtype; ``-m slow`` compiles one shape of every configuration class the
chooser picks over the whole grid (head sizes 64-256, fp16/bf16/fp32, GQA groups 1-16, trees of
1-1024 rows).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.support.triton_aot import (
    ARCHITECTURES,
    DTYPES,
    HEAD_SIZES,
    TreeShape,
    compile_all,
    tree_kernel_resources,
)
from vllm_ddtree.attention.triton_tree import (
    MAX_TREE_ROWS,
    TreeKernelConfig,
    TreeKernelResourceError,
    check_tree_kernel_fits,
    choose_tree_kernel_config,
    estimate_shared_bytes,
)

GROUPS = tuple(range(1, 17))
#: Bytes per thread a chosen configuration may spill (the kernel's old parameters: 664-36,448).
MAX_SPILL = 16
ROWS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 65, 129, 257, 513, MAX_TREE_ROWS)


def _grid():
    return [TreeShape(dt, d, g, r)
            for dt, d, g, r in itertools.product(DTYPES, HEAD_SIZES, GROUPS, ROWS)]


def _config(shape: TreeShape, cap: int) -> TreeKernelConfig:
    return choose_tree_kernel_config(shape.dtype, shape.head_size, shape.group, shape.rows,
                                     ARCHITECTURES[cap])


def _config_class(shape: TreeShape, cap: int):
    c = _config(shape, cap)
    head_pad = max(16, 1 << (shape.head_size - 1).bit_length())
    return shape.dtype, head_pad, c.block_m, c.tile_n, c.num_warps, c.num_stages


def _widest(shapes):
    """The shape with the widest non-power-of-two head and the largest group of ``shapes``
    (the most masking), to stand for its configuration class."""
    return max(shapes, key=lambda s: (s.head_size & (s.head_size - 1) != 0, s.head_size, s.group))


def _default_cases():
    cases = []
    for cap in ARCHITECTURES:
        for dtype in (torch.bfloat16, torch.float32):
            shapes = [s for s in _grid() if s.dtype == dtype]
            most = max(_config(s, cap).shared_bytes for s in shapes)
            cases.append((cap, _widest([s for s in shapes if _config(s, cap).shared_bytes == most])))
        cases.append((cap, TreeShape(torch.float16, 80, 3, 17)))
    # KV block sizes other than 16 (hybrid targets use large ones): the one spill found.
    cases.append((80, TreeShape(torch.bfloat16, 256, 4, 65, block_size=32)))
    cases.append((90, TreeShape(torch.bfloat16, 128, 4, 65, block_size=528)))
    return cases


def _slow_cases():
    classes = {}
    for cap in ARCHITECTURES:
        for s in _grid():
            classes.setdefault((cap, _config_class(s, cap)), []).append(s)
    return [(cap, _widest(shapes)) for (cap, _), shapes in classes.items()]


def _compile(case):
    cap, shape, *config = case
    return tree_kernel_resources(shape, cap, *config)


def _check_compiled(cases):
    results = compile_all(_compile, cases)
    failures = []
    for (cap, shape), res in zip(cases, results):
        config = _config(shape, cap)
        limit = ARCHITECTURES[cap]
        if not res.shared <= limit or not res.shared <= config.shared_bytes or res.spill > MAX_SPILL:
            failures.append(f"sm_{cap} {shape} {config}: {res} (limit {limit})")
    assert not failures, "\n".join(failures)


def test_chosen_configurations_fit_every_architecture_by_estimate():
    for cap, limit in ARCHITECTURES.items():
        for s in _grid():
            c = _config(s, cap)
            group_pad = 1 << (s.group - 1).bit_length()
            elem = torch.empty((), dtype=s.dtype).element_size()
            assert c.shared_bytes == estimate_shared_bytes(c.block_m, c.tile_n, s.head_size, elem)
            assert c.shared_bytes <= limit, (cap, s, c)
            assert c.block_m >= max(16, group_pad) and c.block_m % group_pad == 0, (cap, s, c)
            assert c.tile_n >= 16 and c.num_warps in (4, 8), (cap, s, c)


def test_chosen_configurations_compile_within_shared_memory():
    _check_compiled(_default_cases())


@pytest.mark.slow
def test_every_configuration_class_compiles_within_shared_memory():
    _check_compiled(_slow_cases())


def test_the_check_fails_on_the_launch_parameters_before_it():
    """Power check: the parameters the kernel used to launch with (``block_m`` up to 128, 64-key
    tiles, Triton's default 4 warps and 3 stages) overflow an A100's shared memory for a
    head-256 layer (Qwen3.5 / Qwen3.6 attention, Gemma), so the comparison above can fail."""
    shape = TreeShape(torch.bfloat16, 256, 4, 65)
    old = TreeKernelConfig(block_m=128, tile_n=64, num_warps=4, num_stages=3, shared_bytes=0)
    before, now = compile_all(_compile, [(80, shape, old), (80, shape)])
    assert before.shared > ARCHITECTURES[80], before
    assert now.shared <= ARCHITECTURES[80], now


def test_choice_steps_down_to_the_limit_and_fails_clearly_below_it():
    big = choose_tree_kernel_config(torch.bfloat16, 128, 4, 65, ARCHITECTURES[90])
    assert (big.block_m, big.tile_n, big.num_warps) == (64, 64, 8)
    small = choose_tree_kernel_config(torch.bfloat16, 128, 4, 65, big.shared_bytes - 1)
    assert small.shared_bytes < big.shared_bytes and small.block_m == 64 and small.tile_n == 32
    assert choose_tree_kernel_config(torch.bfloat16, 128, 4, 1, ARCHITECTURES[90]).block_m == 16
    interpreter = choose_tree_kernel_config(torch.bfloat16, 128, 4, 65, None)
    assert (interpreter.block_m, interpreter.tile_n) == (128, 64)  # fewest interpreted tiles
    least = estimate_shared_bytes(16, 16, 256, 4)
    assert choose_tree_kernel_config(torch.float32, 256, 16, 1024, least).tile_n == 16
    with pytest.raises(TreeKernelResourceError, match=r"head_size=256, dtype=float32.*allows"):
        choose_tree_kernel_config(torch.float32, 256, 16, 1024, least - 1)


def test_engine_start_up_check(monkeypatch):
    from vllm_ddtree.attention import triton_tree

    assert check_tree_kernel_fits(torch.bfloat16, 256, 4, "cpu") is None  # interpreter: no limit
    monkeypatch.setattr(triton_tree, "device_shared_memory_limit", lambda device: 101_376)
    assert check_tree_kernel_fits(torch.bfloat16, 256, 4, "cuda:0").shared_bytes <= 101_376
    monkeypatch.setattr(triton_tree, "device_shared_memory_limit", lambda device: 20_000)
    with pytest.raises(TreeKernelResourceError, match="allows 20000"):
        check_tree_kernel_fits(torch.bfloat16, 256, 4, "cuda:0")
