"""Tiny random-weight models for tests, built locally in seconds (no model hub needed).

Every builder writes a self-contained Hugging Face style model directory (``config.json``,
``model.safetensors``, tokenizer files) and returns its path. Builders are deterministic: the same
arguments (and the same torch / transformers / Python standard library) give the same files.

Builders:

* :func:`build_tokenizer`: byte-level BPE trained on Python standard-library sources.
* :func:`build_qwen3_target`: dense ``Qwen3ForCausalLM`` (vLLM ``models/qwen3.py``).
* :func:`build_dflash_drafter`: ``DFlashDraftModel`` drafter for a Qwen3 (or Qwen3-Next) target
  (vLLM ``models/qwen3_dflash.py``).
* :func:`build_qwen3_next_target`: ``Qwen3NextForCausalLM`` (GatedDeltaNet + full attention + MoE,
  bf16; vLLM ``models/qwen3_next.py``).
* :func:`build_granite_hybrid_target`: ``GraniteMoeHybridForCausalLM`` (Mamba2 + attention, fp32;
  vLLM ``models/granitemoehybrid.py``).

:class:`TinyModelZoo` builds them lazily into a cache directory keyed by a hash of the builder
arguments and :data:`FORMAT_VERSION`; :func:`build_all` builds every one. :func:`make_llm` creates a
``vllm.LLM`` with settings that work on the CPU build of vLLM 0.32 (see
``shared/research/cpu-probe.md``); :func:`top2_logprob_gaps` and :func:`greedy_mismatches` help
compare greedy generations.

Known vLLM 0.32 CPU behaviour these fixtures expose: speculative decoding on the hybrid targets
(vLLM's own ngram or dflash) is not lossless once drafts are rejected, so hybrid tree-verifier
tests must compare against target-only output; the bf16 Qwen3-Next logits have exact ties at a
few per cent of positions, so compare bf16 runs with ``greedy_mismatches(..., near_tie=...)``.

This module imports torch / transformers / tokenizers lazily, inside the builders, and vLLM only
inside :func:`make_llm`.
"""

from __future__ import annotations

import gc
import glob
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: Bump when a builder's output changes for the same arguments: invalidates cached directories.
FORMAT_VERSION = 1

EOS_TOKEN = BOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
#: Special tokens in id order: ``<|endoftext|>`` = 0 (bos and eos), ``<|pad|>`` = 1,
#: ``<|mask|>`` = 2 (the DFlash mask token).
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
EOS_TOKEN_ID = BOS_TOKEN_ID = 0
PAD_TOKEN_ID = 1
MASK_TOKEN_ID = 2

#: Environment defaults for fast, quiet, in-process vLLM runs on a small CPU-only machine.
#: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) is required here: the default 92 % of a NUMA node does not fit.
CPU_TEST_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

_HYBRID_ARCHITECTURES = frozenset(
    {"Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM"})
_DTYPES = ("float32", "bfloat16", "float16")


def apply_cpu_test_env(env: Mapping[str, str] | None = None) -> None:
    """Set :data:`CPU_TEST_ENV` (or ``env``) in ``os.environ`` without overriding existing values.

    Call it before vLLM is imported: several of these variables are read at import time.
    """
    for key, value in (CPU_TEST_ENV if env is None else env).items():
        os.environ.setdefault(key, value)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _training_files(num_files: int) -> list[str]:
    stdlib = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:num_files]
    if not files:
        raise FileNotFoundError(f"no *.py files found in the standard library at {stdlib}")
    return files


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 2048, *, num_files: int = 150) -> Path:
    """Train a byte-level BPE tokenizer on local Python sources and save it to ``out_dir``.

    The training text is the first ``num_files`` ``*.py`` files (sorted by name) of the running
    interpreter's standard library (``os.path.dirname(os.__file__)``); training is deterministic and
    takes about a second. Special tokens: ``<|endoftext|>`` id 0 (bos and eos), ``<|pad|>`` id 1,
    ``<|mask|>`` id 2 (the DFlash mask token); there is no unk token (byte-level BPE covers every
    byte). No token is added automatically when encoding (no bos prefix).

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (and whatever else
    ``PreTrainedTokenizerFast.save_pretrained`` writes). Returns ``Path(out_dir)``.

    Raises ``ValueError`` if ``vocab_size`` is too small to hold the 256 byte symbols plus the
    specials, ``FileNotFoundError`` if no standard-library sources are found.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS) + 1}, got {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def texts():
        for path in _training_files(num_files):
            with open(path, encoding="utf-8", errors="replace") as fh:
                yield fh.read()

    tok.train_from_iterator(texts(), trainer=trainer)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != token_id:  # pragma: no cover - a tokenizers behaviour change
            raise RuntimeError(f"special token {token!r} got id {tok.token_to_id(token)}, expected {token_id}")

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=1 << 16,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    return out


def build_small_vocab_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 32) -> Path:
    """A word-level tokenizer of ``vocab_size`` tokens, for statistical tests on tiny vocabularies.

    Ids 0–2 are the specials of :func:`build_tokenizer` (``<|endoftext|>``, ``<|pad|>``,
    ``<|mask|>``); the rest are the words ``w3 … w{V-1}`` split on whitespace. Tests feed token
    ids directly (``TokensPrompt``); the tokenizer only has to detokenize. Returns ``Path(out_dir)``.

    Raises ``ValueError`` if ``vocab_size`` < 4.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 1}, got {vocab_size}")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN, unk_token=PAD_TOKEN, model_max_length=1 << 16,
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def _copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy2(tokenizer_dir / name, out / name)


