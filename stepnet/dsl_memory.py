"""A step-net's memories in the Block DSL: :class:`MemoryHandle`, what
``add_memory`` returns, and how its ``init``, ``shape`` and ``dtype`` decide
the memory's feature shape, dtype and whether its initial value is one row per
sequence.
"""

from __future__ import annotations

import operator

import numpy as np

from .dsl_binding import broadcasts
from .errors import ShapeError, StepNetError
from .tracing import Parameter, Value, _operand_var, compute_dtype, current_frame


class MemoryHandle(Value):
    """A memory of a step-net: ``pre_state()`` is its value at t-1; after
    ``update(v)`` the handle itself stands for the value at t.

    Made by :meth:`RNNOp.add_memory`, not directly.

    Parameters
    ----------
    name : str
        The memory's name: the binding name that rebinds its initial value
        (``rnn(h=...)``).
    pre : stepnet.ir.Var
        The step value that stands for the memory at t-1.
    frame : stepnet.tracing.Frame
        The block of the step-net that the memory belongs to.

    Attributes
    ----------
    memory_name : str
        The memory's own name, as given to ``add_memory`` (``"h"``): the
        keyword that rebinds its initial value. Not :attr:`name`, which
        names an IR variable as on every step value.
    """

    def __init__(self, name, pre, frame):
        super().__init__(None, frame)
        self.memory_name = name
        self.pre = pre
        self.post = None

    @property
    def var(self):
        """The IR variable of the updated value (at t).

        Raises
        ------
        StepNetError
            The memory is used before its ``update``: use ``pre_state()``
            for the previous step's value.
        """
        if self.post is None:
            raise StepNetError(
                f"memory {self.memory_name!r} is used before its update; "
                f"use {self.memory_name}.pre_state() for the previous step's value"
            )
        return self.post

    @property
    def name(self):
        """The name of the IR variable the handle stands for, as on every step
        value: after ``update(v)``, ``v``'s name (``"t2"``), not the memory's.

        It is the key of the updated value in each of ``rnn.step_scopes``
        (``keep_scopes=True``), as ``x.name`` (``"x_t"``) is a step input's.
        The memory's own name (``"h"``, the keyword of ``rnn(h=...)``) is
        :attr:`memory_name`; ``pre_state().name`` names the value at t-1
        (``"h_prev"``).

        Raises
        ------
        StepNetError
            Read before ``update``, like any use of the handle.
        """
        return self.var.name

    def __repr__(self):
        return f"<memory {self.memory_name} {self.pre.type_str()}>"

    def pre_state(self):
        """The memory's value at the previous step (its initial value at the first)."""
        return Value(self.pre, self.frame)

    def update(self, value):
        """Set the memory's value at this step; call it once per step-net.

        After the update the handle itself stands for the new value, as an
        operand or in ``add_outputs``.

        Parameters
        ----------
        value : Value
            A step value of this step-net's block with the memory's shape and
            dtype (no LoD).

        Raises
        ------
        StepNetError
            Called outside the memory's own ``stepnet()`` block, a second
            time, or with something that is not a step value.
        ShapeError
            ``value``'s shape, LoD depth or dtype differs from the memory's.
        """
        frame = self.frame
        if frame.closed or current_frame() is not frame:
            raise StepNetError(
                f"memory {self.memory_name!r} must be updated inside its own stepnet() block"
            )
        if self.post is not None:
            raise StepNetError(f"memory {self.memory_name!r} is updated twice")
        if not isinstance(value, Value):
            raise StepNetError(
                f"memory {self.memory_name!r} must be updated with a step value, "
                f"got {type(value).__name__}"
            )
        var = _operand_var(value, frame)
        if var.shape != self.pre.shape or var.lod_depth:
            raise ShapeError(
                f"memory {self.memory_name!r}: update has shape {var.type_str()} but the memory "
                f"is {self.pre.type_str()}; a memory keeps its shape across steps"
            )
        if np.dtype(var.dtype) != np.dtype(self.pre.dtype):
            raise ShapeError(
                f"memory {self.memory_name!r}: update has dtype {np.dtype(var.dtype)} but the "
                f"memory is {np.dtype(self.pre.dtype)}"
            )
        self.post = var


