"""A `losses` term as a Tinker 0.38 server-side custom loss (``create_custom_loss``).

**Route.** The SDK takes a loss only as a torch function that it traces itself with
``torch.fx`` (``ServiceClient.create_custom_loss(fn, input_ranks)``), and its
``forward_backward_custom`` imports torch even for an uploaded handle. So the term is not
rewritten in torch by hand: its per-datum JAX function is traced to a jaxpr with a *symbolic*
token length ``t`` (``jax.export.symbolic_shape``), and `torch_function` returns a small
interpreter that replays the jaxpr's equations as torch calls. ``torch.fx`` records those calls
(it never runs them), so the uploaded graph is the term's own program, equation for equation:
one source of truth, the JAX term, and torch on the client only for this path (extra
``foldloss[tinker-custom]``). Emitting the ``CustomLossGraph`` directly from the jaxpr would
avoid torch, but the SDK has no public way to upload a graph it did not trace.

**Per datum.** The term must declare a per-datum form (`losses.Term.per_datum`). Its function
of one datum is ``term(lp[None], Batch(field=x[None], ..., **constants))``: the datum's fields
are rank-1 inputs named after the `losses.Batch` fields (the datum's ``loss_fn_inputs`` keys),
and the batch constants (`losses.per_datum_batch`: normalizers, ``is_weight_mean``) are rank-0
inputs computed by the client over the whole batch and attached to every datum.

Metrics: every term metric whose name ends in ``loss`` (``loss``, ``grpo/loss``,
``echo_env/loss``, ``pg_loss``, ...) is a sum over datums of a per-datum form, sent as
``custom/<name>:sum``. Other metrics (means, maxima over the batch) have no per-datum sum and
are not reported by the server pass.

A jaxpr primitive with no torch form here (`UnsupportedTerm`) leaves the term on the client
path; the step planner reports the reason.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.extend.core import Literal

import losses

_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC = re.compile(r"[a-z0-9_./-]{1,64}")


class UnsupportedTerm(ValueError):
    """The term has no server-side form (the reason is the message)."""


# -- the per-datum jaxpr --------------------------------------------------------------------


def per_datum_function(term: Any, fields: Sequence[str], constants: Sequence[str]):
    """``(lp[t], *fields[t], *constants[]) -> (loss, {metric: value})`` of one datum."""

    def one(lp, *values):
        arrays = dict(zip(fields, values[: len(fields)], strict=True))
        consts = dict(zip(constants, values[len(fields) :], strict=True))
        batch = losses.Batch(**{k: v[None] for k, v in arrays.items()}, **consts)
        value, metrics = term(lp[None], batch)
        return value, {k: metrics[k] for k in sorted(metrics) if k.endswith("loss")}

    return one


def _closed_jaxpr(term: Any, fields: Sequence[str], constants: Sequence[str]):
    (t,) = export.symbolic_shape("t")
    vec = jax.ShapeDtypeStruct((t,), jnp.float32)
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    fn = per_datum_function(term, fields, constants)
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
            vec, *[vec] * len(fields), *[scalar] * len(constants)
        )
    except Exception as exc:  # noqa: BLE001 - any tracing failure means "no symbolic form"
        msg = str(exc).splitlines()[0]
        raise UnsupportedTerm(
            f"the per-datum term does not trace with a symbolic length: {msg}"
        ) from None
    return closed, out_shape


# -- jaxpr -> torch ---------------------------------------------------------------------------


def _is_t(d: Any) -> bool:
    return not isinstance(d, (int, np.integer))


def _torch_dtype(torch: Any, dtype: Any) -> Any:
    name = np.dtype(dtype).name
    # float64 / int64 appear only under jax x64 (tests); the server computes in float32.
    table = {
        "float32": torch.float32,
        "float64": torch.float32,
        "bool": torch.bool,
        "int32": torch.int32,
        "int64": torch.int32,
    }
    if name not in table:
        raise UnsupportedTerm(f"dtype {name} has no server-side form")
    return table[name]


class _Replay:
    """Replays a jaxpr as torch calls on ``torch.fx`` proxies (or tensors)."""

    def __init__(self, torch: Any, lp: Any) -> None:
        self.torch = torch
        self.lp = lp  # the datum's logprobs [t]: the reference for token-axis shapes

    def shaped_like(self, shape: Sequence[Any]) -> Any:
        """A zeros tensor of ``shape`` (each dim 1 or ``t``, ``t`` at most once)."""
        ts = [i for i, d in enumerate(shape) if _is_t(d)]
        if len(ts) > 1 or any(not _is_t(d) and d != 1 for d in shape):
            raise UnsupportedTerm(f"a broadcast to shape {tuple(map(str, shape))}")
        ref = self.torch.zeros_like(self.lp)
        if not ts:
            ref = ref.sum()
            for _ in shape:
                ref = ref.unsqueeze(0)
            return ref
        for _ in range(ts[0]):
            ref = ref.unsqueeze(0)
        for _ in range(len(shape) - ts[0] - 1):
            ref = ref.unsqueeze(-1)
        return ref

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            if isinstance(v, Literal):
                return _scalar(v.val)
            return env[v]

        for var, c in zip(jaxpr.constvars, consts, strict=True):
            env[var] = _scalar(c)
        for var, a in zip(jaxpr.invars, args, strict=True):
            env[var] = a
        live = _live(jaxpr)
        for i, eqn in enumerate(jaxpr.eqns):
            if i not in live:
                continue
            ins = [read(v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for var, out in zip(eqn.outvars, outs, strict=True):
                env[var] = out
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn: Any, ins: list[Any]) -> list[Any]:
        torch = self.torch
        name, p = eqn.primitive.name, eqn.params
        if name in ("pjit", "jit", "closed_call", "core_call"):
            inner = p.get("jaxpr") or p.get("call_jaxpr")
            return self.run(inner.jaxpr, inner.consts, ins)
        fn = _SIMPLE.get(name)
        if fn is not None:
            return [fn(torch, *ins)]
        if name in ("max", "min"):
            a, b = ins
            if isinstance(a, float | int | bool):
                a, b = b, a
            if isinstance(b, float | int | bool):
                kw = {"min": b} if name == "max" else {"max": b}
                return [torch.clamp(a, **kw)]
            return [(torch.maximum if name == "max" else torch.minimum)(a, b)]
        if name == "integer_pow":
            return [ins[0] ** int(p["y"])]
        if name == "select_n":
            pred, *cases = ins
            if len(cases) != 2 or eqn.invars[0].aval.dtype != jnp.bool_:
                raise UnsupportedTerm("select_n with more than two cases")
            return [torch.where(pred, cases[1], cases[0])]
        if name == "clamp":
            lo, x, hi = ins
            return [torch.clamp(x, min=lo, max=hi)]
        if name == "convert_element_type":
            dtype = _torch_dtype(torch, p["new_dtype"])
            x = ins[0]
            if isinstance(x, float | int | bool):  # a constant stays a Python number
                return [{torch.bool: bool, torch.int32: int}.get(dtype, float)(x)]
            return [x.to(dtype)]
        if name in ("reduce_sum", "reduce_max", "reduce_min", "reduce_or", "reduce_and"):
            x, axes = ins[0], tuple(int(a) for a in p["axes"])
            if not axes:
                return [x]
            if name == "reduce_sum":
                return [torch.sum(x, dim=axes)]
            if name in ("reduce_or", "reduce_and"):
                f = torch.amax if name == "reduce_or" else torch.amin
                return [f(x.to(torch.float32), dim=axes) > 0.5]
            return [(torch.amax if name == "reduce_max" else torch.amin)(x, dim=axes)]
        if name == "broadcast_in_dim":
            x, shape, dims = ins[0], p["shape"], tuple(p["broadcast_dimensions"])
            if isinstance(x, float | int | bool):
                return [torch.full_like(self.shaped_like(shape), x)]
            in_shape = eqn.invars[0].aval.shape
            got: list[Any] = [1] * len(shape)
            for k, d in enumerate(dims):
                got[d] = in_shape[k]
            for axis in range(len(shape)):
                if axis not in dims:
                    x = x.unsqueeze(axis)
            same = all(_same_dim(a, b) for a, b in zip(got, shape, strict=True))
            return [x if same else x.expand_as(self.shaped_like(shape))]
        if name in ("reshape", "squeeze", "expand_dims"):
            return [self.reshape(ins[0], eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)]
        raise UnsupportedTerm(f"jaxpr primitive {name!r} has no server-side form")

    def reshape(self, x: Any, old: Sequence[Any], new: Sequence[Any]) -> Any:
        """A reshape that only adds or removes size-1 axes, as squeeze / unsqueeze."""
        core_old = [d for d in old if _is_t(d) or d != 1]
        core_new = [d for d in new if _is_t(d) or d != 1]
        if len(core_old) != len(core_new) or any(
            _is_t(a) != _is_t(b) or (not _is_t(a) and a != b)
            for a, b in zip(core_old, core_new, strict=True)
        ):
            raise UnsupportedTerm(f"a reshape from {old} to {new}")
        for axis in reversed([i for i, d in enumerate(old) if not _is_t(d) and d == 1]):
            x = x.squeeze(axis)
        for axis, d in enumerate(new):
            if not _is_t(d) and d == 1:
                x = x.unsqueeze(axis)
        return x


def _scalar(value: Any) -> Any:
    arr = np.asarray(value)
    if arr.shape != ():
        raise UnsupportedTerm(f"the term captures a constant array of shape {arr.shape}")
    return arr.item()


def _live(jaxpr: Any) -> set[int]:
    """Indices of the equations the outputs depend on (dead code is not replayed)."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    live = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if any(v in needed for v in eqn.outvars):
            live.add(i)
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    return live