def _install_tokenizer(out: Path, tokenizer_dir: str | os.PathLike | None, vocab_size: int) -> None:
    """Copy the tokenizer from ``tokenizer_dir`` into ``out``, or train a fresh one into it."""
    if tokenizer_dir is None:
        build_tokenizer(out, vocab_size=vocab_size)
        return
    tokenizer_dir = Path(tokenizer_dir)
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    if len(data["model"]["vocab"]) > vocab_size:
        raise ValueError(
            f"tokenizer at {tokenizer_dir} has {len(data['model']['vocab'])} tokens, more than vocab_size={vocab_size}"
        )
    _copy_tokenizer(tokenizer_dir, out)


# --------------------------------------------------------------------------------------------
# Shared weight helpers
# --------------------------------------------------------------------------------------------


def _torch_dtype(dtype: str):
    import torch

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    return getattr(torch, dtype)


def _generator(seed: int, salt: str):
    """A CPU generator seeded from ``seed`` and a label, independent of the global RNG."""
    import torch

    digest = hashlib.sha256(f"{seed}:{salt}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _normal_(tensor, std: float, gen) -> None:
    import torch

    with torch.no_grad():
        tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=torch.float32) * std)


def _save_hf_model(model, out: Path, dtype: str) -> None:
    from transformers.utils import logging as hf_logging

    model = model.to(_torch_dtype(dtype))
    model.config.dtype = dtype
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    # Drop the generation config: an HF default would only add eos / sampling noise to vLLM runs.
    gen_cfg = out / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()


def _special_token_ids() -> dict[str, int]:
    return {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}


# --------------------------------------------------------------------------------------------
# Qwen3 target
# --------------------------------------------------------------------------------------------


