"""The training scripts of the trained tiny pair (``examples/train/``): a few steps each on a tiny
corpus, and the drafter's train-time forward checked against vLLM's own DFlash drafter.

The last test is the guard against the silent failure of drafter training: if the training
forward fed the drafter anything other than what vLLM feeds it at inference (other tapped
layers, positions shifted by one, the bonus token in the context, a missing norm), the trained
drafter would accept almost nothing in vLLM while looking fine offline.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train"


def _load(name: str):
    sys.path.insert(0, str(TRAIN))
    spec = importlib.util.spec_from_file_location(f"_train_{name}", TRAIN / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def smoke_target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smoke") / "target"
    rc = _load("train_target").main([
        "--out", str(out), "--steps", "3", "--max-files", "8", "--vocab-size", "384", "--batch", "2",
        "--seq-len", "32", "--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "2",
        "--kv-heads", "1", "--head-dim", "32",
    ])
    assert rc == 0
    return out


def test_corpus_split_is_disjoint():
    corpus = _load("corpus")
    train, held, unseen = set(corpus.train_files()), set(corpus.held_out_files()), set(corpus.unseen_files())
    assert train and held and unseen
    assert not (train & held) and not (train & unseen) and not (held & unseen)
    assert len(held) == len(corpus.HELD_OUT)
    prompts = corpus.eval_prompts(4)
    assert len(prompts) == 4 and all(p.lstrip().startswith("def ") for p in prompts)


def test_train_target_smoke(smoke_target):
    from transformers import AutoTokenizer

    cfg = json.loads((smoke_target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["vocab_size"] == 384
    tok = AutoTokenizer.from_pretrained(str(smoke_target))
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|pad|>", "<|mask|>"]) == [0, 1, 2]
    info = json.loads((smoke_target / "training.json").read_text())
    assert info["final_loss_ema"] == info["final_loss_ema"]  # finite, not NaN
    assert (smoke_target / "model.safetensors").exists()


def test_train_drafter_smoke(smoke_target, tmp_path):
    out = tmp_path / "drafter"
    rc = _load("train_drafter").main([
        "--target", str(smoke_target), "--out", str(out), "--steps", "3", "--max-files", "4",
        "--num-prompts", "4", "--prompt-lens", "16", "--gen-tokens", "20", "--eval-prompts", "2",
        "--batch", "2", "--anchors", "2", "--layers", "1", "--block-size", "8", "--target-layer-ids", "0", "1",
    ])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": [0, 1]}
    assert json.loads((out / "training.json").read_text())["offline_chain_tau_held_out"] >= 1.0

    # A continuation run (--init) starts from the saved weights: with 0 steps it saves them back.
    from safetensors.torch import load_file

    again = tmp_path / "again"
    rc = _load("train_drafter").main([
        "--target", str(smoke_target), "--out", str(again), "--steps", "0", "--max-files", "4",
        "--num-prompts", "4", "--prompt-lens", "16", "--gen-tokens", "20", "--eval-prompts", "2",
        "--batch", "2", "--anchors", "2", "--layers", "1", "--block-size", "8", "--target-layer-ids", "0", "1",
        "--init", str(out), "--seed", "1",
    ])
    assert rc == 0
    with pytest.raises(SystemExit, match="--layers 2"):  # checked before distillation
        _load("train_drafter").main(["--target", str(smoke_target), "--out", str(tmp_path / "x"),
                                     "--init", str(out), "--layers", "2"])
    with pytest.raises(SystemExit, match="no config.json"):
        _load("train_drafter").main(["--target", str(smoke_target), "--out", str(tmp_path / "x"),
                                     "--init", str(tmp_path)])
    first, second = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_torch_drafter_matches_vllm_dflash(qwen3_target, tmp_path):
    """The training forward (``train_drafter.DFlashDrafter`` on ``tapped_features`` of a Hugging
    Face forward) gives the drafter log-probs vLLM computes for the first draft after prefill."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3ForCausalLM
    from vllm import SamplingParams

    from tests.support.models import build_dflash_drafter, make_llm, release_llm
    from tests.support.oracle_drafts import injected_drafts

    td = _load("train_drafter")
    drafter = build_dflash_drafter(tmp_path / "drafter", qwen3_target, num_layers=2, target_layer_ids=[1, 3],
                                   block_size=8, seed=3)
    seen = []

    def record(bonus_tokens, bonus_positions, log_probs, req_ids):
        seen.append(log_probs.clone())
        return log_probs

    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    llm = make_llm(qwen3_target, speculative_config={"method": "ddtree", "model": str(drafter), "ddtree_budget": 4})
    with injected_drafts(record):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    release_llm(llm)
    del llm

    tok = AutoTokenizer.from_pretrained(str(qwen3_target))
    ids = torch.tensor([tok(prompt)["input_ids"] + [out[0].outputs[0].token_ids[0]]])  # prompt + bonus
    model = Qwen3ForCausalLM.from_pretrained(str(qwen3_target), dtype=torch.float32).eval()
    cfg = json.loads((drafter / "config.json").read_text())
    mine = td.DFlashDrafter(cfg, 2, 2, model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach())
    mine.block_size = 8
    mine.load_checkpoint_state(load_file(str(drafter / "model.safetensors")))
    with torch.no_grad():
        logits = mine(td.tapped_features(model, ids, [1, 3]), ids, torch.tensor([[ids.shape[1] - 1]]))
    ours = torch.log_softmax(logits[0, 0], dim=-1)  # [L, V]
    theirs = seen[0][0]
    assert theirs.shape == ours.shape
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)
