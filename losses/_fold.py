"""`fold`: sum loss terms so that one fused pass equals several accumulated ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from losses._batch import Batch, Term
from losses._per_datum import union


def _name_of(term: Callable[..., Any]) -> str:
    name = getattr(term, "name", None) or getattr(term, "__name__", None)
    if not isinstance(name, str) or not name or name == "<lambda>":
        raise ValueError(f"fold: cannot name term {term!r}; pass it as a (name, term) pair")
    return name


def fold(*terms: Any) -> Term:
    """Sums loss terms: ``L = Σ_k L_k``, metrics namespaced ``"<name>/<key>"``.

    Because differentiation is linear, ``∂L/∂logp = Σ_k ∂L_k/∂logp``: one fused client pass of a
    fold equals accumulating each term's gradient in its own pass, which is what lets a runner
    replace "builtin policy kernel + a second cross-entropy pass" by one pass.

    Args:
      *terms: term functions ``(logprobs, batch) -> (loss, metrics)`` or ``(name, term)`` pairs.
        A bare term is named by its ``.name`` (e.g. ``"grpo"``, ``"echo_env"``) or
        ``__name__``. Names must be unique and must not contain ``"/"``.

    Returns:
      A `Term` whose value is the sum of the terms' values; metrics are the union of each term's
      metrics as ``"<name>/<key>"`` plus the total as ``"loss"``. Terms marked ``is_zero`` (such as
      ``echo_env(coef=0)``) report metrics but are not added, so such a fold equals the other
      terms bit for bit. The fold's ``parts`` hold the
      ``(name, term)`` pairs.

    Example:
      >>> import losses
      >>> loss_fn = losses.fold(losses.grpo(), losses.echo_env(coef=0.05))
      >>> [name for name, _ in loss_fn.parts]
      ['grpo', 'echo_env']
    """
    if not terms:
        raise ValueError("fold: needs at least one term")
    parts: list[tuple[str, Any]] = []
    for i, item in enumerate(terms):
        if isinstance(item, tuple):
            if len(item) != 2 or not isinstance(item[0], str) or not callable(item[1]):
                raise ValueError(
                    f"fold: term {i} must be a term or a (name, term) pair, got {item!r}"
                )
            name, term = item
        elif callable(item):
            name, term = _name_of(item), item
        else:
            raise ValueError(f"fold: term {i} is not callable: {item!r}")
        if not name or "/" in name:
            raise ValueError(f"fold: term name {name!r} must be non-empty and contain no '/'")
        if name == "loss":
            raise ValueError("fold: 'loss' is reserved for the total; rename the term")
        if any(name == n for n, _ in parts):
            raise ValueError(f"fold: duplicate term name {name!r}; pass (name, term) pairs")
        parts.append((name, term))
    frozen = tuple(parts)
    taken = [(n, getattr(t, "argument", "logprobs")) for n, t in frozen]
    arguments = {a for _, a in taken}
    if len(arguments) > 1:
        listed = ", ".join(f"{n}: {a}" for n, a in taken)
        raise ValueError(
            f"fold: the terms take different first arguments ({listed}); fold only terms that "
            "read the same array"
        )

    def loss_fn(logprobs, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        total = None
        metrics = {}
        for name, term in frozen:
            value, term_metrics = term(logprobs, batch)
            value = jnp.asarray(value)
            if value.shape != ():
                raise ValueError(
                    f"fold: term {name!r} returned a loss of shape {value.shape}, not a scalar"
                )
            if not getattr(term, "is_zero", False):
                total = value if total is None else total + value
            for key, metric in term_metrics.items():
                metrics[f"{name}/{key}"] = metric
        if total is None:  # every term is identically zero
            total = jnp.zeros((), jnp.asarray(logprobs).dtype)
        metrics["loss"] = jax.lax.stop_gradient(total)
        return total, metrics

    declared = [getattr(t, "reads", None) for _, t in frozen]
    validators = [(n, v) for n, t in frozen if (v := getattr(t, "validate", None)) is not None]

    def validate(batch: Batch, logprobs: Any = None) -> None:
        for name, check in validators:
            try:
                check(batch, logprobs)
            except ValueError as exc:
                raise ValueError(f"fold term {name!r}: {exc}") from None

    forms = [getattr(t, "per_datum", None) for _, t in frozen]
    return Term(
        name="fold",
        fn=loss_fn,
        kind="fold",
        config={"terms": tuple(n for n, _ in frozen)},
        parts=frozen,
        is_zero=all(getattr(t, "is_zero", False) for _, t in frozen),
        # A fold reads what its parts read (undeclared if any part is undeclared); each part
        # checks its own required fields when called.
        reads=None if None in declared else frozenset().union(*filter(None, declared)),
        validate=validate if validators else None,
        argument=arguments.pop() if arguments else "logprobs",
        # A sum of per-datum losses is one: the fold decomposes when every part does.
        per_datum=None if any(f is None for f in forms) else union([f for f in forms if f]),
    )