def build_qwen3_target(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    initializer_range: float = 0.1,
    lm_head_std: float = 0.5,
    qk_norm_gain: float = 1.0,
    max_position_embeddings: int = 8192,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write a random-weight ``Qwen3ForCausalLM`` to ``out_dir`` and return its path.

    Shapes: ``num_layers`` decoder layers of width ``hidden_size``, ``num_heads`` query heads and
    ``num_kv_heads`` KV heads of ``head_dim`` (the CPU attention backend accepts head dims 32, 64, 80,
    96, 112, 128, ...), SwiGLU MLP of ``intermediate_size``, untied ``lm_head``, RoPE theta 1e4,
    ``max_position_embeddings`` positions. Weights are saved as ``model.safetensors`` in ``dtype``
    ("float32", "bfloat16" or "float16"); the tokenizer (``tokenizer_dir``, or a freshly trained one
    of ``vocab_size``) is copied in. Loaded by vLLM ``model_executor/models/qwen3.py``.

    Initialisation (seeded by ``seed``, independent of torch's global RNG): every linear and
    embedding weight is N(0, ``initializer_range``); ``lm_head`` is N(0, ``lm_head_std``); the
    per-head q/k RMSNorm weights are ``qk_norm_gain``; other norms are 1. The final-norm output has
    unit RMS, so logits have a standard deviation of about ``lm_head_std * sqrt(hidden_size)``
    (5.7 with the defaults). Measured with vLLM (greedy, 5 prompts x 32 tokens, logprobs=2): the
    top-1/top-2 logit gap has median 1.20, 10th percentile 0.24, minimum 0.014, so fp32 kernel
    differences (~1e-5) do not flip argmaxes, while the continuations differ per prompt (also for
    prompts that differ only in an early line) and do not collapse into repetition (~40 distinct
    tokens in 48). ``initializer_range`` 0.05-0.2 gives the same picture; ``lm_head_std`` scales the
    gap linearly.

    Raises ``ValueError`` on a bad ``dtype`` or a tokenizer larger than ``vocab_size``.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    _torch_dtype(dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_layers,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_special_token_ids(),
    )
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    for name, param in sorted(model.named_parameters()):
        if name == "lm_head.weight":
            _normal_(param, lm_head_std, _generator(seed, name))
        elif param.dim() == 2:
            _normal_(param, initializer_range, _generator(seed, name))
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            with torch.no_grad():
                param.fill_(qk_norm_gain)
        else:
            with torch.no_grad():
                param.fill_(1.0)
    _save_hf_model(model, out, dtype)
    _install_tokenizer(out, tokenizer_dir, vocab_size)
    return out


# --------------------------------------------------------------------------------------------
# DFlash drafter
# --------------------------------------------------------------------------------------------


def default_target_layer_ids(num_target_layers: int, num_features: int = 2) -> list[int]:
    """Evenly spaced target layers in ``[0, num_target_layers - 2]`` (never the last layer).

    ``num_features`` ids are returned (fewer if the range is smaller), e.g. 4 layers -> ``[0, 2]``,
    8 layers -> ``[0, 6]``; for a 1-layer target the only choice, ``[0]``, is returned.
    """
    last = max(num_target_layers - 2, 0)
    if num_features <= 1 or last == 0:
        return [0]
    ids = sorted({round(i * last / (num_features - 1)) for i in range(num_features)})
    return ids


#: Target config keys a DFlash drafter for a non-Qwen3 target inherits (its own dims are these).
_DRAFT_SHARED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
)


def _draft_base_config(target_cfg: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3 config a drafter starts from: the target's own if it is Qwen3, else a fresh Qwen3
    config carrying the target's dims (``num_hidden_layers`` still counts the target's layers)."""
    if target_cfg.get("model_type") == "qwen3":
        return dict(target_cfg)
    from transformers import Qwen3Config

    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
               if k not in target_cfg]
    if missing:
        raise ValueError(f"target config lacks {missing}; cannot size a DFlash drafter for it")
    shared = {k: target_cfg[k] for k in _DRAFT_SHARED_KEYS if k in target_cfg}
    base = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}).to_dict()
    base.update(shared)
    return base


def build_dflash_drafter(
    out_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    *,
    block_size: int = 16,
    num_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    seed: int = 0,
    initializer_range: float = 0.1,
) -> Path:
    """Write a random-weight DFlash drafter for the target at ``target_dir``; return its path.

    Targets vLLM's DFlash loader, ``model_executor/models/qwen3_dflash.py``
    (``DFlashQwen3ForCausalLM``, architecture ``DFlashDraftModel``), used by
    ``speculative_config={"method": "dflash", "model": <this dir>, ...}``.

    ``config.json`` is the target's config with ``architectures=["DFlashDraftModel"]``,
    ``model_type="qwen3"``, ``num_hidden_layers=num_layers``, ``layer_types`` all
    ``full_attention`` (so the draft layers are non-causal, as DFlash expects), ``block_size``,
    ``num_target_layers``, ``dflash_config={"mask_token_id": 2, "target_layer_ids": [...]}`` and
    ``tie_word_embeddings=false``. ``target_layer_ids`` are 0-based target layer indices whose
    outputs feed the drafter (vLLM adds 1 internally); the default is
    :func:`default_target_layer_ids`.

    Weights (``model.safetensors`` in the target's dtype, names without a ``model.`` prefix; H =
    hidden size, n = ``len(target_layer_ids)``): ``fc.weight`` [H, n*H], ``hidden_norm.weight`` [H],
    ``norm.weight`` [H], and per layer i ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``layers.{i}.self_attn.{q,k}_norm.weight`` [head_dim], ``layers.{i}.input_layernorm.weight``,
    ``layers.{i}.post_attention_layernorm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``.
    There is no ``embed_tokens`` or ``lm_head``: vLLM shares the target's. Linear weights are
    N(0, ``initializer_range``), norms 1, so the drafter's acceptance rate is about zero.

    The weights must be real: ``load_format="dummy"`` breaks DFlash on CPU (the CPU GEMM prepack
    empties ``qkv_proj.weight`` before the drafter's fused-KV buffer reads it).

    Any target that vLLM runs with DFlash (it needs the EAGLE3 aux-hidden-state interface: Qwen3,
    Qwen3-Next, ...; not GraniteMoeHybrid on 0.32) is accepted: for a Qwen3 target the draft config is
    the target's config as above; for another architecture it is a fresh ``Qwen3Config`` with the
    target's hidden / intermediate / head sizes, vocab, norm eps and dtype (the drafter is always a
    Qwen3-style ``DFlashDraftModel``).

    Raises ``ValueError`` if ``target_layer_ids`` is empty or out of range, ``block_size`` < 2, or the
    target config lacks the sizes; ``FileNotFoundError`` if ``target_dir`` has no config.
    """
    import torch
    from safetensors.torch import save_file

    target = Path(target_dir)
    cfg = _draft_base_config(json.loads((target / "config.json").read_text()))
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    n_target = int(cfg["num_hidden_layers"])
    layer_ids = list(default_target_layer_ids(n_target) if target_layer_ids is None else target_layer_ids)
    if not layer_ids or any(not 0 <= i < n_target for i in layer_ids):
        raise ValueError(f"target_layer_ids must be non-empty indices in [0, {n_target}), got {layer_ids}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    hidden = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)

    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, len(layer_ids) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "self_attn.k_norm.weight": (head_dim,),
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    tdtype = _torch_dtype(dtype)
    tensors = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=tdtype)
        else:
            t = torch.empty(shape, dtype=torch.float32)
            _normal_(t, initializer_range, _generator(seed, "dflash:" + name))
            tensors[name] = t.to(tdtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    draft_cfg = dict(cfg)
    for key in ("auto_map", "_name_or_path", "transformers_version"):
        draft_cfg.pop(key, None)
    draft_cfg.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        num_hidden_layers=num_layers,
        max_window_layers=num_layers,
        layer_types=["full_attention"] * num_layers,
        block_size=block_size,
        num_target_layers=n_target,
        dflash_config={"mask_token_id": MASK_TOKEN_ID, "target_layer_ids": layer_ids},
        tie_word_embeddings=False,
        initializer_range=initializer_range,
        dtype=dtype,
    )
    (out / "config.json").write_text(json.dumps(draft_cfg, indent=2, sort_keys=True) + "\n")
    _copy_tokenizer(target, out)
    return out


# --------------------------------------------------------------------------------------------
# Hybrid targets
# --------------------------------------------------------------------------------------------


def _refill_lm_head(model, lm_head_std: float | None, seed: int) -> None:
    if lm_head_std is not None:
        _normal_(model.lm_head.weight, lm_head_std, _generator(seed, "lm_head.weight"))


def build_qwen3_next_target(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 4,
    full_attention_interval: int = 4,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_head_dim: int = 128,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    shared_expert_intermediate_size: int = 64,
    mlp_only_layers: tuple[int, ...] | list[int] = (),
    vocab_size: int = 2048,
    seed: int = 0,
    dtype: str = "bfloat16",
    initializer_range: float = 0.1,
    lm_head_std: float | None = 0.5,
    max_position_embeddings: int = 8192,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write a random-weight ``Qwen3NextForCausalLM`` to ``out_dir`` and return its path.

    A hybrid of Gated DeltaNet ("linear_attention") and gated full attention layers: layer i is full
    attention when ``(i + 1) % full_attention_interval == 0`` (default: 3 GDN layers, then 1 full
    attention layer). GDN layers have ``linear_num_key_heads`` / ``linear_num_value_heads`` heads of
    ``linear_head_dim`` (key and value); full attention has ``num_heads`` / ``num_kv_heads`` heads of
    ``head_dim`` with partial RoPE (factor 0.25). Every layer's MLP is a sparse MoE with
    ``num_experts`` experts (top ``num_experts_per_tok``, ``moe_intermediate_size``) plus a gated shared
    expert, except the layers in ``mlp_only_layers``, which get a dense SwiGLU MLP of
    ``intermediate_size`` (vLLM needs at least one MoE layer: it raises "No Qwen3Next layer found"). Loaded by vLLM ``model_executor/models/qwen3_next.py``.

    CPU constraints (vLLM 0.32 CPU build): GDN needs ``dtype="bfloat16"`` and a linear head dim of
    128 (others raise ``Unexpected head dim size``), and spec decode needs
    ``enable_prefix_caching=False`` (see :func:`make_llm`).

    Initialisation: transformers' own ``_init_weights`` (N(0, ``initializer_range``) for linears and
    embeddings, zero-centred RMSNorm gains, GDN ``A_log`` / ``dt_bias``), seeded with
    ``torch.manual_seed(seed)``; then ``lm_head`` is redrawn from N(0, ``lm_head_std``) (skipped if
    None) to widen the top-1/top-2 logit gap.

    Raises ``ValueError`` on a bad ``dtype``, no MoE layer, or a tokenizer larger than ``vocab_size``.
    """
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    _torch_dtype(dtype)
    if num_experts < 1 or len(set(mlp_only_layers) & set(range(num_layers))) == num_layers:
        raise ValueError("Qwen3-Next needs num_experts >= 1 and at least one MoE layer (vLLM requires one)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layer_types = [
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    config = Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim,
        linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        norm_topk_prob=True,
        layer_types=layer_types,
        tie_word_embeddings=False,
        **_special_token_ids(),
    )
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config)
    _refill_lm_head(model, lm_head_std, seed)
    _save_hf_model(model, out, dtype)
    _install_tokenizer(out, tokenizer_dir, vocab_size)
    return out


