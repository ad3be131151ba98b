"""Custom-loss graphs (tinker 0.38 ``create_custom_loss``): validated, then run in JAX per datum.

A graph is untrusted input: plain data naming operations. Nothing in it is evaluated, imported or
looked up by name: every ``call_function`` / ``call_method`` target is a key of one fixed table,
`OPS`, whose values are this module's own JAX functions; anything else is rejected. `compile_graph`
checks a graph in two stages, both before anything is compiled:

1. **Structure** (`_decode`): ``format == 1``; at most ``max_nodes`` nodes; unique names; ops
   ``placeholder`` (exactly the declared inputs, in order, ``logprobs`` first), ``call_function``,
   ``call_method`` and one final ``output``; every target in `OPS` with an allowed arity and
   keyword set; arguments of the SDK's encoding, nested at most `MAX_DEPTH` deep with at most
   `MAX_ARG_ITEMS` items per node; every ``{"ref": name}`` names an *earlier* node; the output is
   ``(loss, {metric: ref})`` with metric keys ``custom/<name>:sum|mean``.
2. **Shapes** (`Program.check_shapes`): the graph is traced abstractly (``jax.eval_shape``: no
   XLA compilation) on example inputs; an operation that fails on its inputs, a loss or metric
   that is not a scalar, is reported with the node's name.

Every error is a `GraphError` (a ``ValueError``) naming the node and the rule; the server answers
it with a 400.

**Padding.** The trainer runs a batch at one padded width ``W`` (its length bucket). Each datum's
per-token inputs are padded to ``W`` with copies of its last value (edge padding: padded positions
compute the same finite numbers as a real one), and every value remembers which of its axes is the
datum's token axis. Reductions over that axis (``sum``, ``mean``, ``amax``, ``amin``,
``logsumexp``, ``softmax``/``log_softmax``) ignore the padded positions and ``mean``, ``numel`` and
``x.shape[0]`` count the datum's own length, so the result equals the SDK's per-datum evaluation at
the datum's length, and padded positions get exactly zero gradient. Operations that would move
values along the token axis in a way padding can change (indexing or slicing it, ``flip``,
``reshape`` other than to ``(-1,)``) are rejected; ``cumsum`` along it is causal and allowed.

The server computes in float32 (a ``float64`` / ``double`` request computes in float32).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: Default of ``--max-loss-nodes``.
MAX_NODES = 4096
#: How deep arguments may nest (tuples, lists, dicts, slices).
MAX_DEPTH = 6
#: Items (scalars, refs, containers) in one node's arguments, all nesting levels together.
MAX_ARG_ITEMS = 256
#: A custom loss takes logprobs and at most 15 more inputs (the SDK's limit).
MAX_INPUTS = 16
_NODE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
_OPS = ("placeholder", "call_function", "call_method", "output")
_DTYPES = {
    "float32": jnp.float32,
    "float": jnp.float32,
    "float64": jnp.float32,  # computed in float32 (module docstring)
    "double": jnp.float32,
    "bool": jnp.bool_,
    "int32": jnp.int32,
    "int64": jnp.int32,
    "long": jnp.int32,
}
#: Encoded constants a graph may pass that change nothing here.
_IGNORED_CONSTANTS = ("device", "layout", "memory_format")


class GraphError(ValueError):
    """A graph the server refuses: the message names the node and the rule."""


# -- values ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ref:
    """``{"ref": name}``: the value of an earlier node."""

    name: str


@dataclasses.dataclass(frozen=True)
class TVal:
    """A tensor value: the array and which of its axes is the datum's token axis (or None)."""

    arr: Any
    t: int | None


@dataclasses.dataclass(frozen=True)
class ShapeVal:
    """``x.shape``: sizes, the token axis's being the datum's length (a traced scalar)."""

    sizes: tuple[Any, ...]


@dataclasses.dataclass
class _Ctx:
    length: Any  # int32 0-d: the datum's number of targets
    width: int  # the padded width W

    def valid(self, x: TVal) -> Any:
        """bool, broadcastable to ``x.arr``: the datum's own positions along its token axis."""
        shape = [1] * x.arr.ndim
        shape[x.t] = x.arr.shape[x.t]
        return (jnp.arange(x.arr.shape[x.t]) < self.length).reshape(shape)


def _arr(x: Any) -> Any:
    return x.arr if isinstance(x, TVal) else x


def _tensor(x: Any, what: str) -> TVal:
    if isinstance(x, TVal):
        return x
    if isinstance(x, (bool, int, float)) or (hasattr(x, "shape") and np.ndim(x) == 0):
        return TVal(jnp.asarray(x), None)
    raise GraphError(f"{what} needs a tensor, got {type(x).__name__}")


def _token_axis(args: Sequence[Any], rank: int) -> int | None:
    """The token axis of a broadcast result of ``rank`` (operands aligned from the right)."""
    t = None
    for a in args:
        if isinstance(a, TVal) and a.t is not None:
            pos = rank - (a.arr.ndim - a.t)
            if t is not None and pos != t:
                raise GraphError("combines tensors whose token axes do not line up")
            t = pos
    return t


