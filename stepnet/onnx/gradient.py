"""The ONNX Gradient operator (domain ``ai.onnx.preview.training``), by
stepnet's reverse mode.

``Gradient(xs=[...], zs=[...], y="...")`` takes values for ``xs`` then
``zs`` and outputs ``dy/dx`` for each ``x``. The differentiated graph is the
part of the enclosing graph that computes ``y`` from ``xs`` and ``zs`` (and
initializers); it is run again on the node's inputs, keeping each recurrent
node's workspace, then walked backwards from ``y`` with the seed
``ones_like(y)``: for a non-scalar ``y`` the outputs are the gradients of
``sum(y)`` (the spec's examples have a scalar ``y``). GRU, LSTM, RNN and
Scan nodes pull back through their step-nets (:func:`stepnet.vjp`); an op
that imports as one of stepnet's primitives by that primitive's own gradient
rule; the other ops by the rules below, one per op, attached to the op's entry
in :mod:`stepnet.onnx.ops`. A Gradient inside the
differentiated graph (a Gradient of a Gradient) raises UnsupportedError.
"""

from __future__ import annotations

import numpy as np

from ..autodiff import _EagerEmitter, sum_to_shape
from ..ir import Eqn, Var
from .. import registry
from .ops import OPS

# ----------------------------------------------------------------------------
# the rules: rule(ctx, inputs, outputs, grads, **attrs) -> one gradient per input


def _rule(*names):
    def register(fn):
        for name in names:
            OPS[name].vjp = fn
        return fn

    return register


def _float(x) -> bool:
    return x is not None and np.asarray(x).dtype.kind == "f"


def _fit(gs, inputs):
    """Each gradient reduced to its input's shape and cast to its dtype; None
    for non-float inputs."""
    out = []
    for g, x in zip(gs, inputs):
        if g is None or not _float(x):
            out.append(None)
        else:
            x = np.asarray(x)
            out.append(sum_to_shape(g, x.shape).astype(x.dtype, copy=False))
    return out


def _primitive_rule(entry):
    """The gradient rule of stepnet's primitive ``entry``, computed with NumPy:
    the ONNX op it imports (``entry.onnx_import``) means the same."""

    def rule(ctx, inputs, outputs, grads):
        arrays = [np.asarray(x) for x in [*inputs, outputs[0]]]
        variables = [Var(f"v{i}", a.dtype, a.shape) for i, a in enumerate(arrays)]
        eqn = Eqn(entry.name, tuple(variables[:-1]), (variables[-1],))
        em = _EagerEmitter({id(v): a for v, a in zip(variables, arrays)})
        return _fit(entry.grad(em, eqn, grads[0]), inputs)

    return rule


for _entry in registry.all_ops().values():
    if _entry.onnx_import and _entry.grad is not None:
        _rule(_entry.onnx_import)(_primitive_rule(_entry))


@_rule("Identity", "Dropout")
def _identity(ctx, inputs, outputs, grads, **attrs):
    return [grads[0]]


@_rule("Sum")
def _sum(ctx, inputs, outputs, grads):
    return _fit([grads[0]] * len(inputs), inputs)


@_rule("Mean")
def _mean(ctx, inputs, outputs, grads):
    return _fit([grads[0] / len(inputs)] * len(inputs), inputs)


@_rule("Max", "Min")
def _extremum(ctx, inputs, outputs, grads):
    """The gradient goes to the first input holding the extremum."""
    taken = np.zeros(np.shape(outputs[0]), bool)
    out = []
    for x in inputs:
        hit = (np.asarray(x) == outputs[0]) & ~taken
        taken |= hit
        out.append(np.where(hit, grads[0], 0))
    return _fit(out, inputs)


def _unary(name, derivative):
    """``derivative(x, y, **attrs)`` is dy/dx elementwise."""

    @_rule(name)
    def rule(ctx, inputs, outputs, grads, **attrs):
        x = np.asarray(inputs[0])
        return _fit([grads[0] * derivative(x, outputs[0], **attrs)], inputs[:1])