def build_granite_hybrid_target(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 4,
    attention_layers: tuple[int, ...] | list[int] = (2,),
    hidden_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    shared_intermediate_size: int = 256,
    num_experts: int = 0,
    mamba_n_heads: int = 8,
    mamba_d_state: int = 16,
    mamba_n_groups: int = 1,
    mamba_expand: int = 2,
    mamba_chunk_size: int = 64,
    vocab_size: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
    initializer_range: float = 0.1,
    lm_head_std: float | None = 0.5,
    max_position_embeddings: int = 8192,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path:
    """Write a random-weight ``GraniteMoeHybridForCausalLM`` to ``out_dir`` and return its path.

    A Mamba2 + attention hybrid: the layers listed in ``attention_layers`` are full (RoPE) attention
    with ``num_heads`` / ``num_kv_heads`` heads of ``hidden_size // num_heads``, the others Mamba2
    mixers with ``mamba_n_heads`` heads of ``mamba_expand * hidden_size // mamba_n_heads``, state size
    ``mamba_d_state``, ``mamba_n_groups`` groups, conv kernel 4. Each layer has a dense shared MLP of
    ``shared_intermediate_size`` and, if ``num_experts`` > 0, a top-2 MoE as well. All Granite
    multipliers are neutral except ``attention_multiplier`` = 1/sqrt(head_dim). Saved in ``dtype``
    (fp32 by default: the CPU Mamba2 path is exercised in fp32). Loaded by vLLM
    ``model_executor/models/granitemoehybrid.py``.

    Note: on vLLM 0.32 this model does not implement the EAGLE3 aux-hidden-state interface, so
    vLLM's own DFlash refuses it; it is a target-only / tree-verifier fixture.

    Initialisation: transformers' ``_init_weights`` seeded with ``torch.manual_seed(seed)``, then
    ``lm_head`` redrawn from N(0, ``lm_head_std``) (skipped if None).

    Raises ``ValueError`` on a bad ``dtype``, an attention layer index out of range, or
    inconsistent Mamba sizes.
    """
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    _torch_dtype(dtype)
    if any(not 0 <= i < num_layers for i in attention_layers):
        raise ValueError(f"attention_layers must be in [0, {num_layers}), got {list(attention_layers)}")
    if (mamba_expand * hidden_size) % mamba_n_heads:
        raise ValueError("mamba_n_heads must divide mamba_expand * hidden_size")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden_size // num_heads
    config = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=shared_intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        position_embedding_type="rope",
        embedding_multiplier=1.0,
        logits_scaling=1.0,
        residual_multiplier=1.0,
        attention_multiplier=head_dim**-0.5,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
        shared_intermediate_size=shared_intermediate_size,
        layer_types=[
            "full_attention" if i in attention_layers else "linear_attention" for i in range(num_layers)
        ],
        mamba_n_heads=mamba_n_heads,
        mamba_n_groups=mamba_n_groups,
        mamba_d_state=mamba_d_state,
        mamba_d_head=mamba_expand * hidden_size // mamba_n_heads,
        mamba_d_conv=4,
        mamba_expand=mamba_expand,
        mamba_chunk_size=mamba_chunk_size,
        tie_word_embeddings=False,
        **_special_token_ids(),
    )
    config.architectures = ["GraniteMoeHybridForCausalLM"]
    torch.manual_seed(seed)
    model = GraniteMoeHybridForCausalLM(config)
    _refill_lm_head(model, lm_head_std, seed)
    _save_hf_model(model, out, dtype)
    _install_tokenizer(out, tokenizer_dir, vocab_size)
    return out


