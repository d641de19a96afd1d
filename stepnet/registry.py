"""The op table: one :class:`OpDef` per primitive.

An entry holds everything stepnet knows about a primitive: its function
(``sn.ops.tanh``), its shape/dtype rule, its NumPy reference, its gradient
rule, its code for each backend and its ONNX forms. The interpreter, autodiff,
the backends, ONNX export and import and the YAML expressions read the
entries; none keeps its own list of ops (only the kernels of matmul, the
reduction and the shape ops are still written in each backend).
``primitives.py`` registers them; docs/adding-an-op.md says how to add one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import ShapeError, StepNetError, UnsupportedError
from .values import Literal, Var

_OPS: dict = {}


@dataclass(frozen=True)
class Aval:
    """An abstract value: what a shape rule returns."""

    shape: tuple
    dtype: np.dtype

    def type_str(self) -> str:
        return Var("", self.dtype, self.shape).type_str()


@dataclass
class OpDef:
    """One primitive.

    - ``rule(avals, **attrs) -> Aval``: shape and dtype of the result; raises
      ShapeError naming the op and the operands' shapes.
    - ``numpy(*arrays, **attrs) -> ndarray``: the reference implementation.
    - ``kind``: "elementwise" (fusable into one loop), "matmul", "reduce"
      or "shape" (concat, slice).
    - ``function``: the public function, ``sn.ops.<name>``.
    - ``grad(em, eqn, g) -> [cotangent or None per operand]``: the gradient
      rule (reverse mode), written with ``em.op`` (see ``primitives.py``);
      None: the result is not differentiable (a comparison).
    - ``numba``, ``cuda``: an elementwise op's code for that backend: a scalar
      expression template, ``{0}``, ``{1}``, ... the operands' code. A Numba
      template may name ``{bits}`` (32 or 64: the result's float width, for
      the helpers of ``jit/numba_runtime.py``), ``np`` and ``math``; a CUDA
      one ``{one}`` and ``{zero}`` (of the result's dtype) and ``math``.
      Or ``code(*operands, **attrs)`` giving the expression, the attributes
      as literals of the result's dtype (clip). ``cuda`` defaults to the
      Numba template.
    - ``onnx``: the export: the name of the ONNX operator computing it
      (operands cast to the result type), or ``emit(g, eqn, operand)`` adding
      nodes to the ONNX graph ``g`` (``operand(v, dtype=None)``: the ONNX name
      of operand ``v``) and returning the result's name.
    - ``onnx_import``: the ONNX operator that an imported model's node runs as
      this op (same operands, same meaning); None where stepnet.onnx.ops has
      its own entry (variadic Max, MatMul's layouts, Clip's bound inputs).
    """

    name: str
    rule: Callable
    numpy: Callable
    kind: str
    num_inputs: int | None = None  # None: variadic
    function: Callable | None = None
    grad: Callable | None = None
    numba: str | Callable | None = None
    cuda: str | Callable | None = None
    onnx: str | Callable | None = None
    onnx_import: str | None = None

    def infer(self, operands, attrs) -> list:
        if self.num_inputs is not None and len(operands) != self.num_inputs:
            raise StepNetError(f"{self.name} takes {self.num_inputs} operands, got {len(operands)}")
        for v in operands:
            if isinstance(v, Var) and v.lod_depth:
                raise UnsupportedError(
                    f"{self.name}: {v.name} is a ragged (nested sequence) value; arithmetic on it "
                    "is not supported: feed it to a nested step-net's add_input and compute "
                    "inside that step, or pass it to add_outputs"
                )
        out = self.rule(list(operands), **attrs)
        return out if isinstance(out, list) else [out]


def register(name, rule, numpy, kind, num_inputs=None, **fields):
    """Register op ``name`` with the function it decorates as ``sn.ops.<name>``;
    ``fields`` are the other fields of :class:`OpDef`."""

    def decorate(function):
        if name in _OPS:
            raise ValueError(f"op {name} is registered twice")
        fields.setdefault("cuda", fields.get("numba"))
        _OPS[name] = OpDef(name, rule, numpy, kind, num_inputs, function, **fields)
        return function

    return decorate


def get(name) -> OpDef:
    try:
        return _OPS[name]
    except KeyError:
        raise UnsupportedError(f"unknown op {name!r}") from None


def all_ops() -> dict:
    return dict(_OPS)


# ----------------------------------------------------------------------------
# helpers for shape rules; ``None`` in a shape is the batch axis


def shape_str(v) -> str:
    if isinstance(v, Literal):
        return f"scalar {v.value!r}"
    return v.type_str()


def result_dtype(operands) -> np.dtype:
    """NumPy promotion with Python scalars weak (NEP 50)."""
    dtypes = [np.dtype(v.dtype) for v in operands if not isinstance(v, Literal)]
    if not dtypes:
        raise StepNetError("an op needs at least one array operand")
    scalars = [v.value for v in operands if isinstance(v, Literal)]
    return np.result_type(*dtypes, *scalars)


def literal_dtype(eqn) -> np.dtype:
    """The dtype the Literal operands of ``eqn`` take in generated code: its
    first float operand's (comparisons, ``where``), else its result's."""
    for v in eqn.inputs:
        if isinstance(v, Var) and np.dtype(v.dtype).kind == "f":
            return v.dtype
    return eqn.outputs[0].dtype


def broadcast(opname, operands) -> tuple:
    """Broadcast full shapes, keeping the batch axis (``None``) leading."""
    shapes = [v.shape for v in operands if not isinstance(v, Literal)]
    ndim = max(len(s) for s in shapes)
    out = []
    for axis in range(-ndim, 0):
        dims = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        if len(dims) > 1:
            raise ShapeError(
                f"{opname}: shapes do not broadcast: "
                + ", ".join(shape_str(v) for v in operands if not isinstance(v, Literal))
            )
        out.append(dims.pop() if dims else 1)
    if None in out[1:]:
        raise ShapeError(
            f"{opname}: a constant operand has more dimensions than the step value it meets, "
            "which would move the batch axis: "
            + ", ".join(shape_str(v) for v in operands if not isinstance(v, Literal))
        )
    return tuple(out)


def normalize_axis(opname, v, axis) -> int:
    """A user axis (counting the batch axis, negative allowed) made non-negative."""
    ndim = len(v.shape)
    if not -ndim <= axis < ndim:
        raise ShapeError(f"{opname}: axis {axis} is out of range for {shape_str(v)}")
    axis %= ndim
    if v.shape[axis] is None:
        raise ShapeError(
            f"{opname}: axis {axis} of {shape_str(v)} is the batch axis; "
            "a step computes each sequence on its own"
        )
    return axis


def check_float(opname, dtype) -> None:
    if np.dtype(dtype).kind != "f":
        raise ShapeError(f"{opname}: needs a floating-point operand, got {np.dtype(dtype)}")
