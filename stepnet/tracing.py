"""Tracing by operator overloading: symbolic step values and the frames that
record their equations.

Inside ``with rnn.stepnet():`` a :class:`Frame` is open; every op applied to a
:class:`Value` appends one equation to the innermost open frame. Arrays and
:class:`Parameter`s met along the way become constants of the program, found by
data dependence.
"""

from __future__ import annotations

import numbers
import threading

import numpy as np

from . import registry
from .errors import ShapeError, StepNetError
from .ir import Eqn, Literal, Var

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def compute_dtype(dtype, what) -> np.dtype:
    """float32/float64 as they are; float16 computed in float32; others refused."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return np.dtype(np.float32)
    if not dtype.isnative and dtype.newbyteorder("=") in FLOAT_DTYPES + (np.dtype(np.float16),):
        raise ShapeError(f"{what}: dtype {dtype.str} is {dtype.name} in the other byte order "
                         f"than this machine's; pass it as .astype(np.{dtype.name})")
    if dtype not in FLOAT_DTYPES:
        raise ShapeError(f"{what}: dtype {dtype} is not supported (use float16, float32 or float64)")
    return dtype


class Parameter:
    """A named array that a step-net reads; identified by the object itself.

    A step-net's parameters are found by data dependence: every Parameter
    its step reads. A run reads ``value`` as it is then, so assigning a new
    array to ``value`` (or updating it in place) changes the next run.

    Parameters
    ----------
    value : array_like
        Copied; float16, float32 or float64.
    name : str, optional
        The name of its constant in the IR (never used to identify it).

    Raises
    ------
    ShapeError
        ``value``'s dtype is not a float dtype.

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> W = sn.Parameter(np.ones((3, 2), np.float32), name="W")
    >>> W.shape
    (3, 2)
    """

    __array_ufunc__ = None  # numpy defers to our reflected operators

    def __init__(self, value, name=None):
        value = np.array(value, copy=True)
        compute_dtype(value.dtype, f"Parameter {name or ''}".strip())
        self.value = value
        self.name = name

    @property
    def shape(self):
        """``value.shape``."""
        return self.value.shape

    @property
    def dtype(self):
        """``value.dtype``."""
        return self.value.dtype

    def __array__(self, dtype=None, copy=None):
        return self.value if dtype is None else self.value.astype(dtype)

    def __repr__(self):
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype})"

    # Reflected arithmetic with step values: ``W @ x`` style is resolved by Value.
    def _binary(self, other, op, reflected=False):
        if isinstance(other, Value):
            return bind(op, [other, self] if reflected else [self, other])
        return NotImplemented

    def __add__(self, o):
        return self._binary(o, "add")

    def __radd__(self, o):
        return self._binary(o, "add", True)

    def __sub__(self, o):
        return self._binary(o, "sub")

    def __rsub__(self, o):
        return self._binary(o, "sub", True)

    def __mul__(self, o):
        return self._binary(o, "mul")

    def __rmul__(self, o):
        return self._binary(o, "mul", True)

    def __truediv__(self, o):
        return self._binary(o, "div")

    def __rtruediv__(self, o):
        return self._binary(o, "div", True)

    def __matmul__(self, o):
        return self._binary(o, "matmul")

    def __rmatmul__(self, o):
        return self._binary(o, "matmul", True)


class Frame:
    """One step-net block being traced."""

    def __init__(self, rnn, parent, program_state):
        self.rnn = rnn
        self.parent = parent
        self.state = program_state  # shared by all frames of one program
        self.step_inputs = []
        self.static_inputs = []
        self.memories = []  # MemoryHandle
        self.eqns = []
        self.outputs = []
        self.captures = {}  # id(outer Var) -> inner static Var
        self.closed = False
        self.vars = set()  # ids of vars defined in this frame

    def define(self, var):
        self.vars.add(id(var))
        return var

    def ancestors(self):
        f = self
        while f is not None:
            yield f
            f = f.parent


class ProgramState:
    """Names, constants and counters shared by every frame of one program."""

    def __init__(self):
        self.names = set()
        self.counter = 0
        self.consts = {}  # id(source object) -> (Var, source)

    def fresh(self, base=None):
        if base is not None and base not in self.names:
            self.names.add(base)
            return base
        while True:
            self.counter += 1
            name = f"{base}_{self.counter}" if base else f"t{self.counter}"
            if name not in self.names:
                self.names.add(name)
                return name

    def const(self, value):
        """The Var of a Parameter or array read by the step (one per object)."""
        key = id(value)
        if key in self.consts:
            return self.consts[key][0]
        if isinstance(value, Parameter):
            arr, name = value.value, value.name
        else:
            arr, name = np.asarray(value), None
        # (a mask array, as a comparison gives: a boolean constant, read as one)
        dtype = arr.dtype if arr.dtype == np.bool_ and not isinstance(value, Parameter) else \
            compute_dtype(arr.dtype, f"constant {name or ''}".strip())
        var = Var(self.fresh(name or "c"), dtype, tuple(arr.shape))
        self.consts[key] = (var, value)
        return var


class _Frames(threading.local):
    """The step-nets being traced, innermost last: one stack per thread, so
    threads may build step-nets at the same time (a layer's directions build
    theirs on the threads that run them)."""

    def __init__(self):
        self.stack = []


_FRAMES = _Frames()


def current_frame():
    stack = _FRAMES.stack
    return stack[-1] if stack else None


def push_frame(frame):
    _FRAMES.stack.append(frame)


def pop_frame(frame):
    stack = _FRAMES.stack
    assert stack and stack[-1] is frame
    stack.pop()


class Value:
    """A symbolic step value: stands for ``[batch, ...]`` arrays while tracing.

    Made by the step-net's methods and the ops applied inside its block, not
    directly. Operators ``+ - * / @``, unary ``-``, ``abs``, comparisons,
    basic slicing of feature axes and ``sn.ops.*`` apply to it.

    Parameters
    ----------
    var : stepnet.ir.Var
        The IR variable it stands for.
    frame : stepnet.tracing.Frame
        The step-net block it belongs to.
    """

    __array_ufunc__ = None  # numpy defers to our reflected operators

    def __init__(self, var, frame):
        self._var = var
        self.frame = frame

    @property
    def var(self):
        """The IR variable (:class:`stepnet.ir.Var`) this value stands for."""
        return self._var

    @property
    def shape(self):
        """The full shape; ``None`` stands for the batch axis."""
        return self.var.shape

    @property
    def dtype(self):
        """The dtype (float32 or float64)."""
        return self.var.dtype

    @property
    def name(self):
        """The name of its IR variable."""
        return self.var.name

    def __repr__(self):
        return f"<step value {self.var!r}>"

    def __bool__(self):
        raise StepNetError(
            "a step value cannot drive Python control flow (if/while/and/or/bool); "
            "use sn.ops.where(cond, a, b) to choose per element"
        )

    def __len__(self):
        raise StepNetError("len() of a step value is not defined; use .shape")

    def __iter__(self):
        raise StepNetError("a step value cannot be iterated; use sn.ops.split or slicing")

    def __add__(self, o):
        return bind("add", [self, o])

    def __radd__(self, o):
        return bind("add", [o, self])

    def __sub__(self, o):
        return bind("sub", [self, o])

    def __rsub__(self, o):
        return bind("sub", [o, self])

    def __mul__(self, o):
        return bind("mul", [self, o])

    def __rmul__(self, o):
        return bind("mul", [o, self])

    def __truediv__(self, o):
        return bind("div", [self, o])

    def __rtruediv__(self, o):
        return bind("div", [o, self])

    def __matmul__(self, o):
        return bind("matmul", [self, o])

    def __rmatmul__(self, o):
        return bind("matmul", [o, self])

    def __neg__(self):
        return bind("neg", [self])

    def __pos__(self):
        return self

    def __abs__(self):
        return bind("abs", [self])

    def __gt__(self, o):
        return bind("greater", [self, o])

    def __ge__(self, o):
        return bind("greater_equal", [self, o])

    def __lt__(self, o):
        return bind("less", [self, o])

    def __le__(self, o):
        return bind("less_equal", [self, o])

    def __getitem__(self, index):
        """Basic slicing of feature axes: ``x[:, 0:64]``."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > len(self.shape):
            dims = ", ".join("B" if d is None else str(d) for d in self.shape)
            raise StepNetError(f"{len(index)} indices for a step value of {len(self.shape)} axes "
                               f"([{dims}], the batch axis B first)")
        out = self
        for axis, item in enumerate(index):
            if not isinstance(item, slice) or item.step not in (None, 1):
                raise StepNetError(
                    "a step value supports only basic slices with step 1 (x[:, a:b]); "
                    f"got {index!r}"
                )
            if item == slice(None):
                continue
            size = out.shape[axis]
            if size is None:
                raise StepNetError("the batch axis of a step value cannot be sliced")
            start, stop, _ = item.indices(size)
            out = bind("slice", [out], axis=axis, start=start, stop=max(start, stop))
        return out

    __hash__ = object.__hash__


