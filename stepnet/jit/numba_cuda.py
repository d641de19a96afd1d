"""The CUDA backend (``backend="cuda"``): a step-net as ``numba.cuda`` kernels.

``compile_program(program)`` generates Python source for a few kernels
(``compiled.source`` shows it, ``STEPNET_DEBUG=1`` prints it) and returns
``run(args, consts)``. A call:

1. sorts the sequences by length (longest first, stable) and numbers the
   steps' rows time-major: step ``t``'s rows are the ``nb[t]`` sequences
   still running, packed rows ``[off[t], off[t] + nb[t])``, and ``tok[r]`` is
   the caller's token of packed row ``r`` (a reversed step-net counts each
   sequence back to front): kernels read step inputs and write all-steps
   outputs through it. Data moves to the device in one copy a call.
2. runs the schedule's **hoisted** stages (:mod:`stepnet.schedule`, the
   one every compiled backend renders) once over every token: ``x @ Wr``,
   ``x @ Wz``, ``x @ Wn`` for every step are one merged GEMM.
3. runs the **time loop** as one kernel (``cuda_run.LoopPlan`` says which:
   one block with ``cuda.syncthreads()`` between stages, or a cooperative
   grid of at most one block per multiprocessor with grid-wide syncs;
   Persistent RNNs, Diamos et al. 2016), or for large batches one launch per
   stage and step. Per step, the schedule's step stages run on the active
   prefix ``[0, nb[t])``, then the outputs and the memory updates: a step
   GEMM over each block's slice of its columns, whose weights the block
   copied to shared memory once (:func:`_sliced_gemm`), a general matmul, a
   shape op (slice, concat, pad, sum, transpose, broadcast_axis), or a run of
   elementwise ops fused into one stage that keeps intermediates in
   registers (only the schedule's materialized values are stored). The
   outputs and memory updates of a step that run over the same elements are
   one stage (each thread copies its own element of each). The hoisted GEMM
   is a tiled kernel (:func:`_tiled_gemm`).
4. copies all-steps outputs and last-step outputs back, in the caller's order.

Ops whose operands are constants only (e.g. ``W.T`` in a backward step) are
computed once per call with NumPy. A nested step-net that reads only its
ragged step input (a word-level encoder inside a sentence-level net) runs once
over every sub-sequence before the enclosing loop, as a program of its own on
this backend; each last-step output is then one row per token of the
enclosing net. Supported: dense step values (any feature rank), dense static
inputs and such nested nets at any depth, and ragged static inputs (an
attention memory) with one LoD: their rows packed in sorted sequence order
("mrow" values, a thread per memory row), the segment ops a thread per
sequence looping over its rows. A nested net reading other values of the
enclosing step or giving it a ragged output raises UnsupportedError.
Gradients run on this backend because the backward of a step-net is a
step-net (stepnet.autodiff).
"""

from __future__ import annotations

import sys
import re

import numpy as np

from .. import ir, schedule
from ..config import config
from ..errors import BackendError, UnsupportedError
from .. import registry
from . import loading
from . import cuda_run
from .cuda_run import TILE, TILE_K, _Run

try:  # numba.cuda imports without a GPU; is_available() says whether one (or the simulator) is there
    from numba import cuda
except ImportError:  # pragma: no cover - numba always ships cuda
    cuda = None

def available() -> bool:
    try:
        return cuda is not None and cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver is "not available"
        return False


def why_unavailable() -> str:
    return ("no CUDA GPU was found; set NUMBA_ENABLE_CUDASIM=1 (before numba is imported) to "
            "run on Numba's CUDA simulator")


# ----------------------------------------------------------------------------
# where the generated code finds a value


