"""The one table of built-in server kernels: inputs, ``loss_fn_config`` keys, defaults, provenance.

Every backend declares the kernels it runs from this table (`supported`) and validates a
``loss_fn_config`` with the same function (`resolve_config`), so a config is accepted or rejected
identically everywhere (docs/conventions.md#the-runner-contract; docs/training-api.md#builtin-kernels). Each `KernelSpec` also
builds the `losses` term that computes the kernel exactly with ``reduction="token_sum"`` over a
batch whose ``action_mask`` is 1 on every real target (``q`` = the datum ``logprobs`` as
``sampling_logprobs``): the local trainer runs that term, and tests compare backends with it.

Notation: ``p`` trainer logprob, ``q`` the sent ``logprobs`` (anchor), ``A`` the ``advantages``,
``r = exp(clamp(p - q, ±cap))``, ``sg`` stop-gradient; every kernel sums over all targets of all
datums. *Provenance* says where a formula or key comes from: ``documented`` (Tinker docs / the
SDK's own client-side checks), ``inferred`` (the Fireworks cookbook's client twins), or
``undocumented`` (only the name is public).

=======================  ========================  ==============================================
kernel (formula)         inputs                    ``loss_fn_config`` keys (default)
=======================  ========================  ==============================================
``cross_entropy`` (doc)  ``weights``               —
``importance_sampling``  ``logprobs, advantages``  ``ratio_log_cap`` (20, > 0; inferred)
(doc)
``ppo`` (doc)            ``logprobs, advantages``  ``clip_low_threshold`` (0.8, [0, 1]),
                                                   ``clip_high_threshold`` (1.2, ≥ 1)
``cispo`` (doc)          ``logprobs, advantages``  thresholds (0.0, 4.0), ``ratio_log_cap`` (20)
``dro`` (doc)            ``logprobs, advantages``  ``beta`` (0.05, ≥ 0)
``dapo`` (inferred)      ``logprobs, advantages``  thresholds (0.8, 1.28), ``eps_clip_c`` (None =
                                                   off, > 1), ``ratio_log_cap`` (20)
``gspo`` (inferred)      ``logprobs, advantages``  thresholds (1 - 3e-4, 1 + 4e-4),
                                                   ``seq_ratio_log_cap`` (10, > 0)
``dppo`` (inferred)      ``logprobs, advantages``  ``divergence`` (binary_tv | binary_kl),
                                                   ``threshold`` (None = 0.15 TV / 0.05 KL),
                                                   ``ratio_log_cap`` (20)
``reinforce``            ``logprobs, advantages``  ``score_centering`` (False; undocumented)
(undocumented)
=======================  ========================  ==============================================

Every kernel also takes the generic key ``target_logprob_support`` ∈ {``full_vocabulary``
(default), ``sampling_support``, ``candidates``} (SDK §4.1; the SDK checks its value and the
trainer capability client-side). ``ppo`` and ``gspo`` take no ``ratio_log_cap`` (the reference's
built-in ``ppo`` has none; their terms clamp ``p - q`` at the fixed ±20, which binds only beyond
``e^±20``). Every term also accepts a datum input ``target_tokens`` equal to ``tokens[1:]``.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

import losses

if TYPE_CHECKING:
    from runner._types import Seq

PROVENANCES = ("documented", "inferred", "undocumented")
KINDS = ("number", "string", "bool")
#: The fixed clamp of ``p - q`` of the kernels without a ``ratio_log_cap`` key (``ppo``,
#: ``gspo``, ``reinforce``; the `losses` terms' default ``max_log_ratio``).
FIXED_LOG_RATIO_CAP = 20.0
#: Largest anchor logprob a kernel accepts (float32 log-softmax may round a hair above 0).
MAX_ANCHOR_LOGPROB = 1e-4


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One ``loss_fn_config`` key: its default, type, valid values and provenance.

    Attributes:
      default: the value when the key is absent. ``None`` means "off" or "the kernel's own
        default" and is then also accepted as an explicit value.
      kind: ``"number"`` (a finite real, not a bool), ``"string"`` (one of ``choices``) or
        ``"bool"``.
      doc: one line.
      provenance: ``"documented"``, ``"inferred"`` or ``"undocumented"``.
      low / high: the valid range of a number (``None`` = unbounded); ``low_open`` /
        ``high_open`` make a bound exclusive.
      choices: the allowed strings.
    """

    default: Any
    kind: str
    doc: str
    provenance: str = "documented"
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ConfigKey.kind must be one of {KINDS}, got {self.kind!r}")
        if self.provenance not in PROVENANCES:
            raise ValueError(f"ConfigKey.provenance must be one of {PROVENANCES}")
        if (self.kind == "string") != bool(self.choices):
            raise ValueError("ConfigKey: a string key needs choices (and only a string key)")

    @property
    def rule(self) -> str:
        """The valid values in words (used in error messages)."""
        if self.kind == "string":
            text = f"one of {self.choices}"
        elif self.kind == "bool":
            text = "a bool (True or False)"
        elif self.low is not None and self.high is not None:
            text = (
                f"a number in {'(' if self.low_open else '['}{self.low:g}, "
                f"{self.high:g}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"a number {'>' if self.low_open else '>='} {self.low:g}"
        elif self.high is not None:
            text = f"a number {'<' if self.high_open else '<='} {self.high:g}"
        else:
            text = "a finite number"
        return text + (" or None" if self.default is None else "")

    def check(self, kernel: str, key: str, value: Any) -> Any:
        """The validated value (numbers as finite Python floats); raises ``ValueError``."""
        where = f"{kernel}: loss_fn_config '{key}'"
        if value is None and self.default is None:
            return None
        if self.kind == "string":
            if not isinstance(value, str) or value not in self.choices:
                raise ValueError(f"{where} must be one of {self.choices}, got {value!r}")
            return str(value)
        if self.kind == "bool":
            if not isinstance(value, bool | np.bool_):
                raise ValueError(f"{where} must be a bool (True or False), got {value!r}")
            return bool(value)
        if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
            raise ValueError(f"{where} must be a number, got {value!r}")
        if isinstance(value, np.complexfloating):
            raise ValueError(f"{where} must be a real number, got {value!r}")
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"{where} must be finite, got {value!r}")
        too_low = self.low is not None and (v <= self.low if self.low_open else v < self.low)
        too_high = self.high is not None and (v >= self.high if self.high_open else v > self.high)
        if too_low or too_high:
            raise ValueError(f"{where} must be {self.rule}, got {value!r}")
        return v


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One built-in server kernel.

    Attributes:
      name: the SDK ``LossFnType`` name.
      inputs: the datum inputs besides ``target_tokens``.
      keys: ``loss_fn_config`` key name → `ConfigKey` (including the generic keys), read-only.
      formula: provenance of the formula (``"documented"``, ``"inferred"``, ``"undocumented"``).
      equation: the formula in one line.
      doc: one line on the kernel and its sources.
    """

    name: str
    inputs: tuple[str, ...]
    keys: Mapping[str, ConfigKey]
    formula: str
    equation: str
    doc: str
    build: Callable[[Mapping[str, Any]], losses.Term] = dataclasses.field(repr=False)
    #: Cross-key rules: full config -> full config (may fill a dependent default).
    rules: Callable[[dict[str, Any]], dict[str, Any]] | None = dataclasses.field(
        default=None, repr=False
    )

    def __post_init__(self) -> None:
        if self.formula not in PROVENANCES:
            raise ValueError(f"KernelSpec.formula must be one of {PROVENANCES}")
        object.__setattr__(self, "keys", types.MappingProxyType(dict(self.keys)))

    @property
    def defaults(self) -> dict[str, Any]:
        """Every key's default (a fresh dict)."""
        return {key: spec.default for key, spec in self.keys.items()}

    def term(self, config: Mapping[str, Any] | None = None) -> losses.Term:
        """The `losses` term computing this kernel exactly with ``reduction="token_sum"``.

        ``config`` is validated and completed with `resolve_config` first.

        Raises:
          ValueError: a bad config, or a config no `losses` term computes
            (``target_logprob_support`` other than ``full_vocabulary``; ``reinforce`` with
            ``score_centering=True``).
        """
        full = resolve_config(self.name, config)
        support = full["target_logprob_support"]
        if support != "full_vocabulary":
            raise ValueError(
                f"{self.name}: no losses term for target_logprob_support={support!r}: the terms "
                "take full-vocabulary logprobs"
            )
        return self.build(full)


