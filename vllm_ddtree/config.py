"""The ``ddtree`` speculative config: parse, validate, translate for vLLM, carry to workers.

A user writes, exactly as for vLLM's own methods::

    --speculative-config '{"method": "ddtree", "model": "<DFlash drafter>", "ddtree_budget": 32}'

vLLM's ``SpeculativeConfig`` is a pydantic dataclass whose ``method`` is a ``Literal`` and which
forbids extra keys, so ``"ddtree"`` cannot reach it. :func:`translate_speculative_config` runs
before vLLM builds that object (see :mod:`vllm_ddtree.patches.frontend`): it validates the DDTree keys,
turns the dict into vLLM's own ``dflash`` config (so vLLM loads the DFlash drafter, its aux hidden
states and KV cache), and returns a :class:`DDTreeConfig` that travels to every engine and
worker process inside ``VllmConfig.additional_config["ddtree"]`` (vLLM's supported channel for
plugin settings; it is pickled with the config).

This module imports nothing from vLLM, so it is testable without an engine.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

#: Key of the DDTree settings inside ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "ddtree"

#: Accepted values of ``ddtree_hybrid``.
HYBRID_MODES = ("oracle", "shadow_linear")

#: Every ``ddtree_*`` key the speculative config accepts.
DDTREE_KEYS = ("ddtree_budget", "ddtree_max_budget", "ddtree_max_children", "ddtree_hybrid")

#: ``"ddtree_budget": "auto"``: the engine chooses each step's tree sizes (vllm_ddtree.budget).
AUTO_BUDGET = "auto"

#: Largest tree ``"auto"`` may choose when ``ddtree_max_budget`` is not given. Large enough for
#: a GPU, where trees of hundreds of nodes can pay, to grow well past the fixed default (B = L);
#: small enough that the ``max(B, L)`` slots vLLM reserves per request stay modest.
DEFAULT_MAX_BUDGET = 64


class DDTreeConfigError(ValueError):
    """A ``ddtree`` speculative config that cannot run; the message names the offending key."""


@dataclass(frozen=True)
class DDTreeConfig:
    """Validated DDTree settings (paper §4; ``ddtree.py`` reference defaults).

    Attributes:
        drafter: path or id of the DFlash drafter checkpoint.
        budget: node budget B, the number of non-root draft-tree nodes verified per step (>= 1);
            with ``auto_budget`` the largest budget the controller may choose (``B_max``,
            ``ddtree_max_budget``), which sizes vLLM's slots like a fixed B.
        drafter_horizon: L, the number of future positions one DFlash pass predicts
            (``num_speculative_tokens``; at most ``block_size - 1``).
        block_size: the drafter's DFlash block size (root + L mask tokens at most).
        max_children: optional cap on the children of any tree node (top-k per depth).
        hybrid: ``"oracle"`` or ``"shadow_linear"`` (how recurrent layers verify trees).
        auto_budget: ``"ddtree_budget": "auto"``: each step's per-request tree size, in
            ``[1, budget]``, comes from :class:`vllm_ddtree.budget.BudgetController`.
    """

    drafter: str
    budget: int
    drafter_horizon: int
    block_size: int
    max_children: int | None = None
    hybrid: str = "oracle"
    auto_budget: bool = False

    @property
    def num_verify_slots(self) -> int:
        """Draft slots vLLM must reserve per request: ``max(B, L)``.

        B slots hold the tree nodes; the DFlash pass writes its L query positions into the
        drafter's KV cache, which vLLM sizes by the same number of lookahead slots.
        """
        return max(self.budget, self.drafter_horizon)

    @property
    def num_recurrent_state_blocks(self) -> int:
        """Speculative state blocks vLLM keeps per request and recurrent layer
        (``MambaSpec.num_speculative_blocks``, ``vllm/v1/kv_cache_interface.py``).

        The tree oracle writes only the accepted path (at most ``L + 1`` tokens, block ``a``
        after ``a`` accepted drafts) into vLLM's blocks, so ``L``; ``shadow_linear`` leaves
        vLLM's own chain path in charge, which addresses ``max(B, L)``.
        """
        return self.drafter_horizon if self.hybrid == "oracle" else self.num_verify_slots

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DDTreeConfig":
        return cls(**dict(d))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_dflash_drafter_config(model: str) -> dict[str, Any]:
    """Read a drafter's ``config.json`` and check it is a DFlash checkpoint.

    Args:
        model: a local directory (or a Hugging Face id already in the local cache).

    Returns:
        the parsed ``config.json``.

    Raises:
        DDTreeConfigError: no readable config, or ``architectures`` is not a DFlash drafter
            (vLLM's loader, ``vllm/transformers_utils/configs/eagle.py``, keys on
            ``DFlashDraftModel``), or ``block_size`` / ``dflash_config`` is missing.
    """
    path = os.path.join(model, "config.json") if os.path.isdir(model) else None
    if path is None:
        try:  # a hub id: only what is already cached locally (no network is assumed)
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model, "config.json", local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot read"
            raise DDTreeConfigError(
                f"speculative_config['model']={model!r}: no DFlash drafter config.json there "
                "(not a local directory, and not a model in the local Hugging Face cache)"
            ) from e
    with open(path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if not any("DFlash" in a for a in archs):
        raise DDTreeConfigError(
            f"speculative_config['model']={model!r} is not a DFlash drafter checkpoint "
            f"(architectures={archs}); method 'ddtree' needs a DFlash drafter "
            "(architectures ['DFlashDraftModel'] with block_size and dflash_config)"
        )
    if not _is_int(cfg.get("block_size")) or cfg["block_size"] < 2:
        raise DDTreeConfigError(
            f"speculative_config['model']={model!r}: the DFlash config has no valid "
            f"'block_size' (got {cfg.get('block_size')!r})"
        )
    if not isinstance(cfg.get("dflash_config"), dict):
        raise DDTreeConfigError(
            f"speculative_config['model']={model!r}: the DFlash config has no 'dflash_config'"
        )
    return cfg


def count_prefixes(vocab_size: int, horizon: int, max_children: int | None, cap: int) -> int:
    """Number of distinct draft prefixes of depth 1..L (each node at most ``max_children``
    children), counted up to ``cap``: the largest node budget a tree can fill."""
    width, total = 1, 0
    for _ in range(horizon):
        width *= min(vocab_size, max_children or vocab_size)
        total += width
        if total >= cap:
            return cap
    return total


def translate_speculative_config(
    spec: Mapping[str, Any],
    *,
    vocab_size: int | None = None,
    max_num_batched_tokens: int | None = None,
    vllm_version: str | None = None,
) -> tuple[dict[str, Any], DDTreeConfig]:
    """Validate a ``{"method": "ddtree", ...}`` dict and turn it into vLLM's ``dflash`` dict.

    Args:
        spec: the user's speculative config (CLI JSON or ``LLM(speculative_config=...)``).
        vocab_size: the target's vocabulary, when known: a budget larger than the number of
            distinct draft prefixes is refused.
        max_num_batched_tokens: the scheduler's token budget per step, when set: a tree of
            ``B + 1`` rows must fit in one step, and a request must be able to get a draft row
            next to the slots vLLM keeps free for the drafter (:func:`check_tree_fits_step`);
            the default ``ddtree_max_budget`` of ``"auto"`` is lowered until a whole tree fits.
        vllm_version: the vLLM whose scheduler runs the engine (default: the installed one).

    Returns:
        ``(vllm_spec, ddtree)``: ``vllm_spec`` is the same dict with ``method="dflash"``,
        ``num_speculative_tokens=max(B, L)`` and the ``ddtree_*`` keys removed; ``ddtree`` the
        validated settings.

    Raises:
        DDTreeConfigError: no ``model``; unknown ``ddtree_*`` key; ``ddtree_budget`` neither an
            int >= 1 nor ``"auto"``; ``ddtree_max_budget`` not an int >= 1, or given without
            ``"auto"``; ``num_speculative_tokens`` (L) < 1 or larger than the drafter's
            ``block_size - 1``; bad ``ddtree_max_children`` / ``ddtree_hybrid``; a drafter that is
            not a DFlash checkpoint; a budget that cannot be filled (``vocab_size``) or
            scheduled (``max_num_batched_tokens``); ``num_speculative_tokens_per_batch_size``
            (dynamic speculation length does not apply to trees).
    """
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    if spec.get("method") != "ddtree":
        raise DDTreeConfigError(f"not a ddtree config: method={spec.get('method')!r}")
    unknown = sorted(k for k in spec if k.startswith("ddtree") and k not in DDTREE_KEYS)
    if unknown:
        raise DDTreeConfigError(
            f"speculative_config: unknown key(s) {unknown} for method 'ddtree'; "
            f"valid DDTree keys are {list(DDTREE_KEYS)}"
        )
    model = spec.get("model")
    if not model or not isinstance(model, str):
        raise DDTreeConfigError(
            "speculative_config: method 'ddtree' requires 'model', the path of a DFlash "
            "drafter checkpoint"
        )
    draft_cfg = read_dflash_drafter_config(model)
    block_size = int(draft_cfg["block_size"])
    max_horizon = block_size - 1

    horizon = spec.get("num_speculative_tokens")
    if horizon is None:
        horizon = max_horizon
    if not _is_int(horizon) or horizon < 1:
        raise DDTreeConfigError(
            f"speculative_config['num_speculative_tokens'] (the drafter horizon L) must be an "
            f"int >= 1, got {horizon!r}"
        )
    if horizon > max_horizon:
        raise DDTreeConfigError(
            f"speculative_config['num_speculative_tokens']={horizon} (drafter horizon L) is "
            f"larger than the drafter's block: block_size={block_size} allows at most "
            f"L = {max_horizon}"
        )

    budget = spec.get("ddtree_budget", horizon)  # reference default: a chain-sized tree
    auto = budget == AUTO_BUDGET
    max_budget = spec.get("ddtree_max_budget")
    if auto:
        if max_budget is not None and (not _is_int(max_budget) or max_budget < 1):
            raise DDTreeConfigError(
                f"speculative_config['ddtree_max_budget'] (the largest node budget "
                f"ddtree_budget='auto' may choose) must be an int >= 1, got {max_budget!r}"
            )
    elif max_budget is not None:
        given = (f"got ddtree_budget={budget!r}" if "ddtree_budget" in spec
                 else f"ddtree_budget not given, so it defaults to L = {horizon}")
        raise DDTreeConfigError(
            "speculative_config['ddtree_max_budget'] is only allowed with "
            f"ddtree_budget='auto' ({given}); a fixed budget is its own maximum"
        )
    elif not _is_int(budget) or budget < 1:
        raise DDTreeConfigError(
            f"speculative_config['ddtree_budget'] (node budget B) must be an int >= 1 or "
            f"'auto', got {budget!r}"
        )
    max_children = spec.get("ddtree_max_children")
    if max_children is not None and (not _is_int(max_children) or max_children < 1):
        raise DDTreeConfigError(
            f"speculative_config['ddtree_max_children'] must be an int >= 1 or absent, "
            f"got {max_children!r}"
        )
    hybrid = spec.get("ddtree_hybrid", "oracle")
    if hybrid not in HYBRID_MODES:
        raise DDTreeConfigError(
            f"speculative_config['ddtree_hybrid'] must be one of {list(HYBRID_MODES)}, "
            f"got {hybrid!r}"
        )
    if auto and hybrid == "shadow_linear":
        raise DDTreeConfigError(
            "speculative_config['ddtree_budget']='auto' cannot be combined with "
            "ddtree_hybrid='shadow_linear': that mode verifies only the top-1 chain, so no tree "
            "size is chosen; use a fixed ddtree_budget"
        )
    if spec.get("disable_padded_drafter_batch") is True:
        raise DDTreeConfigError(
            "speculative_config['disable_padded_drafter_batch']=True is not supported with "
            "method 'ddtree'"
        )
    if spec.get("num_speculative_tokens_per_batch_size") is not None:
        raise DDTreeConfigError(
            "speculative_config['num_speculative_tokens_per_batch_size'] (dynamic speculation "
            "length) is not supported with method 'ddtree'; the node budget is "
            "'ddtree_budget'"
        )
    if vllm_version is None:
        from vllm_ddtree.integration import installed_vllm_version

        vllm_version = installed_vllm_version()
    if auto:
        budget = _auto_max_budget(max_budget, horizon, max_children, vocab_size,
                                  max_num_batched_tokens, vllm_version)
    else:
        _check_fixed_budget("ddtree_budget", budget, horizon, max_children, vocab_size,
                            max_num_batched_tokens, vllm_version)

    ddtree = DDTreeConfig(
        drafter=model,
        budget=budget,
        drafter_horizon=horizon,
        block_size=block_size,
        max_children=max_children,
        hybrid=hybrid,
        auto_budget=auto,
    )
    if max_num_batched_tokens is not None:
        check_tree_fits_step(ddtree, max_num_batched_tokens, vllm_version)
    vllm_spec = {k: v for k, v in spec.items() if k not in DDTREE_KEYS}
    vllm_spec["method"] = "dflash"
    vllm_spec["num_speculative_tokens"] = ddtree.num_verify_slots
    return vllm_spec, ddtree


def max_verify_slots(max_num_batched_tokens: int, vllm_version: str) -> int:
    """The largest ``num_speculative_tokens`` K vLLM accepts for a DFlash drafter with this token
    budget: ``max_num_batched_tokens > K`` in vLLM 0.32; from 0.33 ``max_num_batched_tokens >
    num_lookahead_tokens = K + 1`` (``VllmConfig.num_lookahead_tokens``: a DFlash pass queries
    the bonus token plus one row per draft slot; checked in ``vllm/config/vllm.py``)."""
    return max_num_batched_tokens - (1 if _version_tuple(vllm_version) < (0, 33) else 2)


def _check_fixed_budget(key: str, budget: int, horizon: int, max_children: int | None,
                        vocab_size: int | None, max_num_batched_tokens: int | None,
                        vllm_version: str) -> None:
    """Refuse a budget (``ddtree_budget`` or ``ddtree_max_budget``, named by ``key``) that
    cannot be filled with distinct prefixes or that vLLM ``vllm_version`` cannot give slots in
    one scheduler step (:func:`max_verify_slots`)."""
    if vocab_size is not None:
        fillable = count_prefixes(vocab_size, horizon, max_children, budget)
        if fillable < budget:
            raise DDTreeConfigError(
                f"speculative_config['{key}']={budget} is impossible: only {fillable} "
                f"draft prefixes of depth <= L={horizon} exist (vocab {vocab_size}, "
                f"ddtree_max_children={max_children})"
            )
    if max_num_batched_tokens is not None:
        check_slots_fit(key, budget, horizon, max_num_batched_tokens, vllm_version)


def check_budget_runs(ddtree: DDTreeConfig, vocab_size: int, max_num_batched_tokens: int,
                      vllm_version: str) -> None:
    """The budget check again, in the worker, with the engine's final settings (the front end
    may not have known vLLM's default ``max_num_batched_tokens``): the one rule both runner
    adapters apply (:func:`_check_fixed_budget` on ``ddtree_budget``, or ``ddtree_max_budget``
    under ``"auto"``).

    Raises:
        DDTreeConfigError: the budget cannot be filled with distinct prefixes, or its slots do
            not fit one step.
    """
    key = "ddtree_max_budget" if ddtree.auto_budget else "ddtree_budget"
    _check_fixed_budget(key, ddtree.budget, ddtree.drafter_horizon, ddtree.max_children,
                        vocab_size, max_num_batched_tokens, vllm_version)


def check_slots_fit(key: str, budget: int, horizon: int, max_num_batched_tokens: int,
                    vllm_version: str, shown: str | None = None) -> None:
    """Refuse ``num_speculative_tokens = max(budget, L)`` slots that vLLM ``vllm_version``
    cannot give a DFlash drafter with ``max_num_batched_tokens`` (:func:`max_verify_slots`),
    before vLLM's own config check fails with a message that names neither key.

    Raises:
        DDTreeConfigError: names ``key`` (or L, when L is the larger), the largest value that
            fits, and the ``max_num_batched_tokens`` that would hold these slots (``K + 2``:
            it also leaves a vLLM 0.32 request the two rows :func:`check_tree_fits_step` asks).
            ``shown`` is the value the message gives for ``key`` (default ``budget``).
    """
    k = max(budget, horizon)
    most = max_verify_slots(max_num_batched_tokens, vllm_version)
    if k <= most:
        return
    shown = str(budget) if shown is None else shown
    which = (f"{key}={shown}" if budget >= horizon else
             f"L={horizon} (the drafter horizon: num_speculative_tokens, or the drafter's block "
             f"size - 1)")
    raise DDTreeConfigError(
        f"speculative_config['{key}']={shown} does not fit one step: num_speculative_tokens = "
        f"max({key}={shown}, L={horizon}) = {k}, but with max_num_batched_tokens="
        f"{max_num_batched_tokens} vLLM {vllm_version} gives a DFlash drafter at most {most} "
        f"draft slots per request; lower {which} to {most} or raise max_num_batched_tokens to "
        f"{k + 2}")


def drafting_slots(num_verify_slots: int, vllm_version: str) -> int:
    """Token-budget slots vLLM's scheduler keeps free next to every scheduled request for a
    DFlash drafter (``SpeculativeConfig.max_num_new_slots_for_drafting``,
    ``vllm/config/speculative.py``): ``K = num_speculative_tokens`` in vLLM 0.32, 0 from 0.33
    (the drafter runs its own query pass). A request is scheduled at most
    ``max_num_batched_tokens - drafting_slots`` tokens (``vllm/v1/core/sched/scheduler.py``)."""
    return num_verify_slots if _version_tuple(vllm_version) < (0, 33) else 0


def check_recurrent_kernels(ddtree: DDTreeConfig, use_replayssm: bool) -> None:
    """Refuse vLLM's ReplaySSM Mamba2 decode (``--use-replayssm``) with the tree oracle.

    ReplaySSM replaces the per-token state blocks and the decode kernels the oracle runs
    (``vllm/config/cache.py`` ``use_replayssm``): the tree's rows would reach a chain kernel.

    Raises:
        DDTreeConfigError: ``use_replayssm`` with ``ddtree_hybrid="oracle"``.
    """
    if use_replayssm and ddtree.hybrid == "oracle":
        raise DDTreeConfigError(
            "speculative method 'ddtree' cannot verify draft trees with --use-replayssm "
            "(use_replayssm replaces the recurrent kernels the tree oracle runs); drop it, or set "
            "speculative_config['ddtree_hybrid']='shadow_linear'")


def check_tree_fits_step(ddtree: DDTreeConfig, max_num_batched_tokens: int,
                         vllm_version: str) -> str | None:
    """Whether a whole draft tree fits in one scheduled step next to the drafter's slots.

    Returns:
        ``None``, or a warning (for the start-up log) when the trees will be cut to fewer
        nodes than the budget every step because a request cannot be scheduled ``K + 1`` rows.

    Raises:
        DDTreeConfigError: a request could never be scheduled a draft row, so DDTree would
            silently never verify a tree (the message names the budget key and
            ``max_num_batched_tokens``, and what to raise or lower).
    """
    k = ddtree.num_verify_slots
    reserved = drafting_slots(k, vllm_version)
    rows = max_num_batched_tokens - reserved  # the most one request is scheduled in a step
    key = "ddtree_max_budget" if ddtree.auto_budget else "ddtree_budget"
    why = (f"vLLM {vllm_version} keeps num_speculative_tokens = max({key}={ddtree.budget}, "
           f"L={ddtree.drafter_horizon}) = {k} token slots free per scheduled request for the "
           f"DFlash drafter, so one request gets at most max_num_batched_tokens="
           f"{max_num_batched_tokens} - {reserved} = {rows} rows")
    if rows < 2:
        raise DDTreeConfigError(
            f"speculative_config['{key}']={ddtree.budget} cannot run: {why}, too few for a "
            f"draft row, and no tree would ever be verified; raise max_num_batched_tokens to "
            f"at least {k + 1 + reserved} or lower {key} and L")
    if rows < k + 1:
        return (f"DDTree: {why}, fewer than the {k + 1} a whole tree needs: trees are cut to "
                f"{rows - 1} nodes; raise max_num_batched_tokens to {k + 1 + reserved} or "
                f"lower {key}")
    return None


def _auto_max_budget(max_budget: int | None, horizon: int, max_children: int | None,
                     vocab_size: int | None, max_num_batched_tokens: int | None,
                     vllm_version: str) -> int:
    """``B_max`` for ``ddtree_budget='auto'``: a given ``ddtree_max_budget`` is checked like a
    fixed budget (errors name it); the default, :data:`DEFAULT_MAX_BUDGET`, is lowered to what
    the vocabulary can fill and one step can hold next to the drafter's slots
    (:func:`drafting_slots`: ``2 B_max + 1`` rows in vLLM 0.32), since the user did not ask for
    that number."""
    if max_budget is not None:
        _check_fixed_budget("ddtree_max_budget", max_budget, horizon, max_children, vocab_size,
                            max_num_batched_tokens, vllm_version)
        return max_budget
    cap = DEFAULT_MAX_BUDGET
    if vocab_size is not None:
        cap = count_prefixes(vocab_size, horizon, max_children, cap)
    if max_num_batched_tokens is not None:
        both = drafting_slots(1, vllm_version)  # 1: the drafter's slots grow with K too
        cap = min(cap, (max_num_batched_tokens - 1) // (1 + both),
                  max_verify_slots(max_num_batched_tokens, vllm_version))
    if cap < 1:
        raise DDTreeConfigError(
            f"speculative_config['ddtree_budget']='auto' cannot run: max_num_batched_tokens="
            f"{max_num_batched_tokens} leaves no room for one tree node per request"
        )
    if max_num_batched_tokens is not None:  # L alone must fit, whatever B_max becomes
        check_slots_fit("ddtree_budget", cap, horizon, max_num_batched_tokens, vllm_version,
                        shown="'auto'")
    return cap


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())


def draft_concurrency_cap(ddtree: DDTreeConfig, max_num_batched_tokens: int, max_num_seqs: int,
                          vllm_version: str) -> int | None:
    """How many running requests vLLM admits for a DDTree engine, when that is fewer than
    ``max_num_seqs``.

    From vLLM 0.33 a DFlash engine admits at most ``max_num_batched_tokens // (K + 1)``
    running requests (``VllmConfig._set_max_num_scheduled_tokens`` in ``vllm/config/vllm.py``
    sets ``scheduler_config.max_num_active_seqs``; ``K + 1`` is ``num_lookahead_tokens``, the
    draft pass's query rows per request). DDTree hands vLLM ``K = max(B, L)``, so a large node
    budget lowers that cap. vLLM 0.32 has no such cap (it reserves ``K`` extra token-budget
    slots per scheduled request instead).

    Args:
        ddtree: the DDTree settings (``num_verify_slots`` is K).
        max_num_batched_tokens: the scheduler's token budget per step.
        max_num_seqs: the scheduler's request limit.
        vllm_version: the installed vLLM (``"0.33.0"``).

    Returns:
        the cap, or ``None`` if vLLM does not cap below ``max_num_seqs``.
    """
    if _version_tuple(vllm_version) < (0, 33):
        return None
    cap = max_num_batched_tokens // (ddtree.num_verify_slots + 1)
    return cap if cap < max_num_seqs else None


def draft_concurrency_warning(ddtree: DDTreeConfig, max_num_batched_tokens: int,
                              max_num_seqs: int, vllm_version: str) -> str | None:
    """The start-up warning for :func:`draft_concurrency_cap` (``None`` when there is no cap),
    naming ``ddtree_budget``, ``max_num_batched_tokens`` and the resulting cap."""
    cap = draft_concurrency_cap(ddtree, max_num_batched_tokens, max_num_seqs, vllm_version)
    if cap is None:
        return None
    k = ddtree.num_verify_slots
    key = "ddtree_max_budget" if ddtree.auto_budget else "ddtree_budget"
    return (
        f"DDTree: vLLM {vllm_version} runs at most {cap} requests at once here instead of "
        f"max_num_seqs={max_num_seqs}: max_num_batched_tokens={max_num_batched_tokens} // "
        f"(num_speculative_tokens + 1), where num_speculative_tokens = max({key}="
        f"{ddtree.budget}, L={ddtree.drafter_horizon}) = {k}; raise max_num_batched_tokens to "
        f"{max_num_seqs * (k + 1)} or lower {key} for more concurrency"
    )


def ddtree_config_from(additional_config: Any) -> DDTreeConfig | None:
    """The DDTree settings carried in ``VllmConfig.additional_config``, or ``None``."""
    if isinstance(additional_config, Mapping) and ADDITIONAL_CONFIG_KEY in additional_config:
        return DDTreeConfig.from_dict(additional_config[ADDITIONAL_CONFIG_KEY])
    return None


def get_ddtree_config(vllm_config: Any) -> DDTreeConfig | None:
    """The DDTree settings of a ``VllmConfig`` (``None`` when DDTree is off)."""
    return ddtree_config_from(getattr(vllm_config, "additional_config", None))