# --------------------------------------------------------------------------------------------
# Cache / zoo
# --------------------------------------------------------------------------------------------


def _cache_key(kind: str, kwargs: Mapping[str, Any]) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, "kind": kind, "kwargs": kwargs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cached_build(cache_root: str | os.PathLike, kind: str, builder: Callable[..., Path], **kwargs: Any) -> Path:
    """Run ``builder(out_dir, **kwargs)`` once into ``cache_root/<kind>-<hash>`` and return that path.

    The hash covers ``kind``, ``kwargs`` (JSON, paths as strings) and :data:`FORMAT_VERSION`. A
    directory is complete when it holds a ``.complete`` marker; the build happens in a temporary
    sibling directory that is renamed into place, so concurrent test processes and interrupted
    builds never expose a half-written model.
    """
    root = Path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{kind}-{_cache_key(kind, kwargs)}"
    if (final / ".complete").exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        builder(tmp, **kwargs)
        (tmp / ".complete").write_text(json.dumps({"kind": kind, "kwargs": kwargs}, default=str, indent=2))
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished first (the target is a non-empty directory): keep theirs.
            if not (final / ".complete").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


#: Names understood by :class:`TinyModelZoo` and :func:`build_all`.
MODEL_NAMES = (
    "tokenizer",
    "qwen3_target",
    "dflash_drafter",
    "qwen3_next_target",
    "qwen3_next_dflash_drafter",
    "granite_hybrid_target",
)


