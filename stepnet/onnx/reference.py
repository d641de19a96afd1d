"""ONNX ops run by the ONNX project's reference implementation (``onnx.reference``).

Every node of the default domain that is neither recurrent, control flow nor in
stepnet's own table (:mod:`stepnet.onnx.ops`) runs here: its class from
``onnx.reference.ops`` is loaded and instantiated once, when the session is
made, and called on each run. Where ``onnx.reference`` has no implementation
for an opset the nearest one that means the same is used:

- ``DequantizeLinear`` 10-18 by version 19 (which adds types, not meaning);
- ``Scatter`` (deprecated since 11) by ``ScatterElements``, its new name;
- ``Gelu`` 20+ and ``GroupNormalization`` 18+ are functions whose body
  depends on the input types: built on the first run, once per input types;
- ``BatchNormalization`` 9-13 with one output (inference) by version 14
  with ``training_mode`` 0 (the reference's 9 takes a training path);
- ``GlobalLpPool``, ``MaxRoiPool`` and ``Multinomial`` have none, and its
  ``LRN`` and its ``LogSoftmax`` and ``Hardmax`` before 13 (which read the
  input as 2-D at ``axis``) mean something else, and its ``LogSoftmax`` from
  13 gives -inf for a row whose values span more than a float's exponent:
  they are written below in NumPy.
"""

from __future__ import annotations

import numpy as np

from .. import sizes
from ..errors import Error, ShapeError


def _evaluator():
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator


def run_params(opsets) -> dict:
    """What an ``onnx.reference`` op class is instantiated with."""
    return {"log": lambda *args: None, "opsets": dict(opsets), "verbose": 0, "new_ops": None,
            "existing_functions": {}, "evaluator_cls": _evaluator()}


class ReferenceOp:
    """One node run by ``onnx.reference``: ``op(*inputs) -> list of outputs``.

    ``ctx`` names the node in errors; ``opsets`` maps domains ("" for the
    default one) to the model's versions."""

    def __init__(self, proto, ctx, opsets):
        from onnx.reference.op_run import RuntimeContextError

        self.ctx = ctx
        self.proto = proto
        self.params = run_params(opsets)
        self.by_types = None  # a context-dependent function: one op per input types
        if ctx.op in _NEEDS:
            module, package = _NEEDS[ctx.op]
            try:
                __import__(module)
            except ImportError:
                raise ctx.unsupported(f"onnx.reference runs {ctx.op} with {package}, which is not "
                                      f"installed (pip install {package})") from None
        own = _NUMPY.get((ctx.op, ctx.opset), _NUMPY.get(ctx.op))
        if own is not None:
            self.impl = _Own(own, proto)
            return
        op_type, version = _ALIASES.get((ctx.op, ctx.opset), (ctx.op, ctx.opset))
        if ctx.op == "BatchNormalization" and 9 <= ctx.opset < 14 and len(proto.output) == 1:
            # inference (one output): version 14's meaning, training_mode 0
            # (the reference's 9 fills in a momentum and takes its training path)
            version = 14
        if op_type != ctx.op:
            proto = _renamed(proto, op_type)
        self.proto = proto
        try:
            cls = _load(op_type, version)
        except RuntimeContextError:
            self.by_types = {}
            self.impl = None
            return
        except (NotImplementedError, RuntimeError) as e:
            raise ctx.unsupported(f"onnx.reference has no implementation of {ctx.op}-{ctx.opset} "
                                  f"({e})") from None
        try:
            self.impl = cls(proto, self.params)
        except Exception as e:  # the reference's own complaint, with the node named
            raise Error(f"ONNX node {ctx.node!r} ({ctx.op}): its attributes do not load: {e}") from e

    def __call__(self, *inputs):
        impl = self.impl if self.by_types is None else self._typed(inputs)
        try:
            if self.ctx.op in _SIZED:
                _check_size(self.ctx, inputs)
            outs = impl.run(*inputs)
        except Error:
            raise
        except Exception as e:  # the reference's own complaint, with the node named
            raise ShapeError(f"ONNX node {self.ctx.node!r} ({self.ctx.op}): {type(e).__name__}: "
                             f"{e}") from e
        # strings as onnxruntime gives them: object arrays
        return [y.astype(object) if isinstance(y, np.ndarray) and y.dtype.kind == "U" else y
                for y in outs]

    def _typed(self, inputs):
        from onnx import helper
        from onnx.reference.ops import load_op

        key = tuple((np.asarray(x).dtype.str, np.shape(x)) for x in inputs)
        impl = self.by_types.get(key)
        if impl is None:
            types = [helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(np.asarray(x).dtype),
                                                   list(np.shape(x))) for x in inputs]
            cls = load_op("", self.ctx.op, self.ctx.opset, node=self.proto, input_types=types,
                          evaluator_cls=_evaluator())
            impl = self.by_types[key] = cls(self.proto, self.params)
        return impl


def _load(op_type, version):
    from onnx.reference.ops import load_op

    return load_op("", op_type, version, evaluator_cls=_evaluator())


def _renamed(proto, op_type):
    from onnx import NodeProto

    copy = NodeProto()
    copy.CopyFrom(proto)
    copy.op_type = op_type
    return copy


# ops whose output's shape is read from their inputs' values: (shape, dtype or
# None), checked (stepnet.sizes) before they run; a few bytes of a file can ask
# for terabytes
_SIZED = {
    "ConstantOfShape": lambda shape: (np.asarray(shape).tolist(), None),
    "Expand": lambda x, shape: (np.broadcast_shapes(np.shape(x), tuple(shape)), np.asarray(x).dtype),
    "Tile": lambda x, repeats: (np.multiply(np.shape(x), repeats).tolist(), np.asarray(x).dtype),
    "Range": lambda start, limit, delta: ([max(int(np.ceil((np.ravel(limit)[0] - np.ravel(start)[0])
                                                          / np.ravel(delta)[0])), 0)],
                                          np.asarray(start).dtype),
}


