"""The op table: one :class:`OpDef` per primitive.

An entry holds everything stepnet knows about a primitive: its shape/dtype
rule, its NumPy reference, its code generation per backend and its gradient
rule. Backends and autodiff look ops up here; nothing else special-cases an op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import ShapeError, StepNetError, UnsupportedError
from ..ir import Literal, Var

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
    - ``codegen``: per backend name, whatever that backend needs to emit code.
    - ``grad``: the gradient rule (reverse mode), written as IR.
    """

    name: str
    rule: Callable
    numpy: Callable
    kind: str
    num_inputs: int | None = None  # None: variadic
    codegen: dict = field(default_factory=dict)
    grad: Callable | None = None

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


def register(name, rule, numpy, kind, num_inputs=None) -> OpDef:
    if name in _OPS:
        raise ValueError(f"op {name} is registered twice")
    op = OpDef(name, rule, numpy, kind, num_inputs)
    _OPS[name] = op
    return op


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