class TinyModelZoo:
    """Lazily built, cached tiny models under one ``cache_root``.

    ``zoo.get(name)`` (or ``zoo[name]``, or the attribute of the same name) builds the model on first
    use through :func:`cached_build` and returns its directory; names are :data:`MODEL_NAMES`
    (``dflash_drafter`` is for ``qwen3_target``, ``qwen3_next_dflash_drafter`` for
    ``qwen3_next_target``; both block_size 16, target layers [0, 2]). All models share one
    tokenizer. ``overrides`` maps a name to extra builder keyword arguments (defaults otherwise).
    Raises ``KeyError`` for an unknown name.
    """

    def __init__(self, cache_root: str | os.PathLike, overrides: Mapping[str, Mapping[str, Any]] | None = None):
        self.cache_root = Path(cache_root)
        self.overrides = {k: dict(v) for k, v in (overrides or {}).items()}
        unknown = set(self.overrides) - set(MODEL_NAMES)
        if unknown:
            raise KeyError(f"unknown tiny model(s): {sorted(unknown)}")
        self._paths: dict[str, Path] = {}

    def _kwargs(self, name: str, **base: Any) -> dict[str, Any]:
        return {**base, **self.overrides.get(name, {})}

    def get(self, name: str) -> Path:
        if name in self._paths:
            return self._paths[name]
        root = self.cache_root
        if name == "tokenizer":
            path = cached_build(root, name, build_tokenizer, **self._kwargs(name, vocab_size=2048))
        elif name in ("dflash_drafter", "qwen3_next_dflash_drafter"):
            target = self.get("qwen3_target" if name == "dflash_drafter" else "qwen3_next_target")
            path = cached_build(
                root, name, build_dflash_drafter, **self._kwargs(name, target_dir=str(target), block_size=16)
            )
        elif name in ("qwen3_target", "qwen3_next_target", "granite_hybrid_target"):
            builder = {
                "qwen3_target": build_qwen3_target,
                "qwen3_next_target": build_qwen3_next_target,
                "granite_hybrid_target": build_granite_hybrid_target,
            }[name]
            path = cached_build(root, name, builder, **self._kwargs(name, tokenizer_dir=str(self.get("tokenizer"))))
        else:
            raise KeyError(f"unknown tiny model {name!r}; known: {MODEL_NAMES}")
        self._paths[name] = path
        return path

    __getitem__ = get

    def __getattr__(self, name: str) -> Path:
        if name in MODEL_NAMES:
            return self.get(name)
        raise AttributeError(name)

    def build_all(self) -> dict[str, Path]:
        return {name: self.get(name) for name in MODEL_NAMES}


