"""The hybrid guard: a recurrent layer kind the tree oracle cannot run stops the engine at
start-up with an error naming the layer type and the way out; ``shadow_linear`` runs it."""

from __future__ import annotations

import pytest
import torch

from vllm_ddtree.config import DDTreeConfigError
from vllm_ddtree.hybrid.guard import SUPPORTED_RECURRENT_LAYERS, check_recurrent_layers


@pytest.fixture(scope="module")
def layer_classes():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    def bare(cls):
        """An instance of a vLLM layer class without running its constructor."""
        obj = cls.__new__(cls)
        torch.nn.Module.__init__(obj)
        return obj

    return dict(MambaBase=MambaBase, gdn=QwenGatedDeltaNetAttention, mamba2=MambaMixer2,
                mamba1=MambaMixer, bare=bare)


def _model(*layers):
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), *layers])
    return m


def test_supported_kinds_pass(layer_classes):
    c = layer_classes
    assert check_recurrent_layers(_model(c["bare"](c["gdn"])), "oracle", platform="cpu") == [
        "GatedDeltaNet"]
    assert check_recurrent_layers(_model(c["bare"](c["mamba2"])), "oracle", platform="cpu") == [
        "Mamba2"]
    assert check_recurrent_layers(_model(), "oracle", platform="cpu") == []


def test_unknown_kind_is_refused_naming_the_type_and_the_way_out(layer_classes):
    c = layer_classes
    model = _model(c["bare"](c["mamba2"]), c["bare"](c["mamba1"]))
    with pytest.raises(DDTreeConfigError, match=r"MambaMixer \(e\.g\. layers\.2\).*shadow_linear"):
        check_recurrent_layers(model, "oracle", platform="cpu")
    # A subclass is another kind until proven: its forward may differ.
    sub = type("MyGDNVariant", (c["gdn"],), {})
    with pytest.raises(DDTreeConfigError, match="MyGDNVariant"):
        check_recurrent_layers(_model(c["bare"](sub)), "oracle", platform="cpu")
    assert "MambaMixer" in check_recurrent_layers(model, "shadow_linear", platform="cpu")


def test_oracle_runs_on_cpu_and_cuda_only(layer_classes):
    c = layer_classes
    for kind, name in (("gdn", "GatedDeltaNet"), ("mamba2", "Mamba2")):
        assert check_recurrent_layers(_model(c["bare"](c[kind])), "oracle", platform="cuda") == [
            name]
    with pytest.raises(DDTreeConfigError, match=r"cpu and cuda only, not on 'rocm'.*shadow_linear"):
        check_recurrent_layers(_model(c["bare"](c["gdn"])), "oracle", platform="rocm")
    assert check_recurrent_layers(_model(c["bare"](c["gdn"])), "shadow_linear", platform="rocm")


def test_supported_table_names_real_vllm_classes(layer_classes):
    import importlib

    for qualified in SUPPORTED_RECURRENT_LAYERS:
        module, name = qualified.split(":")
        assert issubclass(getattr(importlib.import_module(module), name), layer_classes["MambaBase"])


def test_unknown_kind_stops_the_engine_and_shadow_linear_runs_it(tiny_models, tmp_path):
    """End to end: a target whose recurrent layers are of an unknown class stops at start-up
    with the documented message; with ``shadow_linear`` it runs and equals target-only."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from tests.support.hybrid_models import (
        UNKNOWN_RECURRENT_ARCH,
        register_unknown_recurrent_model,
        with_architecture,
    )
    from tests.support.models import make_llm, release_llm

    register_unknown_recurrent_model()
    target = with_architecture(tiny_models.get("qwen3_next_target"), tmp_path / "unknown",
                               UNKNOWN_RECURRENT_ARCH)
    drafter = tiny_models.get("qwen3_next_dflash_drafter")
    engine = dict(max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    prompts = ["def main():\n", "import os\n", "class A:\n", "x = 1\n"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ddtree", "model": str(drafter), "ddtree_budget": 8,
            "num_speculative_tokens": 4}
    with pytest.raises(Exception, match=r"TestOnlyRecurrentLayer.*shadow_linear"):
        make_llm(target, speculative_config=spec, **engine)

    llm = make_llm(target, **engine)
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        release_llm(llm)
    llm = make_llm(target, speculative_config={**spec, "ddtree_hybrid": "shadow_linear"}, **engine)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        release_llm(llm)
    assert got == want
