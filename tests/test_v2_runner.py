"""vLLM's Model Runner V2 on CPU (Triton kernels interpreted): target-only, DFlash and DDTree.

V2 can only be chosen before vLLM is imported, and this pytest process runs V1, so every V2
engine runs in one subprocess per module (:mod:`tests.support.v2_run`, several configs per
process). Models: the tiny random fp32 Qwen3 with a random 2-layer DFlash drafter mixing a
sliding-window layer (window 8) and a full layer (acceptance about zero: exercises rejections),
and the shipped trained pair with the same layout put onto its trained drafter (drafts are
accepted). Prompts are longer than the window and than the chunked-prefill step of 32 tokens.

The ``ddtree`` tests need the plugin's V2 adapter; until it exists they fail (the plugin forces
V1, which refuses the sliding drafter, and the full-attention drafter runs on V1's runner).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support.sliding_drafter import MIXED_LAYER_TYPES, make_sliding_variant, sliding_dflash_drafter
from tests.support.v2_run import V1_RUNNER, V2_RUNNER, V2_SITE, _runner_class, run_v2, subprocess_env
from vllm_ddtree.config import DDTreeConfigError
from tests.support import trained

WINDOW = 8
CHUNK = 32  # max_num_batched_tokens of the chunked-prefill configs
PROMPTS = trained.heldout_prompts(2)
TINY_TOKENS = 24
TRAINED_TOKENS = 32
ENGINE = {"max_model_len": 512, "max_num_seqs": 4, "max_num_batched_tokens": 256}
CHUNKED = {**ENGINE, "max_num_batched_tokens": CHUNK}

# name -> (model set, speculative method, drafter kind, budget or horizon, chunked)
DFLASH_CASES = {
    "tiny-dflash-sliding": ("tiny", "dflash", "sliding", 4, False),
    "tiny-dflash-sliding-chunked": ("tiny", "dflash", "sliding", 4, True),
    "trained-dflash-sliding-chunked": ("trained", "dflash", "sliding", 8, True),
}
DDTREE_CASES = {
    "tiny-ddtree-sliding-B4": ("tiny", "ddtree", "sliding", 4, False),
    "tiny-ddtree-sliding-B16-chunked": ("tiny", "ddtree", "sliding", 16, True),
    "tiny-ddtree-full-B16": ("tiny", "ddtree", "full", 16, False),
    "trained-ddtree-sliding-B4-chunked": ("trained", "ddtree", "sliding", 4, True),
    "trained-ddtree-sliding-B16": ("trained", "ddtree", "sliding", 16, False),
}


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory) -> dict:
    """Targets and drafters per model set: ``{"tiny": {...}, "trained": {...}}``."""
    target, drafter = trained.require()
    return {
        "tiny": {"target": tiny_models.get("qwen3_target"),
                 "sliding": sliding_dflash_drafter(tiny_models, window=WINDOW),
                 "full": tiny_models.get("dflash_drafter"), "tokens": TINY_TOKENS},
        "trained": {"target": target, "full": drafter, "tokens": TRAINED_TOKENS,
                    "sliding": make_sliding_variant(drafter, tmp_path_factory.mktemp("trained-sliding"),
                                                    window=WINDOW)},
    }


def _config(name: str, models: dict, case: tuple | None = None, model_set: str = "tiny") -> dict:
    """A v2_run config: target-only (``case`` None) or a speculative case."""
    if case is not None:
        model_set, method, kind, size, chunked = case
    m = models[model_set]
    cfg = {"name": name, "target": str(m["target"]), "prompts": PROMPTS,
           "sampling": {"temperature": 0.0, "max_tokens": m["tokens"], "ignore_eos": True}}
    if case is None:
        cfg["sampling"]["logprobs"] = 2  # top-2 gap for mismatch reports
        return {**cfg, **ENGINE}
    key = "ddtree_budget" if method == "ddtree" else "num_speculative_tokens"
    cfg["speculative_config"] = {"method": method, "model": str(m[kind]), key: size}
    return {**cfg, **(CHUNKED if chunked else ENGINE)}


@pytest.fixture(scope="module")
def v2(models) -> dict:
    """Every V2 config of this module, run in one subprocess; configs by name (``_seconds`` too)."""
    configs = [_config("tiny-target", models), _config("trained-target", models, model_set="trained")]
    # DDTree last: until the V2 adapter exists these fail, and must not cost the others.
    configs += [_config(n, models, c) for n, c in {**DFLASH_CASES, **DDTREE_CASES}.items()]
    t0 = time.perf_counter()
    result = run_v2({"configs": configs}, timeout=1500)
    by_name = {c["name"]: c for c in result["configs"]}
    by_name["_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\nv2_run: {by_name['_seconds']} s; per config (build s, generate s): " + ", ".join(
        f"{c['name']} ({c['build_s']}, {c['generate_s']})" for c in result["configs"]))
    return by_name


def _ok(result: dict) -> dict:
    assert result["error"] is None, f"[{result['name']}] {result['error']}"
    assert result["runners"] and all(r == V2_RUNNER for r in result["runners"]), result["runners"]
    return result


def _first_mismatch(reference: dict, candidate_ids: list[list[int]]) -> list[str]:
    """Per prompt whose tokens differ: the first position, both tokens and the reference's
    top-2 logprob gap there (a near-tie would explain an fp32 kernel difference)."""
    problems = []
    for p, (ref, cand) in enumerate(zip(reference["token_ids"], candidate_ids)):
        if ref == cand:
            continue
        i = next((k for k, (a, b) in enumerate(zip(ref, cand)) if a != b), min(len(ref), len(cand)))
        gap = None
        if reference["logprobs"] and i < len(reference["logprobs"][p]):
            top = reference["logprobs"][p][i]
            gap = top[0][1] - top[1][1] if len(top) > 1 else None
        problems.append(f"prompt {p}: first difference at {i} (reference {ref[i:i + 4]} vs "
                        f"{cand[i:i + 4]}; top-2 gap {gap}), lengths {len(ref)} / {len(cand)}")
    return problems


def _check_equals_target_only(v2: dict, name: str, case: tuple) -> dict:
    model_set, method, kind, size, chunked = case
    reference, result = _ok(v2[f"{model_set}-target"]), _ok(v2[name])
    # The premises: prompts longer than the sliding window and, when chunked, than one step.
    assert min(result["prompt_lens"]) > (CHUNK if chunked else WINDOW), result["prompt_lens"]
    assert not _first_mismatch(reference, result["token_ids"]), _first_mismatch(reference, result["token_ids"])
    spec = result["spec"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] > 0, spec
    if model_set == "trained":  # the trained drafter's drafts are accepted, also when sliding
        assert spec["num_accepted_tokens"] > 0, spec
    return spec


# ----------------------------------------------------------------------------- harness


def test_v2_site_installs_harness_in_spawned_processes(tmp_path):
    """A process spawned (as vLLM's TP workers are) from a process started with ``v2_site`` on
    ``PYTHONPATH`` has the stand-in Triton backend and the V2 switches before vLLM loads."""
    script = tmp_path / "spawn_check.py"
    script.write_text(
        "import multiprocessing as mp, os\n"
        "def probe(_):\n"
        "    import triton.backends\n"
        "    return ('cpu' in triton.backends.backends, os.environ.get('TRITON_INTERPRET'),\n"
        "            os.environ.get('VLLM_USE_V2_MODEL_RUNNER'))\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(1) as pool:\n"
        "        print(pool.map(probe, [0])[0])\n")
    env = subprocess_env(v2=True)
    for key in ("TRITON_INTERPRET", "VLLM_USE_V2_MODEL_RUNNER"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "(True, '1', '1')", out
    assert (V2_SITE / "sitecustomize.py").exists()


def test_v2_target_only_equals_v1(v2, qwen3_target):
    """(a) Greedy target-only on V2 (subprocess) = on V1 (this process), tiny fp32 Qwen3."""
    from vllm import SamplingParams

    from tests.support.models import make_llm, release_llm

    llm = make_llm(qwen3_target, **ENGINE)
    try:
        assert llm.collective_rpc(_runner_class) == [V1_RUNNER]
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=TINY_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        release_llm(llm)
    v1_ids = [list(o.outputs[0].token_ids) for o in outs]
    reference = _ok(v2["tiny-target"])
    assert all(len(ids) == TINY_TOKENS for ids in v1_ids)
    assert not _first_mismatch(reference, v1_ids), _first_mismatch(reference, v1_ids)


@pytest.mark.parametrize("name", list(DFLASH_CASES))
def test_v2_dflash_sliding_drafter_equals_target_only(v2, name):
    """(b) vLLM's own ``dflash`` with a mixed sliding/full drafter on V2 = target-only."""
    _check_equals_target_only(v2, name, DFLASH_CASES[name])


@pytest.mark.parametrize("name", list(DDTREE_CASES))
def test_v2_ddtree_equals_target_only(v2, name):
    """(c) ``ddtree`` on V2 (mixed sliding/full drafter, or the full one) = target-only, and
    drafts were verified. Needs the plugin's V2 adapter."""
    _check_equals_target_only(v2, name, DDTREE_CASES[name])


# ----------------------------------------------------------------------------- V1 refusal


def test_check_drafter_on_v1_runner_message():
    """Mixed layer types are refused with the drafter, its layers and the way to V2 named;
    all-full and all-sliding drafters (V1 runs both) pass."""
    from vllm_ddtree.runners.v1.hooks import check_drafter_on_v1_runner

    check_drafter_on_v1_runner("d", ["full_attention", "full_attention"])
    check_drafter_on_v1_runner("d", ["sliding_attention"])
    check_drafter_on_v1_runner("d", None)
    with pytest.raises(DDTreeConfigError) as e:
        check_drafter_on_v1_runner("/m/drafter", list(MIXED_LAYER_TYPES))
    msg = str(e.value)
    for part in ("speculative_config['model']='/m/drafter'", str(list(MIXED_LAYER_TYPES)),
                 "Model Runner V2", "VLLM_USE_V2_MODEL_RUNNER=1", "CUDA"):
        assert part in msg, (part, msg)


def test_v1_ddtree_refuses_mixed_sliding_drafter_at_startup(qwen3_target, tiny_models):
    """(d) On V1 (this process), DDTree with the mixed drafter stops while the engine config is
    built, with the plugin's error (not pydantic's wrapper, not deep in the engine)."""
    from tests.support.models import make_llm

    drafter = sliding_dflash_drafter(tiny_models, window=WINDOW)
    t0 = time.perf_counter()
    with pytest.raises(DDTreeConfigError) as e:
        make_llm(qwen3_target, speculative_config={"method": "ddtree", "model": str(drafter),
                                                   "ddtree_budget": 4}, **ENGINE)
    msg = str(e.value)
    assert f"speculative_config['model']={str(drafter)!r}" in msg, msg
    assert "['sliding_attention', 'full_attention']" in msg and "VLLM_USE_V2_MODEL_RUNNER=1" in msg, msg
    assert time.perf_counter() - t0 < 120


# ----------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_v2_tensor_parallel_2(models):
    """TP=2 (mp executor, spawned workers, harness from ``v2_site``): both workers run V2, and
    target-only and ``dflash`` with the mixed drafter equal TP=1 target-only (~2-3 min)."""
    tp2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp",
           "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    configs = [_config("tp1-target", models),
               {**_config("tp2-target", models), **tp2},
               {**_config("tp2-dflash", models, ("tiny", "dflash", "sliding", 4, True)), **tp2}]
    result = {c["name"]: c for c in run_v2({"configs": configs}, timeout=1200)["configs"]}
    reference = _ok(result["tp1-target"])
    for name in ("tp2-target", "tp2-dflash"):
        r = _ok(result[name])
        assert len(r["runners"]) == 2, r["runners"]
        assert not _first_mismatch(reference, r["token_ids"]), (name, _first_mismatch(reference, r["token_ids"]))
    assert result["tp2-dflash"]["spec"]["num_drafts"] > 0