_unary("Softsign", lambda x, y: 1 / (1 + np.abs(x)) ** 2)
_unary("Reciprocal", lambda x, y: -y * y)
_unary("Elu", lambda x, y, alpha=1.0: np.where(x > 0, 1, y + alpha))
_unary("LeakyRelu", lambda x, y, alpha=0.01: np.where(x >= 0, 1, alpha))
_unary("ThresholdedRelu", lambda x, y, alpha=1.0: (x > alpha).astype(x.dtype))
_unary("HardSigmoid", lambda x, y, alpha=0.2, beta=0.5:
       np.where((alpha * x + beta > 0) & (alpha * x + beta < 1), alpha, 0))
_unary("Selu", lambda x, y, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875:
       np.where(x > 0, gamma, y + alpha * gamma))


@_rule("Clip")
def _clip(ctx, inputs, outputs, grads, **attrs):
    x = np.asarray(inputs[0])
    lo, hi = (inputs + [None, None])[1:3] if ctx.opset >= 11 else (attrs.get("min"), attrs.get("max"))
    inside = np.ones(x.shape, bool)
    if lo is not None:
        inside &= x >= np.asarray(lo)
    if hi is not None:
        inside &= x <= np.asarray(hi)
    return _fit([np.where(inside, grads[0], 0)], inputs[:1]) + [None] * (len(inputs) - 1)


def _matmul_grads(a, b, g):
    a, b = np.asarray(a), np.asarray(b)
    a2 = a[None] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = g
    if a.ndim == 1:
        g2 = np.expand_dims(g2, -2)
    if b.ndim == 1:
        g2 = np.expand_dims(g2, -1)
    ga = g2 @ np.swapaxes(b2, -1, -2)
    gb = np.swapaxes(a2, -1, -2) @ g2
    if a.ndim == 1:
        ga = ga.reshape(ga.shape[:-2] + ga.shape[-1:])
    if b.ndim == 1:
        gb = gb.reshape(gb.shape[:-1])
    return _fit([ga, gb], [a, b])


@_rule("MatMul")
def _matmul(ctx, inputs, outputs, grads):
    return _matmul_grads(inputs[0], inputs[1], grads[0])


@_rule("Gemm")
def _gemm(ctx, inputs, outputs, grads, alpha=1.0, beta=1.0, transA=0, transB=0):
    a, b = np.asarray(inputs[0]), np.asarray(inputs[1])
    g = grads[0] * alpha
    a_used, b_used = (a.T if transA else a), (b.T if transB else b)
    ga, gb = _matmul_grads(a_used, b_used, g)
    out = [ga.T if transA else ga, gb.T if transB else gb]
    if len(inputs) > 2 and inputs[2] is not None:
        out += _fit([grads[0] * beta], inputs[2:3])
    return out


@_rule("Concat")
def _concat(ctx, inputs, outputs, grads, axis):
    sizes = [np.shape(x)[axis] for x in inputs]
    parts = np.split(grads[0], np.cumsum(sizes)[:-1], axis=axis)
    return _fit(parts, inputs)


@_rule("Split")
def _split(ctx, inputs, outputs, grads, axis=0, **attrs):
    parts = [np.zeros_like(o) if g is None else g for o, g in zip(outputs, grads)]
    return _fit([np.concatenate(parts, axis=axis)], inputs[:1]) + [None] * (len(inputs) - 1)


@_rule("Squeeze", "Unsqueeze", "Reshape", "Flatten")
def _reshape(ctx, inputs, outputs, grads, **attrs):
    return _fit([np.reshape(grads[0], np.shape(inputs[0]))], inputs[:1]) + [None] * (len(inputs) - 1)


@_rule("Transpose")
def _transpose(ctx, inputs, outputs, grads, perm=None):
    x = np.asarray(inputs[0])
    perm = list(reversed(range(x.ndim))) if perm is None else list(perm)
    return [np.transpose(grads[0], np.argsort(perm))]


