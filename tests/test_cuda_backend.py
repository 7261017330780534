"""The CUDA tree-attention backend (``vllm_ddtree.attention.cuda``) and backend selection.

No GPU here: the impl runs on CPU tensors with its Triton kernel under Triton's interpreter
(``TRITON_INTERPRET=1``, set by conftest before Triton is imported), against the torch reference
:func:`vllm_ddtree.attention.paged.tree_attention_reference` over K/V gathered from vLLM's logical
Triton cache layout. What these tests cannot cover is said in docs/architecture.md (the runner
glue on a CUDA device and CUDA-graph replay).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from vllm_ddtree.attention import cuda as tree_cuda
from vllm_ddtree.attention.common import TreeAttentionRequest
from vllm_ddtree.attention.paged import tree_attention_reference
from vllm_ddtree.attention.selection import tree_attention_backend
from vllm_ddtree.attention.triton_tree import unpack_tree_mask
from vllm_ddtree.config import DDTreeConfigError

try:
    import triton  # noqa: F401

    _NO_KERNEL = None if os.environ.get("TRITON_INTERPRET") == "1" else "TRITON_INTERPRET != 1"
except ImportError:
    _NO_KERNEL = "triton is not installed"
needs_kernel = pytest.mark.skipif(_NO_KERNEL is not None, reason=_NO_KERNEL or "")

HEADS, KV_HEADS, HEAD, BLOCK = 4, 2, 32, 16


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    m = len(parents)
    mask = torch.zeros(m, m, dtype=torch.bool)
    for i in range(m):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def make_impl(verify_len: int | None = 8, **kw) -> tree_cuda.DDTreeTritonAttentionImpl:
    impl = tree_cuda.DDTreeTritonAttentionImpl(
        HEADS, HEAD, HEAD**-0.5, KV_HEADS, None, kw.pop("sliding_window", None), "auto", **kw)
    impl.verify_len = verify_len
    return impl


def logical_cache(num_blocks: int, layout: str, gen: torch.Generator,
                  dtype=torch.float32) -> torch.Tensor:
    """vLLM's logical Triton cache ``[num_blocks, Hkv, block_size, 2 * D]`` in a physical
    layout: ``"HND"`` contiguous, or ``"NHD"`` (physically ``[num_blocks, block, Hkv, 2D]``)."""
    if layout == "HND":
        return torch.randn(num_blocks, KV_HEADS, BLOCK, 2 * HEAD, generator=gen).to(dtype)
    raw = torch.randn(num_blocks, BLOCK, KV_HEADS, 2 * HEAD, generator=gen).to(dtype)
    return raw.permute(0, 2, 1, 3)


class Batch:
    """Requests with ``q_lens`` rows and ``seq_lens`` tokens, a tree of ``trees[r]`` (parents
    list or None) on the last rows, K/V already in a random-permutation block table."""

    def __init__(self, q_lens, seq_lens, trees, layout="NHD", seed=0, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.seq_lens_l, self.trees = q_lens, seq_lens, trees
        max_blocks = max(-(-s // BLOCK) for s in seq_lens)
        num_blocks = len(q_lens) * max_blocks + 2
        self.kv_cache = logical_cache(num_blocks, layout, gen, dtype)
        perm = torch.randperm(num_blocks, generator=gen)[: len(q_lens) * max_blocks]
        self.block_table = perm.view(len(q_lens), max_blocks).to(torch.int32)
        qsl = [0]
        for q in q_lens:
            qsl.append(qsl[-1] + q)
        self.qsl = qsl
        self.query = torch.randn(qsl[-1] + 3, HEADS, HEAD, generator=gen).to(dtype)  # 3 padding
        self.requests = []
        for b, parents in enumerate(trees):
            if parents is None:
                continue
            m = len(parents)
            self.requests.append(TreeAttentionRequest(
                batch_index=b, query_start=qsl[b + 1] - m, num_rows=m,
                context_len=seq_lens[b] - m, ancestor_mask=ancestor_mask(parents)))

    def metadata(self, causal=True):
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

        return TritonAttentionMetadata(
            num_actual_tokens=self.qsl[-1], max_query_len=max(self.q_lens),
            query_start_loc=torch.tensor(self.qsl, dtype=torch.int32), max_seq_len=max(
                self.seq_lens_l), seq_lens=torch.tensor(self.seq_lens_l, dtype=torch.int32),
            block_table=self.block_table, slot_mapping=torch.zeros(0, dtype=torch.int64),
            seq_threshold_3D=0, num_par_softmax_segments=0, softmax_segm_output=None,
            softmax_segm_max=None, softmax_segm_expsum=None, causal=causal)

    def forward(self, impl, causal=True):
        out = torch.full_like(self.query, 7.0)
        impl.forward(None, self.query, None, None, self.kv_cache, self.metadata(causal), out)
        return out

    def reference(self, with_trees=True):
        """Per request: prefix causal rows, tree rows under their ancestor mask."""
        key_cache, value_cache = self.kv_cache.transpose(1, 2).split(HEAD, dim=-1)
        out = torch.full_like(self.query, 7.0)
        for b, q_len in enumerate(self.q_lens):
            s = self.seq_lens_l[b]
            pos = torch.arange(s)
            blocks = self.block_table[b, pos // BLOCK].long()
            k, v = key_cache[blocks, pos % BLOCK], value_cache[blocks, pos % BLOCK]
            mask = torch.ones(q_len, q_len, dtype=torch.bool).tril()
            parents = self.trees[b]
            if with_trees and parents is not None:
                m = len(parents)
                mask[q_len - m:, q_len - m:] = ancestor_mask(parents)
            lo = self.qsl[b]
            out[lo:lo + q_len] = tree_attention_reference(
                self.query[lo:lo + q_len], k, v, s - q_len, mask, HEAD**-0.5)
        return out


# A decode row, a tree after a 3-token prefix of the same request, a chain-verified request (no
# tree: causal), a 9-node tree at context 0, and a bushy tree (every node a child of the root).
MIXED = dict(q_lens=[1, 8, 4, 9, 6], seq_lens=[17, 40, 21, 9, 33],
             trees=[None, [-1, 0, 1, 0, 3], None, [-1, 0, 1, 1, 0, 4, 5, 2, 7],
                    [-1, 0, 0, 0, 0, 0]])


@pytest.fixture
def buffers():
    """Engine buffers installed for the test, uninstalled after."""
    bufs = tree_cuda.allocate_engine_tree_masks(max_num_seqs=8, budget=10, device="cpu")
    tree_cuda.install_tree_mask_buffers(bufs)
    yield bufs
    tree_cuda.install_tree_mask_buffers(None)


@needs_kernel
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_tree_rows_see_only_ancestors(buffers, layout):
    batch = Batch(**MIXED, layout=layout)
    impl = make_impl(verify_len=10)
    tree_cuda.publish_tree_masks(batch.requests, batch.qsl, len(batch.q_lens))
    got = batch.forward(impl)
    ref = batch.reference()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    assert torch.all(got[batch.qsl[-1]:] == 7.0), "padding rows were written"
    # With the masks cleared the same rows are plain causal, which differs on every tree row that
    # has a sibling branch before it: the masks are what the kernel read.
    tree_cuda.clear_tree_masks()
    causal = batch.forward(impl)
    torch.testing.assert_close(causal, batch.reference(with_trees=False), atol=2e-5, rtol=1e-5)
    assert not torch.allclose(causal[batch.qsl[1]:batch.qsl[2]], got[batch.qsl[1]:batch.qsl[2]])


@needs_kernel
def test_bf16_tree_rows(buffers):
    batch = Batch(**MIXED, dtype=torch.bfloat16, seed=3)
    tree_cuda.publish_tree_masks(batch.requests, batch.qsl, len(batch.q_lens))
    got = batch.forward(make_impl(verify_len=10))
    torch.testing.assert_close(got.float(), batch.reference().float(), atol=2e-2, rtol=2e-2)


@needs_kernel
def test_prefill_batch_sharing_a_step_with_trees_uses_the_tree_kernel(buffers):
    """A batch longer than verify_len runs vLLM's kernel unless trees are published for it."""
    batch = Batch(q_lens=[30, 6], seq_lens=[30, 50], trees=[None, [-1, 0, 0, 1, 2, 2]], seed=5)
    impl = make_impl(verify_len=6)
    tree_cuda.publish_tree_masks(batch.requests, batch.qsl, 2)
    torch.testing.assert_close(batch.forward(impl), batch.reference(), atol=2e-5, rtol=1e-5)


