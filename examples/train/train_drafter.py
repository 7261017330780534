"""Distil a DFlash drafter from a trained target, in the checkpoint layout vLLM's DFlash loader reads.

The DFlash way (what vLLM computes at inference, ``vllm/v1/spec_decode/dflash.py`` and
``model_executor/models/qwen3_dflash.py``): for a bonus token at position ``p`` the drafter sees

* **context**: the target's tapped hidden states of positions ``0 .. p-1`` (outputs of the decoder
  layers ``target_layer_ids``, the residual stream before any norm; vLLM taps aux layer ``i + 1``),
  fused as ``ctx = hidden_norm(fc(concat))`` and entering every draft layer only as K/V
  (``k_norm(k_proj(ctx))`` with RoPE at the context positions, ``v_proj(ctx)``; no input norm);
* **query block**: ``[x_p, MASK × L]`` at positions ``p .. p+L`` embedded with the target's
  ``embed_tokens`` (MASK = ``<|mask|>`` id 2), non-causal attention over context + whole block;

and predicts ``x_{p+1} .. x_{p+L}`` in one pass (slots 1..L, through the target's ``lm_head``).

Training data = the target's own greedy continuations (distillation): prompts cut from the
training corpus and from code the target never saw (the stdlib test suites), ``--gen-tokens``
greedy tokens each; anchors ``p`` lie in the continuation, so the bonus token and all labels are
target tokens, exactly as in greedy decoding. Loss: cross-entropy per block slot j, weighted
``exp(-(j-1)/gamma)`` (DFlash's decay), many anchors per sequence in one pass (one block mask).
Evaluation: the chain acceptance length ``τ = 1 + #leading correct argmax slots`` on continuations
of prompts from the held-out modules — the quantity vLLM's ``dflash`` method reports.

    python examples/train/train_drafter.py --target models/pystdlib-qwen3 --out /tmp/drafter-0 \
        --steps 1500 --stop-at 350

(the first 350 steps of a 1500-step schedule: the machine was shared; that run switched from 2 to
1 torch thread at step ~210, so a rerun matches it only up to float rounding). The shipped drafter
continues from it twice (``--init``: start from a checkpoint's weights; a new ``--seed`` draws fresh
distillation prompts): the commands are in docs/trained-pair.md.

The checkpoint is written by ``tests.support.models.build_dflash_drafter`` (config, tokenizer,
weight names and shapes) and its weights then replaced by the trained ones.
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The tiny-model builders are test support (tests/support in the source checkout), not part of
# the installed package.
sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import corpus  # noqa: E402

from tests.support.models import EOS_TOKEN_ID, MASK_TOKEN_ID, build_dflash_drafter  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="trained target model directory")
    p.add_argument("--out", required=True, help="output drafter directory")
    p.add_argument("--block-size", type=int, default=16, help="DFlash block: bonus + L = block_size - 1 masks")
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=[1, 3],
                   help="0-based target layers whose outputs feed the drafter")
    p.add_argument("--num-prompts", type=int, default=1536)
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--unseen-share", type=float, default=0.33, help="share of prompts from unseen code")
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this many steps (the learning-rate schedule still spans --steps)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--anchors", type=int, default=8, help="anchor blocks per sequence")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--gamma", type=float, default=7.0, help="slot-weight decay exp(-(j-1)/gamma)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files per split (smoke)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--init", default=None,
                   help="start from this drafter checkpoint's weights (a continuation run; use another "
                        "--seed for fresh distillation prompts)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# Target: greedy continuations and tapped hidden states
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_continue(model, prompts: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy-decode ``n`` tokens after ``prompts`` [B, P] (equal lengths, no padding) -> [B, P+n]."""
    out = model(input_ids=prompts, use_cache=True)
    past, seq = out.past_key_values, [prompts]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(n):
        seq.append(nxt)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(seq, dim=1)


@torch.no_grad()
def tapped_features(model, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """Outputs of decoder layers ``layer_ids`` for ``ids`` [B, T], concatenated -> [B, T, n*H].

    These are the residual stream after each layer (vLLM's aux hidden state ``i + 1``:
    ``hidden_states + residual`` at the input of layer ``i + 1``), read with forward hooks.
    """
    taps: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda _m, _inp, out, i=i: taps.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layer_ids]
    try:
        model.model(input_ids=ids, use_cache=False)  # no lm_head needed
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([taps[i] for i in layer_ids], dim=-1)


