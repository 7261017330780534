"""Checks of the tiny-model fixtures (``tests.support.models``) against stock vLLM on CPU.

Fast part (default run): tokenizer, builder determinism / cache keys, checkpoint layouts, the Qwen3
target in vLLM (generation, prompt dependence, top-1/top-2 logit gap) and vLLM's own ``dflash``
method with the tiny drafter (lossless: same greedy tokens as target-only). Two in-process ``LLM``
instances in all. The hybrid targets (Qwen3-Next, Granite) are ``slow``: run with ``-m slow``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.support import models as tm

# Prompts for the vLLM checks. The last two differ only in their first line, so equal outputs
# for them would mean the continuation ignores earlier context.
PROMPTS = [
    "def main():\n    ",
    "import os\nimport sys\n",
    "class Foo(object):\n",
    "a = 1\nfor i in range(10):",
    "b = 22\nfor i in range(10):",
]
MAX_TOKENS = 32

# The greedy-equality tests of the project compare a tree-attention path with vLLM's own kernel.
# In fp32 those differ by ~1e-6 relative (~1e-5 absolute on these logits), so a position is fragile
# only if its top-1/top-2 logit gap is that small. A median gap above 0.5 (measured ~1.2 with the
# default init) keeps typical positions >4 orders of magnitude away from a flip, and near-ties
# below 0.01 must stay rare (measured ~0.5 %).
MIN_MEDIAN_GAP = 0.5
NEAR_TIE = 0.01
MAX_NEAR_TIE_FRACTION = 0.05


def _sampling(logprobs: int | None = None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


def _token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


# ------------------------------------------------------------------------------------------------
# Builders, no vLLM
# ------------------------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_specials(tiny_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer))
    assert len(tok) == 2048
    assert tok.convert_tokens_to_ids([tm.EOS_TOKEN, tm.PAD_TOKEN, tm.MASK_TOKEN]) == [0, 1, 2]
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 0, 1)
    assert tok.mask_token == tm.MASK_TOKEN and tok.mask_token_id == tm.MASK_TOKEN_ID
    for text in ["def f(x):\n    return x + 1\n", "héllo wörld ✓ — \t\x00 tabs", ""]:
        ids = tok(text)["input_ids"]
        assert all(i >= len(tm.SPECIAL_TOKENS) for i in ids)  # no specials added, bytes cover all
        assert tok.decode(ids) == text
    # The specials are single tokens when they appear in text.
    assert tok("x<|mask|>y")["input_ids"][1] == tm.MASK_TOKEN_ID
    # Trained on Python sources: common code compresses well.
    assert len(tok("import os\nimport sys\n")["input_ids"]) <= 8


def test_tokenizer_is_deterministic(tmp_path, tiny_tokenizer):
    again = tm.build_tokenizer(tmp_path / "tok")
    assert (again / "tokenizer.json").read_bytes() == (Path(tiny_tokenizer) / "tokenizer.json").read_bytes()


def test_qwen3_builder_deterministic_and_seeded(tmp_path, tiny_tokenizer):
    from safetensors.torch import load_file

    kwargs = dict(num_layers=2, tokenizer_dir=tiny_tokenizer)
    a = tm.build_qwen3_target(tmp_path / "a", **kwargs)
    b = tm.build_qwen3_target(tmp_path / "b", **kwargs)
    c = tm.build_qwen3_target(tmp_path / "c", seed=1, **kwargs)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert not wa["lm_head.weight"].equal(wc["lm_head.weight"])
    assert abs(wa["lm_head.weight"].std().item() - 0.5) < 0.01
    assert abs(wa["model.layers.0.mlp.up_proj.weight"].std().item() - 0.1) < 0.005
    cfg = tm.read_config(a)
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["dtype"] == "float32"
    assert cfg["max_position_embeddings"] >= 4096 and cfg["tie_word_embeddings"] is False
    assert (cfg["eos_token_id"], cfg["bos_token_id"], cfg["pad_token_id"]) == (0, 0, 1)
    assert (a / "tokenizer.json").exists()


def test_cache_keys(tmp_path):
    calls = []

    def builder(out, **kw):
        calls.append(kw)
        (Path(out) / "x").write_text(json.dumps(kw))

    p1 = tm.cached_build(tmp_path, "thing", builder, n=1)
    p2 = tm.cached_build(tmp_path, "thing", builder, n=1)
    p3 = tm.cached_build(tmp_path, "thing", builder, n=2)
    assert p1 == p2 != p3 and len(calls) == 2
    assert (p1 / ".complete").exists() and json.loads((p1 / "x").read_text()) == {"n": 1}
    assert tm._cache_key("thing", {"n": 1}) != tm._cache_key("other", {"n": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p1.name, p3.name])  # no temp dirs left

    def failing(out, **kw):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        tm.cached_build(tmp_path, "bad", failing)
    assert not any(p.name.startswith(("bad", ".bad")) for p in tmp_path.iterdir())


def test_zoo_is_lazy(tmp_path):
    zoo = tm.TinyModelZoo(tmp_path)
    zoo.get("tokenizer")
    assert [p.name.split("-")[0] for p in tmp_path.iterdir()] == ["tokenizer"]
    with pytest.raises(KeyError):
        zoo.get("nope")
    with pytest.raises(KeyError):
        tm.TinyModelZoo(tmp_path, overrides={"nope": {}})


def test_default_target_layer_ids():
    assert tm.default_target_layer_ids(4) == [0, 2]
    assert tm.default_target_layer_ids(8) == [0, 6]
    assert tm.default_target_layer_ids(8, 3) == [0, 3, 6]
    assert tm.default_target_layer_ids(2) == [0]
    assert tm.default_target_layer_ids(1) == [0]


def test_dflash_drafter_layout(dflash_drafter, qwen3_target):
    from safetensors import safe_open

    cfg, tcfg = tm.read_config(dflash_drafter), tm.read_config(qwen3_target)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 16 and cfg["num_hidden_layers"] == 1
    assert cfg["num_target_layers"] == tcfg["num_hidden_layers"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": [0, 2]}
    assert cfg["tie_word_embeddings"] is False and cfg["layer_types"] == ["full_attention"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert cfg[key] == tcfg[key]
    h, d = cfg["hidden_size"], cfg["head_dim"]
    with safe_open(str(Path(dflash_drafter) / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert not any(k.startswith(("model.", "lm_head", "embed_tokens")) for k in shapes)
    assert shapes["fc.weight"] == (h, 2 * h)
    assert shapes["hidden_norm.weight"] == shapes["norm.weight"] == (h,)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (cfg["num_attention_heads"] * d, h)
    assert shapes["layers.0.self_attn.k_norm.weight"] == (d,)
    assert len(shapes) == 3 + 11
    with pytest.raises(ValueError):
        tm.build_dflash_drafter(Path(dflash_drafter).parent / "bad", qwen3_target, target_layer_ids=[4])


def test_make_llm_kwargs(qwen3_target, tmp_path):
    kw = tm.llm_kwargs(qwen3_target, max_num_seqs=2)
    assert kw["dtype"] == "float32" and kw["max_model_len"] == 1024 and kw["enforce_eager"] is True
    assert kw["seed"] == 0 and kw["max_num_seqs"] == 2 and kw["disable_log_stats"] is False
    assert "enable_prefix_caching" not in kw
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"], "dtype": "bfloat16"}))
    kw = tm.llm_kwargs(tmp_path)
    assert kw["enable_prefix_caching"] is False and kw["dtype"] == "bfloat16"


# ------------------------------------------------------------------------------------------------
# Qwen3 target and vLLM's own DFlash
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_target):
    """Target-only greedy outputs (with top-2 logprobs) of the Qwen3 target; the LLM is freed."""
    llm = tm.make_llm(qwen3_target)
    try:
        outputs = llm.generate(PROMPTS, _sampling(logprobs=2), use_tqdm=False)
    finally:
        tm.release_llm(llm)
        del llm
    return outputs


def test_qwen3_target_generates_prompt_dependent_text(qwen3_reference):
    ids = _token_ids(qwen3_reference)
    assert all(len(x) == MAX_TOKENS for x in ids)
    assert len({tuple(x) for x in ids}) == len(PROMPTS)  # including the two same-suffix prompts
    for x in ids:
        assert len(set(x)) >= MAX_TOKENS // 4, f"degenerate repetition: {x}"
    assert all(o.outputs[0].text for o in qwen3_reference)


def test_qwen3_target_logit_gap(qwen3_reference):
    gaps = tm.top2_logprob_gaps(qwen3_reference)
    assert len(gaps) == len(PROMPTS) * MAX_TOKENS
    median = statistics.median(gaps)
    near_ties = sum(g < NEAR_TIE for g in gaps) / len(gaps)
    print(
        f"\nqwen3 tiny target top-1/top-2 logit gap over {len(gaps)} generated positions: "
        f"median {median:.3f}, p10 {statistics.quantiles(gaps, n=10)[0]:.3f}, min {min(gaps):.4f}, "
        f"fraction < {NEAR_TIE}: {near_ties:.3%}"
    )
    assert median > MIN_MEDIAN_GAP
    assert near_ties <= MAX_NEAR_TIE_FRACTION


def test_vllm_dflash_with_tiny_drafter_is_lossless(qwen3_target, dflash_drafter, qwen3_reference):
    spec = {"method": "dflash", "model": str(dflash_drafter), "num_speculative_tokens": 15}
    llm = tm.make_llm(qwen3_target, speculative_config=spec)
    try:
        outputs = llm.generate(PROMPTS, _sampling(), use_tqdm=False)
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        tm.release_llm(llm)
        del llm
    assert _token_ids(outputs) == _token_ids(qwen3_reference)
    # The drafter really ran: one draft of 15 tokens per verification step.
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    assert drafts > 0 and metrics["vllm:spec_decode_num_draft_tokens"].value == 15 * drafts


# ------------------------------------------------------------------------------------------------
# Hybrid targets (target-only)
# ------------------------------------------------------------------------------------------------


def _check_hybrid_generates(model_dir, expected_arch: str):
    assert tm.read_config(model_dir)["architectures"] == [expected_arch] and tm.is_hybrid(model_dir)
    llm = tm.make_llm(model_dir)
    try:
        outputs = llm.generate(PROMPTS, _sampling(logprobs=2), use_tqdm=False)
    finally:
        tm.release_llm(llm)
        del llm
    ids = _token_ids(outputs)
    assert all(len(x) == MAX_TOKENS for x in ids)
    assert len({tuple(x) for x in ids}) == len(PROMPTS)
    gaps = tm.top2_logprob_gaps(outputs)
    print(
        f"\n{expected_arch} top-1/top-2 logit gap: median {statistics.median(gaps):.3f}, "
        f"min {min(gaps):.4f}, fraction < {NEAR_TIE}: {sum(g < NEAR_TIE for g in gaps) / len(gaps):.3%}"
    )
    assert statistics.median(gaps) > MIN_MEDIAN_GAP
    return outputs


@pytest.fixture(scope="module")
def qwen3_next_reference(qwen3_next_target):
    cfg = tm.read_config(qwen3_next_target)
    assert cfg["dtype"] == "bfloat16"
    assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"] == 128
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    return _check_hybrid_generates(qwen3_next_target, "Qwen3NextForCausalLM")


def test_qwen3_next_target_generates(qwen3_next_reference):
    assert len(qwen3_next_reference) == len(PROMPTS)


@pytest.mark.slow
def test_vllm_dflash_on_qwen3_next(qwen3_next_target, qwen3_next_dflash_drafter, qwen3_next_reference):
    """vLLM's own DFlash loads the Qwen3-Next drafter and drafts; it is NOT lossless on CPU.

    vLLM 0.32's CPU GDN speculative path corrupts the recurrent state when drafts are rejected
    (ngram with 1 draft token diverges from target-only at the first rejected step, at positions
    with clear top-2 gaps; HF fp32 agrees with target-only vLLM there). This random drafter is
    always rejected, so the outputs diverge. A DDTree verifier must own the GDN state path; compare
    it against target-only outputs, not against vLLM's dflash.
    """
    cfg = tm.read_config(qwen3_next_dflash_drafter)
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dtype"] == "bfloat16"
    assert cfg["hidden_size"] == tm.read_config(qwen3_next_target)["hidden_size"]
    spec = {"method": "dflash", "model": str(qwen3_next_dflash_drafter), "num_speculative_tokens": 15}
    llm = tm.make_llm(qwen3_next_target, speculative_config=spec)
    try:
        outputs = llm.generate(PROMPTS, _sampling(), use_tqdm=False)
        drafts = next(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    finally:
        tm.release_llm(llm)
        del llm
    assert drafts > 0
    assert all(len(x) == MAX_TOKENS for x in _token_ids(outputs))
    problems = tm.greedy_mismatches(qwen3_next_reference, outputs, near_tie=tm.BF16_BATCH_VARIANCE)
    print(f"\nQwen3-Next + vLLM dflash: {len(PROMPTS) - len(problems)}/{len(PROMPTS)} requests match target-only")
    if problems:
        pytest.xfail("vLLM 0.32 CPU GDN spec decode is not lossless when drafts are rejected: " + problems[0])


def test_granite_hybrid_target_generates(granite_hybrid_target):
    cfg = tm.read_config(granite_hybrid_target)
    assert cfg["dtype"] == "float32"
    assert cfg["layer_types"] == ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
    _check_hybrid_generates(granite_hybrid_target, "GraniteMoeHybridForCausalLM")


# ------------------------------------------------------------------------------------------------
# greedy_mismatches helper
# ------------------------------------------------------------------------------------------------


class _LP:
    def __init__(self, logprob):
        self.logprob = logprob


class _Out:
    def __init__(self, token_ids, logprobs=None):
        self.token_ids = token_ids
        self.logprobs = logprobs


class _Req:
    def __init__(self, token_ids, logprobs=None):
        self.outputs = [_Out(token_ids, logprobs)]


def test_greedy_mismatches():
    lps = [{5: _LP(-0.1), 6: _LP(-3.0)}, {7: _LP(-0.50), 8: _LP(-0.52)}, {9: _LP(-0.2), 1: _LP(-2.0)}]
    ref = [_Req([5, 7, 9], lps)]
    assert tm.greedy_mismatches(ref, [[5, 7, 9]]) == []
    assert tm.greedy_mismatches(ref, [_Req([5, 7, 9])]) == []
    # Divergence at a near-tie (gap 0.02) is explained only with a large enough tolerance.
    assert tm.greedy_mismatches(ref, [[5, 8, 3]], near_tie=0.05) == []
    assert len(tm.greedy_mismatches(ref, [[5, 8, 3]])) == 1
    # A clear position (gap 2.9) or a token outside the logprobs is always reported.
    assert len(tm.greedy_mismatches(ref, [[6, 7, 9]], near_tie=0.05)) == 1
    (problem,) = tm.greedy_mismatches(ref, [[5, 7, 4]], near_tie=10.0)
    # ... and named as such when every listed logprob lies within the tolerance: the reference
    # was generated with too few logprobs to tell a near-tie from a wrong token.
    assert "more logprobs" in problem
    assert "more logprobs" not in tm.greedy_mismatches(ref, [[5, 7, 4]], near_tie=0.05)[0]
    assert len(tm.greedy_mismatches(ref, [[5, 7]])) == 1
    assert len(tm.greedy_mismatches(ref, [])) == 1
