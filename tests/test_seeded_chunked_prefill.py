"""A seeded request whose prefill is chunked, on a DDTree engine (issue 15).

vLLM samples every request each step, also one whose prefill chunk is not its last, and undoes
that discarded draw with ``Generator.set_offset`` — which a CPU generator refuses, killing the
engine (``RuntimeError: CPU Generator does not use offset``). The plugin restores the generator's
saved state instead (``runners.v1.hooks._bookkeeping_sync``), so the request completes and its tokens do
not depend on how its prefill was chunked.
"""

from __future__ import annotations

from tests.support.models import make_llm, release_llm

PROMPT = "def parse(line):\n    " + "value = line.strip().split(',')\n    " * 20
CHUNK = 32  # tokens per step: the prompt (well over 100 tokens) takes several prefill chunks


def _sample(target, drafter, **engine):
    from vllm import SamplingParams

    llm = make_llm(target, speculative_config={
        "method": "ddtree", "model": str(drafter), "ddtree_budget": 8}, **engine)
    try:
        params = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s)
                  for s in (11, 12)]
        # A greedy short request shares the steps, so chunks and decodes mix.
        outs = llm.generate([PROMPT, PROMPT, "x = 1\n"],
                            params + [SamplingParams(temperature=0, max_tokens=16)],
                            use_tqdm=False)
        assert len(llm.get_tokenizer().encode(PROMPT)) > 3 * CHUNK
        return [list(o.outputs[0].token_ids) for o in outs[:2]]
    finally:
        release_llm(llm)


def test_seeded_request_with_chunked_prefill(qwen3_target, dflash_drafter):
    """Completes (no engine crash), and equals the same seeds with the prefill in one step: the
    discarded draws left the generators where they were."""
    chunked = _sample(qwen3_target, dflash_drafter, max_num_batched_tokens=CHUNK,
                      enable_chunked_prefill=True)
    whole = _sample(qwen3_target, dflash_drafter, max_num_batched_tokens=2048)
    assert all(len(t) == 16 for t in chunked)
    assert chunked == whole
    assert chunked[0] != chunked[1]  # the seeds are in force
