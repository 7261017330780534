"""Train the tiny target: a byte-level BPE tokenizer and a Qwen3 language model on stdlib sources.

Corpus: :func:`corpus.train_files` (the Python standard library minus test suites and the held-out
modules). Output: a Hugging Face model directory that vLLM loads as ``Qwen3ForCausalLM``
(``config.json``, ``model.safetensors`` in fp32, ``tokenizer.json`` + ``tokenizer_config.json``).

Model (defaults): 4 layers, hidden 256, 4 query heads / 2 KV heads of dim 64, SwiGLU 768, vocab
4096, untied ``lm_head``: 5.25 M parameters, 21 MB in fp32. Training: random windows of
``--seq-len`` tokens from the concatenated corpus (files joined by ``<|endoftext|>``), AdamW,
linear warm-up then cosine decay, fixed seed; about 1.1 s per step on 2 idle CPU cores. The
shipped target is the first 547 steps of the 1000-step schedule (``--stop-at 547``, ~10 minutes
alone on 2 cores; it was cut short because the machine was shared):

    python examples/train/train_target.py --out models/pystdlib-qwen3 --steps 1000 --stop-at 547

Special tokens are those of the test fixtures (``tests.support.models``): ``<|endoftext|>`` 0
(bos/eos), ``<|pad|>`` 1, ``<|mask|>`` 2 (the DFlash mask token; never appears in training text).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The tiny-model builders are test support (tests/support in the source checkout), not part of
# the installed package.
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import corpus  # noqa: E402

from tests.support.models import (  # noqa: E402
    BOS_TOKEN, EOS_TOKEN, EOS_TOKEN_ID, MASK_TOKEN, PAD_TOKEN, PAD_TOKEN_ID, SPECIAL_TOKENS,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this many steps (the learning-rate schedule still spans --steps)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N training files (smoke runs)")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def train_tokenizer(files: list[str], vocab_size: int, out: Path):
    """Byte-level BPE on ``files``, saved to ``out`` (as the fixtures' ``build_tokenizer``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((corpus.read(f) for f in files), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, mask_token=MASK_TOKEN, model_max_length=1 << 16,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out))
    return tok


def encode_corpus(tok, files: list[str]) -> torch.Tensor:
    """All ``files`` tokenized and joined by ``<|endoftext|>``: a 1-D int64 tensor [N]."""
    ids: list[int] = []
    for enc in tok.encode_batch([corpus.read(f) for f in files]):
        ids.extend(enc.ids)
        ids.append(EOS_TOKEN_ID)
    return torch.tensor(ids, dtype=torch.long)


def make_model(args, vocab_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=4096, max_window_layers=args.layers,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID,
        attn_implementation="sdpa",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return Qwen3ForCausalLM(config)


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    files = corpus.train_files()[: args.max_files]
    tok = train_tokenizer(files, args.vocab_size, out)
    data = encode_corpus(tok, files)
    print(f"corpus: {len(files)} files, {data.numel()} tokens; tokenizer {tok.get_vocab_size()} tokens "
          f"({time.time() - t_start:.0f}s)", flush=True)

    model = make_model(args, args.vocab_size)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    ema = None
    for step in range(args.steps if args.stop_at is None else min(args.stop_at, args.steps)):
        starts = torch.randint(0, data.numel() - args.seq_len - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s: s + args.seq_len] for s in starts.tolist()])  # [batch, seq_len]
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if step % 50 == 0 or step == args.steps - 1 or step + 1 == args.stop_at:
            print(f"step {step:5d}  loss {loss.item():.3f}  (ema {ema:.3f})  {time.time() - t_start:.0f}s", flush=True)

    model.eval()
    model.config.dtype = "float32"
    model.save_pretrained(str(out))
    gen_cfg = out / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()  # an HF default would only add eos / sampling noise to vLLM runs
    (out / "training.json").write_text(json.dumps(
        {"script": "examples/train/train_target.py", "args": vars(args), "corpus_tokens": int(data.numel()),
         "final_loss_ema": ema, "seconds": round(time.time() - t_start), "torch": torch.__version__,
         "python_stdlib": corpus.stdlib_root()}, indent=2) + "\n")
    print(f"saved {out} ({time.time() - t_start:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