def _check_size(ctx, inputs):
    """SizeError naming the node if its output would not fit; inputs the
    estimate cannot read are left to the op to refuse."""
    try:
        shape, dtype = _SIZED[ctx.op](*inputs)
    except (ArithmeticError, IndexError, TypeError, ValueError):
        return
    sizes.check(f"ONNX node {ctx.node!r} ({ctx.op}): its output", shape, dtype)
_NEEDS = {"ImageDecoder": ("PIL", "Pillow")}  # what the reference imports to run the op
_ALIASES = {("DequantizeLinear", v): ("DequantizeLinear", 19) for v in range(10, 19)}
_ALIASES.update({("Scatter", v): ("ScatterElements", 11) for v in range(9, 23)})


# ----------------------------------------------------------------------------
# ops onnx.reference does not implement


class _Own:
    """A NumPy function ``fn(*inputs, **attrs) -> tuple`` with the node's attributes."""

    def __init__(self, fn, proto):
        from onnx import helper

        self.fn = fn
        self.attrs = {}
        for a in proto.attribute:
            value = helper.get_attribute_value(a)
            self.attrs[a.name] = value.decode() if isinstance(value, bytes) else value

    def run(self, *inputs):
        return self.fn(*inputs, **self.attrs)


def _global_lp_pool(x, p=2):
    axes = tuple(range(2, x.ndim))
    y = np.sum(np.abs(x) ** p, axis=axes, keepdims=True) ** (1.0 / p)
    return (y.astype(x.dtype),)


def _max_roi_pool(x, rois, pooled_shape, spatial_scale=1.0):
    """Each region of interest ``[batch, x1, y1, x2, y2]`` max-pooled into
    ``pooled_shape`` bins (Caffe's ROIPooling, which the operator follows)."""
    ph, pw = pooled_shape
    H, W = x.shape[2:]
    out = np.zeros((len(rois), x.shape[1], ph, pw), x.dtype)
    for r, (b, x1, y1, x2, y2) in enumerate(np.asarray(rois)):
        # C's round(): halves away from zero (np.round rounds them to even)
        x1, y1, x2, y2 = (int(np.sign(v) * np.floor(abs(v * spatial_scale) + 0.5))
                          for v in (x1, y1, x2, y2))
        h, w = max(y2 - y1 + 1, 1), max(x2 - x1 + 1, 1)
        for i in range(ph):
            h0 = min(max(int(np.floor(i * h / ph)) + y1, 0), H)
            h1 = min(max(int(np.ceil((i + 1) * h / ph)) + y1, 0), H)
            for j in range(pw):
                w0 = min(max(int(np.floor(j * w / pw)) + x1, 0), W)
                w1 = min(max(int(np.ceil((j + 1) * w / pw)) + x1, 0), W)
                if h1 > h0 and w1 > w0:
                    out[r, :, i, j] = x[int(b), :, h0:h1, w0:w1].max(axis=(1, 2))
    return (out,)


def _multinomial(x, dtype=6, sample_size=1, seed=None):
    """``sample_size`` draws per row from the distribution whose unnormalized
    log-probabilities are the row."""
    from onnx import helper

    rng = np.random.default_rng(None if seed is None else int(seed))
    logits = np.asarray(x, np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    draws = np.stack([rng.choice(p.shape[1], size=sample_size, p=row) for row in p])
    return (draws.astype(helper.tensor_dtype_to_np_dtype(dtype)),)


def rows_at(fn, x, axis=1):
    """``fn`` (over the rows of a 2-D array) of ``x`` read as 2-D at ``axis``,
    in ``x``'s shape: the meaning of Softmax, LogSoftmax and Hardmax before
    opset 13."""
    x = np.asarray(x)
    axis = axis % x.ndim if x.ndim else 0
    return fn(x.reshape(int(np.prod(x.shape[:axis])), -1)).reshape(x.shape)


def _on_2d(fn):
    return lambda x, axis=1: (rows_at(fn, x, axis),)


def _log_softmax(x, axis=-1):
    """LogSoftmax over ``axis``, shifted by the maximum: a row whose values
    span more than a float's exponent keeps its finite values (the
    reference takes the log of a softmax that underflows to 0)."""
    x = np.asarray(x)
    if x.size == 0:
        return (x.copy(),)
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return (shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True)),)


def _log_softmax_rows(x):
    return _log_softmax(x, axis=1)[0]


def _hardmax_rows(x):
    out = np.zeros_like(x)
    if x.size:
        out[np.arange(x.shape[0]), np.argmax(x, axis=1)] = 1
    return out


def _lrn(x, size, alpha=1e-4, beta=0.75, bias=1.0):
    """Local response normalization across channels (axis 1), as the
    operator's formula (the reference sums over the wrong axis)."""
    x = np.asarray(x)
    squares = np.square(x)
    total = np.zeros_like(x)
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    for c in range(x.shape[1]):
        total[:, c] = squares[:, max(0, c - lo):min(x.shape[1], c + hi + 1)].sum(axis=1)
    return ((x / (bias + alpha / size * total) ** beta).astype(x.dtype),)


_NUMPY = {"GlobalLpPool": _global_lp_pool, "MaxRoiPool": _max_roi_pool,
          "Multinomial": _multinomial, "LRN": _lrn, "LogSoftmax": _log_softmax,
          **{("LogSoftmax", v): _on_2d(_log_softmax_rows) for v in range(1, 13)},
          **{("Hardmax", v): _on_2d(_hardmax_rows) for v in range(1, 13)}}
