"""The main job: where DDTree pays on this machine, and that its output is exact.

Runs the trained tiny pair shipped in ``models/`` (a 5 M-parameter Qwen3 target trained on the
Python standard library, and its DFlash drafter) on code prompts from standard-library modules
held out of training, with four engines: target-only decoding, vLLM's own DFlash chain, DDTree
with ``"ddtree_budget": "auto"`` and DDTree with one fixed node budget B. Each engine decodes the
prompts one at a time (batch 1) and all at once (batch 8), interleaved in rounds so that a slow
spell of the machine hits every engine alike. Prints, per batch size, the acceptance length τ,
tokens/s and the ratios to target-only and to DFlash, whether greedy output is identical to
target-only, and one closing sentence drawn from those numbers. Exits 1 unless greedy DDTree
output (``auto`` and fixed B) equals target-only output token for token (fp32).

    python examples/generate.py                 # 1.5-2 minutes on 2 CPU cores
    python examples/generate.py --budget 32 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGET = MODELS / "pystdlib-qwen3"
DRAFTER = MODELS / "pystdlib-qwen3-dflash"
PROMPTS = MODELS / "heldout_prompts.json"

#: Speed differences below this are within the run-to-run noise of a shared 2-core machine.
NOISE = 0.03


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(TARGET), help="target model directory")
    p.add_argument("--drafter", default=str(DRAFTER), help="DFlash drafter directory")
    p.add_argument("--budget", type=int, default=16, help="the fixed node budget B to compare")
    p.add_argument("--horizon", type=int, default=None,
                   help="num_speculative_tokens: drafter horizon L (default block_size - 1)")
    p.add_argument("--configs", nargs="+", default=["dflash", "auto", "fixed"],
                   choices=["dflash", "auto", "fixed"],
                   help="engines besides target-only (always run: it is the reference)")
    p.add_argument("--batch", type=int, default=8, help="the batch size compared with batch 1")
    p.add_argument("--num-prompts", type=int, default=8, help="held-out prompts (max 16)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; replaces the held-out ones)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="interleaved measured rounds")
    p.add_argument("--show", action="store_true", help="print DDTree's completions")
    return p.parse_args(argv)


def engine_kwargs(target: str, batch: int, spec: dict | None) -> dict:
    """The settings every number of this project was measured with: fp32 (greedy output is
    then exact token for token), no torch.compile, spec-decode counters on."""
    kwargs = dict(model=target, dtype="float32", enforce_eager=True, max_model_len=1024,
                  max_num_seqs=max(8, batch), seed=0, disable_log_stats=False,
                  use_tqdm_on_load=False)
    if spec is not None:
        kwargs["speculative_config"] = spec
    import torch

    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.2  # four engines share one GPU
    return kwargs


def configs(args) -> list[tuple[str, dict | None]]:
    block = json.loads((Path(args.drafter) / "config.json").read_text())["block_size"]
    horizon = args.horizon or block - 1
    ddtree = {"method": "ddtree", "model": args.drafter, "num_speculative_tokens": horizon}
    out = [("target-only", None)]
    if "dflash" in args.configs:
        out.append(("DFlash", {"method": "dflash", "model": args.drafter,
                               "num_speculative_tokens": horizon}))
    if "auto" in args.configs:
        out.append(("DDTree auto", {**ddtree, "ddtree_budget": "auto"}))
    if "fixed" in args.configs:
        out.append((f"DDTree B={args.budget}", {**ddtree, "ddtree_budget": args.budget}))
    return out


class SpecStats:
    """One engine's spec-decode figures, summed from the per-step stats vLLM hands its stat
    loggers: the numbers behind the server's ``vllm:spec_decode_*`` and ``vllm:ddtree_*``
    series. (``llm.get_metrics()`` reads one Prometheus registry per process, which each new
    engine takes over; this job keeps four engines alive.)"""

    FIELDS = ("num_drafts", "num_accepted_tokens", "tree_builds", "auto_trees", "auto_nodes",
              "auto_unprofitable_steps")

    def __init__(self, llm):
        self.sums = dict.fromkeys(self.FIELDS, 0)
        manager = llm.llm_engine.logger_manager
        record = manager.record

        def counted(*args, scheduler_stats=None, **kwargs):
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            for key in self.FIELDS if spec is not None else ():
                self.sums[key] += getattr(spec, key, 0)  # DDTree's fields: 0 for DFlash
            return record(*args, scheduler_stats=scheduler_stats, **kwargs)

        manager.record = counted

    def snapshot(self) -> dict:
        return dict(self.sums)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.batch < 2:
        raise SystemExit("--batch must be at least 2 (batch 1 is always run)")
    for flag, value in (("--rounds", args.rounds), ("--num-prompts", args.num_prompts),
                        ("--max-tokens", args.max_tokens), ("--budget", args.budget)):
        if value < 1:  # before any engine is built
            raise SystemExit(f"{flag} must be at least 1, got {value}")
    # Engines in this process, as the benchmarks measure them (no two processes to spawn per
    # engine); 1 GiB of KV cache each on a CPU.
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                       ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    if not {"VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING"} & set(os.environ):
        # Four engines' worth of vLLM's start-up warnings would bury the table: vLLM's own lines
        # only from ERROR up, DDTree's from WARNING up (among them auto's advice to turn
        # speculation off). vLLM would reset these levels for every engine it configures.
        os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
        logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
        logging.getLogger("vllm").setLevel(logging.ERROR)
        logging.getLogger("vllm.ddtree").setLevel(logging.WARNING)
    from vllm import LLM, SamplingParams

    prompts = args.prompt or json.loads(PROMPTS.read_text())["prompts"][:args.num_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if len(prompts) < args.batch:
        raise SystemExit(f"--batch {args.batch} needs at least {args.batch} prompts, got "
                         f"{len(prompts)} (--num-prompts, --prompt)")
    # batch -> prompt groups of that size (a short last group runs as a smaller batch)
    groups = {1: [[p] for p in prompts],
              args.batch: [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]}
    print(f"target {args.target}\ndrafter {args.drafter}\n{len(prompts)} prompts × "
          f"{args.max_tokens} tokens, greedy, fp32; batch 1 and batch {args.batch}; "
          f"{args.rounds} interleaved rounds", flush=True)

    t_start = time.perf_counter()
    engines = []  # (name, llm, SpecStats)
    for name, spec in configs(args):
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(args.target, args.batch, spec))
        for group in (g for group_list in groups.values() for g in group_list):
            llm.generate(group, params, use_tqdm=False)  # warm-up: auto learns its step costs
        engines.append((name, llm, SpecStats(llm)))
        print(f"{name} engine ready ({time.perf_counter() - t0:.0f} s)", flush=True)

    # (engine, batch) -> output tokens, seconds, spec-decode sums, greedy output == target-only
    totals = {(n, b): {"tokens": 0, "seconds": 0.0, "spec": dict.fromkeys(SpecStats.FIELDS, 0),
                       "same": True} for n, _, _ in engines for b in groups}
    first = {}  # (engine, batch) -> the first round's token ids, prompt by prompt
    for rnd in range(args.rounds):
        for batch, group_list in groups.items():
            outs = {name: [] for name, _, _ in engines}
            for g, group in enumerate(group_list):
                # Every engine runs this prompt group before the next one, in a shuffled order:
                # a slow spell of the machine hits all of them alike.
                order = list(engines)
                random.Random(f"{rnd}/{batch}/{g}").shuffle(order)
                for name, llm, stats in order:
                    before, t0 = stats.snapshot(), time.perf_counter()
                    got = llm.generate(group, params, use_tqdm=False)
                    t = totals[(name, batch)]
                    t["seconds"] += time.perf_counter() - t0
                    t["tokens"] += sum(len(o.outputs[0].token_ids) for o in got)
                    for key, value in stats.snapshot().items():
                        t["spec"][key] += value - before[key]
                    outs[name] += [list(o.outputs[0].token_ids) for o in got]
            for name, _, _ in engines:
                first.setdefault((name, batch), outs[name])
                totals[(name, batch)]["same"] &= outs[name] == outs["target-only"]
        print(f"round {rnd + 1} of {args.rounds} done", flush=True)

    rows = {}
    for (name, batch), t in totals.items():
        drafts, accepted = t["spec"]["num_drafts"], t["spec"]["num_accepted_tokens"]
        rows[(name, batch)] = {"tok_s": t["tokens"] / t["seconds"], "same": t["same"],
                               "tau": 1 + accepted / drafts if drafts else 1.0}
    names = [n for n, _, _ in engines]
    print(f"\n| batch | engine | τ | tokens/s | × target-only | × DFlash | identical |")
    print("|---|---|---|---|---|---|---|")
    for batch in groups:
        ar = rows[("target-only", batch)]["tok_s"]
        dflash = rows.get(("DFlash", batch), {}).get("tok_s")
        for name in names:
            r = rows[(name, batch)]
            vs_dflash = f"{r['tok_s'] / dflash:.2f}" if dflash else "—"
            print(f"| {batch} | {name} | {r['tau']:.2f} | {r['tok_s']:.0f} | "
                  f"{r['tok_s'] / ar:.2f} | {vs_dflash} | {'yes' if r['same'] else 'NO'} |")
    print()
    for (name, batch), t in totals.items():
        a = t["spec"]
        if a["auto_trees"]:  # what the controller chose, and whether it saw speculation lose
            print(f"{name}, batch {batch}: mean node budget {a['auto_nodes'] / a['auto_trees']:.1f}; "
                  f"target-only predicted faster in {a['auto_unprofitable_steps']} of "
                  f"{a['tree_builds']} steps"
                  + (" -- auto's warning: consider turning speculative decoding off here"
                     if a["auto_unprofitable_steps"] > a["tree_builds"] / 2 else ""))
    print("\n" + verdict(rows, names, list(groups)))
    if args.show:
        tokenizer = engines[0][1].get_tokenizer()
        for prompt, out in zip(prompts, first[(names[-1], 1)]):
            print(f"\n--- prompt ending {prompt.splitlines()[-1]!r}\n{tokenizer.decode(out)}")

    ddtree = [n for n in names if n.startswith("DDTree")]
    same = all(rows[(n, b)]["same"] for n in ddtree for b in groups)
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s; front-end pid {os.getpid()}")
    if ddtree:
        print("greedy DDTree output identical to target-only:", same)
    else:
        print("no DDTree engine ran (--configs); nothing to compare")
    for _, llm, _ in engines:
        llm.llm_engine.engine_core.shutdown()
    return 0 if same else 1


def verdict(rows: dict, names: list[str], batches: list[int]) -> str:
    """One sentence on where speculation pays, drawn from the measured table."""
    spec = [n for n in names if n != "target-only"]
    ddtree = [n for n in spec if n.startswith("DDTree")]
    if not spec:
        return "Only target-only decoding was run."
    parts, slow = [], []
    for b in batches:
        tok_s = {n: rows[(n, b)]["tok_s"] for n in names}
        best = max(spec, key=tok_s.get)
        ratio = tok_s[best] / tok_s["target-only"]
        word = ("pays" if ratio >= 1 + NOISE else "breaks even" if ratio > 1 - NOISE
                else "does not pay")
        detail = f"best: {best}, {ratio:.2f}× target-only"
        if "DFlash" in tok_s and ddtree:
            best_dd = max(ddtree, key=tok_s.get)
            detail += f"; {best_dd} {tok_s[best_dd] / tok_s['DFlash']:.2f}× DFlash"
        parts.append(f"{word} at batch {b} ({detail})")
        if ratio <= 1 - NOISE:
            slow.append(str(b))
    advice = (f": use target-only decoding at batch {' and '.join(slow)} here" if slow else "")
    return "On this machine speculation " + " and ".join(parts) + advice + "."


if __name__ == "__main__":
    sys.exit(main())
