"""A top-level step-net's inputs (:class:`Binding`) and the values a run
binds to them: checked against the definition (kind, LoD, feature shape,
dtype, number of sequences) and made into the program's arguments, the LoD of
nested step inputs compared before anything runs.
"""

from __future__ import annotations

import itertools

import numpy as np

from . import ir, sizes
from .errors import LoDError, ShapeError, StepNetError
from .lod import LoDTensor, host_array
from .tracing import Parameter, compute_dtype


class Binding:
    """A top-level input of the program and its current value."""

    def __init__(self, kind, var, value, memory_shape=None, per_sequence=False):
        self.kind = kind  # "sequence" | "static" | "init"
        self.var = var
        self.value = value
        self.memory_shape = memory_shape
        self.per_sequence = per_sequence
        # a memory given shape= and no init: its value stands for zeros of its shape
        self.zeros_of_shape = False


def check_sequence_inputs(bindings: dict, values: dict) -> tuple:
    """Checks a run's values of the step inputs against their definition
    (``bindings``: name -> :class:`Binding`) and against one another (the
    same sequence lengths); returns the first step input's name and its
    number of sequences."""
    num_seq = None
    first = None
    for name, b in bindings.items():
        if b.kind != "sequence":
            continue
        X = values[name]
        if not isinstance(X, LoDTensor):
            raise ShapeError(f"input {name}: expects a LoDTensor, got {type(X).__name__}")
        if X.num_levels and X.data.shape[0] != X.levels[-1][-1]:  # (its data changed in place)
            raise LoDError(f"input {name}: the LoD's offsets end at {int(X.levels[-1][-1])} but "
                           f"the data has {X.data.shape[0]} rows")
        if X.num_levels != b.var.lod_depth or tuple(X.shape[1:]) != b.var.shape[1:]:
            raise ShapeError(
                f"input {name}: rebound with {X.num_levels} LoD level(s) and feature shape "
                f"{list(X.shape[1:])}; it was defined with {b.var.lod_depth} and "
                f"{list(b.var.shape[1:])}"
            )
        if compute_dtype(X.dtype, f"input {name}") != b.var.dtype:
            raise ShapeError(
                f"input {name}: rebound with dtype {X.dtype}, defined as {b.var.dtype}; cast "
                f"the array ({name}.astype(np.{b.var.dtype})) or define the net in "
                f"{compute_dtype(X.dtype, f'input {name}')}"
            )
        if first is None:
            first, num_seq = name, X.num_sequences
        elif not same_offsets(values[first], X, 1):
            raise StepNetError(
                f"step inputs {first} and {name} have different LoD at level 0; "
                "every step input of one step-net must have the same sequence lengths"
            )
    return first, num_seq


def broadcasts(shape, target) -> bool:
    """Whether an array of ``shape`` broadcasts to ``target`` (a memory's shape)."""
    if not shape or tuple(shape) == tuple(target):  # (a scalar, or the shape itself)
        return True
    try:
        return np.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        return False


def same_offsets(a: LoDTensor, b: LoDTensor, depth: int) -> bool:
    """Whether ``a`` and ``b`` have the same offsets in their first ``depth`` levels."""
    return all(
        np.array_equal(x, y) for x, y in zip(a.levels[:depth], b.levels[:depth])
    ) and min(a.num_levels, b.num_levels) >= depth


