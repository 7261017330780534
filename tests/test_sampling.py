"""Lossless sampling at T > 0: DDTree's output distribution equals target-only decoding.

A tiny Qwen3 target with a 32-token vocabulary makes several continuations likely, so thousands
of short sequences give a sharp two-sample chi-square test. Requests are seeded (a different seed
per request), which makes every run of this test draw the same samples. The same test must fail
on the naive ``min(1, p/q)`` acceptance rule, which is biased on draft trees built from top-k
marginals — that shows it has power.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.support.models import (
    build_dflash_drafter,
    build_qwen3_target,
    build_small_vocab_tokenizer,
    make_llm,
    release_llm,
)

V = 32
N = 2000
PROMPT = [5, 17, 9, 23]
ALPHA = 1e-4  # per statistic; several statistics per configuration
ENGINE = dict(max_model_len=128, max_num_seqs=256, max_num_batched_tokens=16384)
CONFIGS = [
    dict(temperature=0.7),
    dict(temperature=1.0),
    dict(temperature=1.5),
    dict(temperature=1.0, top_p=0.8, top_k=10),
    dict(temperature=1.0, min_p=0.1),
]


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-vocab")
    tok = build_small_vocab_tokenizer(root / "tok", vocab_size=V)
    target = build_qwen3_target(root / "target", vocab_size=V, num_layers=2, tokenizer_dir=tok,
                                lm_head_std=0.15, seed=3)
    drafter = build_dflash_drafter(root / "drafter", target, target_layer_ids=[0])
    return target, drafter


def _params(**kw):
    from vllm import SamplingParams

    return [SamplingParams(max_tokens=4, ignore_eos=True, seed=1000 + i, **kw) for i in range(N)]


def _draw(llm, **kw):
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * N, _params(**kw),
                        use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def target_only(small_pair):
    target, _ = small_pair
    llm = make_llm(target, **ENGINE)
    try:
        yield {i: _draw(llm, **cfg) for i, cfg in enumerate(CONFIGS)}
    finally:
        release_llm(llm)


@pytest.fixture(scope="module")
def ddtree_llm(small_pair):
    target, drafter = small_pair
    llm = make_llm(target, speculative_config={
        "method": "ddtree", "model": str(drafter), "ddtree_budget": 16,
        "num_speculative_tokens": 3}, **ENGINE)
    try:
        yield llm
    finally:
        release_llm(llm)


def chi2_two_sample(a: list, b: list, min_expected: float = 5.0) -> float:
    """p-value of a chi-square homogeneity test between two samples of categories; categories
    with too little mass are pooled into one."""
    from scipy.stats import chi2

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    cells, pooled = [], [0, 0]
    for k in keys:
        tot = ca[k] + cb[k]
        if min(na, nb) * tot / (na + nb) >= min_expected:
            cells.append((ca[k], cb[k]))
        else:
            pooled[0] += ca[k]
            pooled[1] += cb[k]
    if sum(pooled):
        cells.append(tuple(pooled))
    stat = 0.0
    for x, y in cells:
        tot = x + y
        ex, ey = na * tot / (na + nb), nb * tot / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    dof = max(len(cells) - 1, 1)
    return float(chi2.sf(stat, dof))


def _statistics(seqs):
    # Token 0 comes from the prefill step; tokens 1..3 from tree verification steps.
    return {
        "token 1": [s[1] for s in seqs],
        "tokens 1-2": [s[1:3] for s in seqs],
        "token 3": [s[3] for s in seqs],
    }


def _p_values(ours, ref):
    a, b = _statistics(ours), _statistics(ref)
    return {k: chi2_two_sample(a[k], b[k]) for k in a}


def test_the_target_distribution_is_spread(target_only):
    """The test is only sharp if several continuations are likely."""
    firsts = Counter(s[1] for s in target_only[1])
    assert len([t for t, c in firsts.items() if c >= 0.05 * N]) >= 3


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_sampled_distribution_equals_target_only(ddtree_llm, target_only, i):
    from tests.support.recorder import recorded_verification

    with recorded_verification() as rec:
        ours = _draw(ddtree_llm, **CONFIGS[i])
    deep = [r for r in rec.records if len(r["accepted"]) > 1]
    assert len(deep) > 0.2 * len(rec.records), "trees were hardly ever accepted"
    p = _p_values(ours, target_only[i])
    assert min(p.values()) > ALPHA, (CONFIGS[i], p)


def test_naive_acceptance_rule_is_detected(ddtree_llm, target_only, monkeypatch):
    """Power check: the naive rule ``accept child c with prob min(1, p(c)/q(c))`` (q = the
    drafter's marginal), with a fresh target sample on rejection, is biased on DDTree's trees;
    the same statistics must reject it."""
    import vllm_ddtree.runners.v1.verify as verify

    real = verify.verify_tree_step
    gen = torch.Generator().manual_seed(0)

    def naive(logits, num_draft_tokens, step_requests, md, sampler, *rest):
        sampled, logprobs = real(logits, num_draft_tokens, step_requests, md, sampler, *rest)
        start = 0
        for b, n in enumerate(num_draft_tokens):
            req = step_requests.get(b)
            if req is not None:
                rows = logits[start : start + n + 1].float()
                probs = torch.softmax(rows / md.temperature[b], dim=-1)
                lp = req.tree.path_log_probs.tolist()
                maps = req.tree.child_maps
                cur, path, emitted = 0, [0], []
                while True:
                    for tok, child in sorted(maps[cur].items(), key=lambda kv: kv[1]):
                        q = math.exp(lp[child] - lp[cur])
                        if torch.rand((), generator=gen) < min(1.0, probs[cur, tok].item() / q):
                            cur = child
                            path.append(child)
                            emitted.append(tok)
                            break
                    else:
                        emitted.append(int(torch.multinomial(probs[cur], 1, generator=gen)))
                        break
                req.accepted = path
                sampled[b] = -1
                sampled[b, : len(emitted)] = torch.tensor(emitted, dtype=sampled.dtype)
            start += n + 1
        return sampled, logprobs

    monkeypatch.setattr(verify, "verify_tree_step", naive)
    ours = _draw(ddtree_llm, **CONFIGS[1])
    p = _p_values(ours, target_only[1])
    assert min(p.values()) < ALPHA, p


def test_seeded_requests_reproduce(ddtree_llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=s)
              for s in (1, 2, 3)]
    prompts = [TokensPrompt(prompt_token_ids=PROMPT)] * 3
    a = [o.outputs[0].token_ids for o in ddtree_llm.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in ddtree_llm.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # different seeds, different samples


def test_mixed_batch_logprobs_and_seeds(qwen3_target, dflash_drafter):
    """One batch mixing greedy and sampled requests (temperature, top-p, top-k, seeds, logprobs):
    greedy rows equal target-only token for token, reported logprobs equal target-only's for the
    same prefix, seeded sampled rows reproduce run to run."""
    from vllm import SamplingParams

    from tests.support.oracle_drafts import OracleDrafts, injected_drafts

    prompts = ["def main():\n", "import os\nimport sys\n", "class Foo:\n    def __init__(self):",
               "x = 1", "for i in range(3):\n"]
    mix = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7,
                       logprobs=2),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.05, max_tokens=24, ignore_eos=True,
                       seed=3),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0),
    ]
    greedy = [0, 2, 4]
    llm = make_llm(qwen3_target)
    ref = llm.generate(prompts, mix, use_tqdm=False)
    release_llm(llm)
    refs = {tuple(ref[i].prompt_token_ids): list(ref[i].outputs[0].token_ids) for i in greedy}
    llm = make_llm(qwen3_target, speculative_config={
        "method": "ddtree", "model": str(dflash_drafter), "ddtree_budget": 40})
    try:
        with injected_drafts(OracleDrafts(refs)):  # deep acceptance on greedy rows
            a = llm.generate(prompts, mix, use_tqdm=False)
            b = llm.generate(prompts, mix, use_tqdm=False)
    finally:
        release_llm(llm)
    for i in greedy:
        assert list(a[i].outputs[0].token_ids) == list(ref[i].outputs[0].token_ids)
    for i in range(len(prompts)):
        assert list(a[i].outputs[0].token_ids) == list(b[i].outputs[0].token_ids), i
    checked = 0
    for i in (0, 4):
        got, want = a[i].outputs[0].logprobs, ref[i].outputs[0].logprobs
        assert len(got) == len(want) == len(a[i].outputs[0].token_ids)
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            for tok in g:
                assert abs(g[tok].logprob - w[tok].logprob) < 1e-4
                assert g[tok].rank == w[tok].rank
                checked += 1
    assert checked > 40
    # the sampled request's logprobs are those of its own emitted tokens
    lp = a[1].outputs[0].logprobs
    assert all(t in step for t, step in zip(a[1].outputs[0].token_ids, lp))


def _sampling_metadata(num_reqs: int, generators: dict, temperature: float = 1.0):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((num_reqs,), temperature), all_greedy=False, all_random=True,
        top_p=None, top_k=None, generators=generators, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(num_reqs),
        presence_penalties=torch.zeros(num_reqs), repetition_penalties=torch.ones(num_reqs),
        output_token_ids=[[] for _ in range(num_reqs)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def test_seeded_tree_noise_is_keyed_by_position():
    """A seeded request's sample at a tree node depends on its seed and the node's token position
    only: two trees of different size and shape, given the same logits per depth, draw the same
    token at every depth; the request's own generator stream is not advanced; another seed or
    another context length draws other tokens."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_ddtree.tree import build_draft_tree
    from vllm_ddtree.runners.v1.verify import sample_nodes
    from vllm_ddtree.verify import position_seeds

    g = torch.Generator().manual_seed(5)
    drafter = torch.log_softmax(torch.randn(4, 64, generator=g), -1)
    depth_logits = 0.3 * torch.randn(5, 64, generator=g)  # flat: every draw is a real draw
    small, large = build_draft_tree(drafter, 3), build_draft_tree(drafter, 40)
    assert small.max_depth < large.max_depth

    def choices(tree, seed, context_len=20):
        stream = torch.Generator().manual_seed(99)
        before = stream.get_state()
        seeds = position_seeds(seed, context_len + 1 + tree.depths.numpy())
        out = sample_nodes(depth_logits[tree.depths], [tree.num_nodes + 1],
                           _sampling_metadata(1, {0: stream}), Sampler(), None, {0: seeds})
        assert torch.equal(stream.get_state(), before), "the request's stream was advanced"
        by_depth = {}
        for d, c in zip(tree.depths.tolist(), out.tolist()):
            assert by_depth.setdefault(d, c) == c, "two nodes of one depth drew differently"
        return by_depth

    for seed in (0, 7, 2**40 + 3, -1):
        a, b = choices(small, seed), choices(large, seed)
        assert a == {d: b[d] for d in a}
    draws = [tuple(choices(large, s).values()) for s in range(20)]
    assert len(set(draws)) == 20
    assert len({tuple(choices(large, 7, n).values()) for n in (20, 21, 22, 23)}) == 4
    assert position_seeds(1, [5, 6]) != position_seeds(2, [5, 6])
    assert position_seeds(1, [5, 6]) == position_seeds(1, [5, 6])


def test_v1_verification_lays_out_the_walk_like_vllms_rejection_sampler():
    """The V1 adapter's verification (greedy, with logprobs) on a batch of two trees and one
    request without drafts: per request the argmax at each accepted node, then -1 padding;
    each emitted token's logprob is read from the node that emitted it. The drafts are steered so
    the walk leaves the spine (a second child is accepted)."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from vllm_ddtree.runners.v1.verify import verify_tree_step
    from vllm_ddtree.step import StepRequest
    from vllm_ddtree.tree import build_draft_tree

    g = torch.Generator().manual_seed(3)
    vocab = 32
    trees = {b: build_draft_tree(torch.log_softmax(torch.randn(3, vocab, generator=g), -1), n)
             for b, n in ((0, 7), (2, 4))}
    counts = [trees[0].num_nodes + 1, 1, trees[2].num_nodes + 1]
    logits = torch.randn(sum(counts), vocab, generator=g)
    start = {0: 0, 2: counts[0] + counts[1]}
    # Request 0: root -> its second child (off the spine) -> bonus token 5.
    second = sorted(trees[0].child_maps[0].items(), key=lambda kv: kv[1])[1]
    logits[start[0], second[0]] += 50.0
    logits[start[0] + second[1]] = 0.0
    logits[start[0] + second[1], 5] = 50.0
    reqs = {b: StepRequest(f"r{b}", b, start[b], 10, t, True) for b, t in trees.items()}
    md = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=1, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(3), presence_penalties=torch.zeros(3),
        repetition_penalties=torch.ones(3), output_token_ids=[[], [], []],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    out, logprobs = verify_tree_step(logits, [c - 1 for c in counts], reqs, md, Sampler())
    assert reqs[0].accepted[:2] == [0, second[1]] and out[0, :2].tolist() == [second[0], 5]
    argmax = logits.argmax(-1)
    width = max(counts)
    assert out.shape == (3, width) and out.dtype == torch.int32
    lp = torch.log_softmax(logits, -1)
    for b in range(3):
        nodes = reqs[b].accepted if b in reqs else [0]
        base = sum(counts[:b])
        rows = [base + a for a in nodes]
        assert out[b, : len(nodes)].tolist() == argmax[rows].tolist()
        assert (out[b, len(nodes):] == -1).all()
        got = logprobs.logprobs[b * width : b * width + len(nodes), 0]
        torch.testing.assert_close(got, lp[rows, argmax[rows]])
