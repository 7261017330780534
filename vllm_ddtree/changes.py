"""The register's vocabulary: what one entry (:class:`Change`) says, and the helpers that build one.

Kept apart from :mod:`vllm_ddtree.integration` (the register itself and its checks) so that the
legacy Model Runner V1 adapter (:mod:`vllm_ddtree.runners.v1`) can state its own entries without
an import cycle, and be deleted with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

#: Every kind of change in the register.
KINDS = {
    "patch": "a vLLM function or method replaced by a wrapper (falls through outside DDTree)",
    "override": "a vLLM registry entry pointed at the plugin's subclass",
    "registration": "a model class registered with vLLM in place of vLLM's",
    "env": "a process-wide environment variable vLLM reads",
    "global swap": "a vLLM or torch module global replaced for a moment, then restored",
    "class switch": "a vLLM object's class switched to the plugin's subclass after construction",
    "bare instance": "a vLLM object built through __new__ with its state set by the plugin",
    "dependency": "a vLLM class or function the plugin subclasses, overrides or calls",
    "attribute": "an instance attribute or dataclass field of a vLLM class the plugin reads",
    "instance attribute": "an attribute the plugin sets on one vLLM object it hands back to "
                          "vLLM: a new one vLLM ignores, or that object's method wrapped",
    "field type": "a dataclass field's declared type widened to the plugin's subclass of it "
                  "(what vLLM's msgspec decoder builds); the signature is the declared type",
    "distribution alias": "a distribution finder on sys.meta_path that answers a lookup of "
                          "the distribution vLLM's code asks for by name (CLI process only)",
}


#: Every vLLM release the register states expectations for (the supported ones,
#: :data:`vllm_ddtree.SUPPORTED_VLLM_VERSIONS`, the version fence).
REGISTER_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")
#: The expectation of a target that must not exist in a version: Model Runner V1's modules,
#: deleted in vLLM 0.34, and symbols that moved. Checked (a target found there is reported) and
#: never patched or used in that version.
ABSENT = "<absent>"


@dataclass
class Change:
    """One entry of the register (:data:`vllm_ddtree.integration.REGISTER`; its module docstring
    says what each field means).

    Attributes:
        target: ``"module:qualname"``; the module is ``vllm…`` or ``torch…``.
        kind: a key of :data:`KINDS`.
        why: one or two sentences.
        signatures: supported vLLM version -> canonical signature, or ``None`` (existence only).
        site: the plugin file that makes the change or uses the symbol.
        platforms: platforms where the change applies (``"cpu"``, ``"cuda"``).
        platform_signatures: platform -> (version -> signature) where one platform binds the
            target to another function (vLLM's CPU build swaps some kernels at import:
            ``if current_platform.is_cpu(): causal_conv1d_update = causal_conv1d_update_cpu``);
            ``signatures`` holds the other platforms' expectation.
        make_wrapper: kind ``"patch"`` only: ``make_wrapper(original) -> wrapper``, bound by
            :func:`vllm_ddtree.patches.patch`.
    """

    target: str
    kind: str
    why: str
    signatures: Mapping[str, str | None]
    site: str
    platforms: tuple[str, ...] = ("cpu", "cuda")
    platform_signatures: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)
    make_wrapper: Callable[[Callable], Callable] | None = field(default=None, repr=False)

    def expected(self, version: str, platform: str) -> str | None:
        """The signature expected of the target in vLLM ``version`` on ``platform``
        (:data:`ABSENT`: the target must not exist there)."""
        return self.platform_signatures.get(platform, {}).get(version, self.signatures[version])

    def present(self, version: str, platform: str | None = None) -> bool:
        """Whether the target exists in vLLM ``version`` (on ``platform``, default any)."""
        if platform is not None:
            return self.expected(version, platform) != ABSENT
        return any(self.expected(version, p) != ABSENT for p in self.platforms)

    def all_expected(self, version: str) -> set[str]:
        """Every signature the target has in vLLM ``version`` on some platform."""
        found = {self.signatures[version]}
        found.update(v.get(version, self.signatures[version])
                     for v in self.platform_signatures.values())
        return {s for s in found if s is not None and s != ABSENT}

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]


def both(signature: str | None) -> dict[str, str | None]:
    """The same expected signature in every version of :data:`REGISTER_VERSIONS`."""
    return {v: signature for v in REGISTER_VERSIONS}


def until_033(signature: str | None) -> dict[str, str | None]:
    """``signature`` in vLLM 0.32.0 and 0.33.0; the target is gone in 0.34.0."""
    return {"0.32.0": signature, "0.33.0": signature, "0.34.0": ABSENT}


def since_034(signature: str | None) -> dict[str, str | None]:
    """The target exists from vLLM 0.34.0 on, with ``signature`` (it moved there)."""
    return {"0.32.0": ABSENT, "0.33.0": ABSENT, "0.34.0": signature}


def attributes(owner: str, names: str, why: str, site: str,
               platforms: tuple[str, ...] = ("cpu", "cuda")) -> list[Change]:
    """One ``attribute`` entry per name in ``names`` (space-separated) of ``owner``
    (``"module:Class"``), all with the same ``why``."""
    return [Change(f"{owner}.{n}", "attribute", why, both(None), site, platforms)
            for n in names.split()]


def entry(target: str, kind: str, why: str, signatures: Mapping[str, str | None], site: str,
          platforms: tuple[str, ...] = ("cpu", "cuda")) -> Change:
    """One :class:`Change` (``signatures`` copied)."""
    return Change(target, kind, why, dict(signatures), site, platforms)
