"""What the Numba backend's code generator writes with, and the elementwise
code it writes (:mod:`stepnet.jit.cpu_codegen` writes the rest).

- The records of a kernel being written: the module (:class:`_Module`: its
  functions, prologue, arguments and constants), a function's state
  (:class:`_Function`), where each value lives (:class:`_Info`) and the
  place being written (:class:`_Ctx`: the mode, the lines, the values).
- The elementwise code: one op's loop (``_emit_op``), a fused run of them as
  one loop over its rows with its reductions folded in (``_emit_fused``),
  the copies, the arrays a value gets (``_new_array``), the loops over a
  value's elements and the expressions that read them (``_loop_nest``,
  ``_ref``), and the segments of ragged values.
- The same runs over strided arrays of any rank, outside a step-net (an ONNX
  session's fused nodes: ``strided_run_source``). Every fused loop takes
  each op's code from one place (``op_code``: its record's ``numba`` code).
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field

import numpy as np

from .. import ir, registry, schedule
from ..errors import UnsupportedError
from . import apart, numba_runtime

# the scalar helpers an op's numba code may call (relu, tanh32, ...): every
# public function of numba_runtime but those a kernel calls apart
# (apart.HELPERS), imported by the generated code
_RUNTIME_HELPERS = sorted(name for name, f in vars(numba_runtime).items() if not name.startswith("_")
                          and callable(f) and getattr(f, "__module__", None) == numba_runtime.__name__
                          and name not in apart.HELPERS)


def runtime_imports() -> list:
    """The lines of a generated module importing those helpers."""
    return ["from stepnet.jit.numba_runtime import (",
            *textwrap.wrap(", ".join(_RUNTIME_HELPERS) + ",", 90, initial_indent="    ",
                           subsequent_indent="    "),
            ")"]


class _Info:
    """Where the generated code finds a var.

    kind: "const" (whole array, no batch axis), "literal", "global" (an array
    over a whole space, row = entry index), "local" (a buffer with one row per
    active sequence), "scalar" (a register inside a fused loop), "ragged" (a
    nested sequence: ``levels`` map entries down to ``data``, a global),
    "rows" (a value over a ragged static input's rows, row ``j``; its
    ``segment`` says which rows are batch row b's). ``sums``: an int8
    product's int32 sums behind ``ident``, read dequantized (``_ref``), with
    the code of its rows' scales and of its columns' scales. ``row``: the
    code of a "rows" value's row where it is not ``j`` (``_rebased``).
    """

    def __init__(self, kind, ident=None, var=None, offset=0, width=None, size=None,
                 levels=(), data=None, segment=None, sums=None, row=None):
        self.kind = kind
        self.ident = ident
        self.var = var
        self.offset = offset  # column offset into a merged GEMM's result
        self.width = width  # full last-axis width of the array behind ident
        self.size = size  # rows of a global (code expression)
        self.levels = tuple(levels)
        self.data = data
        self.segment = segment  # a value over a ragged static input's rows: its _Segment
        self.sums = sums  # (rows' scales, columns' scales): KernelPlan.dequantized
        self.row = row

    @property
    def whole(self) -> bool:
        """The array behind ``ident`` holds this var alone (no merged columns)."""
        return self.offset == 0 and self.width == _width(self.var)


class _Module:
    """What the generated module shares: fresh names, typed literals, the rnn
    functions, the program's prologue (hoisted work and allocations) and the
    arrays defined so far, which every rnn function takes by name."""

    def __init__(self):
        self.counter = 0
        self.plan = None  # the kernel's KernelPlan (kernel_plan)
        self.literals = {}  # (repr, dtype) -> name of a module-level constant
        self.module_consts = []  # lines defining them
        self.functions = []  # lines of each rnn function
        self.prologue = []
        self.gargs = []
        self.packed = {}  # weights ident -> packed weights ident
        self.const_vars = {}  # ident -> the program's constant (an ir.Var)
        self.concatenated = {}  # ident -> the constants it joins by columns
        self.prepared = {}  # ident -> (a quantized op, its weights' constants): by the caller
        self.small_gemm_dtypes = set()  # dtypes of the products (blas.register_small_gemm)
        self.largest_weights = 0  # elements of the largest weights of a product
        self.rows_by_steps = False  # its top-level net may take its rows by steps (row_step)
        self.extra_returns = []  # the second levels of segment outputs (pl)
        self.given_outputs = []  # output buffers program() takes from its caller
        self.hoisted_bodies = set()  # bodies whose hoisted work is emitted
        self.segments = {}  # a hoisted ragged Var -> its _Segment (a nested net's every step's)
        self.same_lod = set()  # pairs of levels combined row by row (NumbaProgram._check_same_lod)
        self.entry_levels = set()  # the second levels of the two-level inputs
        self.segment_outputs = {}  # all-steps outputs over a static's rows: (data, pl, level)
        self.memory_outputs = {}  # last steps of ragged memories: (buffer, level)
        self.chunks = {}  # body -> the _Chunk of each product its rnn function runs by chunks
        self.output_rows = {}  # step values computed into an all-steps output (_outputs_over_rows)
        self.nested_reads = set()  # ragged step values nested nets step over or read (cpu_codegen)

    def fresh(self, base):
        self.counter += 1
        return f"{base}{self.counter}"

    def literal(self, value, dtype):
        dtype = np.dtype(dtype)
        key = (repr(value), dtype.str)
        if key not in self.literals:
            name = f"K{len(self.literals)}"
            if dtype.kind == "b":
                self.module_consts.append(f"{name} = {bool(value)!r}")
            else:
                self.module_consts.append(f"{name} = np.{dtype.name}({registry.number_code(value)})")
            self.literals[key] = name
        return self.literals[key]


@dataclass
class _Function:
    """One rnn function while its code is generated: the buffers allocated
    before its time loop, and the all-steps outputs its fused loops write."""

    allocs: list = field(default_factory=list)
    buffers: set = field(default_factory=set)  # idents of the step buffers
    materialized: frozenset = frozenset()  # per-step values stored in buffers
    direct: dict = field(default_factory=dict)  # Var -> all-steps output arrays
    written: set = field(default_factory=set)  # Vars a fused loop wrote there
    segments: dict = field(default_factory=dict)  # ragged Var -> its static's (see _segment)
    in_place: set = field(default_factory=set)  # new values of memories written over the old
    placed: dict = field(default_factory=dict)  # Var -> its column block of a step concat's buffer
    unbuffered: set = field(default_factory=set)  # all-steps outputs stored to the outputs alone
    rebased: dict = field(default_factory=dict)  # Var -> its rows read at a static input's (_rebased)
    top: bool = False  # the top-level net's function


@dataclass
class _Ctx:
    """Where a piece of generated code goes: ``lines``, in ``mode`` ("const"
    and "hoist": the program's prologue; "step": a time step; "program": the
    top call), seeing ``values`` (Var -> _Info); ``fn`` in a step."""

    module: _Module
    values: dict
    mode: str
    lines: list
    fn: _Function | None = None

    def at(self, mode, lines=None):
        return dataclasses.replace(self, mode=mode, lines=self.lines if lines is None else lines)


# ----------------------------------------------------------------------------
# arrays, loops and element references


def _new_array(ctx, var, size=None):
    """Allocate the array that holds ``var`` (as ctx.mode says) and record it."""
    module = ctx.module
    ident = module.fresh("v")
    dt = f"np.{np.dtype(var.dtype).name}"
    if ctx.mode == "const":
        ctx.lines.append(f"{ident} = np.empty({tuple(var.shape)!r}, {dt})")
        module.gargs.append(ident)
        info = _Info("const", ident, var)
    elif var.lod_depth and (ctx.mode == "hoist" or _segments(ctx)[var].by_entry
                            or var in module.nested_reads):
        # an array of the call: rows of a nested net's every step (each entry's
        # written once a call), or rows a nested net's function steps over or
        # reads by name (each group writing its own)
        segment = _segments(ctx)[var]
        module.prologue.append(f"{ident} = np.empty({_shape(segment.rows, var.shape[1:])}, {dt})")
        module.gargs.append(ident)
        info = _Info("rows", ident, var, width=_width(var), segment=segment)
    elif ctx.mode == "hoist" and var in module.output_rows:
        ident = module.output_rows.pop(var)  # (an argument already)
        info = _Info("global", ident, var, width=_width(var), size=size)
    elif ctx.mode == "hoist":
        ctx.lines.append(f"{ident} = np.empty({_shape(size, var.shape[1:])}, {dt})")
        module.gargs.append(ident)
        info = _Info("global", ident, var, width=_width(var), size=size)
    elif var.lod_depth:  # a row per row of the ragged static input it comes from
        segment = _segments(ctx)[var]
        ctx.fn.allocs.append(f"{ident} = np.empty({_shape(segment.rows, var.shape[1:])}, {dt})")
        info = _Info("rows", ident, var, width=_width(var), segment=segment)
    else:
        ctx.fn.allocs.append(f"{ident} = np.empty({_shape('num_seq', var.shape[1:])}, {dt})")
        ctx.fn.buffers.add(ident)
        info = _Info("local", ident, var, width=_width(var))
    ctx.values[var] = info
    return info


@dataclass(frozen=True)
class _Segment:
    """Where a batch row's rows of a ragged value lie, in the data whose
    offsets are ``level``: of a ragged static input, ``starts[b]`` to
    ``stops[b]`` (arrays filled before the time loop); of a nested net's
    every step (``by_entry``), its entry's sub-sequence, ``level[e]`` to
    ``level[e + 1]`` (entry ``r`` where hoisted)."""

    starts: str | None
    stops: str | None
    level: str
    by_entry: bool = False

    @property
    def rows(self) -> str:
        return f"{self.level}[-1]"

    def bounds(self, entry):
        """Code for batch row b's first row and the row past its last (its
        entry's code: ``entry``)."""
        if self.by_entry:
            return f"{self.level}[{entry}]", f"{self.level}[{entry} + 1]"
        return f"{self.starts}[b]", f"{self.stops}[b]"


def _segments(ctx):
    """Ragged Var -> the _Segment of the ragged value it comes from: a
    step's, or the hoisted values'."""
    return ctx.fn.segments if ctx.mode == "step" else ctx.module.segments


def _note_segment(ctx, e):
    """Record the segment of ``e``'s ragged result: its ragged operands' (one
    static input's, or nested nets' every steps; several must have the same
    LoD, checked before a run)."""
    infos = [_operand(ctx, v, None) for v in e.inputs if isinstance(v, ir.Var) and v.lod_depth]
    segments = [info.segment for info in infos if info.kind in ("rows", "scalar")]
    if not segments:
        raise UnsupportedError(f"numba backend: {e.op} computing {e.outputs[0].name} reads a "
                               "ragged value that is not a static input's (use the interpreter)")
    for other in segments[1:]:
        if other.by_entry != segments[0].by_entry:
            raise UnsupportedError(f"numba backend: {e.op} computing {e.outputs[0].name} reads rows "
                                   "of a nested net's every step and of a ragged static input "
                                   "(use the interpreter)")
        if other != segments[0]:
            ctx.module.same_lod.add((segments[0].level, other.level))
    if e.outputs[0].lod_depth:
        _segments(ctx)[e.outputs[0]] = segments[0]
    return segments[0]


def _rebased(ctx, group):
    """Where a run of ops reads rows of a ragged static input and of a
    two-level step input (a cotangent of attention weights over a memory,
    one memory's rows at each step), read the step input's rows at the
    static input's: row ``j`` of batch row b is its entry's row
    ``level[e] + j - starts[b]``; each entry has as many rows as its
    sequence's static input (``same_lod``, checked before a run)."""
    if ctx.mode != "step" or not ctx.fn.top:
        return
    infos = {v: _operand(ctx, v, None) for e in group for v in e.inputs
             if isinstance(v, ir.Var) and v.lod_depth and v in ctx.values}
    static = next((i.segment for i in infos.values()
                   if i.kind == "rows" and not i.segment.by_entry), None)
    if static is None:
        return
    for v, info in infos.items():
        if info.kind == "rows" and info.segment.by_entry and info.segment.level in ctx.module.entry_levels:
            first, _ = info.segment.bounds("e")
            ctx.fn.rebased[v] = _Info("rows", info.ident, v, width=info.width, segment=static,
                                      row=f"{first} + j - {static.starts}[b]")
            ctx.module.same_lod.add((static.level, info.segment.level))


def _nested_reads(sched):
    """The values of a step that its nested nets step over, or read as
    ragged static inputs."""
    found = set()
    for e, inner in sched.nested.items():
        seqs, statics, _ = ir.rnn_parts(e)
        found.update(v for v in (*seqs, *statics) if isinstance(v, ir.Var) and v.lod_depth)
        found |= _nested_reads(inner)
    return found


def _at_static_rows(ctx, v, static):
    """A two-level step input ``v`` that a nested net steps over beside
    rows of the enclosing step's ragged static input (``static``: a prior
    per step over the memory) copied at those rows, in an array of the call
    (each group writes its own rows): the nested net reads every input at
    one row space. Each entry has as many rows as its sequence's static
    input (``same_lod``, checked before a run)."""
    info = _operand(ctx, v, None, rebased=False)  # (its own rows, not a group's rebased read)
    if info.kind != "rows" or not info.segment.by_entry:
        return
    first, _ = info.segment.bounds("e")
    source = _Info("rows", info.ident, v, width=info.width, segment=static,
                   row=f"{first} + j - {static.starts}[b]")
    _segments(ctx)[v] = static  # (from here on, its rows are the static input's)
    _emit_copy(ctx, source, _new_array(ctx, v))
    ctx.module.same_lod.add((static.level, info.segment.level))


def _contiguous(ctx, info):
    """An expression for a C-contiguous [rows, K] array holding a 2-D var."""
    if ctx.mode == "hoist" and info.kind == "global" and info.whole:
        return info.ident
    if ctx.mode == "step" and info.kind == "local" and info.whole:
        return f"{info.ident}[:nb]"
    tmp = _new_array(ctx, ir.Var("tmp", info.var.dtype, info.var.shape), size=info.size)
    _emit_copy(ctx, info, tmp)
    return f"{tmp.ident}[:nb]" if ctx.mode == "step" else tmp.ident


def _emit_copy(ctx, src, dst):
    shape = dst.var.shape
    loops, idx = _loop_nest(shape, ctx.mode, dst.size, segment=dst.segment)
    ctx.lines += _nest(loops, [
        f"{_ref(dst, idx, ctx.mode, shape)} = {_ref(src, idx, ctx.mode, shape)}"
    ])


def _loop_nest(shape, mode, size=None, bounds=None, segment=None):
    """Loops over ``shape`` (over ``range(lo, hi)`` on an axis ``bounds`` maps
    to ``(lo, hi)``); in a step, ``e`` is row b's entry (loaded once per row,
    so LLVM vectorizes the inner loop), and for a ragged value (``segment``:
    its _Segment) ``j`` runs over row b's own rows."""
    loops, idx = [], []
    for d, n in enumerate(shape):
        if n is None:
            var = "b" if mode == "step" else "r"
            bound = "nb" if mode == "step" else size
        elif bounds and d in bounds:
            var, bound = f"i{d}", "{}, {}".format(*bounds[d])
        else:
            var, bound = f"i{d}", str(n)
        loops.append(f"for {var} in range({bound}):")
        if n is None and mode == "step":
            loops.append("e = entries[b]")
        if n is None and segment is not None:  # (hoisted: entry r's rows)
            loops.append("for j in range({}, {}):".format(*segment.bounds("e" if mode == "step" else "r")))
        idx.append(var)
    return loops, idx


def _ref(info, idx, mode, loop_shape, row="b"):
    """Code reading element ``idx`` (loop indices over ``loop_shape``) of a var,
    with NumPy broadcasting; ``row``: a local buffer's row."""
    if info.kind in ("literal", "scalar"):
        return info.ident
    shape = info.var.shape
    lead = len(loop_shape) - len(shape)
    parts = []
    for d, n in enumerate(shape):
        i = idx[lead + d]
        if n is None:
            if info.kind == "global":
                i = "e" if mode == "step" else "r"
            elif info.kind == "chunk":
                i = "b * chunk + cs"
            elif info.kind == "rows":
                i = info.row or "j"
            else:
                i = row
        elif n == 1 and loop_shape[lead + d] != 1:
            i = "0"
        if d == len(shape) - 1 and info.offset:
            i = f"{info.offset} + {i}"
        parts.append(i)
    if not parts:  # a 0-d array (a value computed once from constants): read and written at ()
        return f"{info.ident}[()]" if info.kind == "const" else info.ident
    code = f"{info.ident}[{', '.join(parts)}]"
    if info.sums is not None:  # (int8_product's formula)
        scale, column_scale = info.sums
        code = f"(np.float32({code}) * ({scale}[{parts[0]}] * {column_scale}[{parts[-1]}]))"
    return code


def _operand(ctx, v, dtype, rebased=True):
    if isinstance(v, ir.Literal):
        return _Info("literal", ctx.module.literal(v.value, dtype))
    if rebased and ctx.fn is not None and v in ctx.fn.rebased:
        return ctx.fn.rebased[v]
    info = ctx.values[v]
    if info.kind == "ragged" and info.segment is not None:  # a nested net's every step, read by ops
        return _Info("rows", info.data.ident, v, width=info.data.width, segment=info.segment)
    return info


# ----------------------------------------------------------------------------
# one op as its own loop nest


def _emit_op(ctx, e):
    """One op (not a GEMM, not fused) as its own loop nest over its result:
    an elementwise op from its scalar code, a shape op or a reduction from
    its record's ``gather`` or ``reduction`` form (stepnet/registry.py)."""
    out = e.outputs[0]
    ragged = any(isinstance(v, ir.Var) and v.lod_depth for v in e.inputs)
    segment = _note_segment(ctx, e) if ragged else None
    size = None
    if ctx.mode == "hoist" and segment is not None:  # a nested net's every step: over its entries
        size = f"({segment.level}.shape[0] - 1)"
    elif ctx.mode == "hoist":  # the rows of the space: those of a global operand
        size = next(ctx.values[v].size for v in e.inputs
                    if isinstance(v, ir.Var) and ctx.values[v].kind == "global")
    rows = segment if out.lod_depth else None
    info = _new_array(ctx, out, size=size)
    ins = [_operand(ctx, v, registry.literal_dtype(e)) for v in e.inputs]
    loops, idx = _loop_nest(out.shape, ctx.mode, size, segment=rows)
    record = registry.get(e.op)
    dst = _ref(info, idx, ctx.mode, out.shape)
    if record.segment is not None:  # over each batch row's rows of its ragged operand
        combine, initial = record.segment
        start, _ = _loop_nest(out.shape, ctx.mode, size)
        over_rows, _ = _loop_nest(out.shape, ctx.mode, size, segment=segment)
        src = _ref(ins[0], idx, ctx.mode, out.shape)
        ctx.lines += _nest(start, [f"{dst} = {ctx.module.literal(initial, out.dtype)}"])
        ctx.lines += _nest(over_rows, [f"{dst} = {combine.format(acc=dst, x=src)}"])
    elif schedule.is_elementwise(e):
        expr = _scalar_expr(ctx, e, [_ref(i, idx, ctx.mode, out.shape) for i in ins])
        ctx.lines += _nest(loops, [f"{dst} = {expr}"])
    elif record.gather is not None:
        zero = ctx.module.literal(0.0, out.dtype)
        for case in record.gather(idx, [v.shape for v in e.inputs], **e.attrs):
            if case.axis is not None and out.shape[case.axis] is None:
                raise UnsupportedError(f"numba backend: {e.op} along the batch axis")
            bounds = {} if case.axis is None else {case.axis: (case.lo, case.hi)}
            case_loops, _ = _loop_nest(out.shape, ctx.mode, size, bounds, segment=rows)
            src = zero if case.operand is None else _read_at(ctx, ins, e, case.operand, case.index)
            ctx.lines += _nest(case_loops, [f"{dst} = {src}"])
    elif record.reduction is not None:
        extent, sources = record.reduction(idx, [v.shape for v in e.inputs], **e.attrs)
        term = " * ".join(_read_at(ctx, ins, e, k, index) for k, index in enumerate(sources))
        zero = ctx.module.literal(0.0, out.dtype)
        if e.op == "matmul" and len(out.shape) > 1 and out.shape[-1] is not None:
            # ragged rows by a matrix: added a row of the matrix at a time, which
            # LLVM vectorizes, in the same order as a dot product
            inner = loops[-1]
            ctx.lines += _nest(loops[:-1], [inner, f"    {dst} = {zero}", f"for k in range({extent}):",
                                            f"    {inner}", f"        {dst} += {term}"])
        else:
            ctx.lines += _nest(loops, [f"acc = {zero}", f"for k in range({extent}):",
                                       f"    acc += {term}", f"{dst} = acc"])
    else:
        raise UnsupportedError(f"numba backend: no code generation for op {e.op!r}")


def _read_at(ctx, ins, e, k, index):
    """Operand ``k`` of ``e`` read at ``index`` (code per operand axis; an
    axis of size 1 is read at 0)."""
    shape = e.inputs[k].shape
    index = ["0" if n == 1 else i for n, i in zip(shape, index)]
    return _ref(ins[k], index, ctx.mode, shape)


def _scalar_expr(ctx, e, args):
    """Op ``e`` on one element, ``args`` its operands' code."""
    dtype = e.outputs[0].dtype
    return op_code(e.op, args, dtype,
                    {k: ctx.module.literal(v, dtype) for k, v in e.attrs.items() if v is not None})


def op_code(op, args, dtype, attrs=None):
    """Op ``op`` on one element of ``dtype``, ``args`` its operands' code and
    ``attrs`` its attributes': the op's ``numba`` code (its record in
    stepnet/ops/), for every fused loop."""
    return registry.get(op).numba_code(args, dtype, attrs or {})


def _unlinked(group):
    """The ops of a ragged run in sets that share no ragged value (each in
    the run's order); a dense run whole."""
    if not group[0].outputs[0].lod_depth:
        return [group]
    first = {}  # a ragged value -> the first op reading or making it
    parent = list(range(len(group)))

    def root(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i, e in enumerate(group):
        for v in (*e.inputs, *e.outputs):
            if isinstance(v, ir.Var) and v.lod_depth:
                parent[root(i)] = root(first.setdefault(v, i))
    runs = {}
    for i, e in enumerate(group):
        runs.setdefault(root(i), []).append(e)
    return list(runs.values())


def _emit_fused(ctx, group, epilogues=()):
    """A run of elementwise ops as one loop; its intermediates stay scalars,
    the materialized ones are stored, all-steps outputs written in place.
    ``epilogues``: reductions of its values (``KernelPlan.epilogues``),
    accumulated in the same loop. A ragged run whose ops share no ragged
    value (rows of a memory and of another ragged value, side by side) is a
    loop over each one's rows."""
    runs = _unlinked(group)
    if len(runs) > 1:
        for run in runs:
            made = {e.outputs[0] for e in run}
            _emit_fused(ctx, run, [e for e in epilogues if e.inputs[0] in made])
        return
    shape = group[0].outputs[0].shape
    _, idx = _loop_nest(shape, "step")
    inner, scalars, segment = [], [], None
    read, written = [], []  # the per-token arrays (rows "e") it reads and writes
    _rebased(ctx, group)
    for e in group:  # a ragged run loops over its rows (schedule: one LoD depth per run)
        if any(isinstance(v, ir.Var) and v.lod_depth for v in e.inputs):
            segment = _note_segment(ctx, e)
        opdt = registry.literal_dtype(e)
        operands = [_operand(ctx, v, opdt) for v in e.inputs]
        for info in operands:
            if _per_token(info) and info.ident not in read:
                read.append(info.ident)
        args = [_ref(i, idx, "step", shape) for i in operands]
        out = e.outputs[0]
        name = ctx.module.fresh("t")
        inner.append(f"{name} = {_scalar_expr(ctx, e, args)}")
        scalars.append((out, name))
        ctx.values[out] = _Info("scalar", name, out, segment=segment)
    loops, _ = _loop_nest(shape, "step", segment=segment)
    names = dict(scalars)
    before, after = [], []  # around the innermost loop: row sums in registers
    for e in epilogues:
        if e.op == "sum":
            acc = ctx.module.fresh("acc")
            out = e.outputs[0]
            if out.lod_depth:
                _note_segment(ctx, e)
            info = _new_array(ctx, out)
            target = idx[:-1] + (["0"] if e.attrs.get("keepdims", False) else [])
            before.append(f"{acc} = {ctx.module.literal(0.0, out.dtype)}")
            inner.append(f"{acc} += {names[e.inputs[0]]}")
            after.append(f"{_ref(info, target, 'step', out.shape)} = {acc}")
        else:
            inner += _fold(ctx, e, names[e.inputs[0]], idx)
    folded = {e.inputs[0] for e in epilogues}
    skipped = folded | ctx.fn.in_place | ctx.fn.unbuffered
    for out, name in scalars:
        if out in ctx.fn.materialized and out not in skipped:
            info = ctx.fn.placed[out] if out in ctx.fn.placed else _new_array(ctx, out)
            ctx.values[out] = info
            inner.append(f"{_ref(info, idx, 'step', shape)} = {name}")
            if _per_token(info) and info.ident not in written:
                written.append(info.ident)
    for out, name in scalars:
        if out in ctx.fn.written:
            continue
        for target in ctx.fn.direct.get(out, ()):
            inner.append(f"{_ref(target, idx, 'step', shape)} = {name}")
            ctx.fn.written.add(out)
            if _per_token(target) and target.ident not in written:
                written.append(target.ident)
        if out in ctx.fn.unbuffered:  # read from where it was stored, should anything ask
            ctx.values[out] = ctx.fn.direct[out][0]
    loops = _prefetching(ctx, loops, read, written)
    if before or after:
        inner = before + [loops[-1]] + ["    " + line for line in inner] + after
        loops = loops[:-1]
    ctx.lines += _nest(loops, inner)


# per-token arrays a step's loop writes from which it asks for the next
# sequence's rows ahead (``_prefetching``): W9's backward loop, which reads
# 5 per-token arrays and writes 6, runs faster with it; loops writing 2
# (W1's, W2's and W4's forward) run no faster, sometimes slower
_PREFETCH_MIN_WRITTEN = 3


def _prefetching(ctx, loops, read, written):
    """A step's loop nest over its sequences (``_loop_nest``) that writes
    ``_PREFETCH_MIN_WRITTEN`` per-token arrays or more, asking at each
    sequence for the next one's rows of the per-token arrays it reads
    (``read``) and writes (``written``): one call of
    ``numba_runtime.prefetch_rows`` on a table of their addresses and row
    strides made before the steps (one call, not one per array: each call
    site is code Numba and LLVM compile). Each of them is a row in another
    place for every sequence, and a row written is read first: such a loop
    stalls on its stores. Other loops as they are."""
    if "e = entries[b]" not in loops[:-1] or len(written) < _PREFETCH_MIN_WRITTEN:
        return loops
    at = loops.index("e = entries[b]") + 1
    rows = [ident for ident in read if ident not in written] + list(written)
    table = ctx.module.fresh("rows")
    entries = ", ".join(f"(np.int64({ident}.ctypes.data), {ident}.strides[0])" for ident in rows)
    ctx.fn.allocs.append(f"{table} = np.array(({entries},), np.int64)")
    reads = len(rows) - len(written)
    return loops[:at] + [f"prefetch_rows({table}, {reads}, entries, b + 1, nb)"] + loops[at:]


def _per_token(info):
    """Whether a step's loop reads or writes ``info`` at the rows of its
    sequences' tokens (row ``e``: a "global" array over the step's space)."""
    return info.kind == "global" and bool(info.var.shape) and info.var.shape[0] is None


def _fold(ctx, e, scalar, idx):
    """Start segment op ``e``'s result (one row per batch row, lines before
    the loop) and return the line folding ``scalar``, its operand at the
    loop's index ``idx``, into it."""
    out = e.outputs[0]
    combine, initial = registry.get(e.op).segment
    _note_segment(ctx, e)
    info = _new_array(ctx, out)
    start, _ = _loop_nest(out.shape, "step")
    dst = _ref(info, idx, "step", out.shape)
    ctx.lines += _nest(start, [f"{dst} = {ctx.module.literal(initial, out.dtype)}"])
    return [f"{dst} = {combine.format(acc=dst, x=scalar)}"]


def _width(var):
    return var.shape[-1] if len(var.shape) > 0 and var.shape[-1] is not None else None


def _shape(lead, rest) -> str:
    """A shape tuple's code: ``(lead, d1, d2)``."""
    return "(" + ", ".join([str(lead)] + [str(d) for d in rest]) + ("," if not rest else "") + ")"


def _row_assign(dst, dst_row, src, src_row, row_shape, src_shape=None):
    """``dst[dst_row] = src[src_row]`` for every sequence b, element by element
    (row assignment compiles slowly in Numba). ``src_row=None``: ``src`` has no
    batch axis and broadcasts (``src_shape``), or is a scalar (``()``)."""
    idx = [f"i{d}" for d in range(len(row_shape))]
    loops = ["for b in range(num_seq):"] + [
        f"for {i} in range({n}):" for i, n in zip(idx, row_shape)
    ]
    dst_ref = f"{dst}[{', '.join([dst_row] + idx)}]"
    if src_row is not None:
        src_ref = f"{src}[{', '.join([src_row] + idx)}]"
    elif src_shape is None:
        src_ref = src  # a scalar
    elif src_shape == ():
        src_ref = f"{src}[()]"
    else:
        lead = len(row_shape) - len(src_shape)
        parts = ["0" if n == 1 and row_shape[lead + d] != 1 else idx[lead + d]
                 for d, n in enumerate(src_shape)]
        src_ref = f"{src}[{', '.join(parts)}]"
    return _nest(loops, [f"{dst_ref} = {src_ref}"])


def _nest(head, body):
    """Nest ``body`` under ``head``: head lines ending in ':' open a block, the
    others are statements at the depth reached so far."""
    lines, depth = [], 0
    for line in head:
        lines.append("    " * depth + line)
        if line.endswith(":"):
            depth += 1
    return lines + ["    " * depth + line for line in body]


# ----------------------------------------------------------------------------
# a run of elementwise ops over strided arrays (ONNX's fused nodes)


def strided_run_source(ops, inputs, outputs, ranks, kinds, ndim, dtype):
    """The module of ``fused(order, *outputs, *inputs) -> bool``: the
    elementwise ops ``ops`` (``(op, operand names, result name)`` each,
    stepnet's op names) over arrays of rank ``ndim`` and ``dtype``, reading
    ``inputs`` (of ``ranks``, each read with unit stride or broadcast along
    the innermost axis: ``kinds``) and writing ``outputs``, its loops in the
    memory order ``order`` (the innermost axis last). False, nothing
    written, where an input's shape or innermost stride is not as
    planned. The source names no sizes."""
    dt, item = f"np.{dtype.name}", dtype.itemsize
    ys = [f"y{k}" for k in range(len(outputs))]
    xs = [f"x{k}" for k in range(len(inputs))]
    body = [f"def fused(order, {', '.join(ys + xs)}):",
            "    wide_vectors()",
            f"    inner = order[{ndim - 1}]",
            "    n = y0.shape[inner]",
            "    if y0.size == 0:",
            "        return True"]
    for y in ys:
        body += [f"    s{y} = np.empty({ndim}, np.int64)",
                 f"    for k in range({ndim}):",
                 f"        s{y}[k] = {y}.strides[order[k]]"]
    for x, rank, kind in zip(xs, ranks, kinds):
        # byte strides along the loop's axes, 0 where broadcast
        body += [f"    s{x} = np.zeros({ndim}, np.int64)",
                 f"    for k in range({ndim}):",
                 f"        a = order[k] - {ndim - rank}",
                 "        if a >= 0:",
                 f"            if {x}.shape[a] == y0.shape[order[k]] and {x}.shape[a] != 1:",
                 f"                s{x}[k] = {x}.strides[a]",
                 f"            elif {x}.shape[a] != 1:",
                 "                return False"]
        want = "0" if kind == "broadcast" else f"{item}"
        body += [f"    if n > 1 and s{x}[{ndim - 1}] != {want}:", "        return False"]
    body += [f"    b{a} = np.int64({a}.ctypes.data)" for a in ys + xs]
    loops = ["    " * (1 + k) + f"for i{k} in range(y0.shape[order[{k}]]):" for k in range(ndim - 1)]
    pad = "    " * ndim
    for a, kind in [*[(y, "unit") for y in ys], *zip(xs, kinds)]:
        offset = " + ".join([f"b{a}"] + [f"i{k} * s{a}[{k}]" for k in range(ndim - 1)])
        loops.append(f"{pad}r{a} = carray(pointer_to({offset}, {dt}), n)" if kind == "unit" else
                     f"{pad}v{a} = carray(pointer_to({offset}, {dt}), 1)[0]")
    code = {name: (f"r{x}[j]" if kind == "unit" else f"v{x}")
            for name, x, kind in zip(inputs, xs, kinds)}
    element = []
    for t, (op, args, result) in enumerate(ops):
        element.append(f"t{t} = {op_code(op, [code[n] for n in args], dtype)}")
        code[result] = f"t{t}"
    element += [f"r{y}[j] = {code[name]}" for y, name in zip(ys, outputs)]
    body += loops + [f"{pad}for j in range(n):"] + [f"{pad}    {line}" for line in element]
    body.append("    return True")
    return loop_module(body)


def loop_module(function, imports=()):
    """A generated module's source: ``function`` (its lines), ``imports``."""
    return "\n".join(["# generated by stepnet: do not edit", "import math", "import numpy as np",
                      "from numba import carray, njit",
                      "from stepnet.jit.atomics import pointer_to, wide_vectors",
                      *runtime_imports(), *imports, "", "",
                      "@njit(cache=True, error_model='numpy', nogil=True)", *function, ""])