def bind_static(name, b, v, num_seq):
    """The run's value ``v`` of the static input ``b``, checked: one row (or
    sequence) per sequence, in the input's dtype."""
    if b.var.lod_depth:
        if not isinstance(v, LoDTensor) or v.num_levels != b.var.lod_depth:
            raise ShapeError(f"static input {name}: expects a LoDTensor with {b.var.lod_depth} level(s)")
        v = v.to_host()  # (rows a step reads by sequence: one on the GPU is copied)
        rows = v.num_sequences
    else:
        if isinstance(v, LoDTensor):
            raise ShapeError(f"static input {name}: defined by an array of one row per sequence, "
                             f"got a LoDTensor of {v.num_levels} level(s)")
        v = host_array(v)  # (one row per sequence: one on the GPU is copied)
        if v.ndim < 1:
            raise ShapeError(f"static input {name}: needs one row per sequence, got a scalar")
        rows = v.shape[0]
    if tuple(v.shape[1:]) != b.var.shape[1:]:
        raise ShapeError(
            f"static input {name}: feature shape {list(v.shape[1:])}, defined as {list(b.var.shape[1:])}"
        )
    if rows != num_seq:
        raise ShapeError(
            f"static input {name}: has {rows} rows but the step inputs have {num_seq} sequences"
        )
    compute_dtype(v.dtype, f"static input {name}")
    if v.dtype != b.var.dtype:
        sizes.check_large(f"static input {name} in {b.var.dtype}", v.shape, b.var.dtype)
    return v.astype(b.var.dtype) if v.dtype != b.var.dtype else v


def bind_init(name, b, v, num_seq, rebound, sequence_input):
    """The run's initial value ``v`` of the memory ``b`` as ``[num_seq, *shape]``:
    one row per sequence, or one value broadcast to every sequence. A
    per-sequence value left bound (not ``rebound``) must still have a row per
    sequence of the step inputs."""
    v = v.value if isinstance(v, Parameter) else host_array(v)  # (one on the GPU is copied)
    shape = b.memory_shape
    if v.shape == (num_seq,) + shape and (b.per_sequence or rebound or v.shape != shape):
        full = v
    elif broadcasts(v.shape, shape) and not (b.per_sequence and not rebound):
        full = None  # one value for every sequence
    elif b.per_sequence and not rebound:
        raise ShapeError(
            f"memory {name}: its initial value has {v.shape[0]} rows (one per sequence) but "
            f"{sequence_input} now has {num_seq} sequences; rebind {name} too"
        )
    else:
        raise ShapeError(
            f"memory {name}: init of shape {list(v.shape)} fits neither "
            f"[{num_seq}, {', '.join(map(str, shape))}] nor {list(shape)}"
        )
    if v.dtype.kind not in "iubf":
        raise ShapeError(f"memory {name}: init dtype {v.dtype} is not numeric")
    sizes.check_large(f"memory {name}'s initial value", (num_seq,) + shape, b.var.dtype)
    if full is None:
        full = np.empty((num_seq,) + shape, b.var.dtype)
        full[...] = v
        return full
    return np.ascontiguousarray(full, dtype=b.var.dtype)


def check_lod_agreement(program: ir.Program, values: dict) -> None:
    """Nested step inputs of one step-net must have equal LoD: check it on the
    offsets alone, before anything runs."""
    levels_of = {}
    for var in program.inputs:
        value = values.get(var.name)
        if var.lod_depth and isinstance(value, LoDTensor):
            levels_of[id(var)] = value.levels

    def visit(eqn):
        seqs, _, _ = ir.rnn_parts(eqn)
        body = eqn.attrs["body"]
        known = [(v, levels_of[id(v)]) for v in seqs if id(v) in levels_of]
        for (v, lv), (w, lw) in itertools.pairwise(known):
            if not np.array_equal(lv[0], lw[0]):
                raise StepNetError(
                    f"step inputs {v.name} and {w.name} of {eqn.attrs['name']} have different "
                    "LoD; every step input of one step-net must have the same sequence lengths"
                )
        for step, outer in zip(body.step_inputs, seqs):
            if id(outer) in levels_of and step.lod_depth:
                levels_of[id(step)] = levels_of[id(outer)][1:]
        for inner in body.eqns:
            if inner.op == "rnn":
                visit(inner)
                inner_seqs, _, _ = ir.rnn_parts(inner)
                src = next((levels_of[id(v)] for v in inner_seqs if id(v) in levels_of), None)
                for out, all_steps, res in zip(
                    inner.outputs, inner.attrs["all_steps"], inner.attrs["body"].outputs
                ):
                    if src is not None and all_steps and id(res) in levels_of:
                        levels_of[id(out)] = (src[0],) + tuple(levels_of[id(res)])
                    elif src is not None and all_steps and not res.lod_depth:
                        levels_of[id(out)] = (src[0],)

    visit(program.eqn)
