"""The optional torch bridge: `runner.fireworks.torch_loss_fn` in the SDK's own
``forward_backward_custom`` algorithm (the real SDK against the local server) gives the JAX
gradient and loss."""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import losses  # noqa: E402
from runner import AdamParams, ClientLoss, StepRunner  # noqa: E402
from runner.fireworks import to_datums, torch_loss_fn  # noqa: E402
from runner.local import LocalTrainer  # noqa: E402
from tests.test_fireworks import rl_seqs  # noqa: E402
from tests.test_serve_fireworks import CFG, connect, fireworks_server, served_model  # noqa: E402

TERM = losses.fold(losses.grpo(kl_coef=0.0), losses.echo_env(coef=0.2))


def test_closure_value_and_gradient_are_the_jax_ones():
    seqs = rl_seqs(seed=4, n=5)
    rng = np.random.default_rng(0)
    lps = [np.minimum(rng.normal(-2.0, 0.5, s.num_targets), 0.0) for s in seqs]
    value, metrics, grads = ClientLoss(TERM, dtype=np.float64).value_and_grads(lps, seqs)
    fn = torch_loss_fn(TERM, seqs, dtype=np.float64)
    data = to_datums([s.with_inputs() for s in seqs])
    tensors = [torch.tensor(lp, dtype=torch.float64, requires_grad=True) for lp in lps]
    loss, got_metrics = fn(data, tensors)
    loss.backward()
    assert loss.dtype == torch.float64 and float(loss.detach()) == pytest.approx(value, rel=1e-12)
    assert got_metrics == pytest.approx(metrics)
    for t, g in zip(tensors, grads, strict=True):
        np.testing.assert_allclose(t.grad.numpy(), g, rtol=1e-12, atol=1e-15)


def test_closure_checks_the_datums_match_the_batch():
    seqs = rl_seqs(seed=4, n=3)
    fn = torch_loss_fn(TERM, seqs)
    data = to_datums([s.with_inputs() for s in seqs])
    lps = [torch.zeros(s.num_targets, requires_grad=True) for s in seqs]
    with pytest.raises(ValueError, match="datum 0 target_tokens do not match sequence 0"):
        fn(data[::-1], lps[::-1])
    with pytest.raises(ValueError, match="got 2 datums"):
        fn(data[:2], lps[:2])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    st = fireworks_server(tmp_path_factory.mktemp("fw-torch"))
    yield st
    st.stop()


@pytest.fixture
def trainer(served):
    t = connect(served)
    yield t
    t.close()


@pytest.mark.parametrize("precomputed", [False, True])
def test_sdk_forward_backward_custom_equals_the_client_path(served, trainer, precomputed):
    client = trainer.client
    local = LocalTrainer(CFG)
    seqs = rl_seqs(seed=5)
    data = to_datums([s.with_inputs() for s in seqs])  # target_tokens only, as the SDK requires
    forward = client.forward(to_datums([s.with_inputs() for s in seqs]), "cross_entropy").result()
    result = client.forward_backward_custom(
        data, torch_loss_fn(TERM, seqs), precomputed_forward=forward if precomputed else None
    ).result()
    value, metrics, _ = ClientLoss(TERM).value_and_grads(
        [o["logprobs"].to_numpy() for o in forward.loss_fn_outputs], seqs
    )
    # the SDK merges the closure's metrics over the server's; loss:sum stays the surrogate
    assert result.metrics["grpo/loss"] == pytest.approx(metrics["grpo/loss"])
    assert result.metrics["loss:sum"] != pytest.approx(value)
    trainer.optim_step(AdamParams(learning_rate=1e-2), "none")
    StepRunner(TERM, mode="client").step(local, seqs, AdamParams(learning_rate=1e-2))
    params = served_model(served, trainer).trainer.params
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(local.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-7)


def test_the_sdk_rejects_extra_datum_keys_on_the_custom_path(trainer):
    client = trainer.client
    seqs = rl_seqs(seed=5, n=2)
    data = to_datums([s.with_inputs(weights=s.inputs["action_mask"]) for s in seqs], ("weights",))
    data_bad = to_datums(
        [s.with_inputs(advantages=s.inputs["advantages"]) for s in seqs], ("advantages",)
    )
    client.forward_backward_custom(data, torch_loss_fn(TERM, seqs)).result()
    with pytest.raises(ValueError, match="only supports loss_fn_inputs keys"):
        client.forward_backward_custom(data_bad, torch_loss_fn(TERM, seqs))