def _operand_var(x, frame):
    """The Var (or Literal) that stands for ``x`` inside ``frame``."""
    if isinstance(x, Value):
        var = x.var
        owner = x.frame
        if owner is frame:
            return var
        if owner.state is not frame.state or owner not in list(frame.ancestors()):
            raise StepNetError(
                f"step value {var.name} is used outside its step-net block"
                + (" (its block has ended)" if owner.closed else "")
            )
        return capture(frame, owner, var)
    if isinstance(x, (bool, np.bool_)):
        return Literal(bool(x))
    if isinstance(x, np.floating):
        # NumPy's float scalars keep their dtype, as in NumPy (NEP 50): a 0-d constant
        return frame.state.const(x)
    if isinstance(x, numbers.Real) and not isinstance(x, np.ndarray):
        return Literal(float(x))
    if isinstance(x, (Parameter, np.ndarray)):
        return frame.state.const(x)
    if isinstance(x, (list, tuple)):
        raise StepNetError("wrap lists in np.asarray(...) or sn.Parameter(...) before using them")
    raise StepNetError(f"cannot use {type(x).__name__} in a step-net")


def capture(frame, owner, var):
    """An outer step value read inside a nested block becomes a static input of
    the nested step-net (one value per inner sequence = per outer batch row)."""
    chain = []
    f = frame
    while f is not owner:
        chain.append(f)
        f = f.parent
    for f in reversed(chain):  # outermost nested first
        key = id(var)
        if key not in f.captures:
            if var.lod_depth:
                raise StepNetError(
                    f"ragged step value {var.name} cannot be read inside a nested step-net; "
                    "pass it with add_input or add_static_input"
                )
            inner = f.define(Var(f.state.fresh(var.name), var.dtype, var.shape))
            f.captures[key] = inner
            f.static_inputs.append((inner, var))
        var = f.captures[key]
    return var