# -- the table ----------------------------------------------------------------------------------

_RL_INPUTS = ("logprobs", "advantages")

_GENERIC = {
    "target_logprob_support": ConfigKey(
        "full_vocabulary",
        "string",
        "which logprobs the kernel reads: full-vocabulary softmax, the sampler's top-p support "
        "(needs supports_target_logprob_support) or candidates (SDK §4.1)",
        choices=("full_vocabulary", "sampling_support", "candidates"),
    ),
}


def _kernel(name, inputs, keys, formula, equation, doc, build, rules=None) -> KernelSpec:
    """A `KernelSpec` with the generic keys appended."""
    return KernelSpec(name, inputs, {**keys, **_GENERIC}, formula, equation, doc, build, rules)


def _ratio_log_cap(provenance: str = "inferred") -> ConfigKey:
    return ConfigKey(
        20.0,
        "number",
        "clamp of p - q before exp (the cookbook clients' ratio_log_cap)",
        provenance,
        low=0.0,
        low_open=True,
    )


def _thresholds(lo: float, hi: float, provenance: str, note: str = "") -> dict[str, ConfigKey]:
    return {
        "clip_low_threshold": ConfigKey(
            lo, "number", f"lower ratio bound lo{note}", provenance, low=0.0, high=1.0
        ),
        "clip_high_threshold": ConfigKey(
            hi, "number", f"upper ratio bound hi{note}", provenance, low=1.0
        ),
    }