def sample_prompts(streams: list[torch.Tensor], weights: list[float], num: int, lens: list[int], gen) -> dict[int, torch.Tensor]:
    """``num`` random token windows, grouped by length: ``{P: [count, P]}`` (round-robin over ``lens``)."""
    groups: dict[int, list[torch.Tensor]] = {P: [] for P in lens}
    w = torch.tensor(weights)
    for i in range(num):
        P = lens[i % len(lens)]
        s = streams[int(torch.multinomial(w, 1, generator=gen))]
        start = int(torch.randint(0, s.numel() - P, (1,), generator=gen))
        groups[P].append(s[start: start + P])
    return {P: torch.stack(v) for P, v in groups.items() if v}


def distill_set(model, tok, files_by_source, weights, num, lens, gen_tokens, layer_ids, gen, batch=192):
    """Greedy continuations and features: list of (P, ids [N, T], feats [N, T, n*H])."""
    streams = []
    for files in files_by_source:
        ids: list[int] = []
        for enc in tok.encode_batch([corpus.read(f) for f in files]):
            ids.extend(enc.ids + [EOS_TOKEN_ID])
        streams.append(torch.tensor(ids, dtype=torch.long))
    if any(s.numel() <= max(lens) for s in streams):
        raise ValueError(f"a prompt source has fewer than {max(lens) + 1} tokens")
    sets = []
    for P, prompts in sample_prompts(streams, weights, num, lens, gen).items():
        ids_l, feats_l = [], []
        for b in range(0, prompts.shape[0], batch):
            ids = greedy_continue(model, prompts[b: b + batch], gen_tokens)
            ids_l.append(ids)
            feats_l += [tapped_features(model, ids[c: c + 32], layer_ids) for c in range(0, ids.shape[0], 32)]
        sets.append((P, torch.cat(ids_l), torch.cat(feats_l)))
    return sets


