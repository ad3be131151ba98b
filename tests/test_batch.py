"""Batch construction, pytree behaviour, and every ValueError path of check_batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses


def good(**overrides):
    fields = dict(
        action_mask=np.array([[0.0, 1, 1], [1, 0, 0]]),
        obs_mask=np.array([[1.0, 0, 0], [0, 1, 0]]),
        advantages=np.array([1.0, -1.0]),
        sampling_logprobs=np.array([[0.0, -1.0, -2.0], [-0.5, 0.0, np.nan]]),
        ref_logprobs=np.array([[0.0, -1.1, -2.1], [-0.4, 0.0, 0.0]]),
        weights=np.zeros((2, 3)),
    )
    fields.update(overrides)
    return losses.Batch(**fields)


def test_batch_defaults_and_pytree_round_trip():
    b = good()
    assert b.old_logprobs is b.sampling_logprobs
    assert b.shape == (2, 3)
    leaves, treedef = jax.tree.flatten(b)
    again = jax.tree.unflatten(treedef, leaves)
    assert isinstance(again, losses.Batch)
    np.testing.assert_array_equal(np.asarray(again.action_mask), np.asarray(b.action_mask))
    doubled = jax.tree.map(lambda x: x * 2, b)
    np.testing.assert_array_equal(np.asarray(doubled.advantages), [2.0, -2.0])
    assert "action_mask=float64[2, 3]" in repr(b)


def test_batch_masks_become_float_and_extra_fields_are_allowed():
    b = losses.Batch(action_mask=np.array([[True, False]]), extra={"prompt_lengths": [3]})
    assert jnp.issubdtype(b.action_mask.dtype, jnp.floating)
    assert b.extra_fields == ("prompt_lengths",)
    np.testing.assert_array_equal(b.get("prompt_lengths"), [3.0])
    np.testing.assert_array_equal(b.extra["prompt_lengths"], [3.0])
    assert b.get("missing") is None
    with pytest.raises(AttributeError, match="missing"):
        _ = b.missing
    with pytest.raises(AttributeError, match="action_mask"):
        b.action_mask = None


def test_replace_keeps_other_fields_and_does_not_reset_old():
    b = good()
    b2 = b.replace(sampling_logprobs=np.zeros((2, 3)))
    assert b2.old_logprobs is b.old_logprobs
    np.testing.assert_array_equal(np.asarray(b2.sampling_logprobs), 0.0)


def test_jit_accepts_batch():
    b = good()
    out = jax.jit(lambda bb: jnp.sum(bb.action_mask))(b)
    assert float(out) == 3.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(action_mask=None), "'action_mask' is required"),
        (dict(action_mask=np.ones(3)), r"'action_mask' must be rank 2 \[B, T\]"),
        (dict(obs_mask=np.ones((2, 4))), r"'obs_mask' has shape \(2, 4\), expected \(2, 3\)"),
        (dict(weights=np.ones((3, 3))), r"'weights' has shape \(3, 3\)"),
        (dict(advantages=np.ones(3)), r"'advantages' has shape \(3,\), expected \[B\]"),
        (dict(num_rows=np.ones(2)), "'num_rows' must be a 0-d array"),
        (dict(kl_baseline=np.ones(2)), "'kl_baseline' must be a 0-d array"),
        (dict(labels=np.ones((2, 3))), r"'labels' has shape \(2, 3\), expected \[B\]"),
        (
            dict(teacher_topk_logprobs=np.ones((2, 3))),
            r"'teacher_topk_logprobs' has shape \(2, 3\), expected \[B, T, K\]",
        ),
        (
            dict(extra={"lens": np.ones(5)}),
            "extra field 'lens' has leading dimension 5, expected B=2",
        ),
        (dict(extra={"_private": np.ones(2)}), "not starting with '_'"),
        (dict(extra={"obs_mask": np.ones((2, 3))}), "shadows the explicit field"),
        (dict(extra=np.ones(2)), "'extra' must be a mapping"),
        (dict(action_mask=np.array([["a"]], dtype=object)), "dtype object"),
    ],
)
def test_batch_constructor_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        good(**overrides)


def test_check_batch_accepts_a_good_batch():
    losses.check_batch(good(), logprobs=np.array([[-1.0, -1.0, -1.0], [-1.0, -2.0, np.inf]]))


@pytest.mark.parametrize(
    "overrides, logprobs, message",
    [
        (
            dict(action_mask=np.array([[0.0, 0.5, 1], [1, 0, 0]])),
            None,
            r"action_mask\[row 0, column 1\] = .*0\.5.*: masks must hold only 0 or 1",
        ),
        (
            dict(obs_mask=np.array([[1.0, 0, 0], [0, 2, 0]])),
            None,
            r"obs_mask\[row 1, column 1\] = 2: masks must hold only 0 or 1",
        ),
        (
            dict(obs_mask=np.array([[0.0, 1, 0], [0, 0, 0]])),
            None,
            r"action_mask and obs_mask overlap at row 0, column 1",
        ),
        (
            {},
            np.array([[-1.0, -1.0, np.nan], [-1.0, -1.0, -1.0]]),
            r"logprobs\[row 0, column 2\] = .*nan on an unmasked token: logprobs must be finite",
        ),
        (
            {},
            np.array([[-1.0, -1.0, -1.0], [-1.0, 0.5, -1.0]]),
            r"logprobs\[row 1, column 1\] = .*0\.5 > 0 on an unmasked token",
        ),
        ({}, np.zeros((2, 4)), r"logprobs has shape \(2, 4\), expected \(2, 3\)"),
        (
            dict(sampling_logprobs=np.array([[0.0, -np.inf, -1], [0, 0, 0]])),
            None,
            r"sampling_logprobs\[row 0, column 1\] = .*inf on an unmasked token",
        ),
        (
            dict(ref_logprobs=np.array([[0.0, -1, 3.0], [0, 0, 0]])),
            None,
            r"ref_logprobs\[row 0, column 2\] = 3 > 0",
        ),
        (
            dict(advantages=np.array([1.0, np.nan])),
            None,
            r"advantages\[row 1\] = .*nan: advantages must be finite",
        ),
        (
            dict(advantages=np.array([[0.0, 1, np.inf], [1, 0, 0]])),
            None,
            r"advantages\[row 0, column 2\] = .*inf: advantages must be finite",
        ),
        (
            dict(weights=np.array([[0.0, 0, 0], [0, np.nan, 0]])),
            None,
            r"weights\[row 1, column 1\] = .*nan: weights must be finite",
        ),
        (
            dict(num_rows=np.array(-1.0)),
            None,
            r"num_rows = -1\.0: normalizers must be finite and >= 0",
        ),
        (
            dict(teacher_logprobs=np.array([[0.0, -1, 0.5], [0, 0, 0]])),
            None,
            r"teacher_logprobs\[row 0, column 2\] = 0\.5 > 0",
        ),
        (
            dict(teacher_topk_logprobs=np.stack([np.zeros((2, 3)), np.full((2, 3), 0.5)], 2)),
            None,
            r"teacher_topk_logprobs\[row 0, column 1\] = 0\.5 > 0",
        ),
        (
            dict(returns=np.array([[0.0, 1, 2], [np.nan, 0, 0]])),
            None,
            r"returns\[row 1, column 0\] = nan on an action token: values must be finite",
        ),
        (
            dict(labels=np.array([1.0, 0.5])),
            None,
            r"labels\[row 1\] = 0\.5: labels must be 0 or 1",
        ),
        (
            dict(is_weight_mean=np.array(0.0)),
            None,
            r"is_weight_mean = 0\.0: must be finite and > 0",
        ),
        (dict(kl_baseline=np.array(np.inf)), None, r"kl_baseline = inf: must be finite"),
    ],
)
def test_check_batch_errors_name_field_row_and_rule(overrides, logprobs, message):
    with pytest.raises(ValueError, match=message):
        losses.check_batch(good(**overrides), logprobs=logprobs)


def test_check_batch_runs_the_terms_own_rules_and_a_fold_names_the_part():
    def validate(batch, logprobs):
        if batch.shape[0] % 2:
            raise ValueError("odd row count")

    own = losses.Term(name="pairs", fn=lambda lp, b: (lp.sum(), {}), validate=validate)
    odd = losses.Batch(action_mask=np.ones((3, 2)))
    losses.check_batch(odd)  # the generic rules alone pass
    with pytest.raises(ValueError, match="odd row count"):
        losses.check_batch(odd, term=own)
    with pytest.raises(ValueError, match="fold term 'pairs': odd row count"):
        losses.check_batch(odd, term=losses.fold(losses.sft_cross_entropy(), own))
    losses.check_batch(losses.Batch(action_mask=np.ones((2, 2))), term=own)
    assert losses.fold(losses.sft_cross_entropy()).validate is None


def test_check_batch_ignores_masked_garbage():
    b = good(advantages=np.array([[np.nan, 1, 1], [1, np.nan, np.nan]]))
    losses.check_batch(b, logprobs=np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, 5.0]]))


# -- strict fields -------------------------------------------------------------------------------


def test_misspelt_field_fails_with_the_closest_known_name():
    m, o = np.array([[1.0, 0, 0]]), np.array([[0.0, 1, 1]])
    with pytest.raises(losses.UnknownFieldError) as info:
        losses.Batch(action_mask=m, obs_masks=o)
    msg = str(info.value)
    assert msg.startswith("Batch: unknown field 'obs_masks'; did you mean 'obs_mask'?")
    for name in losses.FIELDS:
        assert name in msg
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)
    # The correct spelling gives the ECHO loss the issue measured (3.0, not a silent 0.0).
    ok = losses.Batch(action_mask=m, obs_mask=o)
    assert float(losses.echo_env(coef=1.0)(np.array([[-1.0, -2, -1]]), ok)[0]) == 1.5
    with pytest.raises(losses.UnknownFieldError, match="did you mean 'advantages'"):
        ok.replace(advantage=np.ones(1))
    with pytest.raises(losses.UnknownFieldError, match="unknown field 'zzz' \\(known"):
        losses.Batch(action_mask=m, zzz=o)


def test_extra_fields_are_pytree_leaves_and_split_by_rows():
    b = good(extra={"row_id": np.arange(2.0), "scale": np.array(3.0)})
    leaves, treedef = jax.tree.flatten(b)
    again = jax.tree.unflatten(treedef, leaves)
    np.testing.assert_array_equal(again.extra["row_id"], [0.0, 1.0])
    first, second = losses.split_batch(b, 2)
    np.testing.assert_array_equal(first.extra["row_id"], [0.0])
    np.testing.assert_array_equal(second.extra["row_id"], [1.0])
    assert float(second.extra["scale"]) == 3.0
    doubled = jax.jit(lambda x: jax.tree.map(lambda v: v * 2, x))(b)
    np.testing.assert_array_equal(doubled.extra["row_id"], [0.0, 2.0])


def test_a_term_missing_a_field_it_needs_names_the_term_and_the_field():
    b = losses.Batch(action_mask=np.ones((1, 2)), advantages=np.ones(1))
    with pytest.raises(ValueError, match="ppo needs batch field 'old_logprobs', which is None"):
        losses.ppo()(np.zeros((1, 2)), b)
    with pytest.raises(ValueError, match="weighted_cross_entropy needs batch field 'weights'"):
        losses.weighted_cross_entropy()(np.zeros((1, 2)), b)
    kl = losses.grpo(kl_coef=0.1)
    assert "ref_logprobs" in kl.requires and "ref_logprobs" not in losses.grpo().requires
    with pytest.raises(ValueError, match="grpo needs batch field 'ref_logprobs'"):
        kl(np.zeros((1, 2)), b.replace(sampling_logprobs=np.zeros((1, 2))))
    with pytest.raises(ValueError, match="batch must be a losses.Batch"):
        losses.sft_cross_entropy()(np.zeros((1, 2)), {"action_mask": np.ones((1, 2))})


# -- every public term declares the fields it reads ------------------------------------------------

_TIS = losses.mismatch_correction(kind="tis", level="token", cap=1.5)
DECLARED = [
    ("grpo", lambda: losses.grpo()),
    ("grpo-seq-kl", lambda: losses.grpo(kl_coef=0.1, reduction="seq_mean_token_mean")),
    ("grpo-tis", lambda: losses.grpo(correction=_TIS, reduction="token_sum")),
    ("ppo", lambda: losses.ppo(reduction="seq_mean_token_sum")),
    ("dapo", lambda: losses.dapo(eps_clip_c=3.0)),
    ("cispo", lambda: losses.cispo()),
    ("dro", lambda: losses.dro(reduction="token_sum")),
    ("dppo", lambda: losses.dppo(divergence="binary_kl")),
    ("importance_sampling", lambda: losses.importance_sampling()),
    ("reinforce", lambda: losses.reinforce(kl_coef=0.1, kl_estimator="k2")),
    ("sapo", lambda: losses.sapo()),
    ("gspo", lambda: losses.gspo()),
    ("gmpo", lambda: losses.gmpo(reduction="seq_mean_token_sum_norm", max_tokens=4.0)),
    ("echo_env", lambda: losses.echo_env(coef=0.5)),
    ("echo_env-token_mean", lambda: losses.echo_env(coef=0.5, normalization="token_mean")),
    ("echo_env-token_sum", lambda: losses.echo_env(coef=0.5, normalization="token_sum")),
    ("sft", lambda: losses.sft_cross_entropy()),
    ("sft-seq", lambda: losses.sft_cross_entropy(reduction="seq_mean_token_mean")),
    ("wce", lambda: losses.weighted_cross_entropy()),
    ("fold", lambda: losses.fold(losses.grpo(), losses.echo_env(coef=0.3))),
]


def _full_batch(rng, b=4, t=6):
    kind = rng.integers(0, 3, (b, t))
    kind[:, 0] = 1  # every row has an action
    kind[0, 1] = 2
    kind[2] = np.where(kind[2] == 2, 0, kind[2])  # row 2: no observation
    action = (kind == 1).astype(np.float64)
    lp = -rng.uniform(0.05, 3.0, (b, t))
    return lp, dict(
        action_mask=action,
        obs_mask=(kind == 2).astype(np.float64),
        advantages=rng.normal(size=b),
        sampling_logprobs=lp + rng.normal(0, 0.3, (b, t)) - 0.3,
        old_logprobs=lp + rng.normal(0, 0.3, (b, t)) - 0.3,
        ref_logprobs=lp - rng.uniform(0, 0.5, (b, t)),
        weights=rng.normal(size=(b, t)),
        teacher_logprobs=lp - rng.uniform(0, 0.5, (b, t)),
        old_values=rng.normal(size=(b, t)),
        returns=rng.normal(size=(b, t)),
        labels=(np.arange(b) % 2).astype(np.float64),
        teacher_topk_logprobs=-rng.uniform(0.05, 3.0, (b, t, 3)),
        num_rows=np.array(7.0),
        num_action_tokens=np.array(11.0),
        num_obs_tokens=np.array(5.0),
        kl_baseline=np.array(0.25),
        is_weight_mean=np.array(1.2),
    )


def _perturb(name, value, rng):
    if name.endswith("_mask"):
        return 1.0 - value if name == "obs_mask" else value  # masks: see the caller
    if name.startswith("num_") or name in ("kl_baseline", "is_weight_mean"):
        return value + 3.0
    if name == "labels":
        return 1.0 - value
    return value + rng.uniform(0.1, 0.5, np.shape(value)) * np.sign(
        rng.normal(size=np.shape(value))
    )


def _outputs(term, lp, fields):
    (value, metrics), grad = jax.value_and_grad(term, has_aux=True)(lp, losses.Batch(**fields))
    return np.asarray(value), {k: np.asarray(v) for k, v in metrics.items()}, np.asarray(grad)


def _same(a, b):
    return (
        np.array_equal(a[0], b[0], equal_nan=True)
        and a[1].keys() == b[1].keys()
        and all(np.array_equal(a[1][k], b[1][k], equal_nan=True) for k in a[1])
        and np.array_equal(a[2], b[2], equal_nan=True)
    )


def _variants(rng):
    """Two batches: normalizers carried; and none carried, with a row of observations only
    (so that ``obs_mask`` decides ``N``)."""
    lp, fields = _full_batch(rng)
    counted = dict(fields, num_rows=None, num_action_tokens=None, num_obs_tokens=None)
    counted["obs_mask"] = fields["obs_mask"].copy()
    counted["obs_mask"][-1] = np.maximum(fields["action_mask"][-1], fields["obs_mask"][-1])
    counted["action_mask"] = fields["action_mask"].copy()
    counted["action_mask"][-1] = 0.0
    return lp, [fields, counted]


def _changed(field, fields, rng):
    changed = dict(fields)
    if field == "action_mask":
        # Row 2 (which has no observation) loses its actions: it drops out of N.
        changed[field] = fields["action_mask"].copy()
        changed[field][2] = 0.0
    elif field == "obs_mask":
        flipped = np.where(fields["action_mask"] > 0, 0.0, 1.0 - fields["obs_mask"])
        flipped[-1] = 0.0  # the observation-only row becomes empty: N changes
        changed[field] = flipped
    elif fields[field] is None:
        changed[field] = np.array(2.0)
    else:
        changed[field] = _perturb(field, fields[field], rng)
    return changed


@pytest.mark.parametrize("name, make", DECLARED, ids=[n for n, _ in DECLARED])
def test_declared_fields_are_exactly_what_the_term_reads(name, make):
    """A field outside ``reads`` never changes value, metrics or gradient (it may even be
    garbage); changing a field inside ``reads`` changes something; each of ``requires`` is
    needed (None raises naming it)."""
    term = make()
    assert term.reads is not None and term.reads <= set(losses.FIELDS), term.reads
    assert set(term.requires) <= set(term.reads)
    rng = np.random.default_rng(0)
    lp, variants = _variants(rng)
    bases = [_outputs(term, lp, f) for f in variants]
    for field in losses.FIELDS:
        outs = [_outputs(term, lp, _changed(field, f, rng)) for f in variants]
        same = [_same(o, b) for o, b in zip(outs, bases, strict=True)]
        if field in term.reads:
            assert not all(same), f"{name}: changing '{field}' changed nothing"
            continue
        assert all(same), f"{name}: reads '{field}' but does not declare it"
        for f, base in zip(variants, bases, strict=True):
            if f[field] is not None:
                garbage = dict(f, **{field: np.full_like(np.asarray(f[field]), np.nan)})
                assert _same(_outputs(term, lp, garbage), base), f"{name}: '{field}' (nan)"
    fields = variants[0]
    for field in term.requires - {"action_mask"}:  # (a Batch always has an action_mask)
        missing = dict(fields, **{field: None})
        if field == "old_logprobs":
            missing["sampling_logprobs"] = None
        with pytest.raises(ValueError, match=f"needs batch field '{field}'"):
            term(lp, losses.Batch(**missing))


# -- one set of value rules: the host check and its in-graph count agree -------------------------


def _bad_batches():
    base = dict(
        action_mask=np.array([[0.0, 1, 1], [1, 0, 0]]),
        obs_mask=np.array([[1.0, 0, 0], [0, 1, 0]]),
        advantages=np.array([1.0, -1.0]),
        sampling_logprobs=np.array([[0.0, -1.0, -2.0], [-0.5, 0.0, np.nan]]),
        weights=np.zeros((2, 3)),
    )
    yield "good", base, None
    yield "half mask", dict(base, action_mask=np.array([[0.0, 0.5, 1], [1, 0, 0]])), None
    yield "mask of 2", dict(base, obs_mask=np.array([[2.0, 0, 0], [0, 1, 0]])), None
    yield "overlap", dict(base, obs_mask=np.array([[0.0, 1, 0], [0, 0, 0]])), None
    yield (
        "positive anchor",
        dict(base, sampling_logprobs=np.array([[0.0, 0.3, -2], [0, 0, 0]])),
        None,
    )
    yield "inf advantage", dict(base, advantages=np.array([np.inf, 1.0])), None
    yield "nan weight", dict(base, weights=np.array([[0.0, np.nan, 0], [0, 0, 0]])), None
    yield "inf return", dict(base, returns=np.array([[0.0, np.inf, 0], [0, 0, 0]])), None
    yield "label 2", dict(base, labels=np.array([2.0, 0])), None
    yield (
        "positive top-K",
        dict(base, teacher_topk_logprobs=np.stack([-np.ones((2, 3)), np.ones((2, 3))], 2)),
        None,
    )
    yield "positive logprob", base, np.array([[-1.0, 0.5, -1], [-1, -1, -1]])
    yield (
        "masked garbage",
        dict(base, advantages=np.array([[np.nan, 1, 1], [1, np.nan, np.nan]])),
        np.array([[-1.0, -1, -1], [-1, -1, 5.0]]),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_any_violation_agrees_with_check_batch(dtype):
    for label, fields, lp in _bad_batches():
        b = losses.Batch(**{k: np.asarray(v, dtype) for k, v in fields.items()})
        try:
            losses.check_batch(b, logprobs=None if lp is None else np.asarray(lp, dtype))
            valid = True
        except ValueError:
            valid = False
        bad = bool(jax.jit(losses.any_violation)(b, None if lp is None else np.asarray(lp, dtype)))
        assert bad != valid, label


def test_values_that_overflow_float32_are_rejected_naming_the_rule():
    b = good(advantages=np.array([1e39, 1.0]))
    losses.check_batch(b)  # finite in float64, the batch's own dtype
    with pytest.raises(
        ValueError, match=r"advantages\[row 0\] = 1e\+39: advantages overflows float32"
    ):
        losses.check_batch(b, dtype=np.float32)
    with pytest.raises(
        ValueError, match=r"weights\[row 1, column 2\] = -1e\+40: weights overflows"
    ):
        losses.check_batch(good(weights=np.array([[0.0, 0, 0], [0, 0, -1e40]])), dtype=np.float32)


def test_float16_masks_over_65504_tokens_count_in_float32():
    """A float16 token count overflows at 65504: grpo returned loss 0 and a zero gradient."""
    b, t = 2, 40000
    mask = np.ones((b, t), np.float16)
    batch = losses.Batch(
        action_mask=mask,
        advantages=np.ones(b, np.float16),
        sampling_logprobs=np.full((b, t), -1.0, np.float16),
    )
    lp = np.full((b, t), -1.0, np.float32)
    (value, metrics), grad = jax.value_and_grad(losses.grpo(), has_aux=True)(lp, batch)
    assert float(value) == pytest.approx(-1.0, rel=1e-3)
    assert float(metrics["num_tokens"]) == 80000.0
    np.testing.assert_allclose(np.asarray(grad), -1.0 / 80000.0, rtol=1e-3)
    env = losses.Batch(action_mask=np.zeros((b, t), np.float16), obs_mask=mask)
    value, metrics = losses.echo_env(coef=1.0, normalization="token_mean")(lp, env)
    assert float(value) == pytest.approx(1.0, rel=1e-3)
    assert float(metrics["num_obs_tokens"]) == 80000.0
