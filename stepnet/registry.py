"""The op table: one :class:`OpDef` per primitive.

An entry holds everything stepnet knows about a primitive: its function
(``sn.ops.tanh``), its shape/dtype rule, its NumPy reference, its gradient
rule, its code for each backend and its ONNX forms. The interpreter, autodiff,
the backends, ONNX export and import and the YAML expressions read the
entries; none keeps its own list of ops. An op's code for the backends is a
scalar template (elementwise ops) or a backend-neutral index form
(``gather`` for shape ops, ``reduction`` for sum and matmul).
The modules of ``stepnet/ops/`` register them (``primitives.py`` imports them
in order); docs/adding-an-op.md says how to add one.
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
    lod_depth: int = 0

    def type_str(self) -> str:
        return Var("", self.dtype, self.shape).type_str()


@dataclass
class OpDef:
    """One primitive.

    - ``rule(avals, **attrs) -> Aval``: shape and dtype of the result; raises
      ShapeError naming the op and the operands' shapes.
    - ``numpy(*arrays, **attrs) -> ndarray``: the reference implementation.
    - ``kind``: "elementwise" (fusable into one loop), "matmul", "reduce",
      "shape" (concat, slice) or "segment" (a reduction over each batch
      row's own rows of a ragged value: ``seq_sum``, ``seq_max``) or
      "quantized" (a product by weights in fewer bits, which each backend
      computes by its own routine: ``matmul_int8``, ``matmul_bf16``).
    - ``function``: the public function, ``sn.ops.<name>``.
    - ``grad(em, eqn, g) -> [cotangent or None per operand]``: the gradient
      rule (reverse mode), written with ``em.op`` (see ``stepnet/ops/primitives.py``);
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
    - ``gather(index, shapes, **attrs) -> [Case]``: a shape op's code for
      every backend, as where each result element comes from (see
      :class:`Case`). ``index`` holds the code of the result element's index,
      one string per axis; ``shapes`` the operands' shapes.
    - ``reduction(index, shapes, **attrs) -> (extent, [operand index])``: a
      reduction's (sum, matmul) code for every backend: the result element
      is the sum over ``k in range(extent)`` of the product of the operands,
      each read at its index (code that may name ``k``).
    - ``segment``: a segment op's code for every backend, ``(combine,
      initial value)``: ``combine`` a template of ``{acc}`` and ``{x}`` (one
      row's element), folded over each batch row's rows.
    - ``elementwise_when(**attrs) -> bool``: an op of another kind that is
      elementwise for these attributes (``broadcast_axis`` growing an axis of
      size 1: each element reads its operand with NumPy broadcasting); it
      then fuses with the elementwise ops around it, by its ``numba`` and
      ``cuda`` templates.
    - ``takes_lod``: the NumPy reference takes ragged operands as LoDTensors
      (the segment ops); the other references get a ragged operand's rows,
      the dense batched operands repeated over them.
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
    gather: Callable | None = None
    reduction: Callable | None = None
    segment: tuple | None = None
    takes_lod: bool = False
    elementwise_when: Callable | None = None

    def numba_code(self, args, dtype, attrs=None) -> str:
        """The op on one element as Numba code (``numba``: every Numba loop's,
        a step-net kernel's and an ONNX fused loop's), ``args`` its operands'
        code, ``attrs`` its attributes as literals of the result's ``dtype``."""
        if self.numba is None:
            raise UnsupportedError(f"numba backend: no code generation for op {self.name!r}")
        if callable(self.numba):
            return self.numba(*args, **(attrs or {}))
        return self.numba.format(*args, bits="32" if np.dtype(dtype) == np.float32 else "64")

    def infer(self, operands, attrs) -> list:
        """The results' avals. A ragged operand of one level (a row per batch
        row's own sub-sequence, e.g. an attention memory given by
        ``add_static_input``) makes a ragged result: the batched dense
        operands are repeated over each batch row's rows."""
        if self.num_inputs is not None and len(operands) != self.num_inputs:
            raise StepNetError(f"{self.name} takes {self.num_inputs} operands, got {len(operands)}")
        ragged = [v for v in operands if isinstance(v, Var) and v.lod_depth]
        for v in ragged:
            if v.lod_depth > 1:
                raise UnsupportedError(
                    f"{self.name}: {v.name} is a ragged value of {v.lod_depth} levels; arithmetic "
                    "on it is not supported: feed it to a nested step-net's add_input and "
                    "compute inside that step, or pass it to add_outputs"
                )
        if ragged and self.kind == "matmul" and (
                any(operands[1] is v for v in ragged) or getattr(operands[1], "batched", False)):
            raise UnsupportedError(
                f"matmul: {operands[1].name} is a step value; a ragged value "
                f"({ragged[0].name}) is multiplied by a constant only (rows @ W)"
            )
        out = self.rule(list(operands), **attrs)
        out = out if isinstance(out, list) else [out]
        if ragged and self.kind != "segment":
            out = [Aval(a.shape, a.dtype, 1) for a in out]
        return out


@dataclass(frozen=True)
class Case:
    """Part of a shape op's result: where ``lo <= index[axis] < hi`` (all of
    it when ``axis`` is None) the element is operand ``operand`` read at
    ``index`` (code per operand axis), or zero when ``operand`` is None."""

    operand: int | None
    index: tuple = ()
    axis: int | None = None
    lo: int = 0
    hi: int = 0


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


def number_code(value) -> str:
    """``value`` as Python code of a float in a generated kernel (inf and NaN
    through ``float``, which Numba compiles on the CPU and the GPU)."""
    value = float(value)
    return repr(value) if np.isfinite(value) else f"float('{value!r}')"


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


def broadcast_shapes(shapes):
    """Full shapes broadcast (the batch axis ``None`` a dimension of its own),
    or None where they do not."""
    ndim = max(len(s) for s in shapes)
    out = []
    for axis in range(-ndim, 0):
        dims = {s[axis] for s in shapes if len(s) >= -axis} - {1}
        if len(dims) > 1:
            return None
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def broadcast(opname, operands) -> tuple:
    """Broadcast full shapes, keeping the batch axis (``None``) leading."""
    out = broadcast_shapes([v.shape for v in operands if not isinstance(v, Literal)])
    if out is None:
        raise ShapeError(
            f"{opname}: shapes do not broadcast: "
            + ", ".join(shape_str(v) for v in operands if not isinstance(v, Literal))
        )
    if None in out[1:]:
        raise ShapeError(
            f"{opname}: a constant operand has more dimensions than the step value it meets, "
            "which would move the batch axis: "
            + ", ".join(shape_str(v) for v in operands if not isinstance(v, Literal))
        )
    return out


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