def feature_shape(shape, where):
    """``shape`` as a tuple of non-negative ints; an int ``n`` is ``(n,)``, as
    in NumPy. Anything else (a bool, a float, a string, a negative size) is a
    StepNetError naming ``where``."""

    def dim(d):
        if isinstance(d, (bool, np.bool_, str)):
            raise TypeError
        n = operator.index(d)  # an int, a NumPy integer, a 0-d integer array
        if n < 0:
            raise TypeError
        return n

    try:
        return (dim(shape),)
    except TypeError:
        pass
    try:
        if isinstance(shape, str):
            raise TypeError
        return tuple(dim(d) for d in shape)
    except TypeError:
        raise StepNetError(
            f"{where}: shape must be an int or a sequence of non-negative ints, got {shape!r}"
        ) from None




def memory_from_step_value(name, init, shape, parent):
    """A nested memory started from ``init``, a ``[batch, ...]`` value of the
    enclosing step (``parent``): its feature shape, dtype and initial operand."""
    outer = _operand_var(init, parent)
    if outer.lod_depth or not outer.batched:
        raise ShapeError(f"add_memory({name}): init {outer.type_str()} is not one row per sequence")
    if shape is not None and outer.shape[1:] != shape:
        raise ShapeError(
            f"add_memory({name}): init {outer.type_str()} does not have shape {list(shape)}"
        )
    return outer.shape[1:], np.dtype(outer.dtype), outer


def initial_array(name, init, shape, dtype, default_dtype):
    """``init`` (an array, a Parameter, a scalar, or None: zeros) as an array,
    and the memory's dtype: ``dtype``, else ``init``'s float dtype, else
    ``default_dtype`` (the first step input's)."""
    if init is None:
        if shape is None:
            raise StepNetError(f"add_memory({name}): give init= or shape=")
        init_arr = np.zeros((), dtype or default_dtype)
    elif isinstance(init, Parameter):
        init_arr = init.value
    else:
        init_arr = np.asarray(init)
    mem_dtype = compute_dtype(dtype or init_arr.dtype, f"add_memory({name})")
    # Python scalars are weak (NEP 50): `init=0.5` takes the step's dtype.
    weak = isinstance(init, (int, float)) and not isinstance(init, np.generic)
    if dtype is None and init is not None and (
        weak or np.asarray(init).dtype.kind in "iub"
    ):
        mem_dtype = default_dtype
    return init_arr, mem_dtype


def memory_shape(name, init_arr, shape, num_seq, top):
    """The memory's feature shape and whether ``init_arr`` is one row per
    sequence (only at the top level, ``top``): with ``shape`` omitted, an
    array of two or more dimensions whose first is the number of sequences
    ``num_seq``; with ``shape``, an array ``[n, *shape]``. Anything else is one
    value for every sequence, which must broadcast to ``shape``."""
    if shape is None:
        if init_arr.ndim == 0:
            raise StepNetError(f"add_memory({name}): a scalar init needs shape=")
        per_sequence = (
            top and init_arr.ndim >= 2 and num_seq is not None
            and init_arr.shape[0] == num_seq
        )
        return (init_arr.shape[1:] if per_sequence else init_arr.shape), per_sequence
    per_sequence = (
        top and init_arr.ndim == len(shape) + 1
        and init_arr.shape[1:] == shape and init_arr.shape != shape
    )
    if not per_sequence and not broadcasts(init_arr.shape, shape):
        raise ShapeError(
            f"add_memory({name}): init of shape {list(init_arr.shape)} fits neither "
            f"[num_sequences, {', '.join(map(str, shape))}] nor {list(shape)}"
        )
    if per_sequence and num_seq is not None and init_arr.shape[0] != num_seq:
        raise ShapeError(
            f"add_memory({name}): init has {init_arr.shape[0]} rows (one per "
            f"sequence) but the step inputs have {num_seq} sequences"
        )
    return shape, per_sequence
