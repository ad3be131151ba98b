"""Quickstart: evaluate fold(grpo, echo_env) on a small multi-turn batch.

Builds 4 trajectories of the shape ``[prompt][action][observation][action][padding]``, computes
the folded loss, its metrics, and the gradient norm of each term with respect to the logprobs.

    python examples/quickstart.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import losses


def multi_turn_batch(seed: int = 0, rows: int = 4, length: int = 24):
    """Random multi-turn rows: prompt 4 targets, then action/observation turns, then padding."""
    rng = np.random.default_rng(seed)
    action = np.zeros((rows, length))
    valid = np.zeros((rows, length))
    for i in range(rows):
        n = rng.integers(14, length + 1)  # real target count; the rest is padding
        valid[i, :n] = 1
        t = 4  # prompt targets 0..3
        while t < n:
            a = rng.integers(2, 5)
            action[i, t : min(t + a, n)] = 1  # the policy's turn
            t += a + rng.integers(2, 6)  # the environment's reply
    obs = np.asarray(losses.observation_mask(action, valid, prompt_lengths=np.full(rows, 5)))
    sampling = np.where(valid > 0, -rng.uniform(0.05, 3.0, (rows, length)), 0.0)
    logprobs = np.where(
        valid > 0, np.minimum(sampling + rng.normal(0, 0.15, sampling.shape), 0), 0.0
    )
    rewards = rng.integers(0, 2, rows).astype(np.float64)
    f32 = np.float32
    batch = losses.Batch(
        action_mask=action.astype(f32),
        obs_mask=obs.astype(f32),
        advantages=np.asarray(losses.group_advantages(rewards, group_size=2, estimator="dr_grpo")),
        sampling_logprobs=sampling.astype(f32),
        ref_logprobs=np.minimum(sampling + 0.1, 0.0).astype(f32),
    )
    losses.check_batch(batch, logprobs)
    return jnp.asarray(logprobs, jnp.float32), batch


def main() -> None:
    logprobs, batch = multi_turn_batch()
    policy = losses.grpo(clip_low=0.2, clip_high=0.28, kl_coef=0.01, reduction="token_mean")
    env = losses.echo_env(coef=0.05)
    loss_fn = losses.fold(policy, env)

    (value, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(logprobs, batch)
    print(f"batch: {batch}")
    print(
        f"action tokens: {int(batch.action_mask.sum())}, observation tokens: {int(batch.obs_mask.sum())}"
    )
    print(f"fold(grpo, echo_env) loss = {float(value):+.6f}")
    for key in sorted(metrics):
        print(f"  {key:<24} {float(metrics[key]):+.6f}")
    print("gradient norm with respect to logprobs:")
    for name, term in loss_fn.parts:
        g = jax.grad(lambda lp, t=term: t(lp, batch)[0])(logprobs)
        print(f"  {name:<10} {float(jnp.linalg.norm(g)):.6f}")
    print(f"  {'fold':<10} {float(jnp.linalg.norm(grad)):.6f}")


if __name__ == "__main__":
    main()
