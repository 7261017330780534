"""Run vLLM engines on Model Runner V2 (CPU, Triton interpreted) in a subprocess; results as JSON.

Model Runner V2 can only be chosen before vLLM is imported (:mod:`tests.support.v2_cpu`), and the
pytest process imports vLLM with V1 for the other tests, so V2 engines run in a fresh Python
process. :func:`run_v2` writes a JSON *spec*, runs this file as a script and returns its JSON
*result*; several engine configs run in one process to pay vLLM's start-up once.

Spec (all keys but ``configs`` optional)::

    {"v2": true,                 # false: a plain V1 subprocess (no harness), for comparisons
     "vllm_overlay": null,       # a folder put first on PYTHONPATH: another vLLM's sources
                                 # (tests.support.vllm034.overlay(): vLLM 0.34.0)
     "accept_vllm": null,        # "0.34.0": the plugin's version fence opened for that version
                                 # in the subprocess only (experiments; test-only)
     "cuda_recurrent": false,    # true: GDN / Mamba2 layers on their CUDA code path, vLLM's
                                 # Triton kernels interpreted (tests.support.cuda_recurrent)
     "configs": [{
        "name": "target-only",   # default: "config<i>"
        "target": "/path/to/model",
        "prompts": ["text", [1, 2, 3]],   # strings or token-id lists
        "sampling": {"temperature": 0, "max_tokens": 16, "logprobs": 2, "seed": 1, ...},
        # every other key is a vllm.LLM keyword argument, on top of
        # tests.support.models.llm_kwargs defaults, e.g.
        "speculative_config": {"method": "dflash", "model": "...", "num_speculative_tokens": 4},
        "dtype": "float32", "max_model_len": 512, "max_num_seqs": 4,
        "max_num_batched_tokens": 32, "enable_chunked_prefill": true,
        "enforce_eager": true, "tensor_parallel_size": 2,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},   # set for this config only
        # test-only hooks, for DDTree configs:
        "oracle": {"from": "target-only", "sidestep": 3},  # drafts from an earlier config's
                                 # output (tests.support.oracle_drafts; sidestep > 0 puts the
                                 # target's token at rank 1 every `sidestep` tokens)
        "disable": ["kv_compaction", "recurrent_relayout"],  # power checks: must then differ
        "triton_tree_backend": true,  # the CUDA tree backend registered for CPU_ATTN
        "fixed_cost": 5e-6,      # ddtree_budget="auto": a fixed step cost, 10 ms + this many
                                 # seconds per row (tests.support.auto_cost), no probes; a list:
                                 # one slope per worker rank
        "record_rows": true}]}   # result "rows": [[rows verified, rows booked, requests]
                                 # per step with drafts]

Result::

    {"v2": true, "expected_runner": "vllm.v1.worker.cpu.model_runner.CPUModelRunner",
     "vllm_version": "0.32.0+cpu",
     "plugin": {"path": "/…/vllm_ddtree", "modules": ["vllm_ddtree", ...]},
     "configs": [{"name": ..., "runners": ["<module>.<class>" per worker],
                  "token_ids": [[...] per prompt], "prompt_lens": [int per prompt],
                  "prompt_token_ids": [[...] per prompt],
                  "logprobs": [[[[token_id, logprob], ...] per position] per prompt] or null,
                  "spec": {"num_drafts": int, "num_draft_tokens": int,
                           "num_accepted_tokens": int, "accepted_per_pos": [int, ...]},
                  "figures": {name: sum} of the DDTree worker figures (vllm_ddtree.metrics.
                             WORKER_FIGURES) that reached the front end during generate,
                  "rows": [[logits rows verified, rows V2 booked, requests] per step with
                           drafts] (with "record_rows"),
                  "build_s": float, "generate_s": float,
                  "error": null or "<Type>: <message>\\n<traceback tail>"}]}

A config whose engine fails to build or generate, or runs on another model runner than
``expected_runner``, gets an ``error`` and the next config still runs. :func:`assert_ok` turns
errors into an ``AssertionError``.

Engines with ``tensor_parallel_size`` > 1 (vLLM's ``mp`` executor) spawn worker processes; the
subprocess gets ``tests/support/v2_site`` on ``PYTHONPATH``, whose ``sitecustomize.py`` installs
the harness in every Python process that starts there.

Command line: ``python tests/support/v2_run.py SPEC.json OUT.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
V2_SITE = Path(__file__).resolve().parent / "v2_site"

#: The CPU model runner class of each runner generation in vLLM 0.32 (vllm-cpu).
V2_RUNNER = "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
V1_RUNNER = "vllm.v1.worker.cpu_model_runner.CPUModelRunner"

_SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    "vllm:num_preemptions": "num_preemptions",
}
_PER_POS_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"
#: Result fields of a config that produced nothing.
_EMPTY = {"runners": None, "token_ids": None, "prompt_lens": None, "prompt_token_ids": None,
          "logprobs": None, "spec": None, "figures": None, "rows": None,
          "build_s": None, "generate_s": None}
#: Config keys that are not ``vllm.LLM`` keyword arguments.
_OWN_KEYS = ("name", "target", "prompts", "sampling", "env", "oracle", "disable",
             "triton_tree_backend", "fixed_cost", "record_rows")


class V2RunError(RuntimeError):
    """The subprocess died, timed out or wrote no result; the message holds its output tail."""


# ----------------------------------------------------------------------------- parent side


def subprocess_env(v2: bool = True, extra: dict[str, str] | None = None,
                   vllm_overlay: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment for a child process: repo root (and for V2 the harness site dir, and
    ``vllm_overlay``: another vLLM's sources, ahead of the installed one) first on
    ``PYTHONPATH``; with ``v2=False`` the V2 switches inherited from pytest are removed."""
    env = dict(os.environ)
    paths = (([str(V2_SITE)] if v2 else []) + ([str(vllm_overlay)] if vllm_overlay else [])
             + [str(REPO_ROOT)])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if not v2:
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    env.update(extra or {})
    return env


