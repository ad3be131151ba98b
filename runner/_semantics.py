"""Checks that a server's ``cross_entropy`` is ``Σ −w·logp`` before the runner trusts it.

The fused client path (and SFT) sends ``weights = −dL/dlogp`` through the server's
``cross_entropy``: exact only if the server's loss is the plain weighted token sum over every
datum of the call. A server that normalises differently (SkyRL tx's ``cross_entropy`` divides
each sequence's loss by ``max(Σw, 1e-9)`` and averages over sequences) trains on another
gradient, silently. Two checks (no SDK import here; the backend runs the calls):

* **per call** (`check_reported_loss`): where the server reports ``loss:sum`` and logprobs, the
  reported loss must equal ``Σ −w·logp`` of the returned logprobs;
* **once per run, where the server reports no ``loss:sum``** (`PROBE`): on a *scratch* training
  client of the same base model (the trained model is untouched), one ``cross_entropy`` call on
  three copies of one sequence with weights ``(a, b)``, ``(−a, 0)``, ``(0, −b)`` on two target
  tokens, then one Adam step with ``eps = 1`` (so a tiny gradient makes a tiny step). On a
  conforming server the three datums' gradients cancel (the step moves nothing: the logprobs
  change by rounding only); a server that normalises each sequence (by ``Σw``, ``Σ|w|`` or its
  token count) leaves a gradient and the step moves the logprobs. A second step on the first
  datum alone must move them (the probe can see a step at all). A uniform scale of the whole
  call (e.g. ÷ the number of datums) is not detected: Adam's update is scale-free.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runner._types import AdamParams, Seq

#: Relative tolerance of the per-call check (float32 servers, summed over many tokens).
RTOL = 1e-3
#: A probe step that moves a logprob by more than this moved the model.
MOVED = 1e-4
#: The probe's sequence (token ids below 8: inside any vocabulary) and its two weights.
PROBE_TOKENS = (1, 2, 3, 4, 5)
PROBE_WEIGHTS = (0.75, 0.5)
PROBE_ADAM = AdamParams(
    learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1.0, weight_decay=0.0, grad_clip_norm=0.0
)


class SemanticsError(ValueError):
    """A server's loss is not what the runner sends it for (one line: server, expected, got)."""


def client_cross_entropy(seqs: Sequence[Seq], logprobs: Sequence[np.ndarray]) -> float:
    """``Σ_d Σ_t −w_dt·logp_dt`` in float64."""
    return float(
        sum(
            -np.dot(np.asarray(s.inputs["weights"], np.float64), np.asarray(lp, np.float64))
            for s, lp in zip(seqs, logprobs, strict=True)
        )
    )


def check_reported_loss(seqs: Sequence[Seq], logprobs: Sequence[np.ndarray], metrics: dict) -> bool:
    """Raises `SemanticsError` if the reported ``loss:sum`` is not ``Σ −w·logp``.

    Returns:
      Whether the call could be checked (``loss:sum`` and one logprob array per datum).
    """
    if "loss:sum" not in metrics or len(logprobs) != len(seqs):
        return False
    got = float(metrics["loss:sum"])
    want = client_cross_entropy(seqs, logprobs)
    scale = sum(
        float(np.abs(np.asarray(s.inputs["weights"]) * np.asarray(lp, np.float64)).sum())
        for s, lp in zip(seqs, logprobs, strict=True)
    )
    if not abs(got - want) <= RTOL * scale + 1e-5:
        raise SemanticsError(
            f"cross_entropy is not the weighted token sum the runner needs: expected "
            f"loss:sum = Σ −w·logp = {want:.6g} (from the logprobs it returned), the server "
            f"computed {got:.6g}; refusing to train on a differently normalised gradient"
        )
    return True


def probe_seqs() -> tuple[list[Seq], list[Seq]]:
    """``(cancelling datums, one datum)`` of the probe (see the module docstring)."""
    tokens = np.asarray(PROBE_TOKENS, np.int64)
    n = len(tokens) - 1
    a, b = PROBE_WEIGHTS

    def seq(w1: float, w2: float) -> Seq:
        w = np.zeros(n)
        w[1], w[3] = w1, w2
        return Seq(tokens, {"weights": w})

    return [seq(a, b), seq(-a, 0.0), seq(0.0, -b)], [seq(a, b)]


def probe_verdict(before: np.ndarray, after_cancel: np.ndarray, after_control: np.ndarray) -> None:
    """Raises `SemanticsError` unless the cancelling step moved nothing and the control did."""
    cancel = float(np.max(np.abs(np.asarray(after_cancel, np.float64) - before)))
    control = float(np.max(np.abs(np.asarray(after_control, np.float64) - after_cancel)))
    if cancel > MOVED:
        raise SemanticsError(
            f"cross_entropy is not the weighted token sum the runner needs: datums "
            f"with weights (a, b), (−a, 0), (0, −b) must have gradients that cancel (expected "
            f"no change of the logprobs after a step), the server's step moved them by "
            f"{cancel:.3g} (it normalises each sequence, e.g. by max(Σw, 1e-9)); refusing to "
            "train on a differently normalised gradient"
        )
    if control <= MOVED:
        raise SemanticsError(
            f"cannot verify cross_entropy: a training step on a scratch client moved "
            f"no logprob (by {control:.3g}); refusing to train on an unverified server"
        )
