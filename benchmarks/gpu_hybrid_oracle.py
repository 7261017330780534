"""GPU check and micro-benchmark of the sequential tree oracle on vLLM's own recurrent kernels.

A hybrid target (GatedDeltaNet / Mamba2 layers + attention) verifies a DDTree draft tree with the
*sequential tree oracle* of ``vllm_ddtree/hybrid/oracle.py``: every node's recurrent state is
``step(parent's state, node token)`` and its conv window is its ancestor path. On CUDA this runs
vLLM's Triton kernels, one batched launch per tree depth. This script checks that recipe on a
GPU and times it against the one-call chain that vLLM's DFlash path runs today.

Prepared for a CUDA machine with torch + triton and *no* vLLM and no internet. vLLM's kernels
come from

* ``--vllm-src DIR``: a directory holding the ``vllm`` package (a vLLM checkout or unpacked
  sdist, ``site-packages``, or a bundle written by ``--bundle``). The four kernel files are
  executed with minimal stand-ins for the few ``vllm`` modules they import (see
  :func:`install_vllm_stubs`); vLLM itself is never imported;
* otherwise an installed ``vllm``: its files, with the real ``vllm`` helpers (a CPU build, whose
  ``vllm.triton_utils`` turns Triton off, falls back to the stubs).

Either way each kernel file is executed only up to its ``if current_platform.is_cpu():`` tail,
so a CPU build of vLLM still gives the Triton functions (the tail swaps in CPU versions).

Run from the repository root::

    # here (CPU, vLLM installed): write a small bundle of vLLM's kernel files to carry
    python benchmarks/gpu_hybrid_oracle.py --bundle build/vllm-kernels
    # GPU machine: checks + benchmark tables (carry build/vllm-kernels)
    python benchmarks/gpu_hybrid_oracle.py --vllm-src build/vllm-kernels
    # CPU: tiny sizes under Triton's interpreter (65-140 s on 2 busy cores)
    TRITON_INTERPRET=1 python benchmarks/gpu_hybrid_oracle.py --smoke --vllm-src build/vllm-kernels

The bundle (~130 KiB: the four kernel files, vLLM's ``_version.py``, the tuned
``selective_state_update`` configs packed into one JSON file) lives under ``build/`` (ignored by
git); carry ``build/vllm-kernels`` to the GPU machine.

1. Correctness, per node, on batches of random draft trees (several requests, budgets B in
   7..64, depth <= 16, shapes random / star / spine / binary / bushy, state slots shuffled,
   the committed state at column ``num_accepted - 1`` of each request's slot row, slot 0 left
   as vLLM's null block): every node's state and output from the level-by-level kernel calls
   must equal (a) the fp32 reference step (``*_step_reference``) run along the node's
   root-to-node path and (b) the same kernel run as a chain over each root-to-leaf path
   (vLLM's speculative-decoding layout). fp32 state: tight tolerance; bf16: looser (under
   the interpreter the conv's low-precision check uses fp16: the interpreter garbles a few
   bf16 lanes of that kernel). Tolerances are relative to the largest reference value.

   * GatedDeltaNet: ``fused_sigmoid_gating_delta_rule_update`` with
     ``ssm_state_indices = [dst, src]`` and ``num_accepted_tokens = 2`` (reads the parent's
     slot, writes the node's slot, no copy);
   * Mamba2: ``selective_state_update`` (a) copy parent -> node slot, then update in place
     (must pass), and (b) ``state_batch_indices = src``, ``dst_state_batch_indices = dst``
     without a copy (reported, not required: the line says whether it is correct on this
     device, and whether it left the parents' slots untouched);
   * causal conv: ``causal_conv1d_update`` over a scratch of gathered ancestor windows, one
     call for all nodes.

2. Benchmark (GPU only; ``--smoke`` runs it at toy sizes to exercise the code): ms per tree step
   (all levels; inputs already in level order, level index tensors prepared once, as a forward
   does once for all layers) versus one chain call of L + 1 = 16 tokens per request, for
   B in {16, 32, 64, 128, 256}, batch 1 and 8. Trees: a spine of depth 15 (16 levels, the
   chain's length) plus random nodes of depth <= 15. The plugin keeps the nodes' states in a
   level scratch and, after verification, replays the accepted path (at most L + 1 one-token
   launches per layer, batched over requests); that replay is not in the timed tree step. Shapes:

   * Qwen3.6-27B GatedDeltaNet layer: 16 key heads, 48 value heads, key/value head dim 128,
     conv kernel 4 (conv dim 10240), fp32 state (the model's ``mamba_ssm_dtype``), bf16
     activations;
   * Nemotron-H-8B Mamba2 layer: 128 heads, head dim 64, state 128, 8 groups, conv kernel 4
     (conv dim 10240), fp32 state (``--state-dtype`` changes both), bf16 activations.

   Columns: CUDA-event median ms per call, tree / chain, and kernel launches per call.

Exit status 1 if any required check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from gpu_timing import select_device, time_call  # noqa: E402  (benchmarks/, the script's folder)

from vllm_ddtree.hybrid.oracle import (  # noqa: E402
    RecurrentTreeLayout,
    build_recurrent_layout,
    conv_window_index,
    gated_delta_step_reference,
    gather_conv_windows,
    mamba2_step_reference,
    read_conv_windows,
)

# --------------------------------------------------------------------------- vLLM's kernels

#: the files whose Triton kernels this script runs, relative to the directory holding ``vllm``
KERNEL_FILES = {
    "fused_sigmoid_gating": "vllm/third_party/flash_linear_attention/ops/fused_sigmoid_gating.py",
    "triton_helpers": "vllm/model_executor/layers/mamba/ops/triton_helpers.py",
    "causal_conv1d": "vllm/model_executor/layers/mamba/ops/causal_conv1d.py",
    "mamba_ssm": "vllm/model_executor/layers/mamba/ops/mamba_ssm.py",
}
#: tuned launch configs that ``mamba_ssm.selective_state_update`` looks up next to its file
SSU_CONFIG_DIR = "vllm/model_executor/layers/mamba/ops/configs/selective_state_update"
#: the bundle packs that folder into this one file (see :func:`_unpack_ssu_configs`)
SSU_CONFIG_PACK = SSU_CONFIG_DIR + ".json"
#: bundled for the record (the version the kernels come from)
VERSION_FILE = "vllm/_version.py"
CPU_TAIL = re.compile(r"^if current_platform\.is_cpu\(\):", re.M)


def _module(name: str, **attrs) -> types.ModuleType:
    """Register ``name`` (and any missing parent packages) in ``sys.modules``."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            pkg = types.ModuleType(parent)
            pkg.__path__ = []  # a package with no files: nothing is imported from disk
            sys.modules[parent] = pkg
            if i > 1:
                setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], pkg)
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    if len(parts) > 1:
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], mod)
    return mod


