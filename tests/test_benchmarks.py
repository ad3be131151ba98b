"""The benchmark scripts' ``--quick`` modes: each runs, writes well-formed JSON, and the
equivalence benchmark's gradients agree (float64 ≤ 1e-10 relative, float32 ≤ 1e-5).

The scripts are loaded from ``benchmarks/`` and run once each through their ``main(argv)`` in
this process (sharing its jax configuration: x64 on, strict rank promotion); one of them also runs
as the documented one-line command in a subprocess, and ``make_results.py`` renders their JSON.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
NAMES = ("grad_equivalence", "loss_speed", "compile_count", "checkpoint_integrity")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_json(path: Path) -> dict:
    assert path.is_file(), path
    data = json.loads(path.read_text())  # strict JSON: NaN/inf would have been written as null
    for key in ("benchmark", "command", "machine", "config", "markdown"):
        assert key in data, key
    for key in ("date_utc", "nproc", "jax", "cpu"):
        assert key in data["machine"], key
    return data


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """Each benchmark's ``--quick`` run, once: ``(results dir, {name: returned payload})``."""
    out = tmp_path_factory.mktemp("bench_results")
    payloads = {
        name: load(name).main(["--quick", "--out", str(out / f"{name}.json")]) for name in NAMES
    }
    return out, payloads


def test_grad_equivalence_quick(quick):
    out, payloads = quick
    data = read_json(out / "grad_equivalence.json")
    assert "--quick" in data["command"]
    assert data["equivalence"] == json.loads(
        json.dumps(payloads["grad_equivalence"]["equivalence"])
    )
    rows = data["equivalence"]
    checked = [r for r in rows if r["status"] not in ("reference", "n/a")]
    # Every path ran in both precisions for both terms, except two_pass with KL (n/a).
    assert {(r["dtype"], r["term"]) for r in checked} == {
        (d, t) for d in ("float64", "float32") for t in ("grpo+echo", "grpo_kl+echo")
    }
    tol = {"float64": 1e-10, "float32": 1e-5}
    for r in checked:
        assert r["max_rel_diff"] <= tol[r["dtype"]], r
        assert r["status"] == "ok", r
    na = [r for r in rows if r["status"] == "n/a"]
    assert na and all(r["term"] == "grpo_kl+echo" and r["path"].startswith("two_pass") for r in na)
    passes = {r["path"]: (r["forwards"], r["backwards"]) for r in checked}
    assert passes["two_pass"] == (2, 2)
    assert passes["client"] == (2, 1)
    assert passes["client_precomputed"] == (1, 1)
    assert passes["client_microbatched"] == (6, 3)
    assert data["all_within_tolerance"] is True
    # Managed vs paper observation conventions: more targets and a different gradient.
    conv = {r["convention"].split()[0]: r for r in data["conventions"]["rows"]}
    assert conv["managed"]["extra_targets_vs_paper"] > 0
    assert conv["managed"]["env_grad_diff_rel"] > 1e-3
    assert conv["paper"]["env_grad_diff_norm"] == 0.0
    assert data["conventions_differ"] is True