def run_v2(spec: dict[str, Any], timeout: float = 600, *, env: dict[str, str] | None = None,
           partial: bool = True) -> dict[str, Any]:
    """Run ``spec`` (see the module docstring) in a fresh Python process; return the result dict.

    Args:
        spec: ``{"v2": bool, "configs": [...]}``; ``v2`` defaults to True.
        timeout: seconds before the subprocess is killed.
        env: extra environment variables for the subprocess.
        partial: when the subprocess dies or times out after finishing some configs, return
            those, and give the config it died in and every later one an ``error`` holding the
            process's output tail (instead of raising).

    Raises:
        V2RunError: the subprocess timed out, exited non-zero or wrote no result, and ``partial``
            is off or no config finished (per-config engine errors are not raised; they are in
            each config's ``error``).
    """
    v2 = bool(spec.get("v2", True))
    with tempfile.TemporaryDirectory(prefix="v2run-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)]
        # Own process group: on a timeout the engine's spawned workers die with it.
        proc = subprocess.Popen(cmd, env=subprocess_env(v2, env, spec.get("vllm_overlay")),
                                cwd=str(REPO_ROOT),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
            problem = None if proc.returncode == 0 else f"v2_run exited {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            problem = f"v2_run timed out after {timeout} s"
        if problem is None and out_path.exists():
            return json.loads(out_path.read_text())
        if not partial or not out_path.exists():
            raise V2RunError(f"{problem or 'v2_run wrote no result'}\n{output[-6000:]}")
        result = json.loads(out_path.read_text())
        for i, cfg in enumerate(spec["configs"][len(result["configs"]):], len(result["configs"])):
            result["configs"].append({"name": cfg.get("name", f"config{i}"), **_EMPTY,
                                      "error": f"{problem} during this config\n{output[-4000:]}"})
        return result


def assert_ok(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Raise ``AssertionError`` listing every config that failed; return configs by name."""
    errors = [f"[{c['name']}] {c['error']}" for c in result["configs"] if c["error"]]
    assert not errors, "\n\n".join(errors)
    return {c["name"]: c for c in result["configs"]}


# ----------------------------------------------------------------------------- child side


def _runner_class(worker) -> str:
    """Run inside each worker (``collective_rpc``): the qualified name of its model runner."""
    cls = type(worker.model_runner)
    return f"{cls.__module__}.{cls.__qualname__}"


def _spec_counters(llm) -> dict[str, Any]:
    counts: dict[str, Any] = {v: 0 for v in _SPEC_METRICS.values()}
    counts["accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in _SPEC_METRICS:
            counts[_SPEC_METRICS[m.name]] = int(m.value)
        elif m.name == _PER_POS_METRIC:
            counts["accepted_per_pos"] = [int(v) for v in m.values]
    return counts


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters are process-wide in vLLM's metrics; report only this config's generate call."""
    out = {k: after[k] - before[k] for k in _SPEC_METRICS.values()}
    pre = list(before["accepted_per_pos"])
    pre += [0] * (len(after["accepted_per_pos"]) - len(pre))
    out["accepted_per_pos"] = [b - a for a, b in zip(pre, after["accepted_per_pos"])]
    return out


_FIGURES: dict[str, float] = {}
#: ``record_rows``: [logits rows verified, rows booked, requests] per step with drafts.
_ROWS: list[list[int]] = []


def _capture_figures() -> None:
    """Sum the DDTree worker figures that reach this (front-end) process with the scheduler's
    stats (``StatLoggerManager.record`` wrapped once, test-only)."""
    from vllm.v1.metrics.loggers import StatLoggerManager

    from vllm_ddtree.metrics import WORKER_FIGURES

    record = StatLoggerManager.record
    if getattr(record, "_captures_figures", False):
        return

    def capture(self, scheduler_stats, *args, **kwargs):
        stats = getattr(scheduler_stats, "spec_decoding_stats", None)
        for name in WORKER_FIGURES:
            _FIGURES[name] = _FIGURES.get(name, 0) + getattr(stats, name, 0)
        return record(self, scheduler_stats, *args, **kwargs)

    capture._captures_figures = True
    StatLoggerManager.record = capture


def _test_hooks(cfg: dict[str, Any], done: list[dict[str, Any]]) -> list:
    """Install a config's test-only hooks; returns the functions that remove them."""
    undo = []
    oracle = cfg.get("oracle")
    if oracle:
        from tests.support.oracle_drafts import (
            DRAFTS_ENV,
            drafts_from_file,
            install_v2,
            write_drafts_file,
        )

        src = next(r for r in done if r["name"] == oracle["from"])
        refs = {tuple(p): o for p, o in zip(src["prompt_token_ids"], src["token_ids"])}
        path = write_drafts_file(tempfile.mktemp(suffix=".json"), refs,
                                 sidestep_period=int(oracle.get("sidestep", 0)))
        undo.append(install_v2(drafts_from_file(path)))
        os.environ[DRAFTS_ENV] = path  # spawned workers: v2_site installs it at start-up
        undo.append(lambda: os.environ.pop(DRAFTS_ENV, None))
    for what in cfg.get("disable", ()):
        import vllm_ddtree.commit as commit

        names = {"kv_compaction": ("compact_kv", "compact_kv_in_cache"),
                 "recurrent_relayout": ("relayout_recurrent",)}[what]
        for attr in names:
            original = getattr(commit, attr)
            setattr(commit, attr, lambda *a, **k: 0)
            undo.append(lambda attr=attr, original=original: setattr(commit, attr, original))
    if cfg.get("record_rows"):
        from vllm_ddtree.runners.v2 import DDTreeVerifier

        call = DDTreeVerifier.__call__

        def recording(self, logits, input_batch, *args, **kwargs):
            per_req = input_batch.num_draft_tokens_per_req
            if per_req is not None:  # a step with drafts
                _ROWS.append([int(logits.shape[0]), input_batch.num_reqs + int(per_req.sum()),
                              input_batch.num_reqs])
            return call(self, logits, input_batch, *args, **kwargs)

        DDTreeVerifier.__call__ = recording
        undo.append(lambda: setattr(DDTreeVerifier, "__call__", call))
    if cfg.get("triton_tree_backend"):
        from tests.support.triton_cpu import triton_backend_on_cpu

        ctx = triton_backend_on_cpu()
        ctx.__enter__()
        undo.append(lambda: ctx.__exit__(None, None, None))
    return undo


def _run_config(i: int, cfg: dict[str, Any], expected_runner: str,
                done: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.support.models import llm_kwargs, release_llm

    res: dict[str, Any] = {"name": cfg.get("name", f"config{i}"), **_EMPTY, "error": None}
    llm = None
    saved_env: dict[str, str | None] = {}
    undo: list = []
    try:
        undo = _test_hooks(cfg, done or [])
        import vllm.envs as envs
        from vllm import LLM

        # Each config starts as the first engine of a process would: the runner choice from the
        # harness, not one a previous engine's config set (the plugin may write the variable)
        # or froze (vLLM caches its environment once an engine core starts).
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if expected_runner == V2_RUNNER else "0"
        for key, value in cfg.get("env", {}).items():
            saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        envs.disable_envs_cache()

        overrides = {k: v for k, v in cfg.items() if k not in _OWN_KEYS}
        t0 = time.perf_counter()
        llm = LLM(**llm_kwargs(cfg["target"], **overrides))
        res["build_s"] = round(time.perf_counter() - t0, 2)
        res["runners"] = llm.collective_rpc(_runner_class)
        if "fixed_cost" in cfg:
            from functools import partial

            from tests.support.auto_cost import fixed_cost

            slopes = cfg["fixed_cost"]
            llm.collective_rpc(partial(fixed_cost, rank_slopes=slopes) if isinstance(slopes, list)
                               else partial(fixed_cost, slope=float(slopes)))
        if any(r != expected_runner for r in res["runners"]):
            raise RuntimeError(f"expected model runner {expected_runner}, got {res['runners']}")
        prompts = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in cfg["prompts"]]
        params = SamplingParams(**cfg.get("sampling", {"temperature": 0.0, "max_tokens": 16}))
        before = _spec_counters(llm)
        _capture_figures()
        _FIGURES.clear()
        _ROWS.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        res["generate_s"] = round(time.perf_counter() - t0, 2)
        res["spec"] = _delta(before, _spec_counters(llm))
        res["figures"] = dict(_FIGURES)
        if cfg.get("record_rows"):
            res["rows"] = list(_ROWS)
        res["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        res["prompt_lens"] = [len(o.prompt_token_ids) for o in outs]
        res["prompt_token_ids"] = [list(o.prompt_token_ids) for o in outs]
        if params.logprobs is not None:
            res["logprobs"] = [
                [sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda x: -x[1])
                 for pos in (o.outputs[0].logprobs or [])]
                for o in outs]
    except Exception as e:  # noqa: BLE001 - reported per config; the next config still runs
        tb = traceback.format_exc()
        res["error"] = f"{type(e).__name__}: {e}\n{tb[-3000:]}"
    finally:
        if llm is not None:
            release_llm(llm)
            del llm
        for fn in reversed(undo):
            fn()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return res


def _vllm_version() -> str:
    """The version of the vLLM this process imported (``0.34.0+cpu`` under the overlay)."""
    import vllm

    return str(vllm.__version__)


def _plugin() -> dict[str, Any]:
    """Which vllm_ddtree this process runs (its folder) and which of its modules it imported
    (on vLLM 0.34 none of the legacy V1 adapter's code: only ``runners.v1.register``)."""
    import vllm_ddtree

    return {"path": str(Path(vllm_ddtree.__file__).resolve().parent),
            "modules": sorted(m for m in sys.modules if m.startswith("vllm_ddtree"))}


def _accept_vllm(version: str) -> None:
    """Open the plugin's version fence for ``version`` in this process (test-only, before vLLM
    or the plugin is loaded): an experiment on a release the plugin still refuses."""
    import vllm_ddtree
    import vllm_ddtree.integration as integration

    versions = tuple(vllm_ddtree.SUPPORTED_VLLM_VERSIONS) + (version,)
    vllm_ddtree.SUPPORTED_VLLM_VERSIONS = integration.SUPPORTED_VLLM_VERSIONS = versions


def main(argv: list[str]) -> int:
    """``v2_run.py SPEC.json OUT.json``: install the harness (V2) before vLLM, run every config."""
    spec = json.loads(Path(argv[0]).read_text())
    v2 = bool(spec.get("v2", True))
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    if v2:
        from tests.support.v2_cpu import install

        install()
    if spec.get("accept_vllm"):
        _accept_vllm(spec["accept_vllm"])
    from tests.support.models import apply_cpu_test_env

    apply_cpu_test_env()
    if spec.get("cuda_recurrent"):
        from tests.support.cuda_recurrent import install as cuda_recurrent

        cuda_recurrent()
    expected = V2_RUNNER if v2 else V1_RUNNER
    results: list[dict[str, Any]] = []
    for i, cfg in enumerate(spec["configs"]):
        results.append(_run_config(i, cfg, expected, results))
        # Written after every config: a later crash (or timeout) keeps the finished ones.
        tmp = Path(argv[1] + ".tmp")
        tmp.write_text(json.dumps({"v2": v2, "expected_runner": expected,
                                   "vllm_version": _vllm_version(), "plugin": _plugin(),
                                   "configs": results}))
        os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