# ------------------------------------------------------------------------------------------------
# The drafter, in torch, computing what vLLM's DFlashQwen3Model computes
# ------------------------------------------------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE. x [..., T, heads, hd], pos [..., T] (broadcast over heads)."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    f = pos.to(torch.float32)[..., None] * inv  # [..., T, hd/2]
    cos, sin = torch.cat([f, f], -1).cos()[..., None, :], torch.cat([f, f], -1).sin()[..., None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class DFlashDrafter(nn.Module):
    """DFlash draft model; parameter names are the checkpoint's (``fc.weight``, ``layers.0...``)."""

    def __init__(self, cfg: dict, num_layers: int, num_features: int, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        H, I = cfg["hidden_size"], cfg["intermediate_size"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.eps, self.theta = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"]
        lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(num_features * H, H)
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.norm = nn.Parameter(torch.ones(H))
        self.layers = nn.ModuleList()
        for _ in range(num_layers):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            a = layer.self_attn
            a.q_proj, a.k_proj = lin(H, self.nh * self.hd), lin(H, self.nkv * self.hd)
            a.v_proj, a.o_proj = lin(H, self.nkv * self.hd), lin(self.nh * self.hd, H)
            a.q_norm, a.k_norm = nn.Parameter(torch.ones(self.hd)), nn.Parameter(torch.ones(self.hd))
            layer.input_layernorm, layer.post_attention_layernorm = nn.Parameter(torch.ones(H)), nn.Parameter(torch.ones(H))
            layer.mlp = nn.Module()
            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj = lin(H, I), lin(H, I), lin(I, H)
            self.layers.append(layer)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        self.register_buffer("embed", embed, persistent=False)      # target embed_tokens [V, H], frozen
        self.register_buffer("lm_head", lm_head, persistent=False)  # target lm_head [V, H], frozen

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Weights under the checkpoint names (norm parameters get their ``.weight`` suffix)."""
        out = {}
        for name, p in self.named_parameters():
            if not name.endswith(".weight"):
                name += ".weight"
            out[name] = p.detach().contiguous()
        return out

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`checkpoint_state` (e.g. a drafter checkpoint's ``model.safetensors``).

        Raises:
            ValueError: the checkpoint's weight names or shapes differ from this drafter's.
        """
        params = dict(self.named_parameters())
        want = {k: tuple(v.shape) for k, v in self.checkpoint_state().items()}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if want != got:
            diff = sorted(set(want.items()) ^ set(got.items()))[:4]
            raise ValueError(f"checkpoint does not match this drafter's layout (e.g. {diff})")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name if name.endswith(".weight") else name + ".weight"].to(p.dtype))

    def forward(self, feats: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Draft logits for every anchor block.

        feats [S, T, n*H] tapped target states; ids [S, T] tokens; anchors [S, K] bonus positions p.
        Block k of sequence s = tokens [ids[s, p], MASK × L] at positions p .. p+L; it attends to the
        context positions < p and to its own block (non-causal). Returns logits [S, K, L, V] for
        slots 1..L (slot j predicts the token at position p + j).
        """
        S, T, _ = feats.shape
        K, Lb = anchors.shape[1], self.block_size
        L = Lb - 1
        ctx = rms(self.fc(feats), self.hidden_norm, self.eps)  # [S, T, H]
        ctx_pos = torch.arange(T).expand(S, T)
        blk_ids = torch.full((S, K, Lb), MASK_TOKEN_ID, dtype=torch.long)
        blk_ids[:, :, 0] = torch.gather(ids, 1, anchors)
        blk_pos = (anchors[:, :, None] + torch.arange(Lb)).reshape(S, K * Lb)
        x = self.embed[blk_ids.reshape(S, K * Lb)]  # [S, Q, H], Q = K * Lb
        # mask [S, 1, Q, T + Q]: context t < p_k, and the query's own block
        q_anchor = anchors.repeat_interleave(Lb, dim=1)  # [S, Q]
        ctx_ok = torch.arange(T)[None, None, :] < q_anchor[:, :, None]
        q_blk = torch.arange(K * Lb) // Lb
        blk_ok = (q_blk[:, None] == q_blk[None, :]).expand(S, -1, -1)
        mask = torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]
        Q = K * Lb
        for layer in self.layers:
            a = layer.self_attn
            h = rms(x, layer.input_layernorm, self.eps)
            q = rms(a.q_proj(h).view(S, Q, self.nh, self.hd), a.q_norm, self.eps)
            kb = rms(a.k_proj(h).view(S, Q, self.nkv, self.hd), a.k_norm, self.eps)
            kc = rms(a.k_proj(ctx).view(S, T, self.nkv, self.hd), a.k_norm, self.eps)
            q, kb, kc = rope(q, blk_pos, self.theta), rope(kb, blk_pos, self.theta), rope(kc, ctx_pos, self.theta)
            k = torch.cat([kc, kb], 1).transpose(1, 2)  # [S, nkv, T+Q, hd]
            v = torch.cat([a.v_proj(ctx).view(S, T, self.nkv, self.hd),
                           a.v_proj(h).view(S, Q, self.nkv, self.hd)], 1).transpose(1, 2)
            rep = self.nh // self.nkv
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(rep, 1),
                                               v.repeat_interleave(rep, 1), attn_mask=mask)
            x = x + a.o_proj(o.transpose(1, 2).reshape(S, Q, self.nh * self.hd))
            m = layer.mlp
            h = rms(x, layer.post_attention_layernorm, self.eps)
            x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
        out = rms(x, self.norm, self.eps).view(S, K, Lb, -1)[:, :, 1:]  # [S, K, L, H]
        return out @ self.lm_head.T  # [S, K, L, V]


def block_labels(ids: torch.Tensor, anchors: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ids[p + j] for j = 1..L -> ([S, K, L], valid mask [S, K, L]) (past the end: invalid)."""
    T = ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, L + 1)
    valid = pos < T
    return torch.gather(ids, 1, pos.clamp(max=T - 1).view(ids.shape[0], -1)).view_as(pos), valid


def sample_batch(sets, S, K, gen):
    """A batch from one length group: ids [S, T], feats [S, T, F], anchors [S, K] in the continuation."""
    sizes = torch.tensor([float(s[1].shape[0]) for s in sets])
    P, ids, feats = sets[int(torch.multinomial(sizes, 1, generator=gen))]
    rows = torch.randint(0, ids.shape[0], (S,), generator=gen)
    T = ids.shape[1]
    anchors = torch.randint(P, T - 1, (S, K), generator=gen)
    return ids[rows], feats[rows], anchors


@torch.no_grad()
def chain_tau(drafter, sets, L) -> tuple[float, list[float]]:
    """Mean chain acceptance length and per-depth acceptance over every anchor of ``sets``."""
    acc_len, n = torch.zeros(L + 1), 0
    for P, ids, feats in sets:
        T = ids.shape[1]
        anchors = torch.arange(P, T - L).expand(ids.shape[0], -1)
        for b in range(0, ids.shape[0], 8):
            a = anchors[b: b + 8]
            logits = drafter(feats[b: b + 8], ids[b: b + 8], a)
            labels, _ = block_labels(ids[b: b + 8], a, L)
            lead = (logits.argmax(-1) == labels).int().cumprod(-1).sum(-1).flatten()  # [S*K]
            acc_len += torch.bincount(lead, minlength=L + 1).float()
            n += lead.numel()
    dist = acc_len / n
    tau = 1.0 + float((dist * torch.arange(L + 1)).sum())
    per_depth = [float(dist[d:].sum()) for d in range(1, L + 1)]  # P(accept >= d)
    return tau, per_depth


def check_init(args) -> None:
    """Fail before distillation if ``--init`` is not a drafter with this run's shape.

    Raises:
        SystemExit: no ``model.safetensors`` / ``config.json`` there, or its layer count, block
            size or target layers differ from ``--layers`` / ``--block-size`` / ``--target-layer-ids``.
    """
    init = Path(args.init)
    for f in ("config.json", "model.safetensors"):
        if not (init / f).is_file():
            raise SystemExit(f"--init {init}: no {f} (expected a drafter checkpoint directory)")
    cfg = json.loads((init / "config.json").read_text())
    have = {"--layers": cfg.get("num_hidden_layers"), "--block-size": cfg.get("block_size"),
            "--target-layer-ids": (cfg.get("dflash_config") or {}).get("target_layer_ids")}
    want = {"--layers": args.layers, "--block-size": args.block_size,
            "--target-layer-ids": list(args.target_layer_ids)}
    bad = [f"{k} {want[k]} (checkpoint: {have[k]})" for k in want if have[k] != want[k]]
    if bad:
        raise SystemExit(f"--init {init} does not match this run: " + "; ".join(bad))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    if args.init:
        check_init(args)
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

    target = Path(args.target)
    cfg = json.loads((target / "config.json").read_text())
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    model = Qwen3ForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    L = args.block_size - 1
    mf = args.max_files
    train_sets = distill_set(model, tok, [corpus.train_files()[:mf], corpus.unseen_files()[:mf]],
                             [1 - args.unseen_share, args.unseen_share], args.num_prompts, args.prompt_lens,
                             args.gen_tokens, args.target_layer_ids, gen)
    eval_sets = distill_set(model, tok, [corpus.held_out_files()[:mf]], [1.0], args.eval_prompts,
                            [max(args.prompt_lens)], args.gen_tokens, args.target_layer_ids, gen)
    n_tok = sum(s[1].shape[0] * (s[1].shape[1] - s[0]) for s in train_sets)
    print(f"distillation: {sum(s[1].shape[0] for s in train_sets)} continuations, {n_tok} greedy tokens "
          f"({time.time() - t0:.0f}s)", flush=True)

    drafter = DFlashDrafter(cfg, args.layers, len(args.target_layer_ids),
                            model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach())
    drafter.block_size = args.block_size
    if args.init:
        from safetensors.torch import load_file

        drafter.load_checkpoint_state(load_file(str(Path(args.init) / "model.safetensors")))
        print(f"initialised from {args.init}", flush=True)
    del model
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    w = torch.exp(-torch.arange(L, dtype=torch.float32) / args.gamma)  # slot weights [L]
    for step in range(args.steps if args.stop_at is None else min(args.stop_at, args.steps)):
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, feats, anchors = sample_batch(train_sets, args.batch, args.anchors, gen)
        logits = drafter(feats, ids, anchors)
        labels, valid = block_labels(ids, anchors, L)
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
        wv = w * valid
        loss = (ce * wv).sum() / wv.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == args.steps - 1 or step + 1 == args.stop_at:
            acc1 = float(((logits[:, :, 0].argmax(-1) == labels[:, :, 0]).float()).mean())
            print(f"step {step:5d}  loss {loss.item():.3f}  depth-1 acc {acc1:.2f}  {time.time() - t0:.0f}s", flush=True)

    tau, per_depth = chain_tau(drafter, eval_sets, L)
    print(f"held-out chain tau (offline, L={L}): {tau:.2f}; P(accept >= d): "
          + " ".join(f"{p:.2f}" for p in per_depth[:8]), flush=True)

    out = Path(args.out)
    build_dflash_drafter(out, target, block_size=args.block_size, num_layers=args.layers,
                         target_layer_ids=args.target_layer_ids, seed=args.seed)
    from safetensors.torch import load_file, save_file

    layout = load_file(str(out / "model.safetensors"))
    state = drafter.checkpoint_state()
    assert {k: tuple(v.shape) for k, v in layout.items()} == {k: tuple(v.shape) for k, v in state.items()}, \
        "trained weights do not match the checkpoint layout"
    save_file({k: state[k].to(torch.float32) for k in sorted(state)}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps(
        {"script": "examples/train/train_drafter.py", "args": vars(args), "distill_tokens": n_tok,
         "offline_chain_tau_held_out": round(tau, 3), "per_depth_acceptance": [round(p, 3) for p in per_depth],
         "seconds": round(time.time() - t0), "torch": torch.__version__}, indent=2) + "\n")
    print(f"saved {out} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