class _OnceLogger:
    """``vllm.logger`` loggers have ``info_once`` / ``warning_once`` (with a ``scope=``)."""

    def __init__(self, name: str):
        self._log = logging.getLogger(name)
        self._seen: set = set()

    def __getattr__(self, attr):
        return getattr(self._log, attr)

    def _once(self, level, msg, *args, **_):
        if (level, msg, args) not in self._seen:
            self._seen.add((level, msg, args))
            self._log.log(level, msg, *args)

    def info_once(self, msg, *args, **kw):
        self._once(logging.INFO, msg, *args, **kw)

    def warning_once(self, msg, *args, **kw):
        self._once(logging.WARNING, msg, *args, **kw)

    def debug_once(self, msg, *args, **kw):
        self._once(logging.DEBUG, msg, *args, **kw)


class _CudaPlatform:
    """The few ``current_platform`` queries the kernel files make, answered for CUDA.

    ``is_cpu()`` / ``is_xpu()`` are False (CUDA path at import); ``is_arch_support_pdl()``
    follows vLLM's CUDA platform (compute capability >= 9), False under the interpreter.
    """

    device_type = "cuda"
    allow_pdl = True  # ``--no-pdl`` clears it (an older Triton without gdc_wait)

    def is_cpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return torch.version.hip is not None

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and not self.is_rocm()

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_arch_support_pdl(self) -> bool:
        if (not self.allow_pdl or os.environ.get("TRITON_INTERPRET") == "1"
                or not torch.cuda.is_available()):
            return False
        return torch.cuda.get_device_capability()[0] >= 9

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


def install_vllm_stubs() -> None:
    """Minimal stand-ins for the ``vllm`` modules the kernel files import (nothing else).

    * ``vllm.triton_utils``: ``triton``, ``tl``, ``HAS_TRITON`` (the real packages);
    * ``vllm.platforms.current_platform``: :class:`_CudaPlatform`;
    * ``vllm.v1.attention.backends.utils``: ``NULL_BLOCK_ID = 0``, ``PAD_SLOT_ID = -1``;
    * ``vllm.envs``: ``VLLM_TUNED_CONFIG_FOLDER`` (from the environment, else None);
    * ``vllm.logger.init_logger``: :class:`_OnceLogger`;
    * ``vllm.utils.platform_utils.get_device_name_as_file_name`` (tuned-config file names);
    * ``vllm._custom_ops``: empty (only ``selective_scan_fn``, not used here, calls into it);
    * ``vllm.model_executor.layers.mamba.ops.triton_helpers``: the real file, loaded by
      :func:`load_vllm_kernels`.
    """
    import triton
    import triton.language as tl

    _module("vllm.triton_utils", triton=triton, tl=tl, HAS_TRITON=True)
    _module("vllm.platforms", current_platform=_CudaPlatform())
    _module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=0, PAD_SLOT_ID=-1)
    _module("vllm.envs", VLLM_TUNED_CONFIG_FOLDER=os.environ.get("VLLM_TUNED_CONFIG_FOLDER"))
    _module("vllm.logger", init_logger=_OnceLogger)

    def get_device_name_as_file_name(device_id: int = 0) -> str:
        return re.sub(r"[\s/]+", "_", _CudaPlatform().get_device_name(device_id))

    _module("vllm.utils.platform_utils", get_device_name_as_file_name=get_device_name_as_file_name)
    _module("vllm._custom_ops")


def _exec_file(path: Path, name: str, register: bool) -> types.ModuleType:
    """Execute a kernel file up to its CPU tail; the code keeps the real file name and line
    numbers (Triton reads the kernels' source back through them)."""
    src = path.read_text()
    tail = CPU_TAIL.search(src)
    if tail is not None:
        src = src[: tail.start()]
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    mod.__package__ = name.rpartition(".")[0]
    if register:
        _module(name).__dict__.update(mod.__dict__)
        mod = sys.modules[name]
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