def test_dispatch_to_vllm_kernel(buffers, monkeypatch):
    """vLLM's own forward runs outside DDTree engines, for non-causal (DFlash drafter) metadata,
    and for long batches without published trees (prefill): the tree kernel is never called."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    calls = []
    monkeypatch.setattr(TritonAttentionImpl, "forward",
                        lambda self, *a, **k: calls.append("vllm") or a[-1])
    monkeypatch.setattr(tree_cuda, "tree_attention_paged",
                        lambda *a, **k: calls.append("tree"))
    long_batch = Batch(q_lens=[30, 2], seq_lens=[30, 9], trees=[None, None])
    short = Batch(q_lens=[1, 5], seq_lens=[9, 20], trees=[None, [-1, 0, 0, 1, 1]])
    cases = [
        (make_impl(verify_len=None), short, True, "vllm"),   # not a DDTree engine
        (make_impl(verify_len=8), short, False, "vllm"),     # non-causal drafter
        (make_impl(verify_len=8), long_batch, True, "vllm"),  # prefill, nothing published
        (make_impl(verify_len=8), short, True, "tree"),      # verification-sized batch
    ]
    for impl, batch, causal, want in cases:
        calls.clear()
        batch.forward(impl, causal=causal)
        assert calls == [want]
    tree_cuda.install_tree_mask_buffers(None)  # no buffers: vLLM's kernel
    calls.clear()
    short.forward(make_impl(verify_len=8))
    assert calls == ["vllm"]


def test_unsupported_layer_features_are_refused(buffers):
    batch = Batch(q_lens=[5], seq_lens=[20], trees=[[-1, 0, 0, 1, 1]])
    with pytest.raises(NotImplementedError, match="sliding window"):
        batch.forward(make_impl(verify_len=8, sliding_window=8))


def test_engine_verify_len_from_the_config_being_built(monkeypatch):
    import vllm.config.vllm

    class Spec:
        num_speculative_tokens = 24

    class Cfg:
        speculative_config = Spec()
        additional_config = {"ddtree": {"budget": 24, "drafter_horizon": 15,
                                        "drafter": "d", "max_children": None}}

    monkeypatch.setattr(vllm.config.vllm, "get_current_vllm_config_or_none", lambda: Cfg())
    monkeypatch.setattr("vllm_ddtree.config.get_ddtree_config", lambda cfg: object())
    assert tree_cuda._engine_verify_len() == 25
    monkeypatch.setattr("vllm_ddtree.config.get_ddtree_config", lambda cfg: None)
    assert tree_cuda._engine_verify_len() is None
    monkeypatch.setattr(vllm.config.vllm, "get_current_vllm_config_or_none", lambda: None)
    assert tree_cuda._engine_verify_len() is None


def test_a_layer_the_kernel_cannot_fit_stops_the_engine_at_start_up(monkeypatch):
    """On a GPU whose shared memory cannot hold even the kernel's smallest tiles for a layer,
    building the layer in a DDTree engine fails naming the shape and the limit (never the first
    tree step)."""
    from vllm_ddtree.attention import triton_tree

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_tree, "device_shared_memory_limit", lambda device: 101_376)
    monkeypatch.setattr(tree_cuda, "_engine_verify_len", lambda: 8)
    assert make_impl().verify_len == 8  # fits a 99 KiB GPU
    monkeypatch.setattr(triton_tree, "device_shared_memory_limit", lambda device: 4_096)
    with pytest.raises(triton_tree.TreeKernelResourceError,
                       match=rf"head_size={HEAD}, dtype=float32, GQA group .*allows 4096"):
        make_impl()
    monkeypatch.setattr(tree_cuda, "_engine_verify_len", lambda: None)
    assert make_impl(verify_len=None).verify_len is None  # not a DDTree engine: vLLM's own


def test_publish_writes_in_place_and_clear_resets(buffers):
    ptrs = [t.data_ptr() for t in (buffers.tree_start, buffers.tree_mask,
                                   buffers.tree_mask_offsets)]
    batch = Batch(**MIXED)
    tree_cuda.publish_tree_masks(batch.requests, batch.qsl, len(batch.q_lens))
    assert buffers.tree_start.tolist() == [-1, 3, -1, 0, 0, -1, -1, -1]
    for req in batch.requests:
        b = req.batch_index
        got = unpack_tree_mask(buffers.tree_mask, int(buffers.tree_mask_offsets[b]), req.num_rows)
        assert torch.equal(got, req.ancestor_mask)
    tree_cuda.clear_tree_masks()
    assert buffers.tree_start.tolist() == [-1] * 8
    assert ptrs == [t.data_ptr() for t in (buffers.tree_start, buffers.tree_mask,
                                           buffers.tree_mask_offsets)]  # CUDA-graph safe


def test_publish_errors(buffers):
    batch = Batch(**MIXED)
    bad = TreeAttentionRequest(batch_index=1, query_start=batch.qsl[1], num_rows=5,
                               context_len=35, ancestor_mask=ancestor_mask([-1, 0, 1, 0, 3]))
    with pytest.raises(ValueError, match="do not end at the request's last row"):
        tree_cuda.publish_tree_masks([bad], batch.qsl, len(batch.q_lens))
    with pytest.raises(ValueError, match="outside the step"):
        tree_cuda.publish_tree_masks(batch.requests, batch.qsl[:3], 2)
    tree_cuda.install_tree_mask_buffers(None)
    with pytest.raises(RuntimeError, match="no tree-mask buffers"):
        tree_cuda.publish_tree_masks(batch.requests, batch.qsl, len(batch.q_lens))
    with pytest.raises(ValueError, match="at most 1024 rows"):
        tree_cuda.allocate_engine_tree_masks(4, 1024, "cpu")


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_kv_slots_on_the_triton_layout(layout):
    """KV compaction in the cache: overlapping sources and destinations, read before written."""
    gen = torch.Generator().manual_seed(1)
    cache = logical_cache(6, layout, gen)
    before = cache.clone()
    src = torch.tensor([17, 18, 40, 41], dtype=torch.int64)
    dst = torch.tensor([16, 17, 18, 19], dtype=torch.int64)  # 17, 18 are also sources
    make_impl().copy_kv_slots(cache, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(cache[d // BLOCK, :, d % BLOCK], before[s // BLOCK, :, s % BLOCK])
    touched = torch.zeros(6, BLOCK, dtype=torch.bool)
    touched[dst // BLOCK, dst % BLOCK] = True
    assert torch.equal(cache.transpose(1, 2)[~touched], before.transpose(1, 2)[~touched])


def test_compact_kv_in_cache_moves_accepted_nodes():
    from vllm_ddtree.commit import compact_kv_in_cache
    from vllm_ddtree.step import StepRequest
    from vllm_ddtree.tree import chain_tree

    class Impl:
        def __init__(self):
            self.calls = []

        def copy_kv_slots(self, kv_cache, src, dst):
            self.calls.append((src.tolist(), dst.tolist()))

    tree = chain_tree(torch.tensor([5, 6, 7, 8]))
    reqs = [StepRequest("a", 0, root_row=0, context_len=10, tree=tree, is_tree=True,
                        accepted=[0, 2, 4]),
            StepRequest("b", 1, root_row=5, context_len=3, tree=tree, is_tree=True,
                        accepted=[0, 1]),       # already in place: nothing to move
            StepRequest("c", 2, root_row=10, context_len=7, tree=tree, is_tree=False,
                        accepted=[0, 3])]       # chain-verified: never moved
    slots = torch.arange(100, 115, dtype=torch.int64)
    impls = {"l0": Impl(), "l1": Impl()}
    moved = compact_kv_in_cache({n: (i, torch.zeros(1)) for n, i in impls.items()}, reqs,
                                {"l0": slots, "l1": slots + 1000})
    assert moved == 2
    assert impls["l0"].calls == [([102, 104], [101, 102])]
    assert impls["l1"].calls == [([1102, 1104], [1101, 1102])]


def test_full_cudagraphs_of_mixed_batches_are_refused():
    from vllm.config import CUDAGraphMode

    with pytest.raises(DDTreeConfigError, match="cudagraph_mode=FULL "):
        tree_cuda.check_cudagraph_mode(CUDAGraphMode.FULL)
    for ok in (CUDAGraphMode.FULL_AND_PIECEWISE, CUDAGraphMode.FULL_DECODE_ONLY,
               CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE, None):
        tree_cuda.check_cudagraph_mode(ok)


# --------------------------------------------------------------------------- selection


@pytest.mark.parametrize("platform,named,want", [
    ("cuda", None, "TRITON_ATTN"), ("cuda", "auto", "TRITON_ATTN"),
    ("cuda", "TRITON_ATTN", "TRITON_ATTN"), ("cpu", None, "CPU_ATTN"),
    ("cpu", "CPU_ATTN", "CPU_ATTN"),
])
def test_tree_backend_selected(platform, named, want):
    assert tree_attention_backend(platform, named) == want


@pytest.mark.parametrize("kw,match", [
    (dict(platform="cuda", named="FLASH_ATTN"), "attention_backend=FLASH_ATTN"),
    (dict(platform="cuda", named="FLASHINFER"), "attention_backend=FLASHINFER"),
    (dict(platform="cpu", named="TRITON_ATTN"), "on cpu DDTree uses CPU_ATTN"),
    (dict(platform="cuda", per_kind={"full_attention": "FLASH_ATTN"}), "backend_per_kind"),
    (dict(platform="cuda", kv_cache_dtype="fp8"), "kv_cache_dtype='fp8'"),
    (dict(platform="rocm"), "platform 'rocm'"),
])
def test_tree_backend_refusals(kw, match):
    with pytest.raises(DDTreeConfigError, match=match):
        tree_attention_backend(**kw)


def test_engine_args_named_backend_is_a_start_up_error(qwen3_target, dflash_drafter):
    from vllm.engine.arg_utils import EngineArgs

    for kw, match in (({"attention_backend": "FLASH_ATTN"}, "attention_backend=FLASH_ATTN"),
                      ({"attention_config": {"backend": "FLASHINFER"}},
                       "attention_config.backend=FLASHINFER"),
                      ({"attention_backend": "NOPE"}, "'NOPE' is not an attention backend"),
                      ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype")):
        args = EngineArgs(model=str(qwen3_target), dtype="float32", max_model_len=512, **kw,
                          speculative_config={"method": "ddtree", "model": str(dflash_drafter)})
        with pytest.raises(DDTreeConfigError, match=match):
            args.create_engine_config()


# --------------------------------------------------------------------------- in a vLLM engine


def test_triton_backend_in_a_cpu_engine_is_exact(qwen3_target, dflash_drafter, monkeypatch):
    """The CUDA path end to end, minus the GPU: a CPU engine with the Triton tree backend
    (:mod:`tests.support.triton_cpu`; kernel interpreted), so the runner allocates, writes
    and clears the static mask buffers and compacts KV inside the cache. Greedy output equals
    target-only decoding (vLLM's CPU backend) with injected drafts whose accepted paths leave the
    spine, including a chunked prefill sharing steps with trees."""
    from vllm import SamplingParams

    from vllm_ddtree import commit
    from tests.support.models import make_llm, release_llm
    from tests.support.oracle_drafts import OracleDrafts, injected_drafts
    from tests.support.recorder import recorded_verification
    from tests.support.triton_cpu import triton_backend_on_cpu

    if _NO_KERNEL is not None:
        pytest.skip(_NO_KERNEL)
    import os as _os

    long_prompt = (Path(_os.__file__).parent / "textwrap.py").read_text()[:400]
    prompts = ["def main():\n", "import os\nimport sys\n", long_prompt,
               "class Foo:\n    def __init__(self):", "x = 1"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
              for m in (30, 14, 24, 27, 9)]
    engine = dict(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4)
    llm = make_llm(qwen3_target, **engine)
    ref = llm.generate(prompts, params)
    release_llm(llm)
    want = [list(o.outputs[0].token_ids) for o in ref]
    refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ref}

    counts = {"kernel": 0, "moved": 0}
    kernel, compact = tree_cuda.tree_attention_paged, commit.compact_kv_in_cache

    def counting_kernel(*a, **k):
        counts["kernel"] += 1
        return kernel(*a, **k)

    def counting_compact(*a, **k):
        n = compact(*a, **k)
        counts["moved"] += n
        return n

    monkeypatch.setattr(tree_cuda, "tree_attention_paged", counting_kernel)
    monkeypatch.setattr(commit, "compact_kv_in_cache", counting_compact)
    spec = {"method": "ddtree", "model": str(dflash_drafter), "ddtree_budget": 24}
    with triton_backend_on_cpu():
        llm = make_llm(qwen3_target, speculative_config=spec, **engine)
        try:
            assert tree_cuda.installed_tree_mask_buffers() is not None
            # (Only injected drafts: with the random drafter every step verifies one token and
            # the interpreted kernel makes ~30 such steps cost minutes.)
            oracle = OracleDrafts(refs, lambda depth, i: 1 if i % 7 == 3 else 0)
            with injected_drafts(oracle), recorded_verification() as rec:
                got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            assert got == want
            # cleared after every target forward: no later forward can read a stale tree
            assert bool((tree_cuda.installed_tree_mask_buffers().tree_start == -1).all())
        finally:
            release_llm(llm)
            tree_cuda.install_tree_mask_buffers(None)
    accepted = [r["accepted"] for r in rec.records]
    assert max(len(a) - 1 for a in accepted) >= 6
    assert any(any(n != j for j, n in enumerate(a)) for a in accepted), "no off-spine path"
    assert counts["kernel"] > 0 and counts["moved"] > 0, counts
