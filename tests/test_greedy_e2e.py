"""Greedy DDTree through vLLM equals target-only decoding, token for token.

Random drafters accept almost nothing, so most runs also inject draft distributions built from the
target's own greedy continuation (``tests.support.oracle_drafts``): deep acceptance, and
accepted paths that leave the top-1 spine, which only stay lossless if positions, tree attention
and KV compaction are all right.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.models import make_llm, release_llm
from tests.support.oracle_drafts import OracleDrafts, injected_drafts
from tests.support.recorder import recorded_verification

L = 15  # the fixture drafter: block_size 16
ENGINE = dict(max_model_len=1024, max_num_batched_tokens=128, max_num_seqs=8)


def _stdlib_text(name: str, start: int, n_chars: int) -> str:
    import os

    path = Path(os.__file__).parent / name
    return path.read_text()[start : start + n_chars]


PROMPTS = [
    "def main():\n",
    "import os\nimport sys\n",
    "class Foo:\n    def __init__(self):",
    "x = 1",
    # longer than max_num_batched_tokens (128): chunked prefill
    _stdlib_text("textwrap.py", 0, 1200),
    "for i in range(10):\n    print(i)\n",
    _stdlib_text("shutil.py", 2000, 900),
    "return None\n",
]
MAX_TOKENS = [48, 33, 61, 17, 40, 29, 55, 12]  # requests finish at different steps


def _params(**kw):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kw) for m in MAX_TOKENS]


def _token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


def _spine_with_sidesteps(depth: int, index: int) -> int:
    # Every 7th output token is the drafter's second choice: accepted paths leave the spine.
    return 1 if index % 7 == 3 else 0


def _ddtree(target, drafter, budget, **kw):
    spec = {"method": "ddtree", "model": str(drafter), "ddtree_budget": budget}
    return make_llm(target, speculative_config=spec, **{**ENGINE, **kw})


def _spec_metrics(llm):
    m = {}
    for x in llm.get_metrics():
        if x.name.startswith("vllm:spec_decode"):
            m[x.name] = getattr(x, "values", None) or getattr(x, "value", None)
    return m


@pytest.fixture(scope="module")
def reference(qwen3_target):
    """Target-only greedy outputs: plain, and with stop tokens picked inside the continuation."""
    llm = make_llm(qwen3_target, **ENGINE)
    plain = llm.generate(PROMPTS, _params())
    ids = _token_ids(plain)
    from vllm import SamplingParams

    # A stop token that first occurs mid-continuation, per prompt.
    stop_params = []
    for toks, m in zip(ids, MAX_TOKENS):
        stop = toks[min(len(toks) - 1, 9)]
        stop_params.append(SamplingParams(temperature=0, max_tokens=m, stop_token_ids=[stop]))
    stopped = _token_ids(llm.generate(PROMPTS, stop_params))
    release_llm(llm)
    refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in plain}
    return dict(ids=ids, stop_params=stop_params, stopped=stopped, refs=refs)


@pytest.mark.parametrize("budget", [1, 4, 15, 16, 40, 64])
def test_greedy_equals_target_only(qwen3_target, dflash_drafter, reference, budget):
    llm = _ddtree(qwen3_target, dflash_drafter, budget)
    try:
        # The random drafter: almost nothing accepted, output still exact.
        assert _token_ids(llm.generate(PROMPTS, _params())) == reference["ids"]

        oracle = OracleDrafts(reference["refs"], _spine_with_sidesteps)
        before = _spec_metrics(llm)
        with injected_drafts(oracle), recorded_verification() as rec:
            got = _token_ids(llm.generate(PROMPTS, _params()))
        after = _spec_metrics(llm)
        assert got == reference["ids"]
        assert oracle.hits, "the injected drafts never reached the proposer"

        # The whole top-1 spine correct: the deepest trees are accepted in full.
        with injected_drafts(OracleDrafts(reference["refs"], rank_gap=8.0)), \
                recorded_verification() as spine_rec:
            assert _token_ids(llm.generate(PROMPTS, _params())) == reference["ids"]

        # Stop tokens inside accepted paths: nothing after them is emitted.
        with injected_drafts(oracle):
            assert _token_ids(llm.generate(PROMPTS, reference["stop_params"])) == reference[
                "stopped"
            ]
    finally:
        release_llm(llm)

    accepted = [r["accepted"] for r in rec.records]
    depths = [len(a) - 1 for a in accepted]
    spine_depths = [len(r["accepted"]) - 1 for r in spine_rec.records]
    assert max(spine_depths) == min(budget, L), "a correct spine must be accepted in full"
    assert max(depths) >= min(budget, 6)
    if budget > L:
        # Branching trees: some accepted path leaves the top-1 spine (node index != depth).
        off_spine = [a for a in accepted if any(node != j for j, node in enumerate(a))]
        assert off_spine, "no accepted path off the spine: compaction was not exercised"
    # vLLM's counters stay truthful: accepted drafts per step and per-depth acceptance.
    drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    acc = after["vllm:spec_decode_num_accepted_tokens"] - (
        before.get("vllm:spec_decode_num_accepted_tokens") or 0
    )
    assert drafts == len(rec.records)
    assert acc == sum(depths)
    per_pos_after = after["vllm:spec_decode_num_accepted_tokens_per_pos"]
    per_pos_before = before["vllm:spec_decode_num_accepted_tokens_per_pos"]
    per_pos = [a - b for a, b in zip(per_pos_after, per_pos_before)]
    for d in range(1, L + 1):
        assert per_pos[d - 1] == sum(1 for x in depths if x >= d), f"depth {d}"


@pytest.fixture(scope="module")
def recorded_b40(qwen3_target, dflash_drafter, reference):
    """One injected DDTree run at B = 40 with every verified step recorded, plus each request's
    full token sequence and a Hugging Face copy of the target (the oracles below)."""
    from transformers import AutoModelForCausalLM

    llm = _ddtree(qwen3_target, dflash_drafter, 40)
    oracle = OracleDrafts(reference["refs"], _spine_with_sidesteps)
    try:
        with injected_drafts(oracle), recorded_verification() as rec:
            outs = llm.generate(PROMPTS[:4], _params()[:4])
    finally:
        release_llm(llm)
    full = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_target), dtype=torch.float32).eval()
    return rec, full, hf


def test_node_logits_equal_ancestor_chain(recorded_b40):
    """Node-context oracle: each tree node's target logits equal the logits of running its
    ancestor path alone as a chain (Hugging Face transformers, fp32). Catches wrong positions
    and masks."""
    rec, full, hf = recorded_b40
    checked = 0
    for r in [r for r in rec.records if r["is_tree"]][:6]:
        seq = full[r["req_id"].split("-")[0]]
        tree = r["tree"]
        parents = tree.parents.tolist()
        tokens = [seq[r["context_len"]]] + tree.token_ids.tolist()  # root (bonus) + nodes
        for i in range(tree.num_nodes + 1):
            path, j = [], i
            while j >= 0:
                path.append(tokens[j])
                j = parents[j]
            chain = seq[: r["context_len"]] + path[::-1]
            with torch.no_grad():
                want = hf(torch.tensor([chain])).logits[0, -1]
            torch.testing.assert_close(r["logits"][i], want, atol=2e-3, rtol=2e-3)
            checked += 1
    assert checked > 40


def test_drafter_context_is_the_accepted_path(recorded_b40, dflash_drafter):
    """After an accepted path leaves the spine, the rows the next DFlash pass reads hold the
    target's tapped hidden states of root + accepted path, in path order (equal to a chain run
    of the same tokens in Hugging Face transformers)."""
    from tests.support.models import read_config

    rec, full, hf = recorded_b40
    layer_ids = read_config(dflash_drafter)["dflash_config"]["target_layer_ids"]
    off_spine = [r for r in rec.records
                 if r["is_tree"] and any(a != j for j, a in enumerate(r["accepted"]))]
    assert off_spine, "no accepted path off the spine"
    for r in off_spine[:5]:
        seq = full[r["req_id"].split("-")[0]]
        n_ctx, k1 = r["context_len"], len(r["accepted"])
        with torch.no_grad():
            hs = hf(torch.tensor([seq[: n_ctx + k1]]), output_hidden_states=True).hidden_states
        assert len(r["context_hidden"]) == len(layer_ids)
        for got, layer in zip(r["context_hidden"], layer_ids):
            # vLLM taps layer inputs at id + 1 = HF's hidden_states[id + 1] (residual stream).
            want = hs[layer + 1][0, n_ctx : n_ctx + k1]
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_skipping_kv_compaction_breaks_equality(qwen3_target, dflash_drafter, reference,
                                                monkeypatch):
    """Power check: the equality test above would catch a missing KV compaction."""
    import vllm_ddtree.commit as commit

    monkeypatch.setattr(commit, "compact_kv", lambda *a, **k: 0)
    llm = _ddtree(qwen3_target, dflash_drafter, 40)
    oracle = OracleDrafts(reference["refs"], _spine_with_sidesteps)
    try:
        with injected_drafts(oracle):
            got = _token_ids(llm.generate(PROMPTS, _params()))
    finally:
        release_llm(llm)
    assert got != reference["ids"]


def test_preemption_and_recompute(qwen3_target, dflash_drafter):
    """A KV cache too small for the batch: vLLM preempts and recomputes; output stays exact."""
    from vllm import SamplingParams

    # 12 blocks of 32 tokens: six requests of 100 new tokens cannot all stay resident.
    small = dict(ENGINE, max_model_len=256, block_size=32, num_gpu_blocks_override=12)
    prompts = [p for p in PROMPTS if len(p) < 60]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    llm = make_llm(qwen3_target, **small)
    want_out = llm.generate(prompts, params)
    want = _token_ids(want_out)
    refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in want_out}
    release_llm(llm)
    llm = _ddtree(qwen3_target, dflash_drafter, 16, **small)
    try:
        with injected_drafts(OracleDrafts(refs, _spine_with_sidesteps)):
            got = _token_ids(llm.generate(prompts, params))
        preempted = [
            x for x in llm.get_metrics() if x.name == "vllm:num_preemptions"
        ]
    finally:
        release_llm(llm)
    assert got == want
    assert preempted and preempted[0].value > 0, "the KV cache did not force preemption"


def test_eos_inside_accepted_path(qwen3_target, dflash_drafter, reference, tmp_path):
    """EOS (not ignored) that falls inside an accepted path ends the request right there."""
    from vllm import SamplingParams

    # A copy of the target whose EOS is a token its greedy continuation emits mid-way.
    first = reference["ids"][0]
    cut = next(i for i in range(8, len(first)) if first[i] not in first[:i])
    eos = first[cut]
    variant = tmp_path / "eos-variant"
    shutil.copytree(qwen3_target, variant)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(variant))
    eos_text = tok.convert_ids_to_tokens(eos)
    cfg = json.loads((variant / "tokenizer_config.json").read_text())
    cfg["eos_token"] = eos_text
    (variant / "tokenizer_config.json").write_text(json.dumps(cfg))
    for name in ("config.json", "generation_config.json"):
        f = variant / name
        if f.exists():
            c = json.loads(f.read_text())
            c["eos_token_id"] = eos
            f.write_text(json.dumps(c))
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    llm = make_llm(variant, **ENGINE)
    want_out = llm.generate(PROMPTS, params)
    want = _token_ids(want_out)
    release_llm(llm)
    assert len(want[0]) == cut + 1 and want[0][-1] == eos
    llm = _ddtree(variant, dflash_drafter, 16)
    try:
        with injected_drafts(OracleDrafts(reference["refs"])):
            got = _token_ids(llm.generate(PROMPTS, params))
    finally:
        release_llm(llm)
    assert got == want


def test_bf16_greedy_equals_target_only(qwen3_target, dflash_drafter):
    """In bf16 too, on both CPU tree-attention paths: at B = 15 vLLM's own kernel chain by
    chain, at B = 40 one float32 call per layer rounded once (``LOW_PRECISION_ONE_CALL_MIN_ROWS``),
    each within one bf16 ulp of vLLM's decode rows (a tree row computed wrongly would move logits
    far beyond near-ties).

    Equal token for token, except where vLLM's bf16 kernels themselves depend on the batch's
    shape: on CPUs with AMX / AVX-512-bf16, oneDNN's bf16 GEMMs round a row differently with
    the number of rows, so target-only decoding alone flips near-ties when only its schedule
    changes (measured on such a machine: the same prompts one at a time differ from the batched
    run in 5 of 8 requests; ``max_num_batched_tokens=32`` gives the very divergence DDTree's
    oracle run shows, a 0.125 logprob gap). So a first difference is allowed where target-only's
    top two tokens lie within ``BF16_BATCH_VARIANCE`` (two bf16 logit steps); a tree row computed
    wrongly moves logits by far more (on machines without that variance, e.g. AVX2-only,
    the outputs are equal outright)."""
    from vllm import SamplingParams

    from tests.support.models import BF16_BATCH_VARIANCE, NEAR_TIE_LOGPROBS, greedy_mismatches

    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    llm = make_llm(qwen3_target, dtype="bfloat16", **ENGINE)
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True,
                                               logprobs=NEAR_TIE_LOGPROBS), use_tqdm=False)
    release_llm(llm)
    refs = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ref}
    for budget in (15, 40):
        llm = _ddtree(qwen3_target, dflash_drafter, budget, dtype="bfloat16")
        try:
            got = _token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
            assert greedy_mismatches(ref, got, near_tie=BF16_BATCH_VARIANCE) == []
            with injected_drafts(OracleDrafts(refs, _spine_with_sidesteps)), \
                    recorded_verification() as rec:
                got = _token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
            assert greedy_mismatches(ref, got, near_tie=BF16_BATCH_VARIANCE) == []
        finally:
            release_llm(llm)
        assert any(any(a != j for j, a in enumerate(r["accepted"])) for r in rec.records)


def test_large_budget_keeps_drafting_near_max_model_len(qwen3_target, dflash_drafter):
    """vLLM stops drafting when a request nears max_model_len; the margin it needs is the DFlash
    block (L + 1), not the node budget: B = 128 must keep drafting as long as B = 15 does."""
    from vllm import SamplingParams

    prompt = _stdlib_text("textwrap.py", 0, 2600)
    engine = dict(ENGINE, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    llm = make_llm(qwen3_target, **engine)
    ref = llm.generate([prompt], params, use_tqdm=False)
    release_llm(llm)
    n_prompt = len(ref[0].prompt_token_ids)
    assert 1024 - 250 < n_prompt + 160 <= 1024, n_prompt  # the last steps are near the limit
    refs = {tuple(ref[0].prompt_token_ids): list(ref[0].outputs[0].token_ids)}
    steps = {}
    for budget in (15, 128):
        llm = _ddtree(qwen3_target, dflash_drafter, budget, **engine)
        try:
            with injected_drafts(OracleDrafts(refs, rank_gap=8.0)), \
                    recorded_verification() as rec:
                got = _token_ids(llm.generate([prompt], params, use_tqdm=False))
        finally:
            release_llm(llm)
        assert got == _token_ids(ref)
        steps[budget] = len(rec.records)
    assert steps[128] <= steps[15] + 1, steps