def _ensure_torch_accelerator_device_index() -> None:
    """``selective_state_update`` enters ``torch.accelerator.device_index(i)`` (torch >= 2.8);
    give older torch an equivalent so the script runs on whatever torch the machine has."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "device_index"):
        return

    @contextlib.contextmanager
    def device_index(index):
        if index is None or not torch.cuda.is_available():
            yield
        else:
            with torch.cuda.device(index):
                yield

    if acc is None:
        torch.accelerator = types.SimpleNamespace()
    torch.accelerator.device_index = device_index


def find_vllm_src(arg: str | None) -> tuple[Path, bool]:
    """``(directory holding vllm/, use stubs)``."""
    if arg:
        root = Path(arg).expanduser().resolve()
        if (root / "vllm").is_dir():
            return root, True
        raise SystemExit(f"--vllm-src {arg}: no vllm/ package directory there")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed: pass --vllm-src DIR (a vLLM source tree, "
                         "site-packages, or a folder written by --bundle)")
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent, False


def _unpack_ssu_configs(root: Path) -> None:
    """A bundle carries the tuned ``selective_state_update`` configs as one JSON file; write
    them to a temporary folder and point the stub ``envs.VLLM_TUNED_CONFIG_FOLDER`` at it."""
    pack = root / SSU_CONFIG_PACK
    if (root / SSU_CONFIG_DIR).is_dir() or not pack.is_file():
        return
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="ssu-configs-"))
    for name, text in json.loads(pack.read_text()).items():
        (folder / name).write_text(text)
    sys.modules["vllm.envs"].VLLM_TUNED_CONFIG_FOLDER = str(folder)


def load_vllm_kernels(root: Path, stubs: bool) -> SimpleNamespace:
    """The three kernel entry points, from ``root/vllm/...``."""
    _ensure_torch_accelerator_device_index()
    missing = [rel for rel in KERNEL_FILES.values() if not (root / rel).is_file()]
    if missing:
        raise SystemExit(f"{root}: missing {missing}")
    if not stubs:
        try:
            from vllm.triton_utils import HAS_TRITON
        except Exception:  # noqa: BLE001 - any import failure means: do not use it
            HAS_TRITON = False
        if not HAS_TRITON:  # a CPU build: its triton_utils hands out placeholders
            print("note: the installed vLLM has no usable Triton (a CPU build): running its "
                  "kernel files with the stubbed helpers")
            for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
                del sys.modules[name]
            stubs = True
    if stubs:
        install_vllm_stubs()
        _unpack_ssu_configs(root)
        _exec_file(root / KERNEL_FILES["triton_helpers"],
                   "vllm.model_executor.layers.mamba.ops.triton_helpers", register=True)
    mods = {key: _exec_file(root / rel, f"_ddtree_vllm_kernels.{key}", register=False)
            for key, rel in KERNEL_FILES.items() if key != "triton_helpers"}
    version = "?"
    vfile = root / VERSION_FILE
    if vfile.is_file():
        m = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", vfile.read_text()) or \
            re.search(r"__version__[^=]*=\s*['\"]([^'\"]+)", vfile.read_text())
        version = m.group(1) if m else "?"
    return SimpleNamespace(
        gdn=mods["fused_sigmoid_gating"].fused_sigmoid_gating_delta_rule_update,
        conv_update=mods["causal_conv1d"].causal_conv1d_update,
        ssu=mods["mamba_ssm"].selective_state_update,
        origin=f"{root} ({'stubbed vllm helpers' if stubs else 'installed vllm'}; vllm {version})",
        stubs=stubs,
    )


def write_bundle(out: Path, src: str | None) -> int:
    """Copy just the kernel files (+ the SSU tuned configs, vLLM's version file) to ``out``."""
    root, _ = find_vllm_src(src)
    out = out.resolve()
    if out.exists():
        shutil.rmtree(out)
    rels = list(KERNEL_FILES.values()) + [VERSION_FILE]
    for rel in rels:
        if (root / rel).is_file():
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, out / rel)
    if (root / SSU_CONFIG_DIR).is_dir():  # one JSON file: the names hold ',', '=', '(' ...
        configs = {f.name: f.read_text() for f in sorted((root / SSU_CONFIG_DIR).glob("*.json"))}
        (out / SSU_CONFIG_PACK).parent.mkdir(parents=True, exist_ok=True)
        (out / SSU_CONFIG_PACK).write_text(json.dumps(configs, indent=0))
    (out / "BUNDLE.txt").write_text(
        f"vLLM kernel files (Apache-2.0, the vLLM project) copied from {root}\n"
        "for benchmarks/gpu_hybrid_oracle.py --vllm-src <this folder>\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"bundle: {out} ({size / 1024:.0f} KiB) from {root}")
    return 0


def patch_interpreter_masks() -> None:
    """Test-only: Triton's interpreter (3.x) rejects the int64 masks of
    ``_causal_conv1d_update_kernel`` ("mask has unsupported dtype"); cast masks to bool in the
    interpreter's masked load/store. Compiled runs never call this."""
    import numpy as np
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    if getattr(builder, "_ddtree_bool_masks", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask is None or mask.data.dtype == np.bool_:
            return mask
        return ti.TensorHandle(mask.data.astype(np.bool_), mask.dtype)

    def masked_load(self, ptrs, mask, other, *args, **kw):
        return load(self, ptrs, as_bool(mask), other, *args, **kw)

    def masked_store(self, ptrs, value, mask, *args, **kw):
        return store(self, ptrs, value, as_bool(mask), *args, **kw)

    builder.create_masked_load = masked_load
    builder.create_masked_store = masked_store
    builder._ddtree_bool_masks = True


# --------------------------------------------------------------------------- trees and layouts

MAX_DEPTH = 16
SHAPES = ("random", "star", "spine", "binary", "bushy")


def random_tree(budget: int, shape: str, gen: torch.Generator,
                max_depth: int = MAX_DEPTH) -> list[int]:
    """Parents (``-1`` first) of a ``budget + 1``-node tree in topological order."""
    m = budget + 1
    parents, depth = [-1], [0]

    def pick(candidates):
        return candidates[int(torch.randint(len(candidates), (1,), generator=gen))]

    for i in range(1, m):
        if shape == "star":
            p = 0
        elif shape == "binary":
            p = (i - 1) // 2
        elif shape == "spine" and i <= max_depth:
            p = i - 1
        elif shape == "bushy":  # mostly the few most recent shallow nodes: wide and short
            p = pick([j for j in range(max(0, i - 4), i) if depth[j] < 3] or [0])
        else:
            p = pick([j for j in range(i) if depth[j] < max_depth])
        parents.append(p)
        depth.append(depth[p] + 1)
    assert max(depth) <= max_depth
    return parents


@dataclass
class Problem:
    """A batch of draft trees over one layer's state cache."""

    layout: RecurrentTreeLayout
    state_indices: torch.Tensor  # [N, K + 1] int
    num_accepted: torch.Tensor  # [N]
    src: torch.Tensor  # [T] slot of the state before each node (parent's, or committed)
    dst: torch.Tensor  # [T] slot of the state after each node (every node its own slot)
    num_slots: int
    leaves_paths: list[list[int]]  # flat token indices root -> leaf, per leaf
    depths: list[int]


def make_problem(budgets, shapes, gen, max_depth=MAX_DEPTH) -> Problem:
    trees = [random_tree(b, s, gen, max_depth) for b, s in zip(budgets, shapes)]
    n = len(trees)
    k1 = max(len(t) for t in trees)  # K + 1 slots per request
    num_slots = 1 + n * k1 + 3  # slot 0: vLLM's null block; a few spare slots
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1)[: n * k1]
    state_indices = perm.view(n, k1)
    num_accepted = torch.randint(1, k1 + 1, (n,), generator=gen)
    layout = build_recurrent_layout(
        [len(t) for t in trees], list(range(n)), state_indices, num_accepted,
        {i: torch.tensor(t) for i, t in enumerate(trees)})
    parents = layout.parents.tolist()
    # Every node its own slot (the layout's level scratch reuses rows; the per-node checks and
    # the timed tree step keep every state).
    dst = torch.cat([state_indices[i, : len(t)].long() for i, t in enumerate(trees)])
    src = torch.where(layout.parents >= 0, dst[layout.parents.clamp(min=0)],
                      layout.committed_slots.repeat_interleave(
                          torch.tensor([len(t) for t in trees])))
    children = set(p for p in parents if p >= 0)
    paths = []
    for t in range(layout.num_tokens):
        if t not in children:
            path, cur = [], t
            while cur >= 0:
                path.append(cur)
                cur = parents[cur]
            paths.append(path[::-1])
    return Problem(layout, state_indices, num_accepted, src, dst, num_slots, paths,
                   layout.depths.tolist())


def chain_layout(paths: list[list[int]], device):
    """vLLM's speculative layout for running each path as one sequence from fresh slots:
    ``(flat token order, cu_seqlens, slot rows [P, maxlen] (slot 1 + p * maxlen + j), maxlen)``."""
    maxlen = max(len(p) for p in paths)
    order = torch.tensor([t for p in paths for t in p], device=device)
    lens = torch.tensor([len(p) for p in paths])
    cu = torch.zeros(len(paths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    rows = 1 + torch.arange(len(paths) * maxlen).view(len(paths), maxlen)
    return order, cu.to(device), rows.to(torch.int32).to(device), maxlen


def path_positions(paths, rows):
    """For every (path, position): the flat token and the chain slot, and the chain token."""
    tok, slot, flat = [], [], []
    pos = 0
    for p, path in enumerate(paths):
        for j, t in enumerate(path):
            tok.append(t)
            slot.append(int(rows[p, j]))
            flat.append(pos)
            pos += 1
    return tok, slot, flat


# --------------------------------------------------------------------------- checks


class Checker:
    def __init__(self):
        self.failures: list[str] = []
        self.notes: list[str] = []

    def close(self, name, got, want, tol, required=True) -> bool:
        got, want = got.float(), want.float()
        scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        diff = (got - want).abs().max().item() / scale if got.numel() else 0.0
        ok = diff <= tol and not bool(got.isnan().any())
        tag = "ok  " if ok else ("FAIL" if required else "NO  ")
        print(f"  {tag} {name}: max rel diff {diff:.2e} (tol {tol:.0e})")
        if not ok and required:
            self.failures.append(name)
        return ok


TOL = {  # (vs fp32 reference, vs the same kernel as a chain), relative to max |value|
    torch.float32: (2e-4, 2e-5),
    torch.bfloat16: (6e-2, 6e-2),
    torch.float16: (1e-2, 1e-2),
}


def _levels(layout, device):
    return [lv.to(device) for lv in layout.levels]


def _reference_tree(layout, init_state_of_root, step, device):
    """Per-node fp32 reference: ``state[t] = step(state[parent or committed], token t)``."""
    states, outs = None, None
    parents = layout.parents.to(device)
    for lv in _levels(layout, device):
        par = parents[lv]
        if bool((par < 0).all()):
            prev = init_state_of_root(lv)
        else:
            prev = states[par]
        new, out = step(prev, lv)
        if states is None:
            states = torch.zeros((layout.num_tokens,) + new.shape[1:], device=device)
            outs = torch.zeros((layout.num_tokens,) + out.shape[1:], device=device)
        states[lv], outs[lv] = new, out
    return states, outs


def check_gdn(k, chk, device, gen, dtype, dims, budgets, shapes, tag):
    H, HV, Kd, Vd = dims
    prob = make_problem(budgets, shapes, gen)
    L, T, dev = prob.layout, prob.layout.num_tokens, device
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, kk = rnd(T, H, Kd).to(dtype).to(dev), rnd(T, H, Kd).to(dtype).to(dev)
    v = rnd(T, HV, Vd).to(dtype).to(dev)
    a, b = rnd(T, HV).to(dtype).to(dev), rnd(T, HV).to(dtype).to(dev)
    A_log, dt_bias = (rnd(HV) * 0.5).to(dev), (rnd(HV) * 0.5).to(dev)
    init = (rnd(prob.num_slots, HV, Vd, Kd) * 0.5).to(dtype).to(dev)  # vLLM layout [V, K]
    state = init.clone()
    src, dst = prob.src.to(dev), prob.dst.to(dev)

    out = torch.zeros(T, HV, Vd, dtype=dtype, device=dev)
    for lv in _levels(L, dev):
        n = lv.numel()
        o, _ = k.gdn(
            A_log=A_log, a=a[lv], b=b[lv], dt_bias=dt_bias,
            q=q[lv][None], k=kk[lv][None], v=v[lv][None], initial_state=state,
            inplace_final_state=True, cu_seqlens=torch.arange(n + 1, dtype=torch.int32, device=dev),
            ssm_state_indices=torch.stack([dst[lv], src[lv]], 1).to(torch.int32),
            num_accepted_tokens=torch.full((n,), 2, dtype=torch.int32, device=dev),
            use_qk_l2norm_in_kernel=True)
        out[lv] = o[0]
    tree_states = state[dst]

    rep = HV // H
    ref_states, ref_out = _reference_tree(
        L, lambda lv: init[src[lv]].float().transpose(-1, -2),
        lambda prev, lv: gated_delta_step_reference(
            prev, q[lv].repeat_interleave(rep, 1), kk[lv].repeat_interleave(rep, 1), v[lv],
            a[lv], b[lv], A_log, dt_bias), dev)
    tol_ref, tol_chain = TOL[dtype]
    name = f"GDN {tag} {str(dtype)[6:]} H={H} HV={HV} K={Kd} V={Vd} T={T}"
    chk.close(f"{name}: node states vs fp32 reference path",
              tree_states, ref_states.transpose(-1, -2), tol_ref)
    chk.close(f"{name}: node outputs vs fp32 reference path", out, ref_out, tol_ref)

    # the same kernel as a chain over every root->leaf path (fresh slots, column 0 = committed)
    order, cu, rows, maxlen = chain_layout(prob.leaves_paths, dev)
    P = len(prob.leaves_paths)
    cstate = torch.zeros((1 + P * maxlen,) + init.shape[1:], dtype=dtype, device=dev)
    roots = torch.tensor([p[0] for p in prob.leaves_paths], device=dev)
    cstate[rows[:, 0].long()] = init[src[roots]]
    co, _ = k.gdn(
        A_log=A_log, a=a[order], b=b[order], dt_bias=dt_bias, q=q[order][None],
        k=kk[order][None], v=v[order][None], initial_state=cstate, inplace_final_state=True,
        cu_seqlens=cu, ssm_state_indices=rows,
        num_accepted_tokens=torch.ones(P, dtype=torch.int32, device=dev),
        use_qk_l2norm_in_kernel=True)
    tok, slot, flat = path_positions(prob.leaves_paths, rows.cpu())
    tok = torch.tensor(tok, device=dev)
    chk.close(f"{name}: node states vs kernel chain per path",
              tree_states[tok], cstate[torch.tensor(slot, device=dev)], tol_chain)
    chk.close(f"{name}: node outputs vs kernel chain per path",
              out[tok], co[0][torch.tensor(flat, device=dev)], tol_chain)


def _mamba_inputs(rnd, T, dims, dtype, dev, num_slots, state_dtype=None):
    """Random Mamba2 inputs; ``rnd(*shape)`` draws standard normals (any device)."""
    H, P, N, G = dims
    return SimpleNamespace(
        x=rnd(T, H, P).to(dtype).to(dev), dt=rnd(T, H).to(dtype).to(dev),
        B=rnd(T, G, N).to(dtype).to(dev), C=rnd(T, G, N).to(dtype).to(dev),
        A=(-rnd(H).abs() - 0.5).float().to(dev), D=rnd(H).float().to(dev),
        dt_bias=(rnd(H) * 0.5).float().to(dev),
        init=(rnd(num_slots, H, P, N) * 0.5).to(state_dtype or dtype).to(dev))


def _ssu(k, state, m, idx, src_rows, dst_rows, out, **kw):
    """One ``selective_state_update`` over tokens ``idx`` with vLLM's expanded head layout."""
    H, P, N = state.shape[1:]
    k.ssu(state, m.x[idx], m.dt[idx][:, :, None].expand(-1, -1, P),
          m.A[:, None, None].expand(-1, P, N), m.B[idx], m.C[idx],
          m.D[:, None].expand(-1, P), m.dt_bias[:, None].expand(-1, P), dt_softplus=True,
          state_batch_indices=src_rows, dst_state_batch_indices=dst_rows, out=out, **kw)


def check_mamba2(k, chk, device, gen, dtype, dims, budgets, shapes, tag):
    H, P, N, G = dims
    prob = make_problem(budgets, shapes, gen)
    L, T, dev = prob.layout, prob.layout.num_tokens, device
    m = _mamba_inputs(lambda *sh: torch.randn(*sh, generator=gen), T, dims, dtype, dev,
                      prob.num_slots)
    src, dst = prob.src.to(dev), prob.dst.to(dev)
    ref_states, ref_out = _reference_tree(
        L, lambda lv: m.init[src[lv]].float(),
        lambda prev, lv: mamba2_step_reference(prev, m.x[lv], m.dt[lv], m.A, m.B[lv], m.C[lv],
                                               m.D, m.dt_bias), dev)
    tol_ref, tol_chain = TOL[dtype]
    name = f"Mamba2 {tag} {str(dtype)[6:]} H={H} P={P} N={N} G={G} T={T}"

    def run(variant):
        state = m.init.clone()
        out = torch.zeros(T, H, P, dtype=dtype, device=dev)
        for lv in _levels(L, dev):
            o = torch.empty(lv.numel(), H, P, dtype=dtype, device=dev)
            d = dst[lv].to(torch.int32).view(-1, 1)
            if variant == "copy":
                state.index_copy_(0, dst[lv], state.index_select(0, src[lv]))
                _ssu(k, state, m, lv, d, d, o)
            else:
                _ssu(k, state, m, lv, src[lv].to(torch.int32).view(-1, 1), d, o)
            out[lv] = o
        return state, out

    state, out = run("copy")
    tree_states = state[dst]
    chk.close(f"{name} copy+in-place: node states vs fp32 reference path",
              tree_states, ref_states, tol_ref)
    chk.close(f"{name} copy+in-place: node outputs vs fp32 reference path", out, ref_out, tol_ref)

    order, cu, rows, maxlen = chain_layout(prob.leaves_paths, dev)
    npaths = len(prob.leaves_paths)
    cstate = torch.zeros((1 + npaths * maxlen,) + m.init.shape[1:], dtype=dtype, device=dev)
    roots = torch.tensor([p[0] for p in prob.leaves_paths], device=dev)
    cstate[rows[:, 0].long()] = m.init[src[roots]]
    co = torch.empty(order.numel(), H, P, dtype=dtype, device=dev)
    _ssu(k, cstate, m, order, rows, rows, co,
         num_accepted_tokens=torch.ones(npaths, dtype=torch.int32, device=dev), cu_seqlens=cu)
    tok, slot, flat = path_positions(prob.leaves_paths, rows.cpu())
    tok = torch.tensor(tok, device=dev)
    chk.close(f"{name} copy+in-place: node states vs kernel chain per path",
              tree_states[tok], cstate[torch.tensor(slot, device=dev)], tol_chain)
    chk.close(f"{name} copy+in-place: node outputs vs kernel chain per path",
              out[tok], co[torch.tensor(flat, device=dev)], tol_chain)

    # src/dst without a copy: informational (the interpreter gave wrong results)
    state2, out2 = run("srcdst")
    ok_s = chk.close(f"{name} src/dst no copy: node states vs reference (informational)",
                     state2[dst], ref_states, tol_ref, required=False)
    ok_o = chk.close(f"{name} src/dst no copy: node outputs vs reference (informational)",
                     out2, ref_out, tol_ref, required=False)
    # slots no node writes must be untouched (the committed slots, unless a node reuses one)
    written = torch.zeros(prob.num_slots, dtype=torch.bool, device=dev)
    written[dst] = True
    untouched = bool(torch.equal(state2[~written], m.init[~written]))
    print(f"  {'ok  ' if untouched else 'NO  '} {name} src/dst no copy: unwritten slots "
          "(committed states) unchanged (informational)")
    chk.notes.append(f"Mamba2 src/dst without copy ({str(dtype)[6:]}, {tag}): "
                     f"{'CORRECT' if ok_s and ok_o and untouched else 'WRONG'} on this device")


def check_conv(k, chk, device, gen, dtype, dim, width, budgets, shapes, tag):
    prob = make_problem(budgets, shapes, gen)
    L, T, dev = prob.layout, prob.layout.num_tokens, device
    m = width - 1
    k1 = prob.state_indices.shape[1]
    x = torch.randn(T, dim, generator=gen).to(dtype).to(dev)
    weight = (torch.randn(dim, width, generator=gen) * 0.5).to(dtype).to(dev)
    bias = (torch.randn(dim, generator=gen) * 0.1).to(dtype).to(dev)
    conv_buf = torch.randn(prob.num_slots, dim, m + k1 - 1, generator=gen).to(dtype).to(dev)

    # tree: every node's ancestor window, one launch for all nodes
    prior = read_conv_windows(conv_buf, L, width)  # [N, dim, W - 1]
    windows = gather_conv_windows(x, prior, conv_window_index(L, width).to(dev))
    scratch = torch.cat([windows.new_zeros(1, dim, m), windows]).contiguous()
    out = k.conv_update(x.clone(), scratch, weight, bias, "silu",
                        conv_state_indices=torch.arange(1, T + 1, dtype=torch.int32, device=dev))

    # reference: walk the parents (independent of conv_window_index), fp32
    parents = L.parents.tolist()
    seq_of = [n for n, q in enumerate(L.seq_lens) for _ in range(q)]
    xs = x.float()
    ref = torch.empty(T, dim, device=dev)
    for t in range(T):
        cols, cur = [xs[t]], parents[t]
        while len(cols) < width and cur >= 0:
            cols.append(xs[cur])
            cur = parents[cur]
        back = width - len(cols)
        if back:
            committed = prior[seq_of[t]].float()  # oldest first
            cols.extend(committed[:, m - 1 - j] for j in range(back))
        win = torch.stack(cols[::-1], -1)  # [dim, W], oldest first
        ref[t] = (win * weight.float()).sum(-1) + bias.float()
    ref = torch.nn.functional.silu(ref)
    tol_ref, tol_chain = TOL[dtype]
    name = f"conv {tag} {str(dtype)[6:]} dim={dim} W={width} T={T}"
    chk.close(f"{name}: node outputs vs fp32 reference path", out, ref, tol_ref)

    # the same kernel as a chain per root->leaf path (vLLM's speculative conv layout)
    order, cu, rows, maxlen = chain_layout(prob.leaves_paths, dev)
    npaths = len(prob.leaves_paths)
    cbuf = torch.zeros(npaths + 1, dim, m + maxlen - 1, dtype=dtype, device=dev)
    for p, path in enumerate(prob.leaves_paths):
        cbuf[p + 1, :, :m] = prior[seq_of[path[0]]]
    co = k.conv_update(x[order].clone(), cbuf, weight, bias, "silu",
                       conv_state_indices=torch.arange(1, npaths + 1, dtype=torch.int32, device=dev),
                       num_accepted_tokens=torch.ones(npaths, dtype=torch.int32, device=dev),
                       query_start_loc=cu, max_query_len=maxlen)
    tok, _, flat = path_positions(prob.leaves_paths, rows.cpu())
    chk.close(f"{name}: node outputs vs kernel chain per path",
              out[torch.tensor(tok, device=dev)], co[torch.tensor(flat, device=dev)], tol_chain)


def correctness(k, device: str, smoke: bool) -> Checker:
    chk = Checker()
    gen = torch.Generator().manual_seed(0)
    if smoke:
        gdn_dims, mamba_dims, conv_dims = [(2, 4, 16, 16)], [(4, 8, 16, 2)], [(32, 4)]
        dtypes, rounds, nreq, bmax = (torch.float32, torch.bfloat16), 1, 3, 20
    else:
        gdn_dims = [(4, 8, 64, 64), (16, 48, 128, 128)]
        mamba_dims = [(8, 16, 32, 2), (128, 64, 128, 8)]
        conv_dims = [(256, 4), (10240, 4), (64, 2)]
        dtypes, rounds, nreq, bmax = (torch.float32, torch.bfloat16), 3, 6, 64
    print("correctness, per tree node:")
    for r in range(rounds):
        budgets = [int(torch.randint(7, bmax + 1, (1,), generator=gen)) for _ in range(nreq)]
        shapes = [SHAPES[(r + i) % len(SHAPES)] for i in range(nreq)]
        tag = f"round {r} B={budgets} shapes={shapes}"
        print(f" {tag}")
        for dt in dtypes:
            for dims in gdn_dims:
                check_gdn(k, chk, device, gen, dt, dims, budgets, shapes, f"r{r}")
            for dims in mamba_dims:
                check_mamba2(k, chk, device, gen, dt, dims, budgets, shapes, f"r{r}")
            # Triton's interpreter garbles a few bf16 lanes of the conv kernel (fp32 and fp16
            # are exact there); it checks fp16 instead. Compiled runs check bf16.
            cdt = torch.float16 if dt == torch.bfloat16 and device == "cpu" else dt
            for dim, width in conv_dims:
                check_conv(k, chk, device, gen, cdt, dim, width, budgets, shapes, f"r{r}")
    return chk


# --------------------------------------------------------------------------- benchmark

# Qwen3.6-27B text config: linear_num_key_heads 16, linear_num_value_heads 48,
# linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4 (48 of its 64
# layers are GatedDeltaNet; mamba_ssm_dtype float32). Sources: docs/hybrid_state_memory.md.
QWEN36_27B_GDN = dict(H=16, HV=48, K=128, V=128, W=4)
# Nemotron-H-8B: mamba_num_heads 128, mamba_head_dim 64, ssm_state_size 128, n_groups 8,
# conv_kernel 4 (24 Mamba2 layers of 52). Sources: docs/hybrid_state_memory.md.
NEMOTRON_H_8B_MAMBA2 = dict(H=128, P=64, N=128, G=8, W=4)


def _level_plan(prob, dev):
    """Per depth level of ``prob`` (tokens taken in level order): the slice, the slot index
    tensors each kernel wants, prepared once (a forward prepares them once for all layers)."""
    order = torch.cat(prob.layout.levels)
    src, dst = prob.src[order], prob.dst[order]
    plan, s = [], 0
    for lv in prob.layout.levels:
        e = s + lv.numel()
        plan.append(dict(
            sl=slice(s, e), n=e - s,
            dst_src=torch.stack([dst[s:e], src[s:e]], 1).to(torch.int32).to(dev),
            dst=dst[s:e].to(dev), src=src[s:e].to(dev),
            dst1=dst[s:e].to(torch.int32).view(-1, 1).to(dev),
            src1=src[s:e].to(torch.int32).view(-1, 1).to(dev),
            cu=torch.arange(e - s + 1, dtype=torch.int32, device=dev),
            two=torch.full((e - s,), 2, dtype=torch.int32, device=dev)))
        s = e
    return order, plan


def benchmark(k, device: str, smoke: bool, args) -> str:
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    act = torch.float32 if smoke else torch.bfloat16
    sdt = torch.float32 if args.state_dtype == "float32" else torch.bfloat16
    if smoke:
        gdn = dict(H=2, HV=4, K=16, V=16, W=4)
        mam = dict(H=4, P=8, N=16, G=2, W=4)
        budgets, batches, chain_len, iters, repeats = [6], [1], 5, 1, 1
    else:
        gdn, mam = QWEN36_27B_GDN, NEMOTRON_H_8B_MAMBA2
        budgets, batches, chain_len = [16, 32, 64, 128, 256], [1, 8], 16
        iters, repeats = args.iters, args.repeats
    dev = device
    mdims = (mam["H"], mam["P"], mam["N"], mam["G"])
    conv_dims = {"GDN conv": gdn["K"] * gdn["H"] * 2 + gdn["V"] * gdn["HV"],
                 "Mamba2 conv": mam["H"] * mam["P"] + 2 * mam["G"] * mam["N"]}
    W = gdn["W"]
    rows = []

    def rnd(*shape, dtype=act, scale=1.0):  # drawn on the device: the states are GiBs
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    for batch in batches:
        # ---- chain baselines: `batch` requests x (L + 1) tokens, vLLM's speculative layout
        N, Lp1 = batch, chain_len
        T = N * Lp1
        cu = torch.arange(0, T + 1, Lp1, dtype=torch.int32, device=dev)
        idx = (1 + torch.arange(N * Lp1, device=dev)).view(N, Lp1).to(torch.int32)
        acc = torch.ones(N, dtype=torch.int32, device=dev)
        A_log = rnd(gdn["HV"], dtype=torch.float32, scale=0.5)
        dt_bias = rnd(gdn["HV"], dtype=torch.float32, scale=0.5)

        def gdn_inputs(T):
            return SimpleNamespace(q=rnd(1, T, gdn["H"], gdn["K"]), k=rnd(1, T, gdn["H"], gdn["K"]),
                                   v=rnd(1, T, gdn["HV"], gdn["V"]), a=rnd(T, gdn["HV"]),
                                   b=rnd(T, gdn["HV"]))

        g = gdn_inputs(T)
        gstate = rnd(1 + N * Lp1, gdn["HV"], gdn["V"], gdn["K"], dtype=sdt, scale=0.5)

        def gdn_chain():
            k.gdn(A_log=A_log, a=g.a, b=g.b, dt_bias=dt_bias, q=g.q, k=g.k, v=g.v,
                  initial_state=gstate, inplace_final_state=True, cu_seqlens=cu,
                  ssm_state_indices=idx, num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True)

        mm = _mamba_inputs(rnd, T, mdims, act, dev, 1 + N * Lp1, sdt)
        mout = torch.empty(T, mam["H"], mam["P"], dtype=act, device=dev)

        def mamba_chain():
            _ssu(k, mm.init, mm, slice(None), idx, idx, mout, num_accepted_tokens=acc,
                 cu_seqlens=cu)

        chain = {"gdn": time_call(gdn_chain, dev, iters, repeats),
                 "mamba": time_call(mamba_chain, dev, iters, repeats)}
        for cname, dim in conv_dims.items():
            cx, cw, cb = rnd(T, dim), rnd(dim, W), rnd(dim)
            cout = torch.empty_like(cx)
            cbuf = rnd(N + 1, dim, W - 1 + Lp1 - 1)
            cidx = torch.arange(1, N + 1, dtype=torch.int32, device=dev)
            chain[cname] = time_call(
                lambda: k.conv_update(cx, cbuf, cw, cb, "silu", conv_state_indices=cidx,
                                      num_accepted_tokens=acc, query_start_loc=cu,
                                      max_query_len=Lp1, out=cout), dev, iters, repeats)
        del gstate, mm

        for budget in budgets:
            # `batch` trees of B + 1 nodes: a spine of depth L - 1 (as many levels as the
            # chain has tokens) plus random nodes of depth <= L - 1; tokens in level order
            prob = make_problem([budget] * batch, ["spine"] * batch, gen, max_depth=chain_len - 1)
            _, plan = _level_plan(prob, dev)
            nlev, T = len(plan), prob.layout.num_tokens

            tg = gdn_inputs(T)
            tstate = rnd(prob.num_slots, gdn["HV"], gdn["V"], gdn["K"], dtype=sdt, scale=0.5)

            def gdn_tree():
                for p in plan:
                    sl = p["sl"]
                    k.gdn(A_log=A_log, a=tg.a[sl], b=tg.b[sl], dt_bias=dt_bias,
                          q=tg.q[:, sl], k=tg.k[:, sl], v=tg.v[:, sl],
                          initial_state=tstate, inplace_final_state=True, cu_seqlens=p["cu"],
                          ssm_state_indices=p["dst_src"], num_accepted_tokens=p["two"],
                          use_qk_l2norm_in_kernel=True)

            t = time_call(gdn_tree, dev, iters, repeats)
            rows.append(("GDN", batch, budget, nlev, t, chain["gdn"], f"{nlev}"))
            del tstate, tg

            tm = _mamba_inputs(rnd, T, mdims, act, dev, prob.num_slots, sdt)
            outs = [torch.empty(p["n"], mam["H"], mam["P"], dtype=act, device=dev) for p in plan]

            def mamba_tree_copy():
                for p, o in zip(plan, outs):
                    tm.init.index_copy_(0, p["dst"], tm.init.index_select(0, p["src"]))
                    _ssu(k, tm.init, tm, p["sl"], p["dst1"], p["dst1"], o)

            def mamba_tree_srcdst():
                for p, o in zip(plan, outs):
                    _ssu(k, tm.init, tm, p["sl"], p["src1"], p["dst1"], o)

            t = time_call(mamba_tree_copy, dev, iters, repeats)
            rows.append(("Mamba2 copy+in-place", batch, budget, nlev, t,
                         chain["mamba"], f"{nlev} + {2 * nlev} torch"))
            t = time_call(mamba_tree_srcdst, dev, iters, repeats)
            rows.append(("Mamba2 src/dst", batch, budget, nlev, t,
                         chain["mamba"], f"{nlev}"))
            del tm, outs

            widx = conv_window_index(prob.layout, W).to(dev)
            for cname, dim in conv_dims.items():
                cx, cw, cb = rnd(T, dim), rnd(dim, W), rnd(dim)
                cout = torch.empty_like(cx)
                prior = rnd(batch, dim, W - 1)  # the committed windows (read_conv_windows)
                scratch = torch.empty(T + 1, dim, W - 1, dtype=act, device=dev)
                sidx = torch.arange(1, T + 1, dtype=torch.int32, device=dev)

                def conv_tree():
                    scratch[1:] = gather_conv_windows(cx, prior, widx)
                    k.conv_update(cx, scratch, cw, cb, "silu", conv_state_indices=sidx, out=cout)

                t = time_call(conv_tree, dev, iters, repeats)
                rows.append((cname, batch, budget, nlev, t, chain[cname], "1 + 4 torch"))
            if device == "cuda":
                torch.cuda.empty_cache()

    lines = [
        f"state {str(sdt)[6:]}, activations {str(act)[6:]}; chain = {chain_len} tokens (L + 1) "
        f"per request in one call (vLLM's speculative layout); tree = B + 1 nodes per request, "
        f"one launch per depth level; ms per call ({'CUDA events' if device == 'cuda' else 'wall'}, "
        f"median of {repeats} x {iters}).",
        f"GDN layer{'' if smoke else ' (Qwen3.6-27B)'} {gdn}; Mamba2 layer"
        f"{'' if smoke else ' (Nemotron-H-8B)'} {mam}; conv dims {conv_dims}.",
        "launches: Triton kernels (+ torch index/copy ops) per call; the chain is 1 kernel.",
        "",
        "| layer | batch | B | levels | tree ms | chain ms | tree / chain | launches (tree) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, batch, budget, nlev, tt, tc, launches in rows:
        lines.append(f"| {name} | {batch} | {budget} | {nlev} | {tt:.3f} | {tc:.3f} | "
                     f"{tt / tc:.2f} | {launches} |")
    return "\n".join(lines)



# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-src", default=None,
                   help="directory holding the vllm package (source tree, site-packages, or "
                        "a --bundle folder); default: the installed vllm")
    p.add_argument("--bundle", type=Path, default=None, metavar="OUT_DIR",
                   help="copy the needed vLLM kernel files to OUT_DIR and exit")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter)")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="recurrent state dtype of the benchmark")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch the conv kernel without programmatic dependent launch (stubbed "
                        "platform only; for a Triton too old for tl.extra.cuda.gdc_wait)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)

    if args.bundle is not None:
        return write_bundle(args.bundle, args.vllm_src)
    if importlib.util.find_spec("triton") is None:
        print("triton is not installed", file=sys.stderr)
        return 2
    device = select_device()
    if device is None:
        return 2
    if device == "cpu":
        patch_interpreter_masks()
    import triton

    _CudaPlatform.allow_pdl = not args.no_pdl
    k = load_vllm_kernels(*find_vllm_src(args.vllm_src))
    print(f"torch {torch.__version__}, triton {triton.__version__}; kernels from {k.origin}")
    if k.stubs:  # stand-ins have no import spec; a module vLLM's importer loaded would
        real = [m for m in sys.modules if (m == "vllm" or m.startswith("vllm."))
                and sys.modules[m].__spec__ is not None]
        assert not real, f"real vLLM modules were imported: {real}"
    if device == "cpu" and not args.smoke:
        print("note: full sizes under the interpreter take very long; use --smoke")

    t0 = time.perf_counter()
    chk = Checker() if args.skip_checks else correctness(k, device, args.smoke)
    if not args.skip_bench:
        table = benchmark(k, device, args.smoke, args)
        print()
        print(table)
        if args.out is not None:
            args.out.write_text(table + "\n")
    for note in chk.notes:
        print(f"note: {note}")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if chk.failures:
        print(f"\n{len(chk.failures)} check(s) FAILED: {chk.failures}")
        return 1
    print("\nall required checks passed" if not args.skip_checks else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