def _elementwise(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(ctx: _Ctx, *args: Any, **kwargs: Any) -> Any:
        if not any(isinstance(a, TVal) for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)  # Python numbers (shape arithmetic, constants)
        out = jnp.asarray(fn(*map(_arr, args), **{k: _arr(v) for k, v in kwargs.items()}))
        return TVal(out, _token_axis([*args, *kwargs.values()], out.ndim))

    return run


def _axes(dim: Any, ndim: int, what: str) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not -max(ndim, 1) <= d < max(ndim, 1):
            raise GraphError(f"{what}: dim {d!r} is out of range for a {ndim}-d tensor")
        out.append(d % max(ndim, 1))
    return tuple(sorted(set(out)))


def _after_reduce(t: int | None, axes: tuple[int, ...], keepdim: bool) -> int | None:
    if t is None or t in axes:
        return None
    return t if keepdim else t - sum(1 for a in axes if a < t)


_FILL = {"sum": 0.0, "mean": 0.0, "amax": -jnp.inf, "amin": jnp.inf, "logsumexp": -jnp.inf}


def _reduction(kind: str) -> Callable[..., Any]:
    def run(ctx: _Ctx, x: Any, dim: Any = None, keepdim: bool = False, **kw: Any) -> TVal:
        x = _tensor(x, kind)
        if kw.get("dtype") is not None:
            x = TVal(x.arr.astype(kw["dtype"]), x.t)
        if kind == "logsumexp" and dim is None:
            raise GraphError("logsumexp needs dim")
        axes = _axes(dim, x.arr.ndim, kind)
        arr = x.arr
        if kind in ("sum", "mean") and arr.dtype == jnp.bool_:
            arr = arr.astype(jnp.float32)
        masked = x.t is not None and x.t in axes
        if masked:
            arr = jnp.where(ctx.valid(x), arr, jnp.asarray(_FILL[kind], arr.dtype))
        axis = axes if arr.ndim else None
        if kind == "mean":
            out = jnp.sum(arr, axis=axis, keepdims=keepdim)
            count = math.prod(arr.shape[a] for a in axes if a != x.t)
            out = out / (count * ctx.length.astype(out.dtype) if masked else count)
        else:
            fn = {"sum": jnp.sum, "amax": jnp.max, "amin": jnp.min}.get(kind)
            if fn is None:
                out = jax.nn.logsumexp(arr, axis=axis, keepdims=keepdim)
            else:
                out = fn(arr, axis=axis, keepdims=keepdim)
        return TVal(out, _after_reduce(x.t, axes, keepdim))

    return run


def _softmax(log: bool) -> Callable[..., Any]:
    def run(ctx: _Ctx, x: Any, dim: Any = None, **kw: Any) -> TVal:
        x = _tensor(x, "softmax")
        if dim is None:
            raise GraphError("softmax needs dim")
        (axis,) = _axes(dim, x.arr.ndim, "softmax")
        arr = x.arr
        if x.t == axis:
            arr = jnp.where(ctx.valid(x), arr, -jnp.inf)
        out = jax.nn.log_softmax(arr, axis=axis) if log else jax.nn.softmax(arr, axis=axis)
        if x.t == axis:  # padded positions: finite copies, never read
            out = jnp.where(ctx.valid(x), out, 0.0)
        return TVal(out, x.t)

    return run


def _cumsum(ctx: _Ctx, x: Any, dim: Any = None, **kw: Any) -> TVal:
    x = _tensor(x, "cumsum")
    if dim is None:
        raise GraphError("cumsum needs dim")
    (axis,) = _axes(dim, x.arr.ndim, "cumsum")
    return TVal(jnp.cumsum(x.arr, axis=axis), x.t)  # causal: padding (at the end) changes nothing


def _clamp(ctx: _Ctx, x: Any, min: Any = None, max: Any = None) -> TVal:  # noqa: A002
    x = _tensor(x, "clamp")
    out = x.arr
    if min is not None:
        out = jnp.maximum(out, _arr(min))
    if max is not None:
        out = jnp.minimum(out, _arr(max))
    return TVal(out, _token_axis([x, min, max], jnp.ndim(out)))


def _where(ctx: _Ctx, cond: Any, a: Any, b: Any) -> TVal:
    out = jnp.where(_arr(cond), _arr(a), _arr(b))
    return TVal(out, _token_axis([cond, a, b], out.ndim))


def _like(value: float | None) -> Callable[..., Any]:
    def run(ctx: _Ctx, x: Any, fill: Any = None, dtype: Any = None, **kw: Any) -> TVal:
        x = _tensor(x, "*_like")
        v = _arr(fill) if value is None else value
        if v is None:
            raise GraphError("full_like needs a fill value")
        return TVal(jnp.full_like(x.arr, v, dtype=dtype or x.arr.dtype), x.t)

    return run


def _detach(ctx: _Ctx, x: Any) -> Any:
    x = _tensor(x, "detach")
    return TVal(jax.lax.stop_gradient(x.arr), x.t)


def _cast(dtype: Any) -> Callable[..., Any]:
    def run(ctx: _Ctx, x: Any, *args: Any, **kw: Any) -> TVal:
        x = _tensor(x, "cast")
        return TVal(x.arr.astype(dtype), x.t)

    return run


def _to(ctx: _Ctx, x: Any, *args: Any, dtype: Any = None, **kw: Any) -> TVal:
    x = _tensor(x, "to")
    target = dtype
    for a in args:
        if isinstance(a, TVal):
            target = a.arr.dtype
        elif a is not None and not isinstance(a, str):
            target = a
    return TVal(x.arr if target is None else x.arr.astype(target), x.t)


def _type_as(ctx: _Ctx, x: Any, other: Any) -> TVal:
    x, other = _tensor(x, "type_as"), _tensor(other, "type_as")
    return TVal(x.arr.astype(other.arr.dtype), x.t)


def _unsqueeze(ctx: _Ctx, x: Any, dim: int) -> TVal:
    x = _tensor(x, "unsqueeze")
    nd = x.arr.ndim + 1
    if isinstance(dim, bool) or not isinstance(dim, int) or not -nd <= dim < nd:
        raise GraphError(f"unsqueeze: dim {dim!r} is out of range")
    d = dim % nd
    t = None if x.t is None else (x.t + 1 if d <= x.t else x.t)
    return TVal(jnp.expand_dims(x.arr, d), t)


def _squeeze(ctx: _Ctx, x: Any, dim: Any = None) -> TVal:
    x = _tensor(x, "squeeze")
    axes = (
        tuple(a for a in range(x.arr.ndim) if x.arr.shape[a] == 1 and a != x.t)
        if dim is None
        else _axes(dim, x.arr.ndim, "squeeze")
    )
    if x.t is not None and x.t in axes:
        raise GraphError("squeeze: cannot squeeze the token axis")
    axes = tuple(a for a in axes if x.arr.shape[a] == 1)
    return TVal(jnp.squeeze(x.arr, axes) if axes else x.arr, _after_reduce(x.t, axes, False))


def _reshape(ctx: _Ctx, x: Any, *shape: Any) -> TVal:
    x = _tensor(x, "reshape")
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if tuple(shape) == (-1,) and x.arr.ndim <= 1:
        return TVal(jnp.reshape(x.arr, (-1,)), 0 if x.arr.ndim == 1 else None)
    if x.t is None and all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        try:
            return TVal(jnp.reshape(x.arr, tuple(shape)), None)
        except (TypeError, ValueError) as exc:
            raise GraphError(f"reshape: {exc}") from None
    raise GraphError(
        "reshape/view of a per-token tensor: only reshape(-1) of a 1-d tensor; use unsqueeze "
        "and squeeze to add or remove axes"
    )


def _flatten(ctx: _Ctx, x: Any) -> TVal:
    return _reshape(ctx, x, -1)


def _expand_as(ctx: _Ctx, x: Any, other: Any) -> TVal:
    x, other = _tensor(x, "expand_as"), _tensor(other, "expand_as")
    out = jnp.broadcast_to(x.arr, other.arr.shape)
    t = _token_axis([x, other], out.ndim)
    return TVal(out, t)


def _getitem(ctx: _Ctx, x: Any, index: Any) -> Any:
    if isinstance(x, ShapeVal):
        if isinstance(index, bool) or not isinstance(index, int):
            raise GraphError("indexing a shape needs an int")
        try:
            return x.sizes[index]
        except IndexError:
            raise GraphError(f"shape index {index} is out of range") from None
    if isinstance(x, (tuple, list)):
        if isinstance(index, bool) or not isinstance(index, int) or not -len(x) <= index < len(x):
            raise GraphError("indexing a tuple needs an int in range")
        return x[index]
    x = _tensor(x, "getitem")
    items = list(index) if isinstance(index, tuple) else [index]
    for item in items:
        if not (item is None or item is Ellipsis or isinstance(item, (int, slice))):
            raise GraphError("getitem: indices must be ints, slices, None or ...")
        if isinstance(item, bool):
            raise GraphError("getitem: a bool index is not supported")
        if isinstance(item, slice) and not all(
            s is None or (isinstance(s, int) and not isinstance(s, bool))
            for s in (item.start, item.stop, item.step)
        ):
            raise GraphError("getitem: slice bounds must be ints")
    if sum(1 for i in items if i is Ellipsis) > 1:
        raise GraphError("getitem: at most one ...")
    explicit = sum(1 for i in items if i is not None and i is not Ellipsis)
    if explicit > x.arr.ndim:
        raise GraphError(f"getitem: {explicit} indices for a {x.arr.ndim}-d tensor")
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items[k : k + 1] = [slice(None)] * (x.arr.ndim - explicit)
    else:
        items += [slice(None)] * (x.arr.ndim - explicit)
    src, dst, t = 0, 0, None
    for item in items:
        if item is None:
            dst += 1
            continue
        if src == x.t:
            if item != slice(None):
                raise GraphError("getitem: the token axis can only be taken whole ([:])")
            t = dst
        if isinstance(item, int) and not -x.arr.shape[src] <= item < x.arr.shape[src]:
            raise GraphError(f"getitem: index {item} is out of range for size {x.arr.shape[src]}")
        if isinstance(item, slice):
            dst += 1
        src += 1
    return TVal(x.arr[tuple(items)], t)


def _shape_of(ctx: _Ctx, x: TVal) -> ShapeVal:
    sizes = tuple(ctx.length if a == x.t else int(s) for a, s in enumerate(x.arr.shape))
    return ShapeVal(sizes)


def _getattr(ctx: _Ctx, x: Any, name: Any) -> Any:
    x = _tensor(x, "getattr")
    if name == "shape":
        return _shape_of(ctx, x)
    if name == "ndim":
        return x.arr.ndim
    if name == "dtype":
        return x.arr.dtype
    raise GraphError(f"getattr: only shape, ndim and dtype of a tensor, not {name!r}")


def _size(ctx: _Ctx, x: Any, dim: Any = None) -> Any:
    shape = _shape_of(ctx, _tensor(x, "size"))
    if dim is None:
        return shape
    (axis,) = _axes(dim, len(shape.sizes), "size")
    return shape.sizes[axis]


def _numel(ctx: _Ctx, x: Any) -> Any:
    x = _tensor(x, "numel")
    n = math.prod(int(s) for a, s in enumerate(x.arr.shape) if a != x.t)
    return n if x.t is None else n * ctx.length


def _dim(ctx: _Ctx, x: Any) -> int:
    return _tensor(x, "dim").arr.ndim


def _scalar_tensor(ctx: _Ctx, value: Any, dtype: Any = None, **kw: Any) -> TVal:
    if isinstance(value, TVal) or not isinstance(value, (bool, int, float)):
        if isinstance(value, TVal) and value.arr.ndim == 0:
            return TVal(value.arr if dtype is None else value.arr.astype(dtype), None)
        raise GraphError("torch.tensor: only a Python number (a constant scalar)")
    default = jnp.float32 if isinstance(value, float) else None
    return TVal(jnp.asarray(value, dtype or default), None)


def _math(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(ctx: _Ctx, *args: Any) -> Any:
        if all(isinstance(a, (bool, int, float)) for a in args):
            try:
                return fn(*args)
            except (ValueError, OverflowError, ZeroDivisionError) as exc:
                raise GraphError(f"math: {exc}") from None
        raise GraphError("math functions take Python numbers; use the torch function on tensors")

    return run


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One allowed operation: the function and the arguments it accepts."""

    fn: Callable[..., Any]
    min_args: int
    max_args: int
    kwargs: frozenset[str] = frozenset()


def _op(fn, lo, hi, kwargs=()):
    return OpSpec(fn, lo, hi, frozenset(kwargs))


_UNARY = {
    "exp": jnp.exp,
    "log": jnp.log,
    "log1p": jnp.log1p,
    "expm1": jnp.expm1,
    "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt,
    "abs": jnp.abs,
    "neg": jnp.negative,
    "negative": jnp.negative,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "square": jnp.square,
    "sign": jnp.sign,
    "reciprocal": jnp.reciprocal,
    "relu": jax.nn.relu,
    "logical_not": jnp.logical_not,
    "isfinite": jnp.isfinite,
    "isnan": jnp.isnan,
    "exp2": jnp.exp2,
    "log2": jnp.log2,
}
_BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "subtract": jnp.subtract,
    "mul": jnp.multiply,
    "multiply": jnp.multiply,
    "div": jnp.divide,
    "true_divide": jnp.divide,
    "pow": jnp.power,
    "minimum": jnp.minimum,
    "maximum": jnp.maximum,
    "gt": jnp.greater,
    "lt": jnp.less,
    "ge": jnp.greater_equal,
    "le": jnp.less_equal,
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or,
    "logical_xor": jnp.logical_xor,
}
_REDUCE_KW = ("dim", "keepdim", "dtype")


def _build_ops() -> dict[tuple[str, str], OpSpec]:
    fn: dict[str, OpSpec] = {}
    method: dict[str, OpSpec] = {}
    for name, f in _UNARY.items():
        fn[f"torch.{name}"] = method[name] = _op(_elementwise(f), 1, 1)
    for name, f in _BINARY.items():
        fn[f"torch.{name}"] = method[name] = _op(_elementwise(f), 2, 2)
    for name in ("relu", "sigmoid", "tanh"):
        fn[f"torch.nn.functional.{name}"] = _op(_elementwise(_UNARY[name]), 1, 1)
    fn["torch.nn.functional.logsigmoid"] = _op(_elementwise(jax.nn.log_sigmoid), 1, 1)
    fn["torch.nn.functional.softplus"] = _op(_elementwise(jax.nn.softplus), 1, 1)
    for name, f in {
        "add": operator.add,
        "sub": operator.sub,
        "mul": operator.mul,
        "truediv": operator.truediv,
        "floordiv": operator.floordiv,
        "mod": operator.mod,
        "pow": operator.pow,
        "gt": operator.gt,
        "lt": operator.lt,
        "ge": operator.ge,
        "le": operator.le,
        "eq": operator.eq,
        "ne": operator.ne,
        "and_": operator.and_,
        "or_": operator.or_,
        "xor": operator.xor,
    }.items():
        fn[f"operator.{name}"] = _op(_elementwise(f), 2, 2)
    fn["operator.neg"] = _op(_elementwise(operator.neg), 1, 1)
    fn["operator.invert"] = _op(_elementwise(jnp.invert), 1, 1)
    fn["operator.getitem"] = _op(_getitem, 2, 2)
    fn["getattr"] = fn["builtins.getattr"] = _op(_getattr, 2, 2)  # `x.shape` as fx records it
    for name in ("sum", "mean", "amax", "amin", "logsumexp"):
        fn[f"torch.{name}"] = method[name] = _op(_reduction(name), 1, 3, _REDUCE_KW)
    for name, log in (("softmax", False), ("log_softmax", True)):
        fn[f"torch.{name}"] = method[name] = _op(_softmax(log), 1, 2, ("dim", "dtype"))
        fn[f"torch.nn.functional.{name}"] = _op(_softmax(log), 1, 2, ("dim", "dtype"))
    fn["torch.cumsum"] = method["cumsum"] = _op(_cumsum, 1, 2, ("dim", "dtype"))
    for name in ("clamp", "clip"):
        fn[f"torch.{name}"] = method[name] = _op(_clamp, 1, 3, ("min", "max"))
    method["clamp_min"] = _op(lambda ctx, x, v: _clamp(ctx, x, min=v), 2, 2)
    method["clamp_max"] = _op(lambda ctx, x, v: _clamp(ctx, x, max=v), 2, 2)
    fn["torch.where"] = method["where"] = _op(_where, 3, 3)
    fn["torch.zeros_like"] = _op(_like(0.0), 1, 1, ("dtype",))
    fn["torch.ones_like"] = _op(_like(1.0), 1, 1, ("dtype",))
    fn["torch.full_like"] = _op(_like(None), 2, 2, ("dtype",))
    fn["torch.tensor"] = _op(_scalar_tensor, 1, 1, ("dtype", "device", "requires_grad"))
    fn["torch.as_tensor"] = _op(_scalar_tensor, 1, 1, ("dtype", "device"))
    fn["torch.unsqueeze"] = method["unsqueeze"] = _op(_unsqueeze, 2, 2)
    fn["torch.squeeze"] = method["squeeze"] = _op(_squeeze, 1, 2, ("dim",))
    fn["torch.reshape"] = _op(_reshape, 2, 2)
    method["reshape"] = method["view"] = _op(_reshape, 2, 9)
    fn["torch.flatten"] = method["flatten"] = _op(_flatten, 1, 1)
    method["expand_as"] = _op(_expand_as, 2, 2)
    fn["torch.detach"] = method["detach"] = _op(_detach, 1, 1)
    method["float"] = _op(_cast(jnp.float32), 1, 1)
    method["double"] = _op(_cast(jnp.float32), 1, 1)
    method["bool"] = _op(_cast(jnp.bool_), 1, 1)
    method["long"] = method["int"] = _op(_cast(jnp.int32), 1, 1)
    method["to"] = _op(_to, 1, 3, ("dtype", "device", "non_blocking", "copy"))
    method["type_as"] = _op(_type_as, 2, 2)
    method["size"] = _op(_size, 1, 2, ("dim",))
    method["numel"] = fn["torch.numel"] = _op(_numel, 1, 1)
    method["dim"] = _op(_dim, 1, 1)
    for name in ("sqrt", "log", "exp", "log1p", "expm1", "tanh", "fabs"):
        fn[f"math.{name}"] = _op(_math(getattr(math, name)), 1, 1)
    fn["math.pow"] = _op(_math(math.pow), 2, 2)
    return {
        **{("call_function", k): v for k, v in fn.items()},
        **{("call_method", k): v for k, v in method.items()},
    }


#: The allowed operations: ``(op, target) -> OpSpec``. A method's first argument is its tensor.
OPS: Mapping[tuple[str, str], OpSpec] = _build_ops()


# -- decoding -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    op: str
    target: str
    spec: OpSpec | None
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


class _Budget:
    def __init__(self, node: str) -> None:
        self.node, self.left = node, MAX_ARG_ITEMS

    def take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise GraphError(f"node {self.node!r}: more than {MAX_ARG_ITEMS} argument items")


def _decode_arg(value: Any, node: str, known: Mapping[str, int], depth: int, budget: _Budget):
    budget.take()
    if depth > MAX_DEPTH:
        raise GraphError(f"node {node!r}: arguments nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, int, str)):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**31:
            raise GraphError(f"node {node!r}: integer {value} is out of range")
        if isinstance(value, str) and len(value) > 64:
            raise GraphError(f"node {node!r}: a string argument longer than 64 characters")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise GraphError(f"node {node!r}: a non-finite float must be encoded as {{'float'}}")
        return value
    if isinstance(value, list):
        return [_decode_arg(v, node, known, depth + 1, budget) for v in value]
    if not isinstance(value, dict) or len(value) != 1:
        raise GraphError(f"node {node!r}: cannot decode argument of type {type(value).__name__}")
    ((kind, inner),) = value.items()
    if kind == "ref":
        if not isinstance(inner, str) or inner not in known:
            raise GraphError(
                f"node {node!r}: refers to {inner!r}, which is not an earlier node of the graph"
            )
        return Ref(inner)
    if kind == "tuple" and isinstance(inner, list):
        return tuple(_decode_arg(v, node, known, depth + 1, budget) for v in inner)
    if kind == "dict" and isinstance(inner, dict):
        if not all(isinstance(k, str) and len(k) <= 80 for k in inner):
            raise GraphError(f"node {node!r}: dict keys must be short strings")
        return {k: _decode_arg(v, node, known, depth + 1, budget) for k, v in inner.items()}
    if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
        parts = [_decode_arg(v, node, known, depth + 1, budget) for v in inner]
        if not all(p is None or (isinstance(p, int) and not isinstance(p, bool)) for p in parts):
            raise GraphError(f"node {node!r}: slice bounds must be ints or null")
        return slice(*parts)
    if kind == "ellipsis" and inner is True:
        return Ellipsis
    if kind == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if kind == "dtype" and isinstance(inner, str):
        if inner not in _DTYPES:
            raise GraphError(f"node {node!r}: dtype {inner!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[inner]
    if kind in _IGNORED_CONSTANTS and isinstance(inner, str) and len(inner) <= 64:
        return None
    raise GraphError(f"node {node!r}: cannot decode argument {{{kind!r}: ...}}")


def _field(raw: Any, key: str, default: Any = None) -> Any:
    if isinstance(raw, Mapping):
        return raw.get(key, default)
    return getattr(raw, key, default)


def _decode(graph: Any, inputs: Sequence[tuple[str, int]], max_nodes: int):
    if _field(graph, "format", 1) != 1:
        raise GraphError(f"graph format {_field(graph, 'format')!r} is not 1")
    raw_nodes = _field(graph, "nodes")
    if not isinstance(raw_nodes, (list, tuple)) or not raw_nodes:
        raise GraphError("graph has no nodes")
    if len(raw_nodes) > max_nodes:
        raise GraphError(f"graph has {len(raw_nodes)} nodes; this server allows {max_nodes}")
    known: dict[str, int] = {}
    nodes: list[Node] = []
    output = None
    placeholders: list[str] = []
    for i, raw in enumerate(raw_nodes):
        name, op, target = _field(raw, "name"), _field(raw, "op"), _field(raw, "target")
        label = name if isinstance(name, str) and len(name) <= 128 else f"#{i}"
        if not isinstance(name, str) or not _NODE_NAME.fullmatch(name):
            raise GraphError(f"node {label!r}: name must match {_NODE_NAME.pattern}")
        if name in known:
            raise GraphError(f"node {name!r}: duplicate name")
        if op not in _OPS:
            raise GraphError(
                f"node {name!r}: op {op!r} is not allowed (placeholder, call_function, "
                "call_method, output)"
            )
        if output is not None:
            raise GraphError(f"node {name!r}: comes after the output node")
        if not isinstance(target, str) or len(target) > 128:
            raise GraphError(f"node {name!r}: target must be a short string")
        args, kwargs = _field(raw, "args", []) or [], _field(raw, "kwargs", {}) or {}
        if not isinstance(args, (list, tuple)) or not isinstance(kwargs, Mapping):
            raise GraphError(f"node {name!r}: args must be a list and kwargs an object")
        budget = _Budget(name)
        dargs = tuple(_decode_arg(a, name, known, 0, budget) for a in args)
        dkwargs = {}
        for k, v in kwargs.items():
            if not isinstance(k, str) or not _NODE_NAME.fullmatch(k):
                raise GraphError(f"node {name!r}: keyword {k!r} is not a name")
            dkwargs[k] = _decode_arg(v, name, known, 0, budget)
        spec = None
        if op == "placeholder":
            if nodes and nodes[-1].op != "placeholder":
                raise GraphError(f"node {name!r}: placeholders must come first")
            if dargs or dkwargs:
                raise GraphError(f"node {name!r}: a placeholder takes no arguments (no defaults)")
            placeholders.append(target)
        elif op == "output":
            if len(dargs) != 1 or dkwargs:
                raise GraphError(f"node {name!r}: the output takes one argument")
            output = dargs[0]
        else:
            spec = OPS.get((op, target))
            if spec is None:
                raise GraphError(
                    f"node {name!r}: {op} target {target!r} is not an allowed operation "
                    "(docs/serve.md lists them)"
                )
            if not spec.min_args <= len(dargs) <= spec.max_args:
                raise GraphError(
                    f"node {name!r}: {target} takes {spec.min_args}..{spec.max_args} positional "
                    f"arguments, got {len(dargs)}"
                )
            extra = sorted(set(dkwargs) - spec.kwargs)
            if extra:
                raise GraphError(f"node {name!r}: {target} takes no keyword {extra[0]!r}")
        known[name] = i
        nodes.append(Node(name, op, target, spec, dargs, dkwargs))
    if output is None:
        raise GraphError("graph has no output node")
    names = [n for n, _ in inputs]
    if placeholders != names:
        raise GraphError(
            f"graph placeholders {placeholders} do not match the declared inputs {names}"
        )
    if not (isinstance(output, (tuple, list)) and len(output) == 2):
        raise GraphError(f"node {nodes[-1].name!r}: the output must be (loss, metrics)")
    loss, metrics = output
    if not isinstance(loss, Ref):
        raise GraphError(f"node {nodes[-1].name!r}: the loss must be a node")
    if not isinstance(metrics, dict):
        raise GraphError(f"node {nodes[-1].name!r}: the metrics must be a dict")
    for key, value in metrics.items():
        if not _METRIC_KEY.fullmatch(key):
            raise GraphError(
                f"node {nodes[-1].name!r}: metric {key!r} must be named custom/<name>:sum or "
                "custom/<name>:mean"
            )
        if not isinstance(value, Ref):
            raise GraphError(f"node {nodes[-1].name!r}: metric {key!r} must be a node")
    return tuple(nodes[len(placeholders) : -1]), loss, dict(metrics)


def _check_inputs(inputs: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, (list, tuple)) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise GraphError(f"inputs: give logprobs and at most {MAX_INPUTS - 1} more")
    out = []
    for i, item in enumerate(inputs):
        name, rank = _field(item, "name"), _field(item, "rank")
        if not isinstance(name, str) or not _INPUT_NAME.fullmatch(name):
            raise GraphError(f"inputs[{i}]: name must be lowercase letters, digits, _")
        if isinstance(rank, bool) or rank not in (0, 1, 2):
            raise GraphError(f"inputs[{i}] {name!r}: rank must be 0, 1 or 2")
        out.append((name, int(rank)))
    if out[0][0] != "logprobs" or out[0][1] == 0:
        raise GraphError("inputs[0] must be logprobs with rank 1 or 2")
    if len({n for n, _ in out}) != len(out) or "target_tokens" in [n for n, _ in out[1:]]:
        raise GraphError("inputs: names must be unique and not target_tokens")
    return tuple(out)


# -- the program ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A validated graph: run it per datum with `run` (traced under ``jax.vmap``).

    Attributes:
      name: the loss's name (the SDK's function name).
      inputs: ``(name, rank)`` of every input, ``logprobs`` first.
      nodes: the call nodes, in order.
      loss: the loss node's ref; metrics: metric key → ref.
    """

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[Node, ...]
    loss: Ref
    metrics: Mapping[str, Ref]

    @functools.cached_property
    def loss_and_grad(self) -> Callable[..., Any]:
        """Jitted ``(lp[R, W], data) -> (loss, metrics, dL/dlp)`` of `batch_loss` (one compile
        per bucket shape), for `runner.local.LocalTrainer.forward_backward_logprob_loss`."""

        def run(lp, data):
            (loss, metrics), g = jax.value_and_grad(
                lambda x: batch_loss(self, x, data), has_aux=True
            )(lp)
            return loss, metrics, g

        return jax.jit(run)

    @property
    def input_names(self) -> tuple[str, ...]:
        """The ``loss_fn_inputs`` keys the loss reads (after logprobs)."""
        return tuple(n for n, _ in self.inputs[1:])

    def run(self, values: Sequence[Any], length: Any, width: int) -> tuple[Any, dict[str, Any]]:
        """``(loss, metrics)`` of one datum: ``values`` are its inputs (logprobs first) padded to
        ``width`` along the token axis; ``length`` its number of targets (0-d int)."""
        ctx = _Ctx(length=length, width=width)
        env: dict[str, Any] = {
            name: TVal(v, 0 if rank else None)
            for (name, rank), v in zip(self.inputs, values, strict=True)
        }

        def resolve(a: Any) -> Any:
            if isinstance(a, Ref):
                return env[a.name]
            if isinstance(a, tuple):
                return tuple(resolve(x) for x in a)
            if isinstance(a, list):
                return [resolve(x) for x in a]
            if isinstance(a, dict):
                return {k: resolve(x) for k, x in a.items()}
            return a

        for node in self.nodes:
            try:
                out = node.spec.fn(  # type: ignore[union-attr]
                    ctx, *resolve(node.args), **resolve(dict(node.kwargs))
                )
            except GraphError as exc:
                raise GraphError(f"node {node.name!r} ({node.target}): {exc}") from None
            except (TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
                msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise GraphError(f"node {node.name!r} ({node.target}): {msg}") from None
            env[node.name] = out
        loss = self._scalar(env[self.loss.name], "the loss", self.loss.name)
        metrics = {
            k: jax.lax.stop_gradient(self._scalar(env[r.name], f"metric {k!r}", r.name))
            for k, r in self.metrics.items()
        }
        return loss, metrics

    @staticmethod
    def _scalar(value: Any, what: str, node: str) -> Any:
        arr = value.arr if isinstance(value, TVal) else value
        if isinstance(arr, (bool, int, float)):
            return jnp.asarray(arr, jnp.float32)
        if not hasattr(arr, "shape") or arr.shape != ():
            shape = getattr(arr, "shape", type(arr).__name__)
            raise GraphError(f"node {node!r}: {what} must be a scalar, got shape {shape}")
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            arr = arr.astype(jnp.float32)
        return arr

    def check_shapes(self, width: int = 5, k: int = 3) -> None:
        """Traces the graph abstractly on one example datum (no compilation); raises
        `GraphError` naming the node whose operation fails or whose result is not a scalar."""
        examples = [jax.ShapeDtypeStruct((width, k)[:rank], jnp.float32) for _, rank in self.inputs]
        length = jax.ShapeDtypeStruct((), jnp.int32)
        jax.eval_shape(lambda vs, n: self.run(vs, n, width), examples, length)


def compile_graph(name: Any, inputs: Any, graph: Any, *, max_nodes: int = MAX_NODES) -> Program:
    """Validates a ``create_custom_loss`` request's graph into a `Program` (module docstring).

    Args:
      name: the loss's name.
      inputs: ``[{name, rank}]``, ``logprobs`` first (SDK ``CustomLossInput`` or mappings).
      graph: the ``CustomLossGraph`` (SDK model or mapping).
      max_nodes: the node limit (``--max-loss-nodes``).

    Returns:
      The `Program`.

    Raises:
      GraphError: naming the node and the rule.
    """
    if not isinstance(name, str) or not 0 < len(name) <= 128:
        raise GraphError("name must be a non-empty string of at most 128 characters")
    declared = _check_inputs(inputs)
    nodes, loss, metrics = _decode(graph, declared, max_nodes)
    program = Program(name, declared, nodes, loss, metrics)
    program.check_shapes()
    return program


# -- a batch of datums ----------------------------------------------------------------------


def batch_inputs(program: Program, seqs: Sequence[Any], rows: int, width: int) -> dict:
    """Host arrays for `batch_loss`: each input of each datum edge-padded to ``width``.

    ``seqs`` are `runner.Seq` whose ``inputs`` hold the loss_fn_inputs; rows past ``len(seqs)``
    (the row bucket) repeat datum 0 and count for nothing.

    Raises:
      ValueError: an input is missing or has the wrong rank or length (naming datum and key).
    """
    n = len(seqs)
    lengths = np.ones(rows, np.int32)
    lengths[:n] = [s.num_targets for s in seqs]
    out: dict[str, np.ndarray] = {}
    for name, rank in program.inputs[1:]:
        first = None
        arrays = []
        for i, seq in enumerate(seqs):
            if name not in seq.inputs:
                raise ValueError(f"datum {i}: loss_fn_inputs has no {name!r}, which the loss reads")
            a = np.asarray(seq.inputs[name], np.float32)
            if rank == 0:
                a = a.reshape(-1) if a.size == 1 else a
                if a.size != 1:
                    raise ValueError(f"datum {i}: loss_fn_inputs[{name!r}] must be a scalar")
                arrays.append(a.reshape(()))
                continue
            if a.ndim != rank or a.shape[0] != seq.num_targets:
                raise ValueError(
                    f"datum {i}: loss_fn_inputs[{name!r}] has shape {a.shape}; the loss declared "
                    f"rank {rank} with one row per target ({seq.num_targets})"
                )
            if rank == 2:
                first = a.shape[1] if first is None else first
                if a.shape[1] != first:
                    raise ValueError(
                        f"datum {i}: loss_fn_inputs[{name!r}] has K={a.shape[1]}, "
                        f"datum 0 has K={first}"
                    )
            pad = [(0, width - a.shape[0])] + [(0, 0)] * (rank - 1)
            arrays.append(np.pad(a, pad, mode="edge"))
        arrays += [arrays[0]] * (rows - n)
        out[name] = np.stack(arrays)
    return {"lengths": lengths, "real": (np.arange(rows) < n).astype(np.float32), "inputs": out}


def batch_loss(program: Program, lp_RW: Any, data: Mapping[str, Any]):
    """``(loss, metrics)`` of a padded batch: the sum over real rows of the per-datum losses;
    ``:sum`` metrics summed, ``:mean`` metrics averaged over real rows (the SDK's rule)."""
    lengths, real = data["lengths"], data["real"]
    width = lp_RW.shape[1]
    last = jnp.take_along_axis(lp_RW, jnp.maximum(lengths - 1, 0)[:, None], axis=1)
    lp = jnp.where(jnp.arange(width)[None, :] < lengths[:, None], lp_RW, last)  # edge padding
    names = program.input_names

    def one(lp_W, length, *values):
        return program.run((lp_W, *values), length, width)

    losses_R, metrics_R = jax.vmap(one)(lp, lengths, *(data["inputs"][n] for n in names))
    loss = jnp.sum(jnp.where(real > 0, losses_R, 0.0))
    n_real = jnp.maximum(jnp.sum(real), 1.0)
    metrics = {}
    for key, value in metrics_R.items():
        total = jnp.sum(jnp.where(real > 0, value, 0.0))
        metrics[key] = total / n_real if key.endswith(":mean") else total
    return loss, metrics