#: ``dppo``'s per-divergence default threshold (0.15 TV / 0.05 KL: the Fireworks defaults, which
#: `losses.dppo` shares).
DPPO_DEFAULT_THRESHOLD = {
    d: losses.dppo(divergence=d).config["threshold"] for d in losses.DIVERGENCES
}


def _dppo_rules(cfg: dict[str, Any]) -> dict[str, Any]:
    div = cfg["divergence"]
    if cfg["threshold"] is None:
        cfg["threshold"] = DPPO_DEFAULT_THRESHOLD[div]
    if div == "binary_tv" and cfg["threshold"] > 1.0:
        raise ValueError(
            f"dppo: loss_fn_config 'threshold' must be <= 1 with divergence 'binary_tv' (a "
            f"total-variation distance), got {cfg['threshold']!r}"
        )
    return cfg


def _build_reinforce(cfg: Mapping[str, Any]) -> losses.Term:
    if cfg["score_centering"]:
        raise ValueError(
            "reinforce: no losses term for score_centering=True (the server's score centering "
            "is undocumented)"
        )
    return losses.reinforce(ratio_weight=True, reduction="token_sum")


_GSPO = losses.gspo().config
_TS = "token_sum"

_SPECS = (
    _kernel(
        "cross_entropy",
        ("weights",),
        {},
        "documented",
        "Σ -p·w",
        "weighted NLL, weights of any sign (Tinker docs; the SDK's custom-loss path relies on it)",
        lambda c: losses.weighted_cross_entropy(),
    ),
    _kernel(
        "importance_sampling",
        _RL_INPUTS,
        {"ratio_log_cap": _ratio_log_cap()},
        "documented",
        "-Σ r·A",
        "importance-sampled policy gradient (Tinker docs); the cookbook sent ratio_log_cap",
        lambda c: losses.importance_sampling(reduction=_TS, max_log_ratio=c["ratio_log_cap"]),
    ),
    _kernel(
        "ppo",
        _RL_INPUTS,
        _thresholds(0.8, 1.2, "documented", " (Tinker default)"),
        "documented",
        "-Σ min(r·A, clip(r, lo, hi)·A)",
        "PPO clipped surrogate with absolute thresholds (Tinker docs); no ratio_log_cap key",
        lambda c: losses.ppo(
            reduction=_TS,
            clip_low_threshold=c["clip_low_threshold"],
            clip_high_threshold=c["clip_high_threshold"],
            max_log_ratio=FIXED_LOG_RATIO_CAP,
        ),
    ),
    _kernel(
        "cispo",
        _RL_INPUTS,
        {
            **_thresholds(0.0, 4.0, "documented", " (Tinker tutorial default; FW's unknown)"),
            "ratio_log_cap": _ratio_log_cap(),
        },
        "documented",
        "-Σ sg(clip(r, lo, hi))·A·p",
        "clipped-IS-weight policy gradient (Tinker docs); the cookbook also sends ratio_log_cap",
        lambda c: losses.cispo(
            reduction=_TS,
            clip_low_threshold=c["clip_low_threshold"],
            clip_high_threshold=c["clip_high_threshold"],
            max_log_ratio=c["ratio_log_cap"],
        ),
    ),
    _kernel(
        "dro",
        _RL_INPUTS,
        {
            "beta": ConfigKey(
                0.05, "number", "weight of the quadratic penalty (Tinker docs example)", low=0.0
            )
        },
        "documented",
        "-Σ (p·A - ½β(p - q)²), the quadratic at every target",
        "direct reward optimization (Tinker docs); no ratio, so no ratio_log_cap",
        lambda c: losses.dro(reduction=_TS, beta=c["beta"]),
    ),
    _kernel(
        "dapo",
        _RL_INPUTS,
        {
            **_thresholds(0.8, 1.28, "inferred"),
            "eps_clip_c": ConfigKey(
                None,
                "number",
                "dual-clip constant c for A < 0 (None = off)",
                "inferred",
                low=1.0,
                low_open=True,
            ),
            "ratio_log_cap": _ratio_log_cap(),
        },
        "inferred",
        "PPO clip, and min(-c·A, ppo) for A < 0 when eps_clip_c is set",
        "Fireworks DAPO, inferred from the cookbook's client twin",
        lambda c: losses.dapo(
            reduction=_TS,
            clip_low_threshold=c["clip_low_threshold"],
            clip_high_threshold=c["clip_high_threshold"],
            eps_clip_c=c["eps_clip_c"],
            max_log_ratio=c["ratio_log_cap"],
        ),
    ),
    _kernel(
        "gspo",
        _RL_INPUTS,
        {
            **_thresholds(
                _GSPO["clip_low_threshold"],
                _GSPO["clip_high_threshold"],
                "inferred",
                " on the sequence ratio (losses.gspo default)",
            ),
            "seq_ratio_log_cap": ConfigKey(
                float(_GSPO["seq_ratio_log_cap"]),
                "number",
                "upper clamp of the log sequence ratio",
                "inferred",
                low=0.0,
                low_open=True,
            ),
        },
        "inferred",
        "sequence ratio s = exp(mean_t(p - q)) with PPO-style clipping, summed over tokens",
        "Fireworks GSPO (GSPO-token form), inferred from the cookbook; no ratio_log_cap key",
        lambda c: losses.gspo(
            reduction=_TS,
            clip_low_threshold=c["clip_low_threshold"],
            clip_high_threshold=c["clip_high_threshold"],
            seq_ratio_log_cap=c["seq_ratio_log_cap"],
            max_log_ratio=FIXED_LOG_RATIO_CAP,
        ),
    ),
    _kernel(
        "dppo",
        _RL_INPUTS,
        {
            "divergence": ConfigKey(
                "binary_tv",
                "string",
                "Bernoulli divergence of the trust-region mask",
                "inferred",
                choices=losses.DIVERGENCES,
            ),
            "threshold": ConfigKey(
                None,
                "number",
                "mask threshold δ (None = 0.15 for binary_tv, 0.05 for binary_kl; ≤ 1 for TV)",
                "inferred",
                low=0.0,
                low_open=True,
            ),
            "ratio_log_cap": _ratio_log_cap(),
        },
        "inferred",
        "-Σ r·A·sg(M), M drops improving tokens whose divergence exceeds the threshold",
        "Fireworks DPPO, inferred from the cookbook",
        lambda c: losses.dppo(
            reduction=_TS,
            divergence=c["divergence"],
            threshold=c["threshold"],
            max_log_ratio=c["ratio_log_cap"],
        ),
        rules=_dppo_rules,
    ),
    _kernel(
        "reinforce",
        _RL_INPUTS,
        {
            "score_centering": ConfigKey(
                False,
                "bool",
                "server-side score centering (True needs supports_score_centering; its meaning "
                "is not public)",
                "undocumented",
            ),
        },
        "undocumented",
        "-Σ sg(r)·A·p (gradient -Σ r·A), r = exp(clamp(p - q, ±20)) unclipped",
        "Fireworks REINFORCE (SDK 1.2.30 LossFnType, gated by supports_reinforce); the kernel is "
        "not public: inputs and formula are the cookbook client twin's",
        _build_reinforce,
    ),
)
#: Kernel name → `KernelSpec`, in table order (read-only).
KERNELS: Mapping[str, KernelSpec] = types.MappingProxyType({s.name: s for s in _SPECS})
#: Every kernel name, in table order: the built-in server kernels (Fireworks ``LossFnType``
#: names) a trainer may implement, exported as `runner.BUILTIN_LOSSES`. Each backend declares the
#: subset it runs as ``trainer.builtin_losses``.
KERNEL_NAMES: tuple[str, ...] = tuple(KERNELS)
#: Keys every kernel takes.
GENERIC_KEYS: tuple[str, ...] = tuple(_GENERIC)
#: The kernels whose formulas are documented (the upstream Tinker five).
DOCUMENTED_KERNELS: tuple[str, ...] = tuple(s.name for s in _SPECS if s.formula == "documented")