def _same_dim(a: Any, b: Any) -> bool:
    return (_is_t(a) and _is_t(b)) or (not _is_t(a) and not _is_t(b) and a == b)


def _binary(op: Any):
    return lambda torch, a, b: op(a, b)


_SIMPLE = {
    "add": _binary(operator.add),
    "sub": _binary(operator.sub),
    "mul": _binary(operator.mul),
    "div": _binary(operator.truediv),
    "pow": _binary(operator.pow),
    "gt": _binary(operator.gt),
    "lt": _binary(operator.lt),
    "ge": _binary(operator.ge),
    "le": _binary(operator.le),
    "eq": _binary(operator.eq),
    "ne": _binary(operator.ne),
    "and": _binary(operator.and_),
    "or": _binary(operator.or_),
    "neg": lambda torch, x: -x,
    "not": lambda torch, x: ~x,
    "exp": lambda torch, x: torch.exp(x),
    "log": lambda torch, x: torch.log(x),
    "log1p": lambda torch, x: torch.log1p(x),
    "expm1": lambda torch, x: torch.expm1(x),
    "abs": lambda torch, x: torch.abs(x),
    "sign": lambda torch, x: torch.sign(x),
    "sqrt": lambda torch, x: torch.sqrt(x),
    "rsqrt": lambda torch, x: torch.rsqrt(x),
    "tanh": lambda torch, x: torch.tanh(x),
    "logistic": lambda torch, x: torch.sigmoid(x),
    "square": lambda torch, x: torch.square(x),
    "exp2": lambda torch, x: torch.exp2(x),
    "is_finite": lambda torch, x: torch.isfinite(x),
    "stop_gradient": lambda torch, x: x if isinstance(x, float | int | bool) else x.detach(),
    "copy": lambda torch, x: x,
    "copy_p": lambda torch, x: x,
}


