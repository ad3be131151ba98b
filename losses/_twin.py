"""`builtin_twin`: which Fireworks/Tinker built-in kernel computes a term exactly."""

from __future__ import annotations

from typing import Any

from losses._batch import Twin


def builtin_twin(term: Any) -> tuple[str, dict[str, Any]] | None:
    """The built-in kernel that computes ``term`` exactly, as ``(loss_fn, loss_fn_config)``.

    A runner executes a policy term on the server by folding the term's reduction weights into
    per-token advantages, ``A'_{i,t} = A_{i,t}·w_{i,t}`` with ``w = losses.term_weights(batch,
    "action", reduction, max_tokens)`` (0 off the action mask), sending ``old_logprobs`` as the
    datum ``logprobs``, and calling ``forward_backward(datums, loss_fn, loss_fn_config)``. Every
    built-in sums over tokens (docs/training-api.md#builtin-kernels), so this is exact when the per-token
    loss is positively homogeneous in ``A`` — true of ``importance_sampling``, ``ppo``,
    ``cispo``, ``dapo``, ``gspo``, ``dppo`` and ``grpo`` without KL, for every reduction. The
    config's keys are the terms' own keyword names, so ``getattr(losses, name)(reduction=
    "token_sum", **config)`` rebuilds the kernel as a term (``reinforce`` with
    ``ratio_weight=True``). Each constructor decides its twin
    and attaches it to the term (`Term.twin`, a `losses.Twin`); this function only reads it.

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
    ``reinforce(ratio_weight)``  ``("reinforce", {})``                                undocumented
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
    * ``reinforce`` without ``ratio_weight=True`` or with a ``ratio_cap`` (the Fireworks
      ``reinforce`` kernel is undocumented; its cookbook client twin weights by the unclipped
      ratio, so only ``reinforce(ratio_weight=True)`` maps to ``("reinforce", {})``), ``gmpo``,
      ``sapo`` (no kernel), folds (flatten them and ask per part) and custom terms.

    For the *inferred* kernels (``dapo``, ``gspo``, ``dppo``) the formula comes from the
    cookbook's client twins; in particular the mask of the ``gspo`` kernel's sequence mean is not
    documented (we assume the datum's action tokens, i.e. the non-zero folded advantages).

    Args:
      term: a `Term` (anything else, e.g. a plain function, has no twin).

    Returns:
      ``(loss_fn, loss_fn_config)`` with a fresh, JSON-serializable dict, or ``None``.

    Example:
      >>> import losses
      >>> losses.builtin_twin(losses.grpo(clip_low=0.2, clip_high=0.28, reduction="token_mean"))
      ('ppo', {'clip_low_threshold': 0.8, 'clip_high_threshold': 1.28})
      >>> losses.builtin_twin(losses.grpo(kl_coef=0.01)) is None
      True
    """
    twin = getattr(term, "twin", None)
    if not isinstance(twin, Twin):
        return None
    return twin.kernel, dict(twin.config)
