"""The Numba backend: a whole step-net, time loop included, as native code.

The generated module has one ``rnn_<n>`` function per ``rnn`` equation and a
``program`` function that runs the hoisted work and calls the top rnn. Its
layout:

- **Spaces.** Step values live in a *space*: the entries of one LoD level
  (space 1: the elements of the top-level sequences; space 2: their
  sub-elements; ...). A value that depends only on step inputs and constants
  is computed once for its whole space before any time loop runs (hoisted):
  ``x @ W`` is one GEMM over every token, at every nesting depth. Matmuls that
  share their left operand are merged into one GEMM with concatenated weights.
- **Time loop.** Sequences are sorted by length, so the active batch at step t
  is the prefix ``[0, nb)``; per-step values live in buffers with one row per
  sequence, allocated once per call. ``entries[b]`` is the space index of
  active row b's current element. The per-step recurrent matmuls go to BLAS
  (``np.dot``); runs of elementwise ops are fused into one loop, with float32
  tanh/sigmoid as vectorizable approximations (numba_runtime).
- **Nesting.** A nested rnn is a function called once per outer step with its
  sequences (the active outer rows' sub-sequences) given by start and length.

``compile_program(program)`` returns a callable with ``.source``; kernels are
cached in memory and on disk (``STEPNET_CACHE_DIR``) by a hash of the source,
which encodes the graph and its dtypes but no sizes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import textwrap

import numpy as np

from .. import ir
from ..errors import UnsupportedError
from ..lod import LoDTensor
from ..ops import registry
from . import blas, numba_runtime
from .cache import cache_dir, helpers_fingerprint

# ----------------------------------------------------------------------------
# code generation

# the scalar helpers an op's numba code may call (relu, tanh32, ...): every
# public function of numba_runtime, imported by the generated code
_RUNTIME_HELPERS = sorted(name for name, f in vars(numba_runtime).items() if not name.startswith("_")
                          and callable(f) and getattr(f, "__module__", None) == numba_runtime.__name__)


def _fusable(e) -> bool:
    """An elementwise op: one scalar expression (its entry's ``numba`` code) per element."""
    return e.op != "rnn" and registry.get(e.op).kind == "elementwise"


class _Info:
    """Where the generated code finds a var.

    kind: "const" (whole array, no batch axis), "literal", "global" (an array
    over a whole space, row = entry index), "local" (a buffer with one row per
    active sequence), "scalar" (a register inside a fused loop), "ragged" (a
    nested sequence: ``levels`` map entries down to ``data``, a global).
    """

    def __init__(self, kind, ident=None, var=None, offset=0, width=None, size=None,
                 hoistable=False, levels=(), data=None, literal=None):
        self.kind = kind
        self.ident = ident
        self.var = var
        self.offset = offset  # column offset into a merged matmul result
        self.width = width  # full last-axis width of the array behind ident
        self.size = size  # rows of a global (code expression)
        self.hoistable = hoistable
        self.levels = tuple(levels)
        self.data = data
        self.literal = literal


class _Gen:
    def __init__(self, program: ir.Program):
        self.program = program
        self.info = {}
        self.counter = 0
        self.module_consts = []  # lines defining typed scalar constants
        self.literals = {}
        self.gargs = []  # names passed to every rnn function
        self.functions = {}  # name -> lines
        self.prologue = []  # lines in program(): hoisted work and allocations
        self.hoisted = set()  # ids of bodies whose hoistable work is emitted
        self.packed = {}  # weights ident -> packed weights ident
        self.const_names = {}  # ident -> the program's constant name
        self.concatenated = {}  # ident -> names of the constants it joins by columns
        self.step_buffers = set()  # buffers written inside a time step
        self.extra_returns = []  # data arrays behind ragged last-step outputs
        self.direct_outputs = {}  # id(step result) -> global arrays of all-steps outputs
        self.written_outputs = set()  # ids of those a fused loop already writes

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
                self.module_consts.append(f"{name} = np.{dtype.name}({float(value)!r})")
            self.literals[key] = name
        return self.literals[key]

    # -- entry point ---------------------------------------------------------

    def generate(self) -> str:
        prog = self.program
        params = []
        for v in prog.consts:
            ident = self.fresh("c")
            self.const_names[ident] = v.name
            self.info[id(v)] = _Info("const", ident, v)
            params.append(ident)
            self.gargs.append(ident)
        eqn = prog.eqn
        seqs, statics, _ = ir.rnn_parts(eqn)
        self.top_inputs = []
        for v in prog.inputs:
            if v.lod_depth:
                data = self.fresh("x")
                levels = [self.fresh("L") for _ in range(v.lod_depth)]
                params += [data] + levels
                self.gargs += levels
                size = f"{data}.shape[0]"
                dinfo = _Info("global", data, v, size=size, hoistable=True,
                              width=_width(v))
                self.gargs.append(data)
                if any(s is v for s in statics):
                    raise UnsupportedError(
                        f"static input {v.name} is a LoDTensor; the numba backend takes "
                        "dense static inputs only (use backend='interpreter')"
                    )
                self.info[id(v)] = _Info("ragged", None, v, levels=levels, data=dinfo)
                self.top_inputs.append(("sequence", v, data, levels))
            else:
                ident = self.fresh("a")
                params.append(ident)
                self.info[id(v)] = _Info("local", ident, v, width=_width(v))
                self.top_inputs.append(("dense", v, ident, None))
        self.program_params = params

        self.hoist_block(eqn)
        top_levels = self.info[id(seqs[0])].levels
        call, outs = self.emit_rnn_call(eqn, "starts", "lengths", "num_seq", mode="program")
        self.top_outputs = outs
        body = [f"starts, lengths = starts_and_lengths({top_levels[0]})",
                "num_seq = lengths.shape[0]"] + self.prologue + call
        ret = ", ".join([o[1] for o in outs] + self.extra_returns)
        body.append(f"return ({ret},)")
        src = [
            "# generated by stepnet: do not edit",
            "import math",
            "import numpy as np",
            "from numba import njit, prange",
            f"# BLAS: {blas.BLAS_NAME}" + (" (deterministic)" if blas.DETERMINISTIC else ""),
            "from stepnet.jit.blas import gemm32, gemm64, gemm_packed32, gemm_packed64, pack32, pack64",
            "from stepnet.jit.numba_runtime import (",
            *textwrap.wrap(", ".join(_RUNTIME_HELPERS) + ",", 90, initial_indent="    ",
                           subsequent_indent="    "),
            ")",
            "",
        ]
        src += self.module_consts + [""]
        for fn in self.functions.values():
            src += fn + [""]
        src.append(_decorator(parallel=False))
        # consts, then weights concatenated by the caller for merged matmuls
        params = params[:len(prog.consts)] + list(self.concatenated) + params[len(prog.consts):]
        src.append(f"def program({', '.join(params)}):")
        src += ["    " + line for line in body]
        return "\n".join(src) + "\n"

    # -- hoisting: work that depends on no memory runs once per space --------

    def hoist_block(self, eqn):
        """Classify the body of ``eqn`` and emit its hoistable ops into the prologue."""
        body = eqn.attrs["body"]
        if id(body) in self.hoisted:
            return
        self.hoisted.add(id(body))
        seqs, _, _ = ir.rnn_parts(eqn)
        for step_var, outer in zip(body.step_inputs, seqs):
            oi = self.info[id(outer)]
            if oi.kind != "ragged":
                raise UnsupportedError(f"step input {outer.name} is not a sequence")
            if step_var.lod_depth:
                self.info[id(step_var)] = _Info("ragged", None, step_var,
                                                levels=oi.levels[1:], data=oi.data)
            else:
                d = oi.data
                self.info[id(step_var)] = _Info("global", d.ident, step_var, offset=d.offset,
                                                width=d.width, size=d.size,
                                                hoistable=d.hoistable)
        progress = True
        while progress:  # a hoisted nested rnn can make more of this body hoistable
            progress = False
            merged = self.merge_matmuls(body, hoisting=True)
            for e in self.hoistable_eqns(body):
                if id(e.outputs[0]) in self.info:
                    continue  # computed by a merged matmul
                kinds = [self.info[id(v)] for v in e.inputs if isinstance(v, ir.Var)]
                if all(k.kind == "const" for k in kinds):
                    self.emit_op(e, "const", self.prologue)
                elif id(e) in merged:
                    self.emit_merged(merged[id(e)], "hoist", self.prologue)
                else:
                    self.emit_op(e, "hoist", self.prologue)
                progress = True
            for e in body.eqns:
                if e.op != "rnn":
                    continue
                # its sequence inputs are known now if they come from step inputs
                inner_seqs, _, _ = ir.rnn_parts(e)
                if all(id(v) in self.info for v in inner_seqs):
                    self.hoist_block(e)
                    if id(e.outputs[0]) not in self.info and self.independent_rnn(e):
                        level = self.info[id(inner_seqs[0])].levels[0]
                        st, ln = self.fresh("st"), self.fresh("ln")
                        self.prologue.append(f"{st}, {ln} = starts_and_lengths({level})")
                        call, _ = self.emit_rnn_call(e, st, ln, f"{ln}.shape[0]", mode="hoist")
                        self.prologue.extend(call)
                        progress = True

    def independent_rnn(self, e):
        """A nested rnn that reads no per-step value of its enclosing step (only
        step-input data, constants and literals) runs once over every entry of
        its space, before any time loop, instead of once per enclosing step."""
        seqs, statics, inits = ir.rnn_parts(e)
        for v in seqs:
            info = self.info[id(v)]
            if info.kind != "ragged" or not info.data.hoistable:
                return False
        for v in list(statics) + list(inits):
            if isinstance(v, ir.Var) and self.info.get(id(v), _Info("?")).kind != "const":
                return False
        body = e.attrs["body"]
        return all(
            all_steps or not res.lod_depth
            for res, all_steps in zip(body.outputs, e.attrs["all_steps"])
        )

    def hoistable_eqns(self, body):
        """The ops of ``body`` that depend on no memory, in order.

        An elementwise op is hoisted only when a hoisted matmul, reduction or
        shape op needs its result: otherwise it costs one more pass over every
        token, while inside the step it fuses into the gate loop for free.
        """
        ready = {id(v) for v in self.info_vars(("const",))}
        ready |= {i for i, info in self.info.items() if info.kind == "global" and info.hoistable}
        marked = []
        for e in body.eqns:
            if e.op == "rnn":
                continue
            if all(id(v) in ready for v in e.inputs if isinstance(v, ir.Var)):
                marked.append(e)
                ready.update(id(v) for v in e.outputs)
        consumers = {}
        for e in body.eqns:
            for v in e.inputs:
                if isinstance(v, ir.Var):
                    consumers.setdefault(id(v), []).append(e)
        keep = set()
        for e in reversed(marked):
            const_only = all(self.info.get(id(v)) is not None and self.info[id(v)].kind == "const"
                             for v in e.inputs if isinstance(v, ir.Var))
            fusable = _fusable(e)
            if const_only or not fusable or any(
                id(c) in keep for c in consumers.get(id(e.outputs[0]), ())
            ):
                keep.add(id(e))
        return [e for e in marked if id(e) in keep]

    def info_vars(self, kinds):
        return [info.var for info in self.info.values() if info.kind in kinds]

    def merge_matmuls(self, body, hoisting):
        """Group ``a @ W1``, ``a @ W2``, ... (same a, constant W) -> {id(eqn): group}."""
        groups = {}
        for e in body.eqns:
            if e.op != "matmul":
                continue
            a, w = e.inputs
            if not (isinstance(a, ir.Var) and isinstance(w, ir.Var)):
                continue
            wi = self.info.get(id(w))
            if wi is None or wi.kind != "const" or len(w.shape) != 2 or len(a.shape) != 2:
                continue
            ai = self.info.get(id(a))
            if hoisting and (ai is None or ai.kind != "global" or not ai.hoistable):
                continue
            if not hoisting and ai is not None and ai.kind == "global" and ai.hoistable:
                continue
            groups.setdefault((id(a), np.dtype(e.outputs[0].dtype).str), []).append(e)
        out = {}
        for group in groups.values():
            if len(group) > 1:
                for e in group:
                    out[id(e)] = group
        return out

    # -- emitting ops ----------------------------------------------------------

    def new_array(self, var, mode, lines, size=None):
        """Allocate the array that holds ``var`` (mode: const, hoist or step)."""
        ident = self.fresh("v")
        dt = f"np.{np.dtype(var.dtype).name}"
        if mode == "const":
            lines.append(f"{ident} = np.empty({tuple(var.shape)!r}, {dt})")
            self.gargs.append(ident)
            info = _Info("const", ident, var)
        elif mode == "hoist":
            lines.append(f"{ident} = np.empty({_shape(size, var.shape[1:])}, {dt})")
            self.gargs.append(ident)
            info = _Info("global", ident, var, width=_width(var), size=size, hoistable=True)
        else:
            self.step_allocs.append(
                f"{ident} = np.empty({_shape('num_seq', var.shape[1:])}, {dt})"
            )
            info = _Info("local", ident, var, width=_width(var))
            self.step_buffers.add(ident)
        self.info[id(var)] = info
        return info

    def space_size(self, e):
        for v in e.inputs:
            if isinstance(v, ir.Var) and self.info[id(v)].kind == "global":
                return self.info[id(v)].size
        raise AssertionError("hoisted op without a global operand")

    def emit_merged(self, group, mode, lines):
        a = group[0].inputs[0]
        ai = self.info[id(a)]
        ws = [self.info[id(e.inputs[1])].ident for e in group]
        wcat = self.fresh("w")
        if all(w in self.const_names for w in ws):  # concatenated by the caller
            self.concatenated[wcat] = [self.const_names[w] for w in ws]
        else:
            self.prologue.append(
                f"{wcat} = np.ascontiguousarray(np.concatenate(({', '.join(ws)},), axis=1))"
            )
        self.gargs.append(wcat)
        total = sum(e.outputs[0].shape[-1] for e in group)
        out_var = ir.Var("merged", group[0].outputs[0].dtype, (None, total))
        left = self.contiguous(ai, mode, lines)
        info = self.new_array(out_var, mode, lines, size=ai.size)
        k = a.shape[-1]
        lines.append(self.gemm(left, wcat, info, mode, k, total, out_var.dtype))
        offset = 0
        for e in group:
            out = e.outputs[0]
            self.info[id(out)] = _Info(info.kind, info.ident, out, offset=offset, width=total,
                                       size=info.size, hoistable=info.hoistable)
            offset += out.shape[-1]

    def contiguous(self, info, mode, lines):
        """An expression for a C-contiguous [rows, K] array holding a 2-D var."""
        full = info.offset == 0 and info.width == _width(info.var)
        if mode == "hoist" and info.kind == "global" and full:
            return info.ident
        if mode == "step" and info.kind == "local" and full:
            return f"{info.ident}[:nb]"
        tmp = self.new_array(ir.Var("tmp", info.var.dtype, info.var.shape), mode, lines,
                             size=info.size)
        self.emit_copy(info, tmp, mode, lines)
        return f"{tmp.ident}[:nb]" if mode == "step" else tmp.ident

    def emit_copy(self, src, dst, mode, lines):
        shape = dst.var.shape
        loops, idx = self.loop_nest(shape, mode, dst.size)
        body = f"{self.ref(dst, idx, mode, shape)} = {self.ref(src, idx, mode, shape)}"
        lines += _nest(loops, [body])

    def loop_nest(self, shape, mode, size=None):
        """Loops over ``shape``; in a step, ``e`` is row b's entry (loaded once
        per row, so LLVM vectorizes the inner loop)."""
        loops, idx = [], []
        for d, n in enumerate(shape):
            if n is None:
                var = "b" if mode == "step" else "r"
                bound = "nb" if mode == "step" else size
            else:
                var, bound = f"i{d}", str(n)
            loops.append(f"for {var} in range({bound}):")
            if n is None and mode == "step":
                loops.append("e = entries[b]")
            idx.append(var)
        return loops, idx

    def ref(self, info, idx, mode, loop_shape):
        """Code reading element ``idx`` (loop indices over ``loop_shape``) of a var,
        with NumPy broadcasting."""
        if info.kind == "literal":
            return info.ident
        if info.kind == "scalar":
            return info.ident
        shape = info.var.shape
        lead = len(loop_shape) - len(shape)
        parts = []
        for d, n in enumerate(shape):
            i = idx[lead + d]
            if n is None:
                if info.kind == "global":
                    i = "e" if mode == "step" else "r"
                else:
                    i = "b"
            elif n == 1 and loop_shape[lead + d] != 1:
                i = "0"
            if d == len(shape) - 1 and info.offset:
                i = f"{info.offset} + {i}"
            parts.append(i)
        if not parts:
            return f"{info.ident}.item()" if info.kind == "const" else info.ident
        return f"{info.ident}[{', '.join(parts)}]"

    def operand(self, v, dtype):
        if isinstance(v, ir.Literal):
            return _Info("literal", self.literal(v.value, dtype))
        return self.info[id(v)]

    def emit_op(self, e, mode, lines):
        """One non-rnn op as its own loop nest (or a BLAS call)."""
        out = e.outputs[0]
        size = self.space_size(e) if mode == "hoist" else None
        if e.op == "matmul" and self.emit_dot(e, mode, lines):
            return
        info = self.new_array(out, mode, lines, size=size)
        opdt = _operand_dtype(e)
        ins = [self.operand(v, opdt) for v in e.inputs]
        shape = out.shape
        loops, idx = self.loop_nest(shape, mode, size)
        dst = self.ref(info, idx, mode, shape)
        if _fusable(e):
            expr = self.scalar_expr(e, [self.ref(i, idx, mode, shape) for i in ins])
            lines += _nest(loops, [f"{dst} = {expr}"])
        elif e.op == "sum":
            axis = e.attrs["axis"]
            n = e.inputs[0].shape[axis]
            keep = e.attrs.get("keepdims", False)
            in_idx = list(idx)
            if keep:
                in_idx[axis] = "k"
            else:
                in_idx.insert(axis, "k")
            acc = self.literal(0.0, out.dtype)
            src = self.ref(ins[0], in_idx, mode, e.inputs[0].shape)
            lines += _nest(loops, [f"acc = {acc}", f"for k in range({n}):",
                                   f"    acc += {src}", f"{dst} = acc"])
        elif e.op == "slice":
            axis, start = e.attrs["axis"], e.attrs["start"]
            in_idx = list(idx)
            in_idx[axis] = f"{start} + {idx[axis]}"
            lines += _nest(loops, [f"{dst} = {self.ref(ins[0], in_idx, mode, shape)}"])
        elif e.op == "concat":
            axis = e.attrs["axis"]
            offset = 0
            for v, vi in zip(e.inputs, ins):
                vloops, vidx = self.loop_nest(v.shape, mode, size)
                didx = list(vidx)
                didx[axis] = f"{offset} + {vidx[axis]}"
                lines += _nest(vloops, [
                    f"{self.ref(info, didx, mode, shape)} = {self.ref(vi, vidx, mode, v.shape)}"
                ])
                offset += v.shape[axis]
        elif e.op == "transpose":
            in_idx = list(idx[:-2]) + [idx[-1], idx[-2]]
            lines += _nest(loops, [f"{dst} = {self.ref(ins[0], in_idx, mode, shape)}"])
        elif e.op == "broadcast_axis":
            axis = e.attrs["axis"]
            in_idx = list(idx)
            if e.attrs["insert"]:
                del in_idx[axis]
            else:
                in_idx[axis] = "0"
            src = self.ref(ins[0], in_idx, mode, e.inputs[0].shape)
            lines += _nest(loops, [f"{dst} = {src}"])
        elif e.op == "pad":
            axis, before = e.attrs["axis"], e.attrs["before"]
            n = e.inputs[0].shape[axis]
            in_idx = list(idx)
            in_idx[axis] = f"{idx[axis]} - {before}"
            src = self.ref(ins[0], in_idx, mode, e.inputs[0].shape)
            zero = self.literal(0.0, out.dtype)
            lines += _nest(loops, [
                f"{dst} = {src} if {before} <= {idx[axis]} < {before + n} else {zero}"
            ])
        elif e.op == "matmul":
            self.emit_loop_matmul(e, ins, info, loops, idx, mode, lines)
        else:
            raise UnsupportedError(f"numba backend: no code generation for op {e.op!r}")

    def emit_dot(self, e, mode, lines):
        """``a @ W`` with a 2-D step value and a 2-D constant: one BLAS call."""
        a, w = e.inputs
        if not (isinstance(a, ir.Var) and isinstance(w, ir.Var)):
            return False
        ai, wi = self.info[id(a)], self.info[id(w)]
        if wi.kind != "const" or len(w.shape) != 2 or len(a.shape) != 2 or not a.batched:
            return False
        if np.dtype(a.dtype) != np.dtype(w.dtype):
            return False
        size = ai.size
        left = self.contiguous(ai, mode, lines)
        info = self.new_array(e.outputs[0], mode, lines, size=size)
        lines.append(self.gemm(left, wi.ident, info, mode, w.shape[0], w.shape[1], w.dtype))
        return True

    def gemm(self, left, weights, info, mode, k, n, dtype):
        """A BLAS call: plain GEMM when hoisted, packed weights inside the time loop."""
        bits = np.dtype(dtype).itemsize * 8
        if mode != "step":
            return f"gemm{bits}({left}, {weights}, {info.ident})"
        packed = self.packed.get(weights)
        if packed is None:
            packed = self.packed[weights] = self.fresh("wp")
            self.prologue.append(f"{packed} = pack{bits}({weights}, num_seq)")
            self.gargs.append(packed)
        return f"gemm_packed{bits}({left}, {packed}, {k}, {n}, {info.ident}[:nb])"

    def emit_loop_matmul(self, e, ins, info, loops, idx, mode, lines):
        a, b = e.inputs
        shape = e.outputs[0].shape
        ma = a.shape if len(a.shape) > 1 else (1,) + a.shape
        r = len(shape)
        out_idx = list(idx)
        # indices of the stacked/row dims of the promoted result
        full_idx = out_idx if len(a.shape) > 1 else out_idx[:r - 1] + ["0"] + out_idx[r - 1:]
        if len(b.shape) == 1:
            full_idx = full_idx + ["0"]
        stack = full_idx[:-2]
        a_idx = stack[len(stack) - (len(ma) - 2):] if len(ma) > 2 else []
        a_idx = a_idx + ([full_idx[-2]] if len(a.shape) > 1 else []) + ["k"]
        b_idx = stack[len(stack) - (len(b.shape) - 2):] if len(b.shape) > 2 else []
        b_idx = b_idx + ["k"] + ([full_idx[-1]] if len(b.shape) > 1 else [])
        k = ma[-1]
        acc = self.literal(0.0, e.outputs[0].dtype)
        ra = self.ref(ins[0], a_idx, mode, a.shape)
        rb = self.ref(ins[1], b_idx, mode, b.shape)
        dst = self.ref(info, out_idx, mode, shape)
        lines += _nest(loops, [f"acc = {acc}", f"for k in range({k}):",
                               f"    acc += {ra} * {rb}", f"{dst} = acc"])

    def scalar_expr(self, e, args):
        """Op ``e`` on one element, ``args`` its operands' code: the op's
        ``numba`` code (stepnet/ops/primitives.py)."""
        code = registry.get(e.op).numba
        dtype = e.outputs[0].dtype
        if code is None:
            raise UnsupportedError(f"numba backend: no code generation for op {e.op!r}")
        if callable(code):
            return code(*args, **{k: self.literal(v, dtype) for k, v in e.attrs.items() if v is not None})
        return code.format(*args, bits="32" if np.dtype(dtype) == np.float32 else "64")

    # -- the time loop -----------------------------------------------------------

    def emit_rnn_call(self, eqn, start_expr, len_expr, count_expr, mode):
        """Emit the function for ``eqn`` and the lines that call it.

        Returns (lines, outputs) where outputs lists (kind, ident) per rnn output.
        """
        _, statics, inits = ir.rnn_parts(eqn)
        body = eqn.attrs["body"]
        for out, res, all_steps in zip(eqn.outputs, body.outputs, eqn.attrs["all_steps"]):
            if all_steps and not res.lod_depth:
                level = self.seq_levels(eqn)[0]
                ident = self.fresh("o")
                dt = f"np.{np.dtype(out.dtype).name}"
                self.prologue.append(
                    f"{ident} = np.empty({_shape(level + '[-1]', res.shape[1:])}, {dt})"
                )
                self.gargs.append(ident)
                data = _Info("global", ident, res, width=_width(res), size=f"{level}[-1]",
                             hoistable=mode == "hoist")
                self.info[id(out)] = _Info("ragged", None, out, levels=(level,), data=data)
        fname, result_infos = self.emit_rnn_function(eqn)
        lines, args, outs, hoisted_lasts = [], [start_expr, len_expr], [], []
        for v in list(inits) + list(statics):
            if isinstance(v, ir.Literal):
                continue
            vi = self.info[id(v)]
            if vi.kind == "const":
                continue
            args.append(self.batched_arg(vi, mode, lines))
        for out, res, all_steps, ri in zip(eqn.outputs, body.outputs, eqn.attrs["all_steps"],
                                           result_infos):
            dt = f"np.{np.dtype(out.dtype).name}"
            if all_steps:
                if res.lod_depth:
                    oi = _Info("ragged", None, out, levels=(self.seq_levels(eqn)[0],) + ri.levels,
                               data=ri.data)
                    self.info[id(out)] = oi
                    outs.append(("ragged_all", oi.data.ident, oi.levels))
                else:
                    oi = self.info[id(out)]
                    outs.append(("dense_all", oi.data.ident, oi.levels))
            else:
                if res.lod_depth:
                    if mode != "program":
                        raise UnsupportedError(
                            "numba backend: a nested step-net's last step of a ragged output "
                            "is not supported (use backend='interpreter')"
                        )
                    ident = self.fresh("e")
                    lines.append(f"{ident} = np.empty(num_seq, np.int64)")
                    args.append(ident)
                    outs.append(("ragged_last", ident, ri.levels, ri.data.ident))
                    self.extra_returns.append(ri.data.ident)
                else:
                    if mode in ("program", "hoist"):
                        ident = self.fresh("last")
                        lines.append(
                            f"{ident} = np.empty({_shape(count_expr, res.shape[1:])}, {dt})"
                        )
                        args.append(ident)
                        outs.append(("last", ident))
                        if mode == "hoist":  # one row per entry of the enclosing space
                            hoisted_lasts.append(ident)
                            self.info[id(out)] = _Info("global", ident, out, width=_width(out),
                                                       size=f"({count_expr})", hoistable=True)
                    else:
                        info = self.new_array(out, "step", lines)
                        args.append(f"{info.ident}[:nb]")
                        outs.append(("last", info.ident))
        # The function takes every array defined before its call (consts, data,
        # hoisted values, packed weights, output buffers) by name.
        gargs = ", ".join(self.gargs)
        self.functions[fname] = [line.replace("GARGS", gargs) for line in self.functions[fname]]
        lines.append(f"{fname}({', '.join(args)}, {gargs})")
        self.gargs.extend(hoisted_lasts)
        return lines, outs

    def seq_levels(self, eqn):
        seqs, _, _ = ir.rnn_parts(eqn)
        return self.info[id(seqs[0])].levels

    def batched_arg(self, vi, mode, lines):
        """An expression for an [n, ...] array of a batched operand, in batch order."""
        if mode == "program":
            return vi.ident
        if vi.kind == "local" and vi.offset == 0 and vi.width == _width(vi.var):
            return f"{vi.ident}[:nb]"
        tmp = self.new_array(ir.Var("tmp", vi.var.dtype, vi.var.shape), "step", lines)
        self.emit_copy(vi, tmp, "step", lines)
        return f"{tmp.ident}[:nb]"

    def emit_rnn_function(self, eqn):
        body = eqn.attrs["body"]
        _, statics, inits = ir.rnn_parts(eqn)
        fname = self.fresh("rnn_")
        # The same body may be called twice (all steps and last step): where its
        # per-step values live is local to each function.
        saved_info = dict(self.info)
        saved_allocs = getattr(self, "step_allocs", None)
        self.step_allocs = []
        params = ["seq_start", "seq_len"]
        setup = [
            "num_seq = seq_len.shape[0]",
            "order, slen, sstart = sort_by_length(seq_start, seq_len)",
            "num_steps = slen[0] if num_seq > 0 else 0",
            "entries = np.empty(num_seq, np.int64)",
        ]
        # initial memories (sorted), statics (sorted)
        for mem, init in zip(body.memories, inits):
            ident = self.fresh("m")
            dt = f"np.{np.dtype(mem.pre.dtype).name}"
            setup.append(f"{ident} = np.empty({_shape('num_seq', mem.pre.shape[1:])}, {dt})")
            src, src_row, src_shape = self.init_source(init, mem.pre, params)
            setup += _row_assign(ident, "b", src, src_row, mem.pre.shape[1:], src_shape)
            self.info[id(mem.pre)] = _Info("local", ident, mem.pre, width=_width(mem.pre))
        for sv, outer in zip(body.static_inputs, statics):
            oi = self.info[id(outer)]
            if oi.kind == "const":
                self.info[id(sv)] = oi
                continue
            if outer.lod_depth or sv.lod_depth:
                raise UnsupportedError(
                    f"numba backend: ragged static input {outer.name} is not supported "
                    "(use backend='interpreter')"
                )
            p = self.fresh("s_in")
            params.append(p)
            ident = self.fresh("s")
            dt = f"np.{np.dtype(sv.dtype).name}"
            setup.append(f"{ident} = np.empty({_shape('num_seq', sv.shape[1:])}, {dt})")
            setup += _row_assign(ident, "b", p, "order[b]", sv.shape[1:])
            self.info[id(sv)] = _Info("local", ident, sv, width=_width(sv))
        # last-step outputs: params filled here
        last_params = []
        for res, all_steps, mem_index in zip(body.outputs, eqn.attrs["all_steps"],
                                             eqn.attrs["output_memory"]):
            if all_steps:
                last_params.append(None)
                continue
            p = self.fresh("out_last")
            params.append(p)
            last_params.append(p)
            if res.lod_depth:
                setup += _nest(["for b in range(num_seq):"], [f"{p}[b] = -1"])
            elif mem_index >= 0:
                m = self.info[id(body.memories[mem_index].pre)].ident
                setup += _row_assign(p, "order[b]", m, "b", res.shape[1:])
            else:
                zero = self.literal(0.0, res.dtype)
                setup += _row_assign(p, "b", zero, None, res.shape[1:])

        # the step
        step = ["while nb > 0 and slen[nb - 1] <= step:", "    nb -= 1"]
        pos = "slen[b] - 1 - step" if eqn.attrs["reverse"] else "step"
        step += _nest(["for b in range(nb):"], [f"entries[b] = sstart[b] + {pos}"])
        saved_direct = self.direct_outputs, self.written_outputs
        self.direct_outputs = {}
        for res, out, p in zip(body.outputs, eqn.outputs, last_params):
            if p is None and not res.lod_depth:  # one value may be several outputs
                self.direct_outputs.setdefault(id(res), []).append(self.info[id(out)].data)
        self.written_outputs = set()
        self.emit_step(body, step)
        written = self.written_outputs
        self.direct_outputs, self.written_outputs = saved_direct
        # outputs
        for res, out, p in zip(body.outputs, eqn.outputs, last_params):
            ri = self.info[id(res)]
            if p is None:
                if res.lod_depth or id(res) in written:
                    continue  # written in place by the nested rnn or the fused loop
                oi = self.info[id(out)].data
                loops, idx = self.loop_nest(res.shape, "step")
                step += _nest(loops, [
                    f"{self.ref(oi, idx, 'step', res.shape)} = {self.ref(ri, idx, 'step', res.shape)}"
                ])
            elif res.lod_depth:
                step += _nest(["for b in range(nb):", "if slen[b] == step + 1:"],
                              [f"{p}[order[b]] = entries[b]"])
            else:
                loops, idx = self.loop_nest(res.shape, "step")
                dst = self.ref(_Info("local", p, res), idx, "step", res.shape)
                dst = dst.replace(f"{p}[b", f"{p}[order[b]", 1)
                step += _nest(
                    ["for b in range(nb):", "if slen[b] == step + 1:"],
                    _nest(loops[1:], [f"{dst} = {self.ref(ri, idx, 'step', res.shape)}"]),
                )
        # memories, after the outputs (which may read a previous state): a new
        # value in a buffer of its own is swapped in, anything else is copied
        # (through a snapshot where a new value is another memory's old one).
        pres = {id(m.pre) for m in body.memories}
        posts = [id(m.post) for m in body.memories]
        snaps = {}
        for mem in body.memories:
            if id(mem.post) in pres and id(mem.post) not in snaps:
                tmp = self.new_array(ir.Var("snap", mem.post.dtype, mem.post.shape), "step", step)
                self.emit_copy(self.info[id(mem.post)], tmp, "step", step)
                snaps[id(mem.post)] = tmp
        for mem in body.memories:
            src = snaps.get(id(mem.post), self.info[id(mem.post)])
            dst = self.info[id(mem.pre)]
            own_buffer = (src.kind == "local" and src.ident in self.step_buffers
                          and src.offset == 0 and src.width == dst.width
                          and id(mem.post) not in snaps and posts.count(id(mem.post)) == 1)
            if own_buffer:
                step.append(f"{dst.ident}, {src.ident} = {src.ident}, {dst.ident}")
            else:
                self.emit_copy(src, dst, "step", step)
        fn = [f"def {fname}({', '.join(params)}, GARGS):"]
        fn += ["    " + line for line in setup + self.step_allocs]
        fn += ["    nb = num_seq", "    for step in range(num_steps):"]
        fn += ["        " + line for line in step]
        fn += ["    return 0"]
        fn.insert(0, _decorator(parallel=any("prange(" in line for line in fn)))
        self.functions[fname] = fn
        self.step_allocs = saved_allocs
        result_infos = [self.info.get(id(res)) for res in body.outputs]
        self.info = saved_info
        return fname, result_infos

    def init_source(self, init, pre, params):
        """The expression for row b's initial value of a memory."""
        if isinstance(init, ir.Literal):
            return self.literal(init.value, pre.dtype), None, None
        ii = self.info[id(init)]
        if ii.kind == "const":
            return ii.ident, None, init.shape
        p = self.fresh("init")
        params.append(p)
        return p, "order[b]", None

    def emit_step(self, body, lines):
        """The per-step ops of a block: BLAS calls, fused elementwise loops, nested rnns."""
        step_eqns = [e for e in body.eqns if e.op == "rnn" or id(e.outputs[0]) not in self.info]
        merged = self.merge_matmuls(_Body(step_eqns), hoisting=False)
        needed = self.materialized(body, step_eqns)
        group = []

        def flush():
            if group:
                self.emit_fused(group, needed, lines)
                group.clear()

        for e in step_eqns:
            if id(e.outputs[0]) in self.info:  # computed by a merged matmul
                continue
            if e.op == "rnn":
                flush()
                self.emit_nested(e, lines)
            elif _fusable(e):
                if group and group[0].outputs[0].shape != e.outputs[0].shape:
                    flush()
                group.append(e)
            else:
                flush()
                if id(e) in merged:
                    self.emit_merged(merged[id(e)], "step", lines)
                else:
                    self.emit_op(e, "step", lines)
        flush()

    def materialized(self, body, step_eqns):
        """Vars of fused ops that other ops, memories or outputs read."""
        needed = {id(m.post) for m in body.memories} | {id(v) for v in body.outputs}
        for e in step_eqns:
            fusable = _fusable(e)
            if not fusable:
                for v in e.inputs:
                    if isinstance(v, ir.Var):
                        needed.add(id(v))
        return needed

    def emit_fused(self, group, needed, lines):
        shape = group[0].outputs[0].shape
        loops, idx = self.loop_nest(shape, "step")
        inner = []
        scalars = []
        for e in group:
            opdt = _operand_dtype(e)
            args = []
            for v in e.inputs:
                vi = self.operand(v, opdt)
                args.append(self.ref(vi, idx, "step", shape))
            out = e.outputs[0]
            name = self.fresh("t")
            inner.append(f"{name} = {self.scalar_expr(e, args)}")
            scalars.append((out, name))
            self.info[id(out)] = _Info("scalar", name, out)
        # materialize what is read outside the group
        for out, name in scalars:
            if id(out) in needed or self.used_outside(out, group):
                info = self.new_array(out, "step", lines)
                inner.append(f"{self.ref(info, idx, 'step', shape)} = {name}")
        # all-steps outputs computed here go straight to their global array
        for out, name in scalars:
            if id(out) in self.written_outputs:
                continue
            for target in self.direct_outputs.get(id(out), ()):
                inner.append(f"{self.ref(target, idx, 'step', shape)} = {name}")
                self.written_outputs.add(id(out))
        if _PARALLEL and shape and shape[0] is None:
            # rows are independent: split them over threads when there is
            # enough work to pay for starting the parallel region
            per_row = int(np.prod(shape[1:], dtype=np.int64)) * len(group)
            lines.append(f"if nb * {per_row} >= {_PARALLEL_MIN_WORK}:")
            lines += ["    " + line for line in _nest(["for b in prange(nb):"] + loops[1:], inner)]
            lines.append("else:")
            lines += ["    " + line for line in _nest(loops, inner)]
        else:
            lines += _nest(loops, inner)

    def used_outside(self, var, group):
        ids = {id(e) for e in group}
        for e in self._all_eqns:
            if id(e) in ids:
                continue
            if any(v is var for v in e.inputs):
                return True
        return False

    def emit_nested(self, e, lines):
        seqs, _, _ = ir.rnn_parts(e)
        si = self.info[id(seqs[0])]
        level = si.levels[0]
        starts = self.fresh("st")
        lens = self.fresh("ln")
        self.step_allocs.append(f"{starts} = np.empty(num_seq, np.int64)")
        self.step_allocs.append(f"{lens} = np.empty(num_seq, np.int64)")
        lines += _nest(["for b in range(nb):"], [
            f"{starts}[b] = {level}[entries[b]]",
            f"{lens}[b] = {level}[entries[b] + 1] - {level}[entries[b]]",
        ])
        self.hoist_block(e)
        call, _ = self.emit_rnn_call(e, f"{starts}[:nb]", f"{lens}[:nb]", "nb", mode="step")
        lines += call


class _Body:
    def __init__(self, eqns):
        self.eqns = eqns


def _width(var):
    return var.shape[-1] if len(var.shape) > 0 and var.shape[-1] is not None else None


def _operand_dtype(e):
    """The dtype literals of ``e`` take: its float operands' (comparisons, where)."""
    for v in e.inputs:
        if isinstance(v, ir.Var) and np.dtype(v.dtype).kind == "f":
            return v.dtype
    return e.outputs[0].dtype


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


# Fused per-step loops run their rows in parallel (``prange``) when a step has
# at least this many element-ops. Not with ``STEPNET_BLAS=numpy``: OpenBLAS's
# own thread pool spinning next to Numba's costs 10x or more on a small
# machine; the other two run their GEMMs on Numba's OpenMP pool (blas.py).
_PARALLEL = blas.BLAS_NAME in ("openblas", "mkl")
_PARALLEL_MIN_WORK = 32768


def _decorator(parallel):
    flags = "cache=True, error_model='numpy', nogil=True"
    return f"@njit({flags}, parallel=True)" if parallel else f"@njit({flags})"


# ----------------------------------------------------------------------------
# compiling and running


_MODULES = {}


def generate_source(program: ir.Program) -> str:
    gen = _Gen(program)
    gen._all_eqns = list(ir.iter_eqns(program.eqn.attrs["body"]))
    src = gen.generate()
    return src, gen


def _load(source: str):
    # the key covers what a cached kernel embeds besides its own source: the
    # helpers it calls and the settings they were built with (cache.py)
    key = hashlib.sha256((source + helpers_fingerprint()).encode()).hexdigest()[:24]
    if key in _MODULES:
        return _MODULES[key]
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"stepnet_kernel_{key}.py"
    if not path.exists() or path.read_text() != source:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    name = f"stepnet_kernel_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    _MODULES[key] = module
    return module


class NumbaProgram:
    """A program compiled by the Numba backend: ``run(args, consts)``."""

    def __init__(self, program: ir.Program):
        self.program = program
        self.source, gen = generate_source(program)
        self.top_inputs = gen.top_inputs
        self.top_outputs = gen.top_outputs
        self.concatenated = gen.concatenated
        if os.environ.get("STEPNET_DEBUG"):
            print(self.source, file=sys.stderr)
        self.module = _load(self.source)

    def __call__(self, args, consts):
        call_args = []
        for (kind, _, _, _), value in zip(self.top_inputs, args):
            if kind == "sequence":
                call_args.append(_read_only(value.data))
                call_args += [_read_only(lv) for lv in value.levels]
            else:
                call_args.append(_read_only(value))
        const_args = [_read_only(consts[v.name]) for v in self.program.consts]
        const_args += [_read_only(np.concatenate([consts[n] for n in names], axis=1))
                       for names in self.concatenated.values()]
        results = self.module.program(*const_args, *call_args)
        extra = list(results[len(self.top_outputs):])
        outputs = []
        for spec, arr in zip(self.top_outputs, results):
            kind = spec[0]
            if kind in ("dense_all", "ragged_all"):
                outputs.append(LoDTensor(arr, [self._level(name, args) for name in spec[2]]))
            elif kind == "last":
                outputs.append(arr)
            else:
                outputs.append(self._ragged_last(arr, spec, args, extra.pop(0)))
        return outputs

    def _level(self, name, args):
        for (kind, _, _, levels), value in zip(self.top_inputs, args):
            if kind == "sequence" and name in levels:
                return value.levels[levels.index(name)]
        raise AssertionError(name)

    def _ragged_last(self, entries, spec, args, data):
        """Each sequence's last element of a ragged output, as a LoDTensor."""
        levels = [self._level(n, args) for n in spec[2]]
        nested = LoDTensor(data, levels)
        empty = LoDTensor(np.zeros((0,) + data.shape[1:], data.dtype),
                          [[0, 0]] + [[0]] * (len(levels) - 1))
        pieces = [nested.select([int(e)]) if e >= 0 else empty for e in entries]
        if not pieces:
            return LoDTensor(empty.data, [[0]] + [[0]] * (len(levels) - 1))
        return LoDTensor.concat(pieces)


def _read_only(array):
    """A C-contiguous read-only view: the kernel never writes its inputs, and one
    array type for every call means one compiled signature."""
    view = np.ascontiguousarray(array).view()
    view.flags.writeable = False
    return view


def compile_program(program: ir.Program):
    return NumbaProgram(program)


def available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True