class _Value:
    """A var as the kernels see it. ``kind``: "token" (one row per token of
    the packed layout: step inputs and hoisted values), "row" (one row per
    sequence in sorted order: memories, statics, per-step values), "mrow"
    (one row per row of the ragged static input: its data packed in sorted
    sequence order, sequence b's rows ``mstart[b]`` to ``mstart[b + 1]``, so
    the active sequences' rows are a prefix), "const" (flat, no batch axis)
    or "literal"."""

    def __init__(self, kind, name, shape, dtype, offset=0):
        self.kind, self.name, self.shape, self.dtype = kind, name, shape, dtype
        self.offset = offset  # first column in the buffer (a merged GEMM's results share one)

    @property
    def width(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _strides(shape):
    out, s = [], 1
    for d in reversed(shape):
        out.append(s)
        s *= d
    return list(reversed(out))


def _dtype_name(dtype) -> str:
    return {"f4": "float32", "f8": "float64", "b1": "boolean"}.get(np.dtype(dtype).str[1:],
                                                                   np.dtype(dtype).name)


def _number(dtype, value) -> str:
    """``value`` as a number of ``dtype`` in kernel code (inf and NaN too)."""
    return f"{_dtype_name(dtype)}({registry.number_code(value)})"


class _Kernels:
    """Generates the kernels of one program (see the module docstring)."""

    def __init__(self, program: ir.Program):
        self.program = program
        eqn = program.eqn
        self.body = body = eqn.attrs["body"]
        for e in ir.iter_eqns(body):
            if e.op != "rnn" and registry.get(e.op).kind == "quantized":
                raise UnsupportedError(f"cuda backend: {e.op} (a quantized product) runs on the "
                                       "CPU backends only; run the float model on the GPU")
        read = ir.ragged_step_read(body)
        if read is not None:
            raise UnsupportedError(f"cuda backend: step value {read.name} has LoD levels of its own "
                                   "(a step input of two levels or more), and an op reads it; only "
                                   "a nested step-net does here; it runs on the interpreter")
        for v in ir.rnn_parts(eqn)[1]:
            if v.lod_depth > 1:
                raise UnsupportedError(f"cuda backend: static input {v.name} is a LoDTensor of "
                                       f"{v.lod_depth} levels; one level at most")
        # ragged static inputs (one LoD for all of them, checked per call)
        self.ragged = [i for i, v in enumerate(body.static_inputs) if v.lod_depth]
        self.ragged_memories = eqn.attrs.get("ragged_memories", {})
        self.space = "row"  # the rows the stage being generated runs over ("row" or "mrow")
        self.values = {}  # id(var) -> _Value
        self.nested = []  # (nested rnn eqn, its own compiled program), run before the loop
        self.host_eqns = []  # constant-only equations, computed with NumPy per call
        self.buffers = []  # (name, kind, width, dtype) of "row" and "token" scratch buffers
        self.lines = ["import math", "from numba import cuda", "from numba import float32, float64",
                      "from numba import boolean", ""]
        self.kernel_names = []
        self.used_names = []  # the arrays some stage reads (source())
        for v in program.consts:
            self.values[id(v)] = _Value("const", f"c_{_ident(v.name)}", tuple(v.shape), v.dtype)
        for i, var in enumerate(body.step_inputs):
            # a ragged step (a multi-level input) is read by nested step-nets only
            kind = "ragged" if var.lod_depth else "token"
            self.values[id(var)] = _Value(kind, f"seq{i}", tuple(var.shape[1:]), var.dtype)
        for i, var in enumerate(body.static_inputs):
            kind = "mrow" if var.lod_depth else "row"
            self.values[id(var)] = _Value(kind, f"static{i}", tuple(var.shape[1:]), var.dtype)
        for i, mem in enumerate(body.memories):
            kind = "mrow" if i in self.ragged_memories else "row"
            self.values[id(mem.pre)] = _Value(kind, f"mem{i}", tuple(mem.pre.shape[1:]),
                                              mem.pre.dtype)
        self.schedule = sched = schedule.schedule(program)
        self.joined = []  # (name, weights): a merged GEMM's weights, joined by columns per call
        self.stored = {id(v) for v in sched.materialized}  # per-step values written to buffers
        for stage in sched.const:
            self._host(stage.eqns[0])
        for section, kind in (("hoisted", "token"), ("step", "row")):
            for stage in getattr(sched, section):
                if stage.kind == "rnn":
                    self._nested(stage.eqns[0], program.consts)
                else:
                    self._allocate(stage, kind)
        self.hoisted = [self._stage_lines(s) for s in sched.hoisted if s.kind != "rnn"]
        self.stepped = [self._stage_lines(s) for s in sched.step]
        self.step_gemms = [g for _, _, _, g in self.stepped if g is not None]
        self.finish = self._finish_lines()
        self.widest = max([w for (_, _, w, _) in self.buffers] + [v.width for v in self.values.values()
                                                                   if v.kind != "const"] + [1])

    def _allocate(self, stage, kind):
        if kind == "row" and stage.outputs[0].lod_depth:
            kind = "mrow"
        """Buffers for a stage's results: one row per token ("token", hoisted)
        or per sequence ("row"). A merged GEMM's results are column blocks of
        one buffer; a fused run's intermediates that nobody reads outside it
        stay in registers."""
        if stage.merged:
            name, offset = f"v{len(self.values)}", 0
            for o in stage.outputs:
                self.values[id(o)] = _Value(kind, name, tuple(o.shape[1:]), o.dtype, offset)
                self.stored.add(id(o))
                offset += self.values[id(o)].width
            self.buffers.append((name, kind, offset, np.dtype(stage.outputs[0].dtype)))
            return
        for o in stage.outputs:
            if kind in ("row", "mrow") and stage.kind == "elementwise" and id(o) not in self.stored:
                continue  # stays in a register
            name = f"v{len(self.values)}"
            self.values[id(o)] = _Value(kind, name, tuple(o.shape[1:]), o.dtype)
            self.stored.add(id(o))
            self.buffers.append((name, kind, self.values[id(o)].width, np.dtype(o.dtype)))

    # -- nested step-nets ---------------------------------------------------------

    def _nested(self, e, consts):
        """A nested step-net that reads nothing of the enclosing step but its
        ragged step inputs runs once over every sub-sequence before the loop
        (its own program on this backend); each last-step output is then one
        row per token of the enclosing net."""
        name = e.attrs["name"]
        seqs, statics, inits = ir.rnn_parts(e)
        own = {id(v) for v in self.body.step_inputs}
        why = None
        if statics or any(id(v) not in own for v in seqs):
            why = "reads values of the enclosing step (only its step inputs are supported)"
        elif any(isinstance(v, ir.Var) and self.values.get(id(v), _Value("", "", (), None)).kind
                 != "const" for v in inits):
            why = "starts a memory from a value of the enclosing step"
        elif any(e.attrs["all_steps"]):
            why = "gives an all-steps (ragged) output to the enclosing step"
        elif any(o.lod_depth for o in e.outputs):
            why = "gives a ragged last-step output to the enclosing step"
        if why:
            raise UnsupportedError(f"cuda backend: nested step-net {name} {why}; it runs on numba "
                                   "and interpreter")
        inner = ir.Program(inputs=tuple(seqs), consts=tuple(consts), eqn=e)
        for j, o in enumerate(e.outputs):
            self.values[id(o)] = _Value("token", f"nest{len(self.nested)}_{j}", tuple(o.shape[1:]),
                                        o.dtype)
        self.nested.append((e, compile_program(inner)))

    # -- constants ------------------------------------------------------------------

    def _host(self, e):
        for o in e.outputs:
            self.values[id(o)] = _Value("const", f"h{len(self.host_eqns)}_{_ident(o.name)}",
                                        tuple(o.shape), o.dtype)
        self.host_eqns.append(e)

    # -- reading values inside a kernel ----------------------------------------------

    def _operand(self, v, local, out_shape):
        """Code reading operand ``v`` at this thread's element of an output of
        feature shape ``out_shape`` (right-aligned broadcasting)."""
        if isinstance(v, ir.Literal):
            return None, v
        if id(v) in local:
            return local[id(v)], None
        info = self.values[id(v)]
        index = _broadcast_index(out_shape, info.shape)
        return self._read(info, index), None

    def _read(self, info, index):
        """Code reading ``info`` at flat feature ``index`` of this thread's row:
        ``i`` is a sequence (``space`` "row") or a memory row whose sequence
        is ``row_of[i]`` ("mrow")."""
        if info.kind == "const":
            return f"{info.name}[{index}]"
        sequence = "row_of[i]" if self.space == "mrow" else "i"
        if info.kind == "mrow":
            if self.space != "mrow":
                raise UnsupportedError(f"cuda backend: {info.name} is ragged; read it with a "
                                       "segment op (seq_sum, seq_max)")
            row = "i"
        else:
            row = f"off + {sequence}" if info.kind == "token" else sequence
            if info.name.startswith("seq"):  # the caller's rows: packed row r is token tok[r]
                row = f"tok[{row}]"
        if info.offset:
            index = f"{info.offset} + {index}"
        return f"{info.name}[{row}, {index}]"

    # -- stages -------------------------------------------------------------------

    def _stage_lines(self, stage):
        """(element count per row, body lines computing element ``e`` = (row
        ``i``, flat feature ``j``), the rows: "row" or "mrow", the stage's
        :class:`_Gemm` or None) of one stage."""
        self.space = "mrow" if stage.outputs[0].lod_depth else "row"
        self.gemm = None
        width, lines = self._stage_code(stage)
        return width, lines, self.space, self.gemm

    def _stage_code(self, stage):
        first = stage.eqns[0]
        if stage.kind == "gemm":
            return self._gemm(stage)
        width = int(np.prod(first.outputs[0].shape[1:], dtype=np.int64))
        if stage.kind in ("matmul", "shape"):
            return width, self._indexed(first)
        return width, self._elementwise(stage.eqns)

    def _coords(self, shape, flat="j"):
        lines = []
        for k, (d, s) in enumerate(zip(shape, _strides(shape))):
            lines.append(f"c{k} = ({flat} // {s}) % {d}")
        return lines

    def _elementwise(self, eqns):
        out_shape = tuple(eqns[0].outputs[0].shape[1:])
        lines = []
        local = {}
        for e in eqns:
            o = e.outputs[0]
            dt = registry.literal_dtype(e)
            args = []
            for v in e.inputs:
                code, lit = self._operand(v, local, out_shape)
                args.append(code if lit is None else _number(dt, lit.value))
            name = f"t{len(local)}"
            lines.append(f"{name} = {self._scalar(e, args)}")
            local[id(o)] = name
            if id(o) in self.stored:
                lines.append(f"{self._read(self.values[id(o)], 'j')} = {name}")
        return _used_coords(self._coords(out_shape), lines)

    def _scalar(self, e, args):
        """Op ``e`` on one element, ``args`` its operands' code: the op's
        ``cuda`` code (its record in stepnet/ops/)."""
        dt = _dtype_name(e.outputs[0].dtype) if np.dtype(e.outputs[0].dtype).kind == "f" else "float64"
        code = registry.get(e.op).cuda
        if callable(code):
            return code(*args, **{k: _number(dt, v) for k, v in e.attrs.items() if v is not None})
        return code.format(*args, one=f"{dt}(1.0)", zero=f"{dt}(0.0)", inf=f"{dt}(math.inf)",
                           nan=f"{dt}(math.nan)", dt=dt)

    def _gemm(self, stage):
        """``a @ W`` (W a 2-D constant) on the per-stage path: a row-dot per
        output element (the loop kernel and the hoisted kernel render the
        stage's :class:`_Gemm` their own ways); a merged
        GEMM reads the weights joined by columns (``joined<n>``)."""
        ia = self.values[id(stage.left)]
        weights = [e.inputs[1] for e in stage.eqns]
        if stage.merged:
            name = f"joined{len(self.joined)}"
            self.joined.append((name, weights))
        else:
            name = self.values[id(weights[0])].name
        K, N = stage.left.shape[-1], sum(w.shape[1] for w in weights)
        out = self.values[id(stage.eqns[0].outputs[0])]
        self.gemm = _Gemm(K, N, name, self._read(ia, "@k"), self._read(out, "j"),
                          np.dtype(out.dtype), np.dtype(weights[0].dtype))
        acc = f"{_dtype_name(out.dtype)}(0.0)"
        return N, [f"n = j % {N}", f"acc = {acc}", f"for k in range({K}):",
                   f"    acc += {self._read(ia, 'k')} * {name}[k * {N} + n]",
                   f"{self._read(out, 'j')} = acc"]

    def _indexed(self, e):
        """A shape op or a reduction (sum, a matmul that is not a GEMM) from
        its record's ``gather`` or ``reduction`` form (stepnet/registry.py)."""
        out = self.values[id(e.outputs[0])]
        index = ["i"] + [f"c{k}" for k in range(len(out.shape))]
        shapes = [v.shape for v in e.inputs]
        record = registry.get(e.op)
        dst, zero = self._read(out, "j"), f"{_dtype_name(out.dtype)}(0.0)"
        if record.segment is not None:  # over sequence i's rows of its ragged operand
            combine, initial = record.segment
            x = self.values[id(e.inputs[0])]
            lines = [f"acc = {_number(out.dtype, initial)}",
                     "for r in range(mstart[i], mstart[i + 1]):",
                     f"    acc = {combine.format(acc='acc', x=f'{x.name}[r, j]')}", f"{dst} = acc"]
        elif record.reduction is not None:
            extent, sources = record.reduction(index, shapes, **e.attrs)
            term = " * ".join(self._read_at(e, k, source) for k, source in enumerate(sources))
            lines = [f"acc = {zero}", f"for k in range({extent}):", f"    acc += {term}",
                     f"{dst} = acc"]
        elif record.gather is not None:
            lines = []
            for n, case in enumerate(record.gather(index, shapes, **e.attrs)):
                src = zero if case.operand is None else self._read_at(e, case.operand, case.index)
                if case.axis is None:
                    lines.append(f"{dst} = {src}")
                else:
                    lines += [f"{'if' if n == 0 else 'elif'} {case.lo} <= {index[case.axis]} < "
                              f"{case.hi}:", f"    {dst} = {src}"]
        else:
            raise UnsupportedError(f"cuda backend: no code generation for op {e.op!r}")
        return _used_coords(self._coords(out.shape), lines)

    def _read_at(self, e, k, index):
        """Operand ``k`` of ``e`` read at ``index`` (code per axis of the
        operand, ``i`` on the batch axis; an axis of size 1 is read at 0)."""
        v = e.inputs[k]
        info = self.values.get(id(v))
        if info is None:
            raise UnsupportedError(f"cuda backend: {e.op} reads {v.name}, which is not available "
                                   "inside the kernel")
        shape, index = tuple(v.shape), list(index)
        if shape and shape[0] is None:
            if index[0] != "i":
                raise UnsupportedError(f"cuda backend: {e.op} across the batch axis of {v.name}")
            shape, index = shape[1:], index[1:]
        index = ["0" if n == 1 else i for n, i in zip(shape, index)]
        flat = " + ".join(f"({i}) * {s}" for i, s in zip(index, _strides(shape))) or "0"
        return self._read(info, flat)

    # -- outputs and memory updates --------------------------------------------------

    def _finish_lines(self):
        """Stages after a step: outputs first (a pre-state output reads the
        memory before its update), memories through a snapshot when one
        memory's new value is another's old one."""
        body, eqn = self.body, self.program.eqn
        stages = []
        self.space = "row"
        for k, (out, all_steps) in enumerate(zip(body.outputs, eqn.attrs["all_steps"])):
            if not all_steps and eqn.attrs["output_memory"][k] in self.ragged_memories:
                continue  # the memory's buffer is the output
            info = self.values[id(out)]
            if info.kind in ("const", "ragged") or (info.kind == "mrow" and not all_steps):
                raise UnsupportedError(f"cuda backend: output {out.name} is a constant or a ragged "
                                       "value; it runs on numba and interpreter")
            self.space = "mrow" if info.kind == "mrow" else "row"
            # an all-steps output in the caller's rows (its LoD is the input's)
            row = "i" if not all_steps else ("moff + i" if info.kind == "mrow" else "tok[off + i]")
            stages.append((info.width, [f"out{k}[{row}, j] = {self._read(info, 'j')}"], self.space))
            self.space = "row"
        pres = {id(m.pre) for m in body.memories}
        snap = []
        for i, mem in enumerate(body.memories):
            info = self.values[id(mem.post)]
            if id(mem.post) in pres:
                snap.append((info.width, [f"snap{i}[i, j] = {self._read(info, 'j')}"], "row"))
        stages += snap
        for i, mem in enumerate(body.memories):
            info = self.values.get(id(mem.post))
            if info is None or info.kind == "literal":
                raise UnsupportedError(f"cuda backend: memory {mem.name} is updated with a literal")
            self.space = "mrow" if i in self.ragged_memories else "row"
            read = f"snap{i}[i, j]" if id(mem.post) in pres else (
                f"{info.name}[j]" if info.kind == "const" else self._read(info, "j"))
            stages.append((info.width, [f"mem{i}[i, j] = {read}"], self.space))
        self.space = "row"
        self.snapshots = [i for i, m in enumerate(self.body.memories) if id(m.post) in pres]
        # each of these stages copies element (i, j) of a value of its width to
        # element (i, j) of an output, a snapshot or a memory: those of one
        # width and space in a row are one stage, each thread copying its own
        # element of each in this order (an output before the update of the
        # memory it reads, a snapshot before the update it is read by)
        merged = []
        for width, lines, space in stages:
            if merged and merged[-1][0] == width and merged[-1][2] == space:
                merged[-1][1].extend(lines)
            else:
                merged.append((width, list(lines), space, None))
        return merged

    # -- source ------------------------------------------------------------------

    def arg_names(self):
        body = self.body
        names = [f"seq{i}" for i in range(len(body.step_inputs))]
        names += [f"static{i}" for i in range(len(body.static_inputs))]
        names += [f"mem{i}" for i in range(len(body.memories))]
        names += [f"snap{i}" for i in self.snapshots]
        names += [f"out{k}" for k in range(len(body.outputs))]
        names += [name for name, _, _, _ in self.buffers]
        names += [f"nest{n}_{j}" for n, (e, _) in enumerate(self.nested) for j in range(len(e.outputs))]
        names += sorted({v.name for v in self.values.values() if v.kind == "const"})
        names += [name for name, _ in self.joined]
        if self.ragged:
            names += ["mstart", "row_of"]
        return names + ["tok"]

    def source(self):
        groups = (("hoisted", self.hoisted), ("step", self.stepped + self.finish))

        def read(body, space):
            rows = "mstart[nb]" if space == "mrow" else "nb"
            return set(re.findall(r"[A-Za-z_]\w*", "\n".join(body + [rows])))

        # the arrays some stage reads (a constant read only joined by columns
        # is neither copied to the device nor passed); each stage kernel takes
        # only those it reads itself: numba-cuda prepares every argument of
        # every launch on the host
        reads = {(group, k): read(body, space) for group, stages in groups
                 for k, (_, body, space, _) in enumerate(stages)}
        every = set().union(*reads.values())
        names = self.used_names = [n for n in self.arg_names() if n in every]
        lines = list(self.lines)
        for group, stages in groups:
            for k, (width, body, space, gemm) in enumerate(stages):
                name = f"{group}{k}"
                used = [n for n in names if n in reads[group, k]]
                tiled = group == "hoisted" and gemm is not None
                self.kernel_names.append((group, name, width, space, used, tiled))
                lines += ["@cuda.jit", f"def {name}({', '.join(['nb', 'off', 'moff'] + used)}):"]
                if tiled:
                    lines += ["    " + s for s in _tiled_gemm(gemm)] + [""]
                    continue
                rows = "mstart[nb]" if space == "mrow" else "nb"
                lines += ["    e = cuda.grid(1)", f"    if e < {rows} * {width}:",
                          f"        i = e // {width}", f"        j = e % {width}"]
                lines += ["        " + s for s in body] + [""]
        for driver in ("persistent", "block"):
            lines += self._loop_kernel(driver, names)
        return "\n".join(lines) + "\n"

    def _loop_kernel(self, driver, names):
        """The whole time loop as one kernel: ``persistent`` on a cooperative
        grid, its stages separated by grid-wide syncs; ``block`` on one block,
        separated by ``cuda.syncthreads()``. Each block owns a slice of every
        step GEMM's columns (all of them on one block); with ``resident`` its
        slice of the weights is copied to shared memory once, before the
        first step, and read there at every step."""
        sync = "grid.sync()" if driver == "persistent" else "cuda.syncthreads()"
        gemms = self.step_gemms
        wdt = _dtype_name(gemms[0].weight_dtype) if gemms else "float32"
        lines = ["@cuda.jit", f"def {driver}(steps, nbs, resident, {', '.join(names)}):"]
        if driver == "persistent":
            lines += ["    grid = cuda.cg.this_grid()", "    tid = cuda.grid(1)",
                      "    nt = cuda.gridsize(1)"]
        else:
            lines += ["    tid = cuda.threadIdx.x", "    nt = cuda.blockDim.x"]
        lines += ["    lt = cuda.threadIdx.x", "    bd = cuda.blockDim.x",
                  "    blk = cuda.blockIdx.x", "    nblk = cuda.gridDim.x",
                  f"    wsh = cuda.shared.array(0, {wdt})", "    g_w0 = 0"]
        for g, gemm in enumerate(gemms):  # the block's columns of each GEMM, where they sit in wsh
            N = gemm.N
            lines += [f"    g_cpb{g} = ({N} + nblk - 1) // nblk", f"    g_c{g} = blk * g_cpb{g}",
                      f"    g_n{g} = max(0, min(g_cpb{g}, {N} - g_c{g}))"]
            if g + 1 < len(gemms):
                lines.append(f"    g_w{g + 1} = g_w{g} + {gemm.row} * g_cpb{g}")
        if gemms:
            lines.append("    if resident:")
            for g, gemm in enumerate(gemms):
                # column n of the slice is row n of wsh from g_w<g>, ``row`` words a
                # row: a thread's reads are at constant offsets from its row, and
                # a warp's threads (consecutive columns) read distinct banks
                lines += [f"        for e in range(lt, {gemm.K} * g_n{g}, bd):",
                          f"            wsh[g_w{g} + (e % g_n{g}) * {gemm.row} + e // g_n{g}] = "
                          f"{gemm.weight}[(e // g_n{g}) * {gemm.N} + g_c{g} + e % g_n{g}]"]
            lines.append("        cuda.syncthreads()")
        lines += ["    for t in range(steps):", "        nb = nbs[0, t]", "        off = nbs[1, t]",
                  "        moff = nbs[2, t]"]
        g = 0
        for width, body, space, gemm in self.stepped + self.finish:
            rows = "mstart[nb]" if space == "mrow" else "nb"
            if gemm is not None:
                lines += ["        " + s for s in _sliced_gemm(gemm, g, rows)]
                g += 1
            else:
                lines += [f"        for e in range(tid, {rows} * {width}, nt):",
                          f"            i = e // {width}", f"            j = e % {width}"]
                lines += ["            " + s for s in body]
            lines.append(f"        {sync}")
        return lines + [""]


class _Gemm:
    """A GEMM stage as its kernels read it: ``a @ W`` with ``a`` read at
    column ``k`` of row ``i`` by ``left(k)``, the weights flat (``K x N``,
    row-major) in array ``weight``, element (``i``, ``j``) written by
    ``out``."""

    def __init__(self, K, N, weight, left, out, dtype, weight_dtype):
        self.K, self.N, self.weight, self._left, self.out = K, N, weight, left, out
        self.dtype, self.weight_dtype = dtype, weight_dtype

    def left(self, k) -> str:
        return self._left.replace("@k", k)

    @property
    def weight_bytes(self) -> int:
        return self.K * self.N * self.weight_dtype.itemsize

    @property
    def row(self) -> int:
        """Words a column of the weights takes in shared memory: K, made odd
        so that consecutive columns start in distinct banks."""
        return self.K + 1 - self.K % 2


def _tiled_gemm(gemm):
    """A hoisted GEMM over every token (``nb`` rows): a 2-D grid of TILE x TILE
    tiles, each thread 4 x 4 outputs held in registers (rows ``ty * 4 + r``,
    columns ``tx + 16 * c``), the operands' slices staged in shared memory; a
    block takes every ``gridDim.y``-th tile of rows (CUDA's grid has at most
    65,535 blocks down)."""
    dt, K, N, q = _dtype_name(gemm.dtype), gemm.K, gemm.N, TILE // 4
    body = [f"a{r}{c} = {dt}(0.0)" for r in range(4) for c in range(4)]
    body += [f"for k0 in range(0, {K}, {TILE_K}):",
             f"    for p in range(lid, {TILE_K * TILE}, {q * q}):",
             f"        i = r0 + p // {TILE_K}", f"        k = k0 + p % {TILE_K}",
             f"        x = {dt}(0.0)", f"        if i < nb and k < {K}:",
             f"            x = {gemm.left('k')}", f"        ta[p % {TILE_K}, p // {TILE_K}] = x",
             f"        k = k0 + p // {TILE}", f"        n = c0 + p % {TILE}", f"        x = {dt}(0.0)",
             f"        if k < {K} and n < {N}:", f"            x = {gemm.weight}[k * {N} + n]",
             f"        tb[p // {TILE}, p % {TILE}] = x",
             "    cuda.syncthreads()", f"    for kk in range({TILE_K}):"]
    body += [f"        x{r} = ta[kk, ty * 4 + {r}]" for r in range(4)]
    body += [f"        y{c} = tb[kk, tx + {q * c}]" for c in range(4)]
    body += [f"        a{r}{c} += x{r} * y{c}" for r in range(4) for c in range(4)]
    body.append("    cuda.syncthreads()")
    for r in range(4):
        body += [f"i = r0 + ty * 4 + {r}", "if i < nb:"]
        for c in range(4):
            body += [f"    j = c0 + tx + {q * c}", f"    if j < {N}:", f"        {gemm.out} = a{r}{c}"]
    return ([f"ta = cuda.shared.array(({TILE_K}, {TILE}), {dt})",
             f"tb = cuda.shared.array(({TILE_K}, {TILE}), {dt})",
             "tx = cuda.threadIdx.x", "ty = cuda.threadIdx.y", f"lid = ty * {q} + tx",
             f"c0 = cuda.blockIdx.x * {TILE}",
             f"for r0 in range(cuda.blockIdx.y * {TILE}, nb, cuda.gridDim.y * {TILE}):"]
            + ["    " + line for line in body])


def _sliced_gemm(gemm, g, rows):
    """Step GEMM ``g`` in the loop kernel: this block's columns (from ``g_c<g>``,
    ``g_n<g>`` of them) for every active row, a thread per output, four partial
    sums (independent chains of multiply-adds); the weights from shared memory
    where they are resident. The products are written out ``cuda_run.UNROLL``
    at a time in a loop over the inputs, so that each operand is read at a
    constant offset from the chunk's start (a loop of one product spends more
    instructions on its indices than on its arithmetic; written out in full,
    a kernel takes many times as long to compile)."""
    K, N, dt, u = gemm.K, gemm.N, _dtype_name(gemm.dtype), max(1, cuda_run.UNROLL)
    body = []
    for source, stride, column in (("wsh", 1, f"g_r{g}"), (gemm.weight, N, "j")):
        lines = []
        if K >= u:
            lines += [f"        for k in range(0, {K - u + 1}, {u}):"]
            at = "k + {c}" if stride == 1 else f"(k + {{c}}) * {stride}"
            lines += [f"            g_s{c % 4} += {gemm.left(f'k + {c}')} * {source}[{column} + "
                      f"{at.format(c=c)}]" for c in range(u)]
        lines += [f"        g_s{k % 4} += {gemm.left(str(k))} * {source}[{column} + {k * stride}]"
                  for k in range(K - K % u, K)]
        body.append(lines)
    return ([f"for e in range(lt, {rows} * g_n{g}, bd):", f"    i = e // g_n{g}",
             f"    g_nl = e % g_n{g}", f"    j = g_c{g} + g_nl"]
            + [f"    g_s{p} = {dt}(0.0)" for p in range(4)]
            + ["    if resident:", f"        g_r{g} = g_w{g} + g_nl * {gemm.row}"] + body[0]
            + ["    else:"] + (body[1] or ["        pass"])  # (no terms: K = 0)
            + [f"    {gemm.out} = g_s0 + g_s1 + g_s2 + g_s3"])


def _used_coords(coords, lines):
    """The coordinate lines (``c<k> = ...``) that ``lines`` read, then ``lines``."""
    text = "\n".join(lines)
    return [c for c in coords if c.split(" = ")[0] in text] + lines


def _ident(name) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _broadcast_index(out_shape, shape) -> str:
    """The flat index into a value of feature ``shape`` broadcast (right-aligned)
    to ``out_shape``, from the output's coordinates ``c<k>``."""
    shape = tuple(shape)
    if shape == tuple(out_shape):
        return "j"
    if int(np.prod(shape, dtype=np.int64)) == 1:
        return "0"
    lead = len(out_shape) - len(shape)
    terms = [f"c{lead + k} * {s}" for k, (d, s) in enumerate(zip(shape, _strides(shape))) if d != 1]
    return " + ".join(terms) or "0"


# ----------------------------------------------------------------------------
# running


def compile_program(program: ir.Program):
    if not available():
        raise BackendError(f"backend 'cuda' is not available on this machine: {why_unavailable()}")
    kernels = _Kernels(program)
    source = kernels.source()
    if config.debug:
        print(source, file=sys.stderr)
    # (its kernels compile at their first launch)
    run = _Run(program, kernels, vars(loading.load_source(source)))
    run.source = source
    run.schedule = kernels.schedule
    return run


__all__ = ["available", "compile_program"]
