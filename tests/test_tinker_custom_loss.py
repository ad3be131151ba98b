"""`runner.tinker._custom_loss`: every decomposable registered term (tests/cases.py), compiled to
a Tinker custom loss, traced by the SDK, validated by the local server's graph compiler and run
the server's way (per datum, padded, token-axis aware) gives the client path's gradient: the
JAX term on the padded batch, in float32, to 1e-6 relative (in practice bit for bit), with
exactly zero gradient at masked and padded positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tinker")
pytest.importorskip("torch")

from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss  # noqa: E402

import losses  # noqa: E402
from runner._step import datum_constants  # noqa: E402
from runner.serve._graph import batch_loss, compile_graph  # noqa: E402
from runner.tinker._custom_loss import UnsupportedTerm, compiled  # noqa: E402
from tests import cases  # noqa: E402

LENGTHS = [6, 3, 5, 1]
WIDTH = 8  # the server's padded width (> every length)
DECOMPOSABLE = [c for c in cases.CASES if c.term().per_datum is not None]
#: Declared per-datum but with no symbolic-length form (the top-k count depends on the length):
#: the planner keeps it on the client path, with this reason.
NO_SYMBOLIC = {"p40-kl_cov"}


def _float32_batch(batch):
    valid = np.arange(cases.T)[None, :] < np.array(LENGTHS)[:, None]
    fields = {}
    for name in losses.DATA_FIELDS:
        v = getattr(batch, name)
        if v is None:
            continue
        v = np.asarray(v, np.float32)
        if v.ndim == 1:
            v = np.broadcast_to(v[:, None], v.shape + (cases.T,)).copy()
        fields[name] = np.where(valid, v, 0.0).astype(np.float32)  # padding, as a client pads
    return fields, valid


def _server_inputs(program, fields, consts):
    inputs = {}
    for name, rank in program.inputs[1:]:
        if rank == 0:
            inputs[name] = np.full((len(LENGTHS),), consts[name], np.float32)
            continue
        arr = np.zeros((len(LENGTHS), WIDTH), np.float32)
        for i, n in enumerate(LENGTHS):
            arr[i, :n] = fields[name][i, :n]
            arr[i, n:] = fields[name][i, n - 1]  # the server's edge padding
        inputs[name] = arr
    return {
        "lengths": np.array(LENGTHS, np.int32),
        "real": np.ones(len(LENGTHS), np.float32),
        "inputs": inputs,
    }


@pytest.mark.parametrize("case", DECOMPOSABLE, ids=cases.ids(DECOMPOSABLE))
def test_server_side_gradient_equals_the_client_path(case):
    term = case.term()
    lp, batch = cases.fixed_batch(seed=2)
    fields, valid = _float32_batch(batch)
    b32 = losses.Batch(**fields)
    consts = datum_constants(term, b32)
    try:
        ct = compiled(term, tuple(sorted(fields)), tuple(sorted(consts)))
    except UnsupportedTerm as exc:
        assert case.id in NO_SYMBOLIC, exc
        return
    assert case.id not in NO_SYMBOLIC
    handle = trace_loss(ct.torch_function(), ct.input_ranks, "session")  # the SDK's checks
    program = compile_graph(handle.name, list(handle.inputs), encode_graph(handle))
    data = _server_inputs(program, fields, consts)
    lp_w = np.zeros((len(LENGTHS), WIDTH), np.float32)
    lp_w[:, : cases.T] = np.where(valid, lp, -7.0)  # whatever the model puts at padding
    lp_w[:, cases.T :] = -3.0
    (v_server, m_server), g_server = jax.value_and_grad(
        lambda x: batch_loss(program, x, data), has_aux=True
    )(jnp.asarray(lp_w))
    lp_client = jnp.asarray(np.where(valid, lp, 0.0), jnp.float32)
    (v_client, m_client), g_client = jax.value_and_grad(
        lambda x: term(x, losses.per_datum_batch(term, b32)), has_aux=True
    )(lp_client)
    g_server, g_client = np.asarray(g_server), np.asarray(g_client)
    scale = max(float(np.max(np.abs(g_client))), 1e-30)
    assert float(np.max(np.abs(g_server[:, : cases.T] * valid - g_client))) <= 1e-6 * scale
    assert np.all(g_server[:, : cases.T][~valid] == 0) and np.all(g_server[:, cases.T :] == 0)
    assert np.all(g_server[:, : cases.T][valid & (g_client == 0)] == 0)  # masked: exactly 0
    assert float(v_server) == pytest.approx(float(v_client), rel=1e-6, abs=1e-7)
    for name in ct.metric_names:
        assert float(m_server[f"custom/{name}:sum"]) == pytest.approx(
            float(m_client[name]), rel=1e-5, abs=1e-6
        )


def test_coupled_terms_do_not_compile():
    with pytest.raises(UnsupportedTerm, match="per datum"):
        compiled(losses.clip_cov(), ("action_mask", "advantages", "old_logprobs"), ())