def build_all(cache_root: str | os.PathLike) -> dict[str, Path]:
    """Build (or reuse) every tiny model under ``cache_root``; return ``{name: directory}``.

    Names are :data:`MODEL_NAMES`. Cached directories are keyed by a hash of the builder arguments
    and :data:`FORMAT_VERSION`, so changed defaults or a bumped format rebuild automatically.
    """
    return TinyModelZoo(cache_root).build_all()


# --------------------------------------------------------------------------------------------
# vLLM helpers
# --------------------------------------------------------------------------------------------


def read_config(model: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of a model directory as a dict."""
    return json.loads((Path(model) / "config.json").read_text())


def is_hybrid(model: str | os.PathLike) -> bool:
    """Whether the model directory holds a hybrid (GDN / Mamba + attention) architecture."""
    return bool(set(read_config(model).get("architectures") or ()) & _HYBRID_ARCHITECTURES)


def llm_kwargs(model: str | os.PathLike, **overrides: Any) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments :func:`make_llm` uses, with ``overrides`` applied.

    Defaults: ``dtype`` from the model's ``config.json``, ``max_model_len=1024``,
    ``enforce_eager=True``, ``seed=0``, ``max_num_seqs=8``, ``disable_log_stats=False`` (so
    ``llm.get_metrics()`` has the spec-decode counters), and for hybrid models
    ``enable_prefix_caching=False`` (CPU vLLM 0.32 has no CPU kernel for the mamba "align" prefix
    cache mode, which breaks hybrid + spec decode).
    """
    cfg = read_config(model)
    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": cfg.get("dtype") or cfg.get("torch_dtype") or "float32",
        "max_model_len": 1024,
        "enforce_eager": True,
        "seed": 0,
        "max_num_seqs": 8,
        "disable_log_stats": False,
    }
    if is_hybrid(model):
        kwargs["enable_prefix_caching"] = False
    kwargs.update(overrides)
    return kwargs


def make_llm(model: str | os.PathLike, **overrides: Any):
    """Create a ``vllm.LLM`` for a tiny model with settings that work on CPU vLLM 0.32.

    See :func:`llm_kwargs` for the defaults; ``overrides`` (e.g. ``speculative_config=...``) win.
    Applies :data:`CPU_TEST_ENV` defaults first (effective only if vLLM was not imported yet).
    Free it with :func:`release_llm` before creating many more in one process.
    """
    apply_cpu_test_env()
    from vllm import LLM

    return LLM(**llm_kwargs(model, **overrides))


def top2_logprob_gaps(outputs) -> list[float]:
    """Top-1 minus top-2 logprob (= logit gap) at every generated position of ``outputs``.

    ``outputs`` are ``vllm.RequestOutput`` objects generated with ``SamplingParams(logprobs>=2)``;
    the result is flat, in request then position order. Raises ``ValueError`` if a position carries
    fewer than two logprobs.
    """
    gaps: list[float] = []
    for request in outputs:
        for position in request.outputs[0].logprobs or ():
            values = sorted((lp.logprob for lp in position.values()), reverse=True)
            if len(values) < 2:
                raise ValueError("generate with SamplingParams(logprobs=2) or more")
            gaps.append(values[0] - values[1])
    return gaps


