"""The register (``vllm_ddtree/integration.py``) is complete and is the only way vLLM is changed.

* every vLLM symbol the package imports (and every attribute it reads from an imported vLLM
  module, ``ops.x`` / ``envs.X``) is a register entry;
* code that changes vLLM or torch (``register_backend``, ``ModelRegistry.register_model``,
  ``__new__``, ``__class__ =``, ``os.environ[...] =``, assignments to another module's globals,
  ``setattr``) appears only in ``integration.py`` or at a site the register names for that kind;
* the helpers that make changes refuse targets the register does not list.

Each scanner is also fed a deliberately wrong snippet, to show it can fail.
"""

from __future__ import annotations

import ast
import importlib
import io
import tokenize
import importlib.util
import re
from pathlib import Path

import pytest

from vllm_ddtree import integration

PACKAGE = Path(integration.__file__).parent
ROOT = PACKAGE.parent


def _package_files() -> list[Path]:
    # The test harnesses (vllm_ddtree/testing, moving to tests/support) are not the plugin.
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "testing" not in p.parts]


def _covered(target: str) -> bool:
    """A register entry is ``target`` or a member of it (``mod:Class`` covers ``mod:Class.x``)."""
    return any(c.target == target or c.target.startswith(target + ".")
               for c in integration.REGISTER)