# -- the SDK's loss function ------------------------------------------------------------------


class CompiledTerm:
    """A term's per-datum form as the SDK's custom loss.

    Attributes:
      fields: the per-token `losses.Batch` fields it reads (datum inputs of rank 1).
      constants: the batch constants (datum inputs of rank 0).
      metric_names: the term metrics the server pass reports (``custom/<name>:sum``).
    """

    def __init__(self, term: Any, fields: Sequence[str], constants: Sequence[str]) -> None:
        if getattr(term, "per_datum", None) is None:
            raise UnsupportedTerm("the term does not decompose per datum (Term.per_datum)")
        for name in (*fields, *constants):
            if not _NAME.fullmatch(name):
                raise UnsupportedTerm(f"input name {name!r} is not a loss_fn_inputs key")
        if 1 + len(fields) + len(constants) > 16:
            raise UnsupportedTerm("the term reads more than 15 inputs (the SDK's limit)")
        self.term = term
        self.fields = tuple(fields)
        self.constants = tuple(constants)
        self.closed, out_shape = _closed_jaxpr(term, self.fields, self.constants)
        self.metric_names = tuple(sorted(out_shape[1]))
        for m in self.metric_names:
            if not _METRIC.fullmatch(m):
                raise UnsupportedTerm(f"metric {m!r} is not a custom metric name")
        self.name = "foldloss_" + re.sub(r"[^a-z0-9_]", "_", getattr(term, "name", "term").lower())

    @property
    def input_ranks(self) -> dict[str, int]:
        return {"logprobs": 1, **dict.fromkeys(self.fields, 1), **dict.fromkeys(self.constants, 0)}

    def torch_function(self):
        """The ``fn(logprobs, *inputs) -> (loss, metrics)`` the SDK traces (needs torch)."""
        import torch

        closed, metric_names = self.closed, self.metric_names

        def impl(lp, *values):
            replay = _Replay(torch, lp)
            outs = replay.run(closed.jaxpr, closed.consts, [lp, *values])
            # A constant output (an identically-zero term's) must still be a tensor.
            zero = torch.zeros_like(lp).sum()
            outs = [zero + v if isinstance(v, float | int | bool) else v for v in outs]
            loss, metric_values = outs[0], outs[1:]
            metrics = {
                f"custom/{k}:sum": v for k, v in zip(metric_names, metric_values, strict=True)
            }
            return loss, metrics

        return _named(self.name, ("logprobs", *self.fields, *self.constants), impl)