#: bf16 greedy comparisons: the largest top-2 logprob gap at which a first differing token is
#: taken for vLLM's own rounding, two steps of the tiny bf16 models' logits (gaps come in
#: multiples of 0.125). On CPUs with AMX / AVX-512-bf16, oneDNN's bf16 GEMMs round a row
#: differently with the number of rows in the step, so stock target-only decoding flips such
#: near-ties when only its schedule changes (measured on such a machine: the tiny Qwen3 target's
#: test prompts one at a time vs batched differ in 5 of 8 requests, gaps 0.125–0.25; the tiny
#: Qwen3-Next with ``max_num_batched_tokens`` 64 instead of 256 gives exactly the divergence
#: a DDTree run there showed, gap 0.125). fp32 comparisons stay exact (``near_tie=0``).
BF16_BATCH_VARIANCE = 0.25

#: ``SamplingParams.logprobs`` for the reference of a near-tie comparison. bf16 logits come in
#: steps of 0.125, so ties are often three-way: the tiny Qwen3-Next's target-only run gave, at
#: one position, 1532 at -1.637 and 521 and 150 both at -1.762, and a DDTree run on an AVX2 CPU
#: (1532 and 150 tied there) chose 150; a top-2 reference cannot show that 150 was a near-tie.
NEAR_TIE_LOGPROBS = 8


def greedy_mismatches(reference, candidate, *, near_tie: float = 0.0) -> list[str]:
    """Compare greedy generations token by token; return a description of each unexplained mismatch.

    ``reference``: ``vllm.RequestOutput`` list generated with logprobs (e.g. target-only;
    :data:`NEAR_TIE_LOGPROBS` of them when ``near_tie > 0``, so that every token within the
    near-tie of the top is listed);
    ``candidate``: a ``RequestOutput`` list or a list of token-id lists, same requests and order.
    For each request the first differing position is located. It is *explained* (not reported)
    when the candidate's token is among the reference's logprobs there and at most ``near_tie``
    below the reference's top logprob: a numerical near-tie, after which the sequences may
    legitimately diverge. Everything else (length mismatches, a different token at a clear position) is
    reported. ``near_tie=0.0`` demands exact equality except on exact ties.

    Use :data:`BF16_BATCH_VARIANCE` for bf16 models such as the tiny Qwen3-Next, where ~5 % of
    positions are within 0.01 of a tie; keep it 0 for fp32 models.
    """
    problems: list[str] = []
    if len(reference) != len(candidate):
        return [f"{len(reference)} reference requests but {len(candidate)} candidate requests"]
    for r, (ref, cand) in enumerate(zip(reference, candidate)):
        ref_ids = list(ref.outputs[0].token_ids)
        cand_ids = list(cand.outputs[0].token_ids) if hasattr(cand, "outputs") else list(cand)
        pos = next((i for i, (a, b) in enumerate(zip(ref_ids, cand_ids)) if a != b), None)
        if pos is None:
            if len(ref_ids) != len(cand_ids):
                problems.append(f"request {r}: lengths {len(ref_ids)} vs {len(cand_ids)} with a common prefix")
            continue
        logprobs = ref.outputs[0].logprobs
        if not logprobs:
            problems.append(f"request {r}: first mismatch at {pos} ({ref_ids[pos]} vs {cand_ids[pos]})")
            continue
        top = max(lp.logprob for lp in logprobs[pos].values())
        cand_lp = logprobs[pos].get(cand_ids[pos])
        deficit = top - cand_lp.logprob if cand_lp is not None else float("inf")
        if deficit <= near_tie:
            continue
        lowest = min(lp.logprob for lp in logprobs[pos].values())
        if cand_lp is None and top - lowest <= near_tie:
            problems.append(
                f"request {r}: first mismatch at {pos}: reference {ref_ids[pos]} vs candidate "
                f"{cand_ids[pos]}, which is not among the reference's {len(logprobs[pos])} "
                f"logprobs, all within near_tie={near_tie} of the top: generate the reference with "
                f"more logprobs (NEAR_TIE_LOGPROBS) to judge it")
            continue
        problems.append(
            f"request {r}: first mismatch at {pos}: reference {ref_ids[pos]} vs candidate {cand_ids[pos]}, "
            f"candidate token {deficit:.4g} below the reference's top logprob (near_tie={near_tie})"
        )
    return problems


def release_llm(llm) -> None:
    """Shut down an ``LLM`` made by :func:`make_llm` and free its memory (best effort).

    The caller must drop its own references too (``del llm``) before the next :func:`make_llm`.
    """
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # pragma: no cover - best effort
            pass
    del llm
    gc.collect()