def test_loss_speed_quick(quick):
    out, _ = quick
    data = read_json(out / "loss_speed.json")
    assert data["implementations_agree"] is True
    assert len(data["results"]) == 2
    for r in data["results"]:
        for key in ("foldloss_ms", "numpy_ms", "bound_ms", "compile_s", "foldloss_over_bound"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0, key
        assert r["compile_count"] == 1  # warm timings: one compilation, reused every call
        assert r["numpy_check"]["agrees"]
        for name in ("cookbook", "tuned"):
            if r[f"torch_{name}_ms"] is None:  # torch is optional
                assert data["config"]["torch"].startswith("skipped")
            else:
                assert r[f"torch_{name}_check"]["agrees"], name
                assert r[f"torch_{name}_over_foldloss"] > 0, name
    # One row per round-2 loss family, each finite, every family represented.
    families = {r["family"] for r in data["families"]}
    assert families >= {"baseline", "preference", "distillation", "critic", "filters", "floor"}
    for r in data["families"]:
        assert r["finite"] and r["ms"] > 0 and r["over_grpo"] > 0, r["term"]
    assert "Loss families vs GRPO" in data["markdown"]


def test_compile_count_quick(quick):
    out, _ = quick
    r = read_json(out / "compile_count.json")["result"]
    assert r["adapter"] == "client"
    assert r["compile_count"] == r["distinct_shapes_hit"] <= r["row_x_length_buckets"]
    assert r["target_met"] and r["one_compile_per_shape"]
    assert r["client_padding_overhead"] >= r["client_length_padding_overhead"] >= 1.0
    assert r["real_tokens"] > 0


def test_checkpoint_integrity_quick(quick):
    out, _ = quick
    (row,) = read_json(out / "checkpoint_integrity.json")["result"]["rows"]
    assert row["params"] > 0 and row["state_bytes"] > 0
    for key in ("save_state_s", "state_digest_s", "load_state_s", "state_verify_s"):
        assert row[key] > 0, key


def test_make_results_renders_every_table(quick, tmp_path):
    out, _ = quick
    md = tmp_path / "RESULTS.md"
    load("make_results").main(["--results", str(out), "--out", str(md)])
    text = md.read_text()
    for title in (
        "Parameter gradient vs direct jax.grad",
        "Loss + gradient",
        "compilations",
        "Checkpoint integrity cost",
    ):
        assert title in text
    assert "python benchmarks/loss_speed.py --quick" in text


def test_documented_command_runs(tmp_path):
    # ``python benchmarks/<name>.py`` from another directory, without the repo on sys.path.
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(BENCH / "loss_speed.py"), "--quick", "--no-torch", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = read_json(out)
    assert data["config"]["torch"] == "skipped (--no-torch)"
    assert all(
        r["torch_cookbook_ms"] is None and r["torch_tuned_ms"] is None for r in data["results"]
    )


@pytest.mark.parametrize("rows, length", [(8, 64), (64, 4096)])  # inline and thread-pool paths
def test_client_loss_reused_buffers_give_fresh_results(rows, length):
    # The speed work behind loss_speed reuses padded host buffers between calls of one bucket;
    # a second call with other (shorter) sequences must not see the first call's data.
    import numpy as np

    from runner import ClientLoss

    bench = load("loss_speed")
    term = bench.make_term()
    seqs1, lps1 = bench.make_batch(rows, length, seed=1)
    seqs2, lps2 = bench.make_batch(rows - 1, length, seed=2)  # same bucket, different lengths
    reused = ClientLoss(term)
    reused.value_and_grads(lps1, seqs1)
    value, metrics, grads = reused.value_and_grads(lps2, seqs2)
    ref_value, ref_metrics, ref_grads = ClientLoss(term).value_and_grads(lps2, seqs2)
    assert reused.compile_count == 1
    assert value == ref_value and metrics == ref_metrics
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_array_equal(g, r)


def test_client_loss_own_normalizers_equal_normalizers_of_the_sequences():
    # ClientLoss.batch(norms=None) computes the normalizers from the padded masks (faster);
    # they must equal `normalizers(seqs)`, including rows with neither actions nor observations.
    import numpy as np

    from runner import ClientLoss, Seq, normalizers

    seqs, _ = load("loss_speed").make_batch(6, 256, seed=3)
    empty = np.zeros(9)
    seqs.append(Seq(np.zeros(10, np.int64), {k: empty for k in seqs[0].inputs}))
    batch = ClientLoss(load("loss_speed").make_term()).batch(seqs)
    expected = normalizers(seqs)
    assert expected["num_rows"] == 6
    for name, value in expected.items():
        assert float(getattr(batch, name)) == value, name


def test_torch_closures_compute_the_foldloss_term():
    # The two torch baselines of loss_speed (cookbook-style through the SDK protocol's list
    # conversions, and the tuned loop) must compute the same loss and -grad as foldloss, or their
    # times mean nothing. torch is optional (not installed in CI).
    pytest.importorskip("torch")
    import numpy as np

    from runner import ClientLoss

    bench = load("loss_speed")
    seqs, lps = bench.make_batch(6, 300, seed=4)
    value, _, weights = ClientLoss(bench.make_term()).value_and_weights(lps, seqs)
    cookbook, tuned = bench.torch_cookbook_fn(1), bench.torch_tuned_fn(1)
    try:
        for got_value, got, _ in (cookbook(bench.cookbook_inputs(lps, seqs)), tuned(lps, seqs)):
            np.testing.assert_allclose(got_value, value, rtol=1e-5)
            for g, w in zip(got, weights, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)
        # The cookbook-style closure checks its rollout logprobs per position, as the cookbook.
        inputs = bench.cookbook_inputs(lps, seqs)
        active = int(np.flatnonzero(seqs[0].inputs["action_mask"])[0])
        inputs["inf_logprobs"][0][active] = None
        with pytest.raises(ValueError, match="rollout logprob missing"):
            cookbook(inputs)
    finally:
        cookbook.restore()
        tuned.restore()


def test_synthetic_multi_turn_seqs():
    # benchmarks/synthetic.py: the one synthetic multi-turn factory of the benchmarks and tests.
    import numpy as np

    from tests.fakes import BigramTrainer

    make = load("synthetic").multi_turn_seqs
    kw = dict(lengths=(14, 40), obs_turn=(1, 5), gap=1, vocab=8, with_ref=True)
    seqs, lps = make(np.random.default_rng(0), 5, **kw)
    again, _ = make(np.random.default_rng(0), 5, **kw)
    assert lps is None  # no logprobs: anchors -U(1, 5)
    for s, t in zip(seqs, again, strict=True):
        np.testing.assert_array_equal(s.tokens, t.tokens)
        for name in ("action_mask", "obs_mask", "advantages", "sampling_logprobs", "ref_logprobs"):
            np.testing.assert_array_equal(s.inputs[name], t.inputs[name])
    for s in seqs:
        action, obs = s.inputs["action_mask"], s.inputs["obs_mask"]
        assert 14 <= s.tokens.shape[0] < 40 and action.shape == obs.shape == (s.num_targets,)
        assert not np.any(action * obs) and 3 <= np.flatnonzero(action)[0] < 6
        kind = action + 2 * obs
        ends = np.flatnonzero((kind[:-1] == 2) & (kind[1:] != 2))
        assert np.all(kind[ends + 1] == 0)  # one wrapper target after each observation turn
        sampling = s.inputs["sampling_logprobs"]
        assert np.all(sampling[action == 0] == 0) and np.all(sampling[action > 0] <= -1)
    # Synthetic float32 logprobs, a fixed first length and prompt; anchors near the logprobs.
    seqs, lps = make(
        np.random.default_rng(1),
        3,
        lengths=(20, 30),
        first_length=31,
        start=4,
        logprobs="exponential",
        sampling_noise=0.1,
        with_ref=True,
        ref_offset=0.05,
    )
    assert seqs[0].tokens.shape[0] == 31 and not np.any(seqs[0].tokens)
    for s, lp in zip(seqs, lps, strict=True):
        action = s.inputs["action_mask"]
        assert lp.dtype == np.float32 and lp.shape == (s.num_targets,)
        assert np.flatnonzero(action)[0] == 4
        np.testing.assert_array_equal(s.inputs["ref_logprobs"], np.minimum(lp - 0.05, 0) * action)
    # A prompt longer than the sequence: ensure_action makes the last target an action.
    seqs, _ = make(np.random.default_rng(2), 3, lengths=(3, 6), start=9, ensure_action=True)
    assert all(
        np.flatnonzero(s.inputs["action_mask"]).tolist() == [s.num_targets - 1] for s in seqs
    )
    # Logprobs from a trainer's forward (not counted), around given layouts.
    trainer = BigramTrainer(vocab=8)
    seqs, lps = make(np.random.default_rng(3), layouts=seqs, trainer=trainer, with_ref=True)
    assert trainer.counters["forward"] == 0
    for s, lp in zip(seqs, lps, strict=True):
        action = s.inputs["action_mask"]
        assert lp.dtype == np.float64
        np.testing.assert_array_equal(s.inputs["ref_logprobs"], np.minimum(lp - 0.1, 0) * action)
    with pytest.raises(ValueError, match="give n or layouts"):
        make(np.random.default_rng(0))
    with pytest.raises(ValueError, match="logprobs must be None or 'exponential'"):
        make(np.random.default_rng(0), 2, logprobs="normal")


def _topk_inputs(seed: int):
    """``(s, t, m, batch)``: float64 student and teacher [3, 5, 4] values and a random mask."""
    import numpy as np

    import losses

    rng = np.random.default_rng(seed)
    s, t = rng.normal(size=(2, 3, 5, 4))
    m = (rng.random((3, 5)) < 0.6).astype(np.float64)
    return s, t, m, losses.Batch(action_mask=m, teacher_topk_logprobs=t)


def test_the_topk_floor_reads_every_topk_input_and_returns_their_gradient():
    import jax.numpy as jnp
    import numpy as np

    families = load("loss_families")
    s, t, m, batch = _topk_inputs(0)
    value, grad = families.TopkFloor.value_and_grad(jnp.asarray(s), batch)
    np.testing.assert_allclose(grad, m[..., None] * (s - t), rtol=1e-12)
    np.testing.assert_allclose(value, np.sum(m[..., None] * (s - t)), rtol=1e-12)
    floors = {r[2]: r for r in families.FAMILIES if r[0] == "floor"}
    assert set(floors) == {families.TopkFloor, families.TopkTwoPassFloor}
    assert all(r[3] == "topk" for r in floors.values())


def test_the_two_pass_floor_gates_the_gradient_by_its_per_token_statistic():
    import jax.numpy as jnp
    import numpy as np

    families = load("loss_families")
    s, t, m, batch = _topk_inputs(1)
    value, grad = families.TopkTwoPassFloor.value_and_grad(jnp.asarray(s), batch)
    d = (s - t).sum(axis=-1)  # NumPy reference
    gate = m * (d > 0)
    assert 0 < gate.sum() < m.sum()  # both sides of the gate occur
    np.testing.assert_allclose(grad, gate[..., None] * (s - t), rtol=1e-12)
    np.testing.assert_allclose(value, np.sum(gate * d), rtol=1e-12)


def test_hf_logprobs_memory_quick_reports_both_heads_bounded(tmp_path):
    """The compiled-memory table (``--quick --no-run``): chunking removes the ``[T, V]``
    logits from the temporaries of both the differentiated head and the fused linear head."""
    out = tmp_path / "mem.json"
    data = load("hf_logprobs_memory").main(["--quick", "--no-run", "--out", str(out)])
    assert read_json(out)["rows"] == data["rows"]
    rows = {(r["H"], r["chunk"]): r for r in data["rows"]}
    for (_, chunk), r in rows.items():
        if chunk:
            assert r["temp_vs_materialized"] < 0.5, r
            assert r["fused_temp_vs_materialized"] < 0.5, r
    assert "fused head temp MiB" in data["markdown"]


def test_async_rl_quick_on_the_tinker_backend_with_a_plot(tmp_path):
    """``benchmarks/async_rl.py --quick`` through the real Tinker SDK to an in-process server,
    two settings at a 20 ms tool latency: a row per setting, the O=1 step sampled while the
    trainer trained (offset 1), and a reward-vs-wall-clock PNG."""
    pytest.importorskip("tinker")
    out, png = tmp_path / "async_rl.json", tmp_path / "async_rl.png"
    data = load("async_rl").main(
        ["--quick", "--backend", "tinker", "--settings", "1,2", "--latencies", "20"]
        + ["--out", str(out), "--plot", str(png)]
    )
    assert read_json(out)["config"]["backend"] == "tinker"
    rows = data["result"]["rows"]
    assert [r["setting"] for r in rows] == ["concurrent O=0", "concurrent O=1"]
    assert [r["version_offset_max"] for r in rows] == [0, 1]
    for r in rows:
        (run,) = r["runs"]
        assert len(run["wall_s"]) == len(run["reward"]) == 2
        assert run["wall_s"][0] < run["wall_s"][1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
