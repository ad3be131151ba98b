"""Client-side loss speed: ragged per-sequence logprobs in, per-sequence ``-grad`` weights out.

One evaluation of GRPO (clip 0.2/0.28, k3 KL β=0.05, token mean) + ECHO env CE (λ=0.05,
seq_mean_token_mean) and its gradient, at B ∈ {64, 256} sequences, T ∈ {1024, 4096} (sequence
lengths uniform in [T/2, T], the longest exactly T; a 128-token prompt, then alternating action
and observation turns). Inputs are what the runner holds: float32 trainer logprobs and float64
per-token ``action_mask``, ``obs_mask``, ``advantages``, ``sampling_logprobs``,
``ref_logprobs``; the output is one float ``-dL/dlogprobs`` array per sequence. Implementations:

  foldloss   ``runner.ClientLoss.value_and_weights`` (warm; the first call's compilation is
             reported separately): the float32 ``weights = -dL/dlogprobs`` per sequence that
             the linear cross-entropy pass sends
  torch cookbook
             the closure a Fireworks cookbook user runs through the SDK's custom-loss protocol
             (`torch_cookbook_fn`, our own code after the data flow of the cookbook's
             ``run_loss_loop`` and GRPO ``policy_fn``): logprob tensors built from
             ``TensorData.data`` lists (SDK step 4), per datum the mask from the datum's
             ``weights`` list, the reference / rollout / old-policy logprobs gathered from the
             closure's Python lists position by position, ``.item()`` metrics, one
             ``.backward()``, ``-grad`` as numpy (SDK step 6). This is the 50x target's baseline.
  torch tuned
             the fastest per-sequence torch loop we could write (`torch_tuned_fn`: numpy inputs
             shared zero-copy, no per-token Python); reported for scale
  numpy      vectorized NumPy over the concatenated tokens with the analytic gradient
  bound      the memory-bandwidth bound: a plain copy of the bytes the loss must read (the
             inputs above) and write (a float32 weight per token), as ``np.copyto`` and as a
             jitted XLA elementwise copy; the faster of the two is the bound

All compute the same loss; each is checked against foldloss (loss and gradient). Times are
medians of several repeats in which the implementations run back to back; each ratio is the
median of the per-repeat ratios (robust to load changes on a shared machine); each torch closure
alternates with foldloss call by call. The closures' captured lists (advantages, reference and
rollout logprobs, prompt lengths) are built before timing, as a cookbook run builds them at
rollout time. The torch closures run single-threaded by default (``--torch-threads``), their
fastest setting for small per-datum ops.

A second table times each round-2 loss family (preference, distillation, KL variants,
off-policy filters, newer objectives, the critic) against GRPO on one padded batch of the
largest configuration (`loss_families`; issue #16's target: each within 2x of GRPO).

Run: ``python benchmarks/loss_speed.py [--quick] [--out PATH] [--repeats N] [--no-families]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import loss_families  # noqa: E402
import synthetic  # noqa: E402

_common.setup()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import losses  # noqa: E402
from runner import ClientLoss, Seq  # noqa: E402

NAME = "loss_speed"
PROMPT = 128
CLIP_LOW, CLIP_HIGH, KL_COEF, ECHO_COEF, MAX_LOG_RATIO = 0.2, 0.28, 0.05, 0.05, 20.0
FIELDS = ("action_mask", "obs_mask", "advantages", "sampling_logprobs", "ref_logprobs")
#: Targets of the issue, checked at the largest configuration.
TARGET_TORCH_SPEEDUP = 50.0
TARGET_BOUND_RATIO = 4.0
TARGET_CONFIG = (256, 4096)


def make_term():
    return losses.fold(
        losses.grpo(
            clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH,
            kl_coef=KL_COEF,
            kl_estimator="k3",
            reduction="token_mean",
            max_log_ratio=MAX_LOG_RATIO,
        ),
        losses.echo_env(coef=ECHO_COEF, normalization="seq_mean_token_mean"),
    )


def make_batch(num: int, length: int, seed: int = 0) -> tuple[list[Seq], list[np.ndarray]]:
    """``num`` ragged sequences (targets uniform in [length/2, length], the first = length)."""
    # 0 prompt / wrapper, 1 action, 2 observation; targets 0..126 are prompt tokens 1..127
    return synthetic.multi_turn_seqs(
        np.random.default_rng(seed),
        num,
        lengths=(length // 2 + 1, length + 2),  # tokens = targets + 1
        first_length=length + 1,
        start=PROMPT - 1,
        action_turn=(16, 257),
        obs_turn=(8, 129),
        logprobs="exponential",
        sampling_noise=0.1,
        with_ref=True,
        ref_offset=0.05,
    )


# -- foldloss -------------------------------------------------------------------------------------


def foldloss_fn(client: ClientLoss):
    def run(lps, seqs):
        # The weights the linear cross-entropy pass sends: -dL/dlogprobs per sequence (float32).
        value, _, weights = client.value_and_weights(lps, seqs)
        return value, weights

    return run


def foldloss_split(client: ClientLoss, lps, seqs, calls: int) -> dict:
    """Where one warm `foldloss_fn` call's time goes (median ms over ``calls`` calls).

    ``pad``: filling the padded host buffers (`runner._padding.pad_fields`); ``jit``: the jitted
    loss + gradient + value check, from dispatch until its outputs are ready; ``rest``: the
    call's Python (length and field checks, the per-sequence weight views, the metrics). Times
    the adapter's internals by wrapping them for these calls only (restored afterwards).
    """
    import runner._client_loss as impl

    spent = {"pad": 0, "jit": 0}

    def timed(fn, key, block=False):
        def call(*args, **kwargs):
            t0 = time.perf_counter_ns()
            out = fn(*args, **kwargs)
            if block:
                jax.block_until_ready(out)
            spent[key] += time.perf_counter_ns() - t0
            return out

        return call

    pad, jits = impl.pad_fields, client._jits
    impl.pad_fields = timed(pad, "pad")
    client._jits = {k: tuple(timed(f, "jit", block=True) for f in v) for k, v in jits.items()}
    fl = foldloss_fn(client)
    parts: dict[str, list[float]] = {"pad": [], "jit": [], "rest": [], "total": []}
    try:
        fl(lps, seqs)
        for _ in range(calls):
            spent.update(pad=0, jit=0)
            t0 = time.perf_counter_ns()
            fl(lps, seqs)
            total = time.perf_counter_ns() - t0
            parts["pad"].append(spent["pad"] / 1e6)
            parts["jit"].append(spent["jit"] / 1e6)
            parts["rest"].append((total - spent["pad"] - spent["jit"]) / 1e6)
            parts["total"].append(total / 1e6)
    finally:
        impl.pad_fields, client._jits = pad, jits
    return {k: _common.median(v) for k, v in parts.items()}


# -- numpy ---------------------------------------------------------------------------------------


def numpy_loss(lps: list[np.ndarray], seqs: list[Seq]):
    """Vectorized value + analytic gradient over the concatenated tokens (float64)."""
    lengths = np.fromiter((s.num_targets for s in seqs), np.int64, len(seqs))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    lp = np.concatenate(lps).astype(np.float64)
    f = {k: np.concatenate([s.inputs[k] for s in seqs]) for k in FIELDS}
    act, obs = f["action_mask"] > 0, f["obs_mask"] > 0
    w = f["action_mask"] / max(float(f["action_mask"].sum()), 1.0)  # token_mean weights
    rows = np.count_nonzero(
        np.maximum.reduceat(np.maximum(f["action_mask"], f["obs_mask"]), starts)
    )
    obs_count = np.add.reduceat(f["obs_mask"], starts)
    w_env = (
        ECHO_COEF * f["obs_mask"] / (max(rows, 1) * np.repeat(np.maximum(obs_count, 1.0), lengths))
    )
    adv = np.where(act, f["advantages"], 0.0)
    d = np.where(act, lp - f["sampling_logprobs"], 0.0)
    lr = np.clip(d, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    r = np.exp(lr)
    unclipped, clipped = -adv * r, -adv * np.clip(r, 1 - CLIP_LOW, 1 + CLIP_HIGH)
    pg = np.maximum(unclipped, clipped)
    inside = (r >= 1 - CLIP_LOW) & (r <= 1 + CLIP_HIGH)
    d_pg = np.where(inside | (unclipped > clipped), -adv * r, 0.0) * (np.abs(d) < MAX_LOG_RATIO)
    dk = np.where(act, lp - f["ref_logprobs"], 0.0)
    delta = np.clip(dk, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3 = np.expm1(-delta) + delta
    d_k3 = -np.expm1(-delta) * (np.abs(dk) < MAX_LOG_RATIO)
    nll = -np.where(obs, lp, 0.0)
    value = float(np.sum(w * (pg + KL_COEF * k3)) + np.sum(w_env * nll))
    neg_grad = w_env - w * (d_pg + KL_COEF * d_k3)
    n_act = max(int(act.sum()), 1)
    metrics = {
        "clip_frac_low": float(np.sum(act & (adv < 0) & (r < 1 - CLIP_LOW)) / n_act),
        "clip_frac_high": float(np.sum(act & (adv > 0) & (r > 1 + CLIP_HIGH)) / n_act),
        "ratio_mean": float(np.sum(np.where(act, r, 0.0)) / n_act),
        "kl": float(np.sum(np.where(act, k3, 0.0)) / n_act),
        "nll": float(np.sum(nll) / max(int(obs.sum()), 1)),
    }
    return value, np.split(neg_grad, starts[1:]), metrics


# -- torch ---------------------------------------------------------------------------------------


def cookbook_inputs(lps: list[np.ndarray], seqs: list[Seq]) -> dict:
    """What the cookbook's closure holds (untimed setup; docs/training-api.md#the-cookbooks-custom-loss-closure).

    Rollout-time Python lists captured by the closure: one scalar advantage per sample, the
    target-aligned reference and rollout ("inf") logprobs, the old-policy logprobs (= rollout here:
    one optimizer step per batch), the prompt lengths; plus, per datum, the trainer's logprobs and
    the loss mask as numpy buffers (the SDK's ``TensorData``, whose ``.data`` is
    ``_numpy.flatten().tolist()``) and the observation mask for the ECHO term.
    """
    adv = []
    for s in seqs:
        active = s.inputs["action_mask"] > 0
        adv.append(float(s.inputs["advantages"][active][0]) if active.any() else 0.0)
    return dict(
        advantages=adv,
        ref_logprobs=[s.inputs["ref_logprobs"].tolist() for s in seqs],
        inf_logprobs=[s.inputs["sampling_logprobs"].tolist() for s in seqs],
        old_policy_logprobs=[s.inputs["sampling_logprobs"].tolist() for s in seqs],
        prompt_lens=[PROMPT] * len(seqs),
        weights=[s.inputs["action_mask"].astype(np.float32) for s in seqs],
        obs=[s.inputs["obs_mask"].tolist() for s in seqs],
        logprobs=[np.asarray(lp, np.float32) for lp in lps],
    )


def _torch(threads: int | None):
    try:
        import torch
    except ImportError:
        return None, None
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    return torch, previous


def torch_cookbook_fn(threads: int | None = 1):
    """The cookbook-style closure through the SDK's custom-loss protocol, or None (no torch).

    Written here after the data flow of the Fireworks cookbook's ``run_loss_loop`` and GRPO
    ``policy_fn`` (docs/training-api.md#custom-losses, §6.2-6.3), with the same loss as foldloss:

    * SDK step 4: per datum ``torch.tensor(TensorData.data)`` (a list) with ``requires_grad``;
    * per datum: the response slice from ``prompt_len - 1``; the mask from the datum's
      ``weights`` (``.data`` sliced, then a tensor); the reference and old-policy logprobs
      gathered from the closure's lists position by position, with a bounds check; the rollout
      logprobs checked for ``None`` at each position; the active positions; ``ppo_kl``/``ref_kl``
      and the active count with ``.item()``; the per-token GRPO loss (clip, k3 KL) and the ECHO
      NLL, each normalized as foldloss's term; ``.item()`` metrics;
    * ``backward``, then SDK step 6: ``weights = -grad`` per datum, as numpy.
    """
    torch, previous = _torch(threads)
    if torch is None:
        return None

    def run(inputs: dict):
        adv, prompt_lens = inputs["advantages"], inputs["prompt_lens"]
        ref_lists, inf_lists = inputs["ref_logprobs"], inputs["inf_logprobs"]
        old_lists = inputs["old_policy_logprobs"]
        logprobs = [torch.tensor(lp.tolist()).requires_grad_(True) for lp in inputs["logprobs"]]
        n_act = max(sum(float(w.sum()) for w in inputs["weights"]), 1.0)
        n_rows = max(
            sum(
                1
                for w, o in zip(inputs["weights"], inputs["obs"], strict=True)
                if w.any() or any(o)
            ),
            1,
        )
        total = torch.tensor(0.0, requires_grad=True)
        ppo_kl = ref_kl = mean_kl = clip_frac = ratio_sum = 0.0
        num_tokens = samples = 0
        for i, pi in enumerate(logprobs):
            start = max(0, prompt_lens[i] - 1)
            resp_pi = pi[start:]
            n = len(resp_pi)
            if n == 0:
                continue
            mask_vals = inputs["weights"][i].tolist()[start : start + n]
            mask_vals += [0.0] * (n - len(mask_vals))
            mask = torch.tensor(mask_vals, dtype=resp_pi.dtype)
            active = mask > 0.5
            active_count = int(active.sum().item())
            obs_vals = inputs["obs"][i][start : start + n]
            obs = torch.tensor(obs_vals, dtype=resp_pi.dtype)
            n_obs = float(obs.sum().item())
            if n_obs > 0:  # ECHO env CE folded into the closure (rLLM's Fireworks fold)
                nll = -(resp_pi * obs)
                total = total + ECHO_COEF / (n_rows * n_obs) * nll.sum()
            if active_count == 0:
                continue
            ref = ref_lists[i]
            resp_ref = torch.tensor(
                [ref[start + j] if start + j < len(ref) else 0.0 for j in range(n)],
                dtype=resp_pi.dtype,
            )
            inf_vals = []
            for j, v in enumerate(inf_lists[i][start : start + n]):
                if v is None:
                    if bool(active[j].item()):
                        raise ValueError(f"sample {i}: rollout logprob missing at position {j}")
                    v = 0.0
                inf_vals.append(float(v))
            resp_inf = torch.tensor(inf_vals, dtype=resp_pi.dtype)
            old = old_lists[i]
            resp_old = torch.tensor(
                [old[start + j] if start + j < len(old) else 0.0 for j in range(n)],
                dtype=resp_pi.dtype,
            )
            pi_det = resp_pi.detach()
            d = pi_det[active] - resp_old[active]
            ppo_kl += (torch.exp(d) - d - 1.0).mean().item()
            r_d = resp_ref[active] - pi_det[active]
            ref_kl += (torch.exp(r_d) - r_d - 1.0).mean().item()
            del resp_inf  # TIS off: the weight is 1 (old policy = rollout policy here)
            # GRPO policy_fn: PPO clip against the old policy, k3 KL to the reference.
            log_ratio = torch.clamp(resp_pi - resp_old, -MAX_LOG_RATIO, MAX_LOG_RATIO)
            ratio = torch.exp(log_ratio)
            a = torch.as_tensor(adv[i], dtype=resp_pi.dtype)
            pg = torch.maximum(-ratio * a, -torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
            delta = torch.clamp(resp_pi - resp_ref, -MAX_LOG_RATIO, MAX_LOG_RATIO)
            k3 = torch.expm1(-delta) + delta
            per_token = (pg + KL_COEF * k3) * mask / n_act
            total = total + per_token.sum()
            with torch.no_grad():
                rd = ratio.detach()
                clip_frac += (((rd < 1 - CLIP_LOW) | (rd > 1 + CLIP_HIGH)) & active).sum().item()
                ratio_sum += (rd * mask).sum().item()
            mean_kl += ((pi_det - resp_ref) * mask).sum().item()
            num_tokens += active_count
            samples += 1
        total.backward()
        weights = [(-pi.grad).numpy() for pi in logprobs]  # SDK step 6
        k = max(samples, 1)
        metrics = {
            "ppo_kl": ppo_kl / k,
            "ref_kl": ref_kl / k,
            "mean_kl": mean_kl / max(num_tokens, 1),
            "clip_frac": clip_frac / max(num_tokens, 1),
            "ratio_mean": ratio_sum / max(num_tokens, 1),
        }
        return float(total.item()), weights, metrics

    run.threads = torch.get_num_threads()
    run.version = torch.__version__
    run.restore = lambda: torch.set_num_threads(previous)
    return run


def torch_tuned_fn(threads: int | None = 1):
    """A tuned per-sequence torch loop (numpy inputs shared zero-copy), or None (no torch).

    The fastest per-datum torch loop we could write: no Python lists, no per-token Python, the
    batch normalizers captured in the closure, metrics with ``.item()`` per datum. Reported for
    scale; the 50x target is against the cookbook-style closure (`torch_cookbook_fn`).
    """
    torch, previous = _torch(threads)
    if torch is None:
        return None

    def run(lps: list[np.ndarray], seqs: list[Seq]):
        logprobs = [torch.tensor(lp).requires_grad_(True) for lp in lps]
        n_act = max(sum(float(s.inputs["action_mask"].sum()) for s in seqs), 1.0)
        n_rows = max(
            sum(1 for s in seqs if s.inputs["action_mask"].any() or s.inputs["obs_mask"].any()), 1
        )
        total = torch.zeros((), dtype=torch.float32)
        clip_low = clip_high = ratio_sum = kl_sum = active_tokens = 0.0
        for pi, s in zip(logprobs, seqs, strict=True):
            m = torch.as_tensor(s.inputs["action_mask"], dtype=torch.float32)
            o = torch.as_tensor(s.inputs["obs_mask"], dtype=torch.float32)
            adv = torch.as_tensor(s.inputs["advantages"], dtype=torch.float32)
            old = torch.as_tensor(s.inputs["sampling_logprobs"], dtype=torch.float32)
            ref = torch.as_tensor(s.inputs["ref_logprobs"], dtype=torch.float32)
            active = m > 0.5
            zero = torch.zeros_like(pi)
            pi_a = torch.where(active, pi, zero)
            log_ratio = torch.clamp(pi_a - torch.where(active, old, zero), -20.0, 20.0)
            ratio = torch.exp(log_ratio)
            pg = torch.maximum(-ratio * adv, -torch.clamp(ratio, 1 - CLIP_LOW, 1 + CLIP_HIGH) * adv)
            delta = torch.clamp(pi_a - torch.where(active, ref, zero), -20.0, 20.0)
            k3 = torch.expm1(-delta) + delta
            total = total + ((pg + KL_COEF * k3) * m).sum() / n_act
            n_obs = float(o.sum())
            if n_obs > 0:
                nll = -torch.where(o > 0.5, pi, zero)
                total = total + ECHO_COEF / (n_rows * n_obs) * (nll * o).sum()
            with torch.no_grad():
                a = active
                clip_low += ((ratio < 1 - CLIP_LOW) & (adv < 0) & a).sum().item()
                clip_high += ((ratio > 1 + CLIP_HIGH) & (adv > 0) & a).sum().item()
                ratio_sum += (ratio * m).sum().item()
                kl_sum += (k3 * m).sum().item()
                active_tokens += m.sum().item()
        total.backward()
        weights = [(-pi.grad).numpy() for pi in logprobs]
        n = max(active_tokens, 1.0)
        metrics = {
            "clip_frac_low": clip_low / n,
            "clip_frac_high": clip_high / n,
            "ratio_mean": ratio_sum / n,
            "kl": kl_sum / n,
        }
        return float(total.item()), weights, metrics

    run.threads = torch.get_num_threads()
    run.version = torch.__version__
    run.restore = lambda: torch.set_num_threads(previous)
    return run


# -- bandwidth bound ------------------------------------------------------------------------------


def bound_fns(nbytes: int):
    """``np.copyto`` and a jitted XLA copy (``x + 1`` over uint32) of ``nbytes`` bytes."""
    n32 = -(-nbytes // 4)
    src = np.random.default_rng(0).integers(0, 2**31, n32, dtype=np.uint32)
    dst = np.empty_like(src)
    xla_copy = jax.jit(lambda x: x + np.uint32(1))
    dev = jax.device_put(src)
    jax.block_until_ready(xla_copy(dev))

    def numpy_copy():
        np.copyto(dst, src)

    def xla():
        jax.block_until_ready(xla_copy(dev))

    return numpy_copy, xla


# -- driver ---------------------------------------------------------------------------------------


def _check(ref_value, ref_neg_grads, value, neg_grads) -> dict:
    scale = max(float(np.max(np.abs(g))) for g in ref_neg_grads)
    diff = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - b)))
        for a, b in zip(neg_grads, ref_neg_grads, strict=True)
    )
    rel = diff / max(scale, 1e-30)
    value_rel = abs(value - ref_value) / max(abs(ref_value), 1e-30)
    return dict(
        grad_rel_diff=rel, value_rel_diff=value_rel, agrees=rel <= 1e-4 and value_rel <= 1e-4
    )


def run_config(b: int, t: int, repeats: int, torch_repeats: int, torch_fns: dict) -> dict:
    seqs, lps = make_batch(b, t)
    real = sum(s.num_targets for s in seqs)
    in_bytes = sum(lp.nbytes for lp in lps) + sum(s.inputs[k].nbytes for s in seqs for k in FIELDS)
    out_bytes = real * 4  # a float32 weight per token (ClientLoss.value_and_weights' output)
    res: dict = dict(B=b, T=t, real_tokens=real, padded_tokens=b * t, bytes=in_bytes + out_bytes)

    client = ClientLoss(make_term())
    fl = foldloss_fn(client)
    t0 = time.perf_counter()
    ref_value, ref_neg = fl(lps, seqs)
    first = time.perf_counter() - t0
    numpy_copy, xla_copy = bound_fns(in_bytes + out_bytes)
    fns = {
        "foldloss": lambda: fl(lps, seqs),
        "numpy": lambda: numpy_loss(lps, seqs),
        "copy_numpy": numpy_copy,
        "copy_xla": xla_copy,
    }
    times: dict[str, list[float]] = {k: [] for k in fns}
    for k in fns:  # warm-up
        fns[k]()
    for _ in range(repeats):  # interleaved, so load changes hit every implementation alike
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: _common.median(v) for k, v in times.items()}
    res["compile_s"] = max(first - med["foldloss"], 0.0)
    res["compile_count"] = client.compile_count
    res["foldloss_ms"] = med["foldloss"] * 1e3
    res["foldloss_min_ms"] = min(times["foldloss"]) * 1e3
    res["numpy_ms"] = med["numpy"] * 1e3
    res["copy_numpy_ms"] = med["copy_numpy"] * 1e3
    res["copy_xla_ms"] = med["copy_xla"] * 1e3
    res["bound_ms"] = min(med["copy_numpy"], med["copy_xla"]) * 1e3
    res["bound_GBps"] = (in_bytes + out_bytes) / (res["bound_ms"] * 1e-3) / 1e9
    # Ratios: the median over repeats of the ratio within each repeat (the implementations run
    # back to back in every repeat, so a load change on the shared machine hits both sides).
    bound_i = [min(a, b) for a, b in zip(times["copy_numpy"], times["copy_xla"], strict=True)]
    res["numpy_over_foldloss"] = _common.median(
        [n / f for n, f in zip(times["numpy"], times["foldloss"], strict=True)]
    )
    per_repeat = [f / b for f, b in zip(times["foldloss"], bound_i, strict=True)]
    res["foldloss_over_bound"] = _common.median(per_repeat)
    res["foldloss_over_bound_best"] = min(per_repeat)
    res["foldloss_over_bound_of_medians"] = res["foldloss_ms"] / res["bound_ms"]
    res["split"] = foldloss_split(client, lps, seqs, calls=3 * repeats)
    nv, ng, _ = numpy_loss(lps, seqs)
    res["numpy_check"] = _check(ref_value, ref_neg, nv, ng)
    # The torch closures, each timed beside foldloss (alternating), so every ratio compares
    # times from the same moments on a shared machine.
    book = cookbook_inputs(lps, seqs)  # the closure's captured lists: rollout-time, untimed
    args = {"cookbook": (book,), "tuned": (lps, seqs)}
    for name in ("cookbook", "tuned"):
        fn = torch_fns.get(name)
        if fn is None:
            res[f"torch_{name}_ms"] = res[f"torch_{name}_over_foldloss"] = None
            res[f"torch_{name}_over_bound"] = None
            continue
        tv, tg, _ = fn(*args[name])  # also the warm-up
        res[f"torch_{name}_check"] = _check(ref_value, ref_neg, tv, tg)
        tt, ft = [], []
        for _ in range(torch_repeats):
            t0 = time.perf_counter()
            fn(*args[name])
            tt.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fl(lps, seqs)
            ft.append(time.perf_counter() - t0)
        res[f"torch_{name}_ms"] = _common.median(tt) * 1e3
        res[f"torch_{name}_over_foldloss"] = _common.median(
            [a / b for a, b in zip(tt, ft, strict=True)]
        )
        # The largest speedup any implementation could show against it: its time over the bound.
        res[f"torch_{name}_over_bound"] = res[f"torch_{name}_ms"] / res["bound_ms"]
    return res


def main(argv: list[str] | None = None) -> dict:
    p = _common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 9; quick 3)")
    p.add_argument("--torch-repeats", type=int, default=None, help="(default 3; quick 1)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch closures")
    p.add_argument("--no-families", action="store_true", help="skip the loss-family table")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch.set_num_threads for the torch closures (default 1, their fastest here; 0: "
        "torch's default)",
    )
    args = p.parse_args(argv)
    configs = (
        [(8, 256), (16, 512)] if args.quick else [(64, 1024), (64, 4096), (256, 1024), (256, 4096)]
    )
    repeats = args.repeats or (3 if args.quick else 9)
    torch_repeats = args.torch_repeats or (1 if args.quick else 3)
    threads = args.torch_threads or None
    torch_fns = (
        {}
        if args.no_torch
        else {"cookbook": torch_cookbook_fn(threads), "tuned": torch_tuned_fn(threads)}
    )
    first = next((f for f in torch_fns.values() if f is not None), None)
    torch_status = (
        "skipped (--no-torch)"
        if args.no_torch
        else ("skipped (torch not installed)" if first is None else f"torch {first.version}")
    )
    print(f"torch baseline: {torch_status}")
    results = []
    for b, t in configs:
        print(f"B={b} T={t} ...", flush=True)
        results.append(run_config(b, t, repeats, torch_repeats, torch_fns))
    for f in torch_fns.values():
        if f is not None:
            f.restore()  # leave torch as we found it (main() may run inside another program)
    families = []
    if not args.no_families:
        fb, ft = configs[-1]
        print(f"loss families at B={fb} T={ft} ...", flush=True)
        fseqs, flps = make_batch(fb, ft)
        families = loss_families.family_rows(*loss_families.padded(fseqs, flps, ft), repeats)

    rows = [
        [
            r["B"],
            r["T"],
            r["foldloss_ms"],
            r["compile_s"],
            r["torch_cookbook_ms"],
            r["torch_tuned_ms"],
            r["numpy_ms"],
            r["bound_ms"],
            r["torch_cookbook_over_foldloss"],
            r["torch_tuned_over_foldloss"],
            r["numpy_over_foldloss"],
            r["foldloss_over_bound"],
        ]
        for r in results
    ]
    md = _common.table(
        "Loss + gradient, ragged in → per-sequence -grad out (median ms; ratios)",
        [
            "B",
            "T",
            "foldloss ms",
            "compile s",
            "torch cookbook ms",
            "torch tuned ms",
            "numpy ms",
            "bound ms",
            "cookbook/foldloss",
            "tuned/foldloss",
            "numpy/foldloss",
            "foldloss/bound",
        ],
        rows,
    )
    md += "\n\n" + _common.table(
        "Where foldloss's time goes (median ms over back-to-back warm calls; pad = host padding, "
        "jit = jitted loss + gradient + value check until ready, rest = Python)",
        ["B", "T", "pad ms", "jit ms", "rest ms", "total ms", "bound ms"],
        [
            [
                r["B"],
                r["T"],
                r["split"]["pad"],
                r["split"]["jit"],
                r["split"]["rest"],
                r["split"]["total"],
                r["bound_ms"],
            ]
            for r in results
        ],
    )
    if families:
        fb, ft = configs[-1]
        md += "\n\n" + _common.table(
            f"Loss families vs GRPO, jitted value_and_grad on one padded [B={fb}, T={ft}] "
            f"float32 batch (median ms; ratio = median per-repeat time / GRPO's; target ≤ "
            f"{loss_families.TARGET_OVER_GRPO:g})",
            ["family", "term", "input", "ms", "GRPO ms", "compile s", "/ GRPO", "≤ target"],
            [
                [
                    r["family"],
                    r["term"],
                    r["input"],
                    r["ms"],
                    r["grpo_ms"],
                    r["compile_s"],
                    r["over_grpo"],
                    r["within_target"],
                ]
                for r in families
            ],
        )
    target = next((r for r in results if (r["B"], r["T"]) == TARGET_CONFIG), None)
    targets = {}
    if target is not None:
        tor = target["torch_cookbook_over_foldloss"]
        targets = dict(
            config=f"B={TARGET_CONFIG[0]}, T={TARGET_CONFIG[1]}",
            torch_speedup=tor,
            torch_speedup_target=TARGET_TORCH_SPEEDUP,
            torch_speedup_met=None if tor is None else tor >= TARGET_TORCH_SPEEDUP,
            torch_tuned_speedup=target["torch_tuned_over_foldloss"],
            torch_cookbook_over_bound=target["torch_cookbook_over_bound"],
            torch_tuned_over_bound=target["torch_tuned_over_bound"],
            bound_ratio=target["foldloss_over_bound"],
            bound_ratio_best=target["foldloss_over_bound_best"],
            bound_ratio_target=TARGET_BOUND_RATIO,
            bound_ratio_met=target["foldloss_over_bound"] <= TARGET_BOUND_RATIO,
        )
        print(
            f"\ntargets at {targets['config']}: cookbook torch/foldloss = {_common.fmt(tor)} "
            f"(≥ {TARGET_TORCH_SPEEDUP:g}: {_common.fmt(targets['torch_speedup_met'])}; tuned "
            f"torch/foldloss = {_common.fmt(targets['torch_tuned_speedup'])}); "
            f"foldloss/bound = {_common.fmt(targets['bound_ratio'])} "
            f"(≤ {TARGET_BOUND_RATIO:g}: {_common.fmt(targets['bound_ratio_met'])})"
        )
    checks_ok = all(
        r[k]["agrees"]
        for r in results
        for k in ("numpy_check", "torch_cookbook_check", "torch_tuned_check")
        if k in r
    )
    payload = dict(
        benchmark=NAME,
        command=_common.command(argv, NAME),
        machine=_common.machine(),
        config=dict(
            quick=args.quick,
            repeats=repeats,
            torch_repeats=torch_repeats,
            prompt_tokens=PROMPT,
            torch=torch_status,
            torch_threads=getattr(first, "threads", None),
            torch_threads_requested=args.torch_threads or "default",
            term="fold(grpo(clip 0.2/0.28, k3 KL 0.05, token_mean), echo_env(0.05, "
            "seq_mean_token_mean))",
        ),
        results=results,
        families=families,
        targets=targets,
        implementations_agree=checks_ok,
        markdown=md,
    )
    _common.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