def _named(name: str, params: Sequence[str], impl: Any):
    """A function ``name(params...)`` calling ``impl``: the SDK reads the parameter names (the
    ``loss_fn_inputs`` keys) from the code object, so they must be real parameters. The names are
    this module's own, checked against ``[a-z_][a-z0-9_]*``."""
    if not _NAME.fullmatch(name) or not all(_NAME.fullmatch(p) for p in params):
        raise UnsupportedTerm("bad generated name")
    args = ", ".join(params)
    namespace = {"_impl": impl}
    code = compile(f"def {name}({args}):\n    return _impl({args})\n", "<foldloss>", "exec")
    exec(code, namespace)  # noqa: S102 - a fixed template over validated identifiers
    return namespace[name]


@functools.lru_cache(maxsize=64)
def compiled(term: Any, fields: tuple[str, ...], constants: tuple[str, ...]) -> CompiledTerm:
    """`CompiledTerm`, cached per (term, fields, constants) — the 64 most recent, so that a
    long-lived process that builds many terms does not keep every program."""
    return CompiledTerm(term, fields, constants)


# -- the trainer's side ------------------------------------------------------------------------


def _fields(seqs: Sequence[Any]) -> tuple[str, ...]:
    from runner._padding import batch_field_names

    return tuple(sorted(batch_field_names(seqs)))


def _constant_names(term: Any, seqs: Sequence[Any]) -> tuple[str, ...]:
    """The constants' names (their values come per step from the whole batch)."""
    first = seqs[0]
    row = losses.Batch(**{k: np.asarray(first.inputs[k], np.float32)[None] for k in _fields(seqs)})
    return tuple(sorted(term.per_datum.constants(row)))


class SessionLosses:
    """A Tinker session's server-side losses: whether the service runs them, and one uploaded
    `tinker` ``LossHandle`` per compiled term (each traced graph is created once per session)."""

    def __init__(self, service: Any) -> None:
        self.service = service
        self._handles: dict[int, Any] = {}
        self._advertised: bool | None = None

    @property
    def advertised(self) -> bool:
        """The service's client config says ``custom_loss_server_side`` and torch is here."""
        if self._advertised is None:
            ok = False
            if self.service is not None:
                config = self.service.holder.get_client_config()
                ok = bool(getattr(config, "custom_loss_server_side", False))
            if ok:
                try:
                    import torch.fx  # noqa: F401 - the SDK traces the loss with it
                except ImportError:
                    ok = False
            self._advertised = ok
        return self._advertised

    def unsupported(self, term: Any, seqs: Sequence[Any]) -> str | None:
        try:
            compiled(term, _fields(seqs), _constant_names(term, seqs))
        except UnsupportedTerm as exc:
            return str(exc)
        return None

    def handle(self, ct: CompiledTerm) -> Any:
        key = id(ct)
        if key not in self._handles:
            fn = ct.torch_function()
            self._handles[key] = self.service.create_custom_loss(fn, ct.input_ranks).result()
        return self._handles[key]

    def datums(self, ct: CompiledTerm, seqs: Sequence[Any], constants: Any, **kw: Any) -> list:
        from tinker import types

        from runner.tinker._convert import to_datums

        data = to_datums(seqs, ct.fields, **kw)
        shared = {
            name: types.TensorData.from_numpy(np.asarray(constants[name], np.float32))
            for name in ct.constants
        }
        for datum in data:
            datum.loss_fn_inputs.update(shared)
        return data

    def compiled_for(self, term: Any, seqs: Sequence[Any]) -> CompiledTerm:
        return compiled(term, _fields(seqs), _constant_names(term, seqs))