def supported(*names: str) -> tuple[str, ...]:
    """A backend's kernel subset, in table order; raises ``ValueError`` on a name not in it."""
    unknown = [n for n in names if not isinstance(n, str) or n not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; the kernel table has {KERNEL_NAMES}")
    wanted = set(names)
    return tuple(n for n in KERNEL_NAMES if n in wanted)


def spec(name: str) -> KernelSpec:
    """The `KernelSpec` of ``name``; raises ``ValueError`` naming the known kernels."""
    if not isinstance(name, str) or name not in KERNELS:
        raise ValueError(f"unknown loss {name!r}; expected one of {KERNEL_NAMES}")
    return KERNELS[name]


def resolve_config(name: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Validates a kernel's ``loss_fn_config``; returns the full config with defaults filled.

    Numbers become finite Python floats, strings come from their choices, bools stay bools; a
    key whose default is ``None`` also accepts ``None``. Cross-key rules apply (``dppo``: the
    per-divergence default threshold is filled in; a TV threshold is ≤ 1). Every backend
    validates with this function.

    Raises:
      ValueError: unknown kernel, unknown key (naming the allowed keys), or a value breaking its
        rule (naming the kernel, the key and the rule).
    """
    kernel = spec(name)
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ValueError(f"{name}: loss_fn_config must be a mapping, got {type(config).__name__}")
    unknown = sorted(str(k) for k in config if k not in kernel.keys)
    if unknown:
        raise ValueError(
            f"{name}: unknown loss_fn_config key {unknown[0]!r}; allowed keys: {tuple(kernel.keys)}"
        )
    full = kernel.defaults
    for key, value in config.items():
        full[key] = kernel.keys[key].check(name, key, value)
    if kernel.rules is not None:
        full = kernel.rules(full)
    return full


# -- kernel inputs ------------------------------------------------------------------------------


def check_kernel_inputs(
    seqs: Sequence[Seq], inputs: Sequence[str], kernel_name: str | None = None
) -> None:
    """Kernel-level checks after `runner.validate_seqs`, shared by every backend.

    Rules: only ``inputs`` (and ``target_tokens``) may be present; ``target_tokens`` must equal
    ``tokens[1:]``; anchor ``logprobs`` must be ``≤ 0`` (up to `MAX_ANCHOR_LOGPROB`).

    Raises:
      ValueError: naming the sequence, the field and the rule.
    """
    allowed = set(inputs) | {"target_tokens"}
    where = f"kernel '{kernel_name}'" if kernel_name else "this call"
    for i, seq in enumerate(seqs):
        extra = sorted(set(seq.inputs) - allowed)
        if extra:
            raise ValueError(
                f"sequence {i}: field '{extra[0]}' is not an input of {where} "
                f"(inputs: {sorted(allowed)})"
            )
        if "target_tokens" in seq.inputs:
            tt = np.asarray(seq.inputs["target_tokens"])
            if tt.shape != seq.tokens[1:].shape or not np.array_equal(tt, seq.tokens[1:]):
                raise ValueError(
                    f"sequence {i}: field 'target_tokens' must equal tokens[1:] (the targets are "
                    "the tokens shifted by one)"
                )
        if "logprobs" in inputs and "logprobs" in seq.inputs:
            q = np.asarray(seq.inputs["logprobs"])
            if (q > MAX_ANCHOR_LOGPROB).any():
                t = int(np.argmax(q > MAX_ANCHOR_LOGPROB))
                raise ValueError(
                    f"sequence {i}: field 'logprobs' has a positive logprob {float(q[t])} at "
                    f"target {t}"
                )