@_rule("ReduceSum", "ReduceMean")
def _reduce(ctx, inputs, outputs, grads, **attrs):
    x = np.asarray(inputs[0])
    g = np.asarray(grads[0])
    y = np.asarray(outputs[0])
    # put back the reduced axes (size 1) and spread over them
    kept = np.reshape(g, _kept_shape(x.shape, y.shape, g))
    out = np.broadcast_to(kept, x.shape)
    if ctx.op == "ReduceMean":
        out = out * (y.size / max(x.size, 1)) if x.size else out
    return _fit([out], inputs[:1]) + [None] * (len(inputs) - 1)


def _kept_shape(x_shape, y_shape, g):
    """The reduction's output shape with its reduced axes kept (size 1)."""
    if len(y_shape) == len(x_shape):
        return y_shape
    # keepdims=0: reduced axes are those x has and y lost; match greedily
    shape, j = [], 0
    for n in x_shape:
        if j < len(y_shape) and y_shape[j] == n:
            shape.append(n)
            j += 1
        else:
            shape.append(1)
    return tuple(shape)


@_rule("Slice")
def _slice(ctx, inputs, outputs, grads, **attrs):
    x = np.asarray(inputs[0])
    # the slice, replayed on positions, says where each output element came from
    index = np.arange(x.size).reshape(x.shape)
    taken = OPS["Slice"].run(ctx, index, *inputs[1:], **attrs)
    out = np.zeros(x.size, grads[0].dtype)
    np.add.at(out, np.asarray(taken).ravel(), np.asarray(grads[0]).ravel())
    return [out.reshape(x.shape).astype(x.dtype)] + [None] * (len(inputs) - 1)


@_rule("Gather")
def _gather(ctx, inputs, outputs, grads, axis=0):
    x = np.asarray(inputs[0])
    index = np.arange(x.size).reshape(x.shape)
    taken = np.take(index, np.asarray(inputs[1], np.int64), axis=axis)
    out = np.zeros(x.size, grads[0].dtype)
    np.add.at(out, taken.ravel(), np.asarray(grads[0]).ravel())
    return [out.reshape(x.shape).astype(x.dtype), None]


@_rule("Softmax")
def _softmax(ctx, inputs, outputs, grads, axis=None):
    y, g = outputs[0], grads[0]
    if ctx.opset < 13:
        axis = 1 if axis is None else axis % y.ndim
        y2, g2 = y.reshape(int(np.prod(y.shape[:axis])), -1), g.reshape(int(np.prod(y.shape[:axis])), -1)
        return [(y2 * (g2 - (g2 * y2).sum(axis=1, keepdims=True))).reshape(y.shape)]
    axis = -1 if axis is None else axis
    return [y * (g - (g * y).sum(axis=axis, keepdims=True))]


@_rule("Pow")
def _pow(ctx, inputs, outputs, grads):
    x, p = np.asarray(inputs[0]), np.asarray(inputs[1])
    gx = grads[0] * p * np.power(x, p - 1)
    gp = grads[0] * outputs[0] * np.log(np.where(x > 0, x, 1))
    return _fit([gx, gp], inputs)


@_rule("Cast")
def _cast(ctx, inputs, outputs, grads, **attrs):
    return _fit([grads[0]], inputs[:1])


# ----------------------------------------------------------------------------
# the node


