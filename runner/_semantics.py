"""Checks that a server's kernels are the token sums the runner sends them for, before it trains.

The fused client path (and SFT) sends ``weights = −dL/dlogp`` through the server's
``cross_entropy``: exact only if the server's loss is the plain weighted token sum over every
datum of the call. A server that normalises differently (SkyRL tx's ``cross_entropy`` divides
each sequence's loss by ``max(Σw, 1e-9)`` and averages over sequences) trains on another
gradient, silently. Two checks (no SDK import here; the backend runs the calls):

* **per call** (`check_reported_loss`): where the server reports ``loss:sum`` and logprobs, the
  reported loss must equal ``Σ −w·logp`` of the returned logprobs;
* **once per run and kernel, where the server reports no ``loss:sum``** (`probe_seqs`,
  `probe_verdict`): on a *scratch* training client of the same base model (the trained model is
  untouched), one call of the kernel on three prefixes of one token sequence, of three lengths,
  with signals ``(a, b)``, ``(−a, 0)``, ``(0, −b)`` on the same two target tokens (``weights``
  for ``cross_entropy``; per-token ``advantages`` at the current logprobs, on-policy, for the
  policy kernels whose on-policy gradient is ``−Σ A·∇logp``: ``PROBED``), then one Adam step
  with ``eps = 1`` (a tiny gradient makes a tiny step) and ``beta1 = 0`` (no momentum from the
  scratch client's earlier steps). On a conforming server the three datums' gradients cancel
  (a causal model's logprob of a target depends on its prefix only), so the step moves
  nothing: the logprobs change by rounding only. A server that normalises each
  sequence (by ``Σw``, ``Σ|w|`` or its token count, as SkyRL tx does for every kernel) leaves a
  gradient and the step moves the logprobs. A second step on the first datum alone must move
  them (the probe sees a step at all). A uniform scale of the whole call (e.g. ÷ the number of
  datums) is not detected: Adam's update does not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runner._types import AdamParams, Seq

#: Relative tolerance of the per-call check (float32 servers, summed over many tokens).
RTOL = 1e-3
#: A probe step that moves a logprob by more than this moved the model.
MOVED = 1e-4
#: The probe's token sequence (ids below 8: inside any vocabulary), the lengths of its three
#: prefixes, the two signal positions (targets) and the signals.
PROBE_TOKENS = (1, 2, 3, 4, 5, 6, 7, 1, 2)
PROBE_LENGTHS = (6, 9, 7)
PROBE_POSITIONS = (1, 3)
PROBE_SIGNALS = (0.75, 0.5)
PROBE_ADAM = AdamParams(
    learning_rate=1e-2, beta1=0.0, beta2=0.95, eps=1.0, weight_decay=0.0, grad_clip_norm=0.0
)
#: The kernels the probe can check, and the input that carries its signal.
PROBED = {
    "cross_entropy": "weights",
    "importance_sampling": "advantages",
    "ppo": "advantages",
    "cispo": "advantages",
}


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
            f"cross_entropy is not the token sum the runner needs: expected "
            f"loss:sum = Σ −w·logp = {want:.6g} (from the logprobs it returned), the server "
            f"computed {got:.6g}; refusing to train on a differently normalised gradient"
        )
    return True


def probe_seqs(kernel: str) -> tuple[list[Seq], list[Seq]]:
    """``(cancelling datums, the control datum)`` of ``kernel``'s probe, without the current
    ``logprobs`` that a policy kernel also needs (`with_logprobs`)."""
    name = PROBED[kernel]
    tokens = np.asarray(PROBE_TOKENS, np.int64)
    (i, j), (a, b) = PROBE_POSITIONS, PROBE_SIGNALS

    def seq(length: int, si: float, sj: float) -> Seq:
        signal = np.zeros(length - 1)
        signal[i], signal[j] = si, sj
        return Seq(tokens[:length], {name: signal})

    n1, n2, n3 = PROBE_LENGTHS
    return [seq(n1, a, b), seq(n2, -a, 0.0), seq(n3, 0.0, -b)], [seq(n1, a, b)]


def with_logprobs(seqs: Sequence[Seq], logprobs: Sequence[np.ndarray], kernel: str) -> list[Seq]:
    """The probe datums of a policy kernel with their current logprobs (ratio 1); unchanged for
    ``cross_entropy``."""
    if PROBED[kernel] == "weights":
        return list(seqs)
    return [
        s.with_inputs(**s.inputs, logprobs=np.asarray(lp, np.float64))
        for s, lp in zip(seqs, logprobs, strict=True)
    ]


def probe_verdict(
    kernel: str, before: np.ndarray, after_cancel: np.ndarray, after_control: np.ndarray
) -> None:
    """Raises `SemanticsError` unless the cancelling step moved nothing and the control did."""
    cancel = float(np.max(np.abs(np.asarray(after_cancel, np.float64) - before)))
    control = float(np.max(np.abs(np.asarray(after_control, np.float64) - after_cancel)))
    if cancel > MOVED:
        raise SemanticsError(
            f"{kernel} is not the token sum the runner needs: datums with {PROBED[kernel]} "
            f"(a, b), (−a, 0), (0, −b) must have gradients that cancel (expected no change of "
            f"the logprobs after a step), the server's step moved them by "
            f"{cancel:.3g} (it normalises each sequence, e.g. by max(Σw, 1e-9)); refusing to "
            "train on a differently normalised gradient"
        )
    if control <= MOVED:
        raise SemanticsError(
            f"cannot verify {kernel}: a training step on a scratch client moved "
            f"no logprob (by {control:.3g}); refusing to train on an unverified server"
        )