def vllm_uses(source: str) -> list[tuple[str, str]]:
    """``(module, name)`` of every vLLM name ``source`` imports, and of every attribute it reads
    from an imported vLLM module (``from vllm import envs`` … ``envs.X``)."""
    tree = ast.parse(source)
    uses, module_aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if importlib.util.find_spec(full.split(".")[0]) and _is_module(full):
                    module_aliases[alias.asname or alias.name] = full
                else:
                    uses.append((node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm" and alias.asname:
                    module_aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases):
            uses.append((module_aliases[node.value.id], node.attr))
    return uses


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _definition(module: str, name: str) -> str:
    """Where ``module.name`` is defined (``vllm:SamplingParams`` ->
    ``vllm.sampling_params:SamplingParams``; an instance -> its class)."""
    obj = getattr(importlib.import_module(module), name)
    if not hasattr(obj, "__qualname__"):
        obj = type(obj)
    return f"{obj.__module__}:{obj.__qualname__}"


def uncovered(source: str) -> list[str]:
    """The vLLM names ``source`` uses that the register does not list."""
    missing = []
    for module, name in vllm_uses(source):
        target = f"{module}:{name}"
        if _covered(target):
            continue
        try:
            if _covered(_definition(module, name)):
                continue
        except AttributeError:
            pass
        missing.append(target)
    return missing


def test_every_vllm_name_the_plugin_uses_is_registered():
    missing = {str(p.relative_to(ROOT)): uncovered(p.read_text()) for p in _package_files()}
    assert {k: v for k, v in missing.items() if v} == {}


def test_the_import_scanner_can_fail():
    snippet = ("from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
               "from vllm import envs\n"
               "from vllm.v1.core.kv_cache_manager import KVCacheManager\n"
               "x = envs.VLLM_CPU_ATTN_SPLIT_KV, envs.VLLM_NO_SUCH_THING\n")
    assert uncovered(snippet) == ["vllm.v1.core.kv_cache_manager:KVCacheManager",
                                  "vllm.envs:VLLM_NO_SUCH_THING"]


#: Code that changes vLLM or torch, by kind of register entry.
CHANGE_PATTERNS = {
    "override": re.compile(r"\bregister_backend\("),
    "registration": re.compile(r"\bregister_model\("),
    "bare instance": re.compile(r"\.__new__\("),
    "class switch": re.compile(r"\.__class__\s*="),
    "env": re.compile(r"os\.environ\[[^]]+\]\s*=|os\.environ\.(setdefault|update)\(|os\.putenv\("),
    # module globals: ``torch.x.y = …`` / ``some_module.Name = …`` (lower-case owner, not self)
    "global swap": re.compile(r"^\s*(?!self\.)(torch|vllm|[a-z_]*module)\.[\w.]+\s*=[^=]"),
    "patch": re.compile(r"\bsetattr\("),
    # attributes set on a step's output object vLLM hands around, or on a model's layer
    "instance attribute": re.compile(r"^\s*(output|model_runner_output|layer)\.\w+\s*=[^=]"),
    "distribution alias": re.compile(r"\bsys\.meta_path\.(insert|append|extend)\("),
}


def _code_lines(text: str) -> list[str]:
    """``text``'s lines with strings (docstrings included) and comments blanked out."""
    out = [list(line) for line in text.splitlines()]
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            row = out[r - 1]
            lo = c0 if r == r0 else 0
            hi = c1 if r == r1 else len(row)
            row[lo:hi] = " " * (hi - lo)
    return ["".join(row) for row in out]


def change_sites(path: Path, text: str) -> list[str]:
    """Lines of ``text`` that change vLLM or torch and are neither in ``integration.py`` nor at
    a site the register names for that kind."""
    if path.name == "integration.py":
        return []
    rel = str(path.relative_to(ROOT)) if path.is_absolute() else str(path)
    bad = []
    for i, (line, code) in enumerate(zip(text.splitlines(), _code_lines(text)), 1):
        for kind, pattern in CHANGE_PATTERNS.items():
            if not pattern.search(code):
                continue
            if kind == "patch" and rel == "vllm_ddtree/patches/__init__.py":
                continue  # the patch installer itself
            if kind == "patch" and "object.__setattr__" in code:
                continue  # the plugin's own frozen dataclasses
            if any(c.kind == kind and c.site == rel for c in integration.REGISTER):
                continue
            bad.append(f"{rel}:{i}: {kind}: {line.strip()}")
    return bad


def test_vllm_is_changed_only_through_the_register():
    bad = [line for p in _package_files() for line in change_sites(p, p.read_text())]
    assert bad == []


def test_the_change_scanner_can_fail():
    snippet = ("import torch\n"
               "torch.cpu._is_avx512_bf16_supported = lambda: True\n"
               "os.environ['VLLM_X'] = '1'  # a comment: register_model(\n"
               "doc = 'register_backend( in a string is not code'\n"
               "register_backend(AttentionBackendEnum.FLASH_ATTN, 'x')\n"
               "proc = MinPLogitsProcessor.__new__(MinPLogitsProcessor)\n"
               "    output.extra = 1\n")
    bad = change_sites(Path("vllm_ddtree/runners/v1/verify.py"), snippet)
    assert [b.split(": ")[1] for b in bad] == ["global swap", "env", "override",
                                               "instance attribute"]
    # runners/v1/verify.py is the registered site of a bare instance, so its __new__ line passes (the
    # helper integration.bare_instance checks the entry); models/__init__.py registers models.
    assert change_sites(Path("vllm_ddtree/models/__init__.py"),
                        "integration.register_model(arch, target)\n") == []
    assert len(change_sites(Path("vllm_ddtree/patches/__init__.py"), "os.environ['X'] = '0'\n")) == 1


#: The files whose functions wrap vLLM methods: there ``self`` is a vLLM object.
WRAPPER_FILES = [*sorted((ROOT / "vllm_ddtree" / "patches").glob("*.py")),
                 ROOT / "vllm_ddtree" / "runners" / "v1" / "hooks.py"]
_SELF_SET = re.compile(r"^\s*self\.(\w+)\s*=[^=]")


def unregistered_self_attributes(path: Path, text: str) -> list[str]:
    """``self.name = …`` lines of a wrapper file whose ``name`` no ``attribute`` or
    ``instance attribute`` entry of the register names."""
    names = {c.qualname.rsplit(".", 1)[-1] for c in integration.REGISTER
             if c.kind in ("attribute", "instance attribute")}
    return [f"{path.name}:{i}: {line.strip()}"
            for i, (line, code) in enumerate(zip(text.splitlines(), _code_lines(text)), 1)
            if (m := _SELF_SET.search(code)) and m.group(1) not in names]


def test_every_attribute_set_on_a_vllm_object_is_registered():
    bad = [line for p in WRAPPER_FILES if p.exists()
           for line in unregistered_self_attributes(p, p.read_text())]
    assert bad == []
    # Power: an attribute the register does not name is reported.
    assert unregistered_self_attributes(Path("x.py"), "    self._ddtree_new = 1\n")


def test_register_entries_are_well_formed():
    targets = [c.target for c in integration.REGISTER]
    assert len(targets) == len(set(targets))
    for c in integration.REGISTER:
        assert c.kind in integration.KINDS, c.target
        assert c.why.strip(), c.target
        assert (ROOT / c.site).is_file(), c.target
        assert set(c.platforms) <= {"cpu", "cuda"} and c.platforms, c.target
        assert ":" in c.target and c.module.split(".")[0] in ("vllm", "torch"), c.target
    assert {c.kind for c in integration.REGISTER} <= set(integration.KINDS)


def test_patches_feed_the_register(monkeypatch):
    """A patch of an unlisted target adds its entry; without expectations the install check
    names it (and the plugin would change nothing)."""
    from vllm_ddtree import patches

    monkeypatch.setattr(integration, "REGISTER", list(integration.REGISTER))
    runner = "vllm.v1.worker.gpu_model_runner"
    patches.patch(runner, "GPUModelRunner.execute_model")(lambda original: original)
    blind = integration.get(f"{runner}:GPUModelRunner.execute_model")
    assert blind.kind == "patch" and blind.site == "tests/test_integration.py"
    assert integration.check_installed("0.32.0", "cpu", [blind]) == [
        f"{blind.target}: the register has no expectation for vLLM 0.32.0"]
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sig = integration.live_signature(GPUModelRunner.__dict__["sample_tokens"])
    patches.patch(runner, "GPUModelRunner.sample_tokens", why="test",
                  signatures={"0.32.0": sig, "0.33.0": sig})(lambda original: original)
    declared = integration.get(f"{runner}:GPUModelRunner.sample_tokens")
    assert declared.why == "test" and declared.make_wrapper is not None
    assert integration.check_installed("0.32.0", "cpu", [declared]) == []

    with pytest.raises(KeyError, match="registered as 'dependency', not as a patch"):
        patches.patch("vllm.v1.spec_decode.dflash", "DFlashProposer.propose")(lambda o: o)
    with pytest.raises(ValueError, match="cpu_only=True"):
        patches.patch("vllm.engine.arg_utils", "EngineArgs.create_engine_config",
                      cpu_only=True)(lambda o: o)
    with pytest.raises(ValueError, match="patched twice"):
        patches.patch("vllm.engine.arg_utils", "EngineArgs.create_engine_config")(lambda o: o)
    with pytest.raises(ValueError, match="declared in the register already"):
        patches.patch("vllm.engine.arg_utils", "EngineArgs.create_engine_config",
                      why="again")(lambda o: o)


def test_every_patch_in_the_package_is_bound():
    import vllm_ddtree.patches  # noqa: F401

    version = integration.installed_vllm_version()
    assert all(c.make_wrapper is not None for c in integration.entries("patch")
               if c.present(version))


def test_change_helpers_refuse_unregistered_targets():
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    with pytest.raises(KeyError):
        with integration.swapped("vllm.v1.worker.gpu_model_runner", "EagleProposer", None):
            pass
    with pytest.raises(KeyError):
        integration.override_backend("FLASH_ATTN", "x.Y")
    with pytest.raises(KeyError):
        integration.register_model("LlamaForCausalLM", "x:Y")
    with pytest.raises(KeyError):
        integration.bare_instance(LogitBiasLogitsProcessor)
    with pytest.raises(KeyError):
        integration.switch_class(LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor), int)