class GradientNode:
    """An ONNX Gradient node; see the module docstring."""

    def __init__(self, ctx, attrs, inputs):
        self.ctx = ctx
        unknown = sorted(set(attrs) - {"xs", "zs", "y"})
        if unknown:
            raise ctx.unsupported(f"attribute {unknown[0]!r} is not supported")
        if "xs" not in attrs or "y" not in attrs:
            raise ctx.unsupported("needs the attributes xs and y")
        self.xs = list(attrs["xs"])
        self.zs = list(attrs.get("zs", []))
        self.y = attrs["y"]
        self.inputs = list(inputs)
        if len(self.inputs) != len(self.xs) + len(self.zs):
            raise ctx.unsupported(f"has {len(self.inputs)} inputs for {len(self.xs)} xs and "
                                  f"{len(self.zs)} zs")

    def _subgraph(self, graph):
        """The nodes between ``xs``/``zs`` and ``y``, in graph order."""
        ctx = self.ctx
        producer = {}
        for node in graph.nodes:
            for name in node.outputs:
                if name:
                    producer[name] = node
        leaves = set(self.xs) | set(self.zs)
        needed, stack, seen = set(), [self.y], set()
        while stack:
            name = stack.pop()
            if name in seen or name in leaves:
                continue
            seen.add(name)
            if name in graph.initializers:
                continue
            node = producer.get(name)
            if node is None:
                raise ctx.unsupported(f"y {self.y!r} depends on {name!r}, which is neither in xs, "
                                      "zs nor computed by the graph")
            if node is not None and node.op == "Gradient":
                raise ctx.unsupported("a Gradient of a Gradient (higher-order derivatives)")
            needed.add(id(node))
            stack.extend(n for n in node.inputs if n)
            if node.op == "Scan":
                stack.extend(node.captures)
        if self.y in leaves:
            raise ctx.unsupported(f"y {self.y!r} is one of xs/zs")
        return [n for n in graph.nodes if id(n) in needed]

    def run(self, graph, env, backend):
        ctx = self.ctx
        values = {name: env[n] for name, n in zip(self.xs + self.zs, self.inputs)}
        nodes = self._subgraph(graph)
        local = dict(graph.initializers)
        local.update(values)
        varying = set(self.xs) | set(self.zs)
        records = []
        for node in nodes:
            inputs = [local[n] if n else None for n in node.inputs]
            while inputs and inputs[-1] is None:
                inputs.pop()
            if node.op == "Scan":
                captures = {n: local[n] for n in node.captures}
                wrt = [n for n in node.captures if n in varying and np.asarray(local[n]).dtype.kind == "f"]
                outs, pullback = node.impl.forward(inputs, backend, captures, keep=True,
                                                   wrt_captures=wrt)
            elif node.recurrent:
                outs, pullback = node.impl.forward(inputs, backend, keep=True)
            else:
                outs = graph.run_op(node, inputs, step=False, rows=False, float16_as_float32=False)
                pullback = None
            if any(n in varying for n in node.inputs if n) or (
                    node.op == "Scan" and any(n in varying for n in node.captures)):
                varying.update(n for n in node.outputs if n)
            records.append((node, inputs, outs, pullback))
            for name, value in zip(node.outputs, outs):
                if name:
                    local[name] = value
        y = np.asarray(local[self.y])
        if y.dtype.kind != "f":
            raise ctx.unsupported(f"y {self.y!r} is {y.dtype}, not floating point")
        grads = {self.y: np.ones_like(y)}
        for node, inputs, outs, pullback in reversed(records):
            out_grads = [grads.get(n) if n else None for n in node.outputs]
            if all(g is None for g in out_grads):
                continue
            if node.op == "Scan":
                in_grads, capture_grads = pullback(out_grads)
            elif pullback is not None:
                in_grads, capture_grads = pullback(out_grads), {}
            else:
                entry = node.entry
                if entry.vjp is None:
                    raise node.ctx.unsupported("has no gradient rule (the Gradient operator "
                                               "cannot differentiate through it)")
                out_grads = [np.zeros_like(o) if g is None else g for o, g in zip(outs, out_grads)]
                in_grads = entry.vjp(node.ctx, inputs, outs, out_grads, **node.attrs)
                capture_grads = {}
            pairs = list(zip(node.inputs, in_grads)) + list(capture_grads.items())
            for name, g in pairs:
                if name and g is not None and name in varying:
                    grads[name] = grads[name] + g if name in grads else g
        outs = []
        for x in self.xs:
            value = np.asarray(local[x])
            g = grads.get(x)
            outs.append(np.zeros_like(value) if g is None
                        else np.asarray(g, value.dtype).reshape(value.shape))
        return outs