def bind(opname, operands, **attrs):
    """Apply a primitive: trace it inside a block, compute it eagerly outside."""
    op = registry.get(opname)
    # eager on plain arrays; traced on step values, and on Parameters inside a
    # step block (so the run reads the Parameter's current value)
    if not any(isinstance(x, Value) for x in operands) and not (
            current_frame() is not None and any(isinstance(x, Parameter) for x in operands)):
        arrays = [
            x.value if isinstance(x, Parameter) else x for x in operands
        ]
        return op.numpy(*arrays, **attrs)
    frame = current_frame()
    if frame is None:
        owner = next(x.frame for x in operands if isinstance(x, Value))
        raise StepNetError(
            f"step value {next(x for x in operands if isinstance(x, Value)).name} is used "
            "outside its step-net block"
            + (" (its block has ended)" if owner.closed else "")
        )
    ins = [_operand_var(x, frame) for x in operands]
    if "axis" in attrs and opname in ("sum", "concat", "slice", "pad"):
        attrs["axis"] = registry.normalize_axis(opname, ins[0], attrs["axis"])
    avals = op.infer(ins, attrs)
    outs = tuple(
        frame.define(Var(frame.state.fresh(), np.dtype(a.dtype), tuple(a.shape), a.lod_depth))
        for a in avals
    )
    frame.eqns.append(Eqn(opname, tuple(ins), outs, dict(attrs)))
    values = [Value(v, frame) for v in outs]
    return values[0] if len(values) == 1 else values