def test_swapped_restores():
    import torch

    original = torch.cpu._is_amx_tile_supported
    with pytest.raises(RuntimeError):
        with integration.swapped("torch.cpu", "_is_amx_tile_supported", lambda: "swapped"):
            assert torch.cpu._is_amx_tile_supported() == "swapped"
            raise RuntimeError
    assert torch.cpu._is_amx_tile_supported is original


def test_signature_forms_agree():
    """Live and source signatures are written the same way (names, kinds, literal defaults)."""
    import inspect

    src = ("def f(a, b=1, /, c=None, *args, d, e=-2.5, f='x', g=CONST, **kw): pass\n"
           "def h(*, a): pass\n")
    tree = ast.parse(src)

    def f(a, b=1, /, c=None, *args, d, e=-2.5, f="x", g=object(), **kw):
        pass

    def h(*, a):
        pass

    for node, fn in zip(tree.body, (f, h)):
        assert integration.ast_signature(node) == integration.canonical_signature(
            inspect.signature(fn))
    assert integration.canonical_signature(inspect.signature(f)) == (
        "(a, b=1, /, c=None, *args, d, e=-2.5, f='x', g=..., **kw)")
    assert integration.canonical_signature(inspect.signature(h)) == "(*, a)"


def test_describe_lists_every_entry():
    table = integration.describe()
    assert all(f"`{c.target}`" in table for c in integration.REGISTER)
    assert "vLLM 0.32.0" in table and "vLLM 0.33.0" in table
