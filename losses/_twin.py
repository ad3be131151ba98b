"""`builtin_twin`: which Fireworks/Tinker built-in kernel computes a term exactly."""

from __future__ import annotations

from typing import Any

#: The ``max_log_ratio`` the twins assume: the cookbook clients' ``ratio_log_cap`` default. The
#: ``ppo``/``importance_sampling`` kernels take no cap; a clamp at 20 binds only beyond e^±20.
_TWIN_MAX_LOG_RATIO = 20.0
_HOMOGENEOUS = ("importance_sampling", "ppo", "cispo", "dapo", "gspo", "dppo", "grpo")


def _thresholds(cfg) -> dict[str, float]:
    return {
        "clip_low_threshold": float(cfg["clip_low_threshold"]),
        "clip_high_threshold": float(cfg["clip_high_threshold"]),
    }


def builtin_twin(term: Any) -> tuple[str, dict[str, Any]] | None:
    """The built-in kernel that computes ``term`` exactly, as ``(loss_fn, loss_fn_config)``.

    A runner executes a policy term on the server by folding the term's reduction weights into
    per-token advantages, ``A'_{i,t} = A_{i,t}·w_{i,t}`` with ``w = losses.term_weights(batch,
    "action", reduction, max_tokens)`` (0 off the action mask), sending ``old_logprobs`` as the
    datum ``logprobs``, and calling ``forward_backward(datums, loss_fn, loss_fn_config)``. Every
    built-in sums over tokens (Fireworks SDK reference §4), so this is exact when the per-token
    loss is positively homogeneous in ``A`` — true of ``importance_sampling``, ``ppo``,
    ``cispo``, ``dapo``, ``gspo``, ``dppo`` and ``grpo`` without KL, for every reduction. The
    config's keys are the terms' own keyword names, so ``getattr(losses, name)(reduction=
    "token_sum", **config)`` rebuilds the kernel as a term. The function is pure and reads only
    ``term.kind`` and ``term.config``.

    ==========================  ===================================================  =========
    term                        twin                                                 formula
    ==========================  ===================================================  =========
    ``importance_sampling``     ``("importance_sampling", {})``                      documented
    ``ppo``                     ``("ppo", {clip_low_threshold, clip_high_threshold})``  documented
    ``cispo``                   ``("cispo", {clip_low_threshold, clip_high_threshold})`` documented
    ``dro`` (``token_sum``)     ``("dro", {beta})``                                  documented
    ``dapo`` without ``c``      ``("ppo", {thresholds})``                            documented
    ``dapo`` with ``c``         ``("dapo", {thresholds, eps_clip_c})``               inferred
    ``gspo``                    ``("gspo", {thresholds, seq_ratio_log_cap})``        inferred
    ``dppo``                    ``("dppo", {divergence, threshold})``                inferred
    ``grpo`` (ε_lo, ε_hi)       ``("ppo", {1-ε_lo, 1+ε_hi})``; with ``dual_clip=c``
                                ``("dapo", {1-ε_lo, 1+ε_hi, eps_clip_c: c})``
    ==========================  ===================================================  =========

    ``None`` (run the term as a client loss) when no kernel is exact:

    * a mismatch ``correction`` or a KL penalty (``kl_coef > 0``) is on (the cookbook's built-in
      path requires ``kl_beta = 0``);
    * ``max_log_ratio`` is not the default 20 (the kernels clamp at 20 or not at all);
    * ``dro`` with a reduction other than ``token_sum``: its quadratic term does not scale with
      ``A``, so folding is not exact. Even with ``token_sum`` the kernel applies the quadratic at
      every target position, so it matches only when every target of the datums is an action
      token (a runner must check that on the data);
    * ``reinforce`` (the Fireworks ``reinforce`` kernel is undocumented), ``gmpo``, ``sapo``
      (no kernel), folds (flatten them and ask per part) and custom terms.

    For the *inferred* kernels (``dapo``, ``gspo``, ``dppo``) the formula comes from the
    cookbook's client twins; in particular the mask of the ``gspo`` kernel's sequence mean is not
    documented (we assume the datum's action tokens, i.e. the non-zero folded advantages).

    Args:
      term: a `Term` (anything with ``kind`` and ``config``).

    Returns:
      ``(loss_fn, loss_fn_config)`` with a fresh, JSON-serializable dict, or ``None``.

    Example:
      >>> import losses
      >>> losses.builtin_twin(losses.grpo(clip_low=0.2, clip_high=0.28, reduction="token_mean"))
      ('ppo', {'clip_low_threshold': 0.8, 'clip_high_threshold': 1.28})
      >>> losses.builtin_twin(losses.grpo(kl_coef=0.01)) is None
      True
    """
    kind = getattr(term, "kind", None)
    cfg = getattr(term, "config", None)
    if not isinstance(kind, str) or cfg is None:
        return None
    if cfg.get("correction") is not None or float(cfg.get("kl_coef", 0.0) or 0.0) > 0.0:
        return None
    if kind in _HOMOGENEOUS and cfg.get("max_log_ratio") != _TWIN_MAX_LOG_RATIO:
        return None
    if kind == "importance_sampling":
        return "importance_sampling", {}
    if kind in ("ppo", "cispo"):
        return kind, _thresholds(cfg)
    if kind == "dro":
        if cfg.get("reduction") != "token_sum":
            return None
        return "dro", {"beta": float(cfg["beta"])}
    if kind == "dapo":
        if cfg.get("eps_clip_c") is None:
            return "ppo", _thresholds(cfg)
        return "dapo", {**_thresholds(cfg), "eps_clip_c": float(cfg["eps_clip_c"])}
    if kind == "gspo":
        return "gspo", {**_thresholds(cfg), "seq_ratio_log_cap": float(cfg["seq_ratio_log_cap"])}
    if kind == "dppo":
        return "dppo", {"divergence": str(cfg["divergence"]), "threshold": float(cfg["threshold"])}
    if kind == "grpo":
        thresholds = {
            "clip_low_threshold": 1.0 - float(cfg["clip_low"]),
            "clip_high_threshold": 1.0 + float(cfg["clip_high"]),
        }
        if cfg.get("dual_clip") is None:
            return "ppo", thresholds
        return "dapo", {**thresholds, "eps_clip_c": float(cfg["dual_clip"])}
    return None
