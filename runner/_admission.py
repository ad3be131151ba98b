"""Bounded staleness by admission: which problem groups may start sampling now.

A concurrent RL run (``[rl].rollout = "concurrent"``) trains steps of ``B`` episodes (``P``
problems × ``G`` samples) in the order their groups were admitted. `AdmissionController` admits
a whole group (its ``G`` episodes) only when it fits both budgets:

* staleness: ``(version + O + 1) · B - (trained + reserved) ≥ G`` — at published policy
  ``version`` (optimizer steps done), at most ``O + 1`` steps' worth of episodes may be admitted
  ahead of the trainer, so a group admitted at ``version`` is trained by step ``version + O``
  at the latest and no token it samples is more than ``O`` versions older than the policy that
  trains on it (``O = 0``: on-policy, each step samples only after the previous one published);
* concurrency: ``in_flight + G ≤ C`` episodes sampling or waiting on their environment.

``reserved`` counts the episodes of admitted groups that are not trained yet (in flight or
finished and queued); a group that is dropped (failures, dynamic filtering) returns its
reservation, so another problem takes its place. The controller is plain bookkeeping (no clock,
no threads): the rollout service calls it from its event loop, the property test from a toy
simulation.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Ticket:
    """An admitted group: its admission order and the published version when it was admitted."""

    order: int
    version: int
    size: int


class AdmissionController:
    """Admission bookkeeping (module docstring).

    Args:
      batch_episodes: ``B``, episodes trained per optimizer step.
      group_size: ``G``, episodes per group (``B`` is a multiple of it).
      max_off_policy_steps: ``O`` ≥ 0.
      max_concurrent: ``C`` ≥ ``G``, episodes in flight at most.
    """

    def __init__(
        self,
        *,
        batch_episodes: int,
        group_size: int,
        max_off_policy_steps: int,
        max_concurrent: int,
    ):
        for name, value, low in (
            ("batch_episodes", batch_episodes, 1),
            ("group_size", group_size, 1),
            ("max_off_policy_steps", max_off_policy_steps, 0),
            ("max_concurrent", max_concurrent, group_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"AdmissionController: {name} must be an int >= {low}, got {value!r}"
                )
        if batch_episodes % group_size:
            raise ValueError(
                f"AdmissionController: batch_episodes ({batch_episodes}) must be a multiple of "
                f"group_size ({group_size})"
            )
        self.batch, self.group = batch_episodes, group_size
        self.max_off_policy, self.max_concurrent = max_off_policy_steps, max_concurrent
        self.version = 0  # published optimizer steps
        self.trained = 0  # episodes trained (or accounted as trained) so far
        self.reserved = 0  # admitted, not trained
        self.in_flight = 0  # admitted, not finished
        self._order = 0

    def start_at(self, version: int) -> None:
        """Resumes the bookkeeping after ``version`` trained steps (nothing in flight)."""
        if self.reserved or self.in_flight:
            raise RuntimeError("AdmissionController.start_at: groups are still admitted")
        self.version = version
        self.trained = version * self.batch

    def staleness_budget(self) -> int:
        return (self.version + self.max_off_policy + 1) * self.batch - (
            self.trained + self.reserved
        )

    def can_admit(self) -> bool:
        return (
            self.staleness_budget() >= self.group
            and self.in_flight + self.group <= self.max_concurrent
        )

    def admit(self) -> Ticket:
        if not self.can_admit():
            raise RuntimeError("AdmissionController.admit: no budget (call can_admit first)")
        self.reserved += self.group
        self.in_flight += self.group
        ticket = Ticket(self._order, self.version, self.group)
        self._order += 1
        return ticket

    def finish(self, ticket: Ticket, *, kept: bool) -> None:
        """A group's episodes are done: queued for training (``kept``) or dropped (its
        reservation returns)."""
        self.in_flight -= ticket.size
        if not kept:
            self.reserved -= ticket.size

    def train(self, episodes: int) -> None:
        """``episodes`` of queued groups were trained in the current step."""
        self.reserved -= episodes
        self.trained += episodes

    def publish(self) -> None:
        """The optimizer step is done and the sampler has the new weights."""
        self.version += 1
