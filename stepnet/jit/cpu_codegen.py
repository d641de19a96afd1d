"""The Numba backend's code generator: a whole step-net, time loop included,
as the source of one module that Numba compiles (:mod:`stepnet.jit.numba_cpu`
loads and runs it).

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
  (:mod:`stepnet.jit.blas`); runs of elementwise ops are fused into one loop, with float32
  tanh/sigmoid as vectorizable approximations (numba_runtime).
- **Nesting.** A nested rnn is a function called once per outer step with its
  sequences (the active outer rows' sub-sequences) given by start and length.

The records it writes with and the elementwise loops are in
:mod:`stepnet.jit.cpu_emit`, the products in :mod:`stepnet.jit.cpu_products`;
this module writes the program, the hoisted work and the rnn functions.

``generate_source(program)`` gives the source (it encodes the graph and its
dtypes but no sizes: kernels are cached by a hash of it) and what a call of
its ``program`` takes.

Importing it raises LLVM's vectorizer limits for the process
(``LLVM_VECTORIZER_OPTIONS``, written into every kernel's source;
docs/decisions.md says why).
"""

from __future__ import annotations

import collections
import textwrap
from dataclasses import dataclass

import llvmlite.binding as llvm_binding
import numpy as np

from .. import ir, schedule
from ..errors import UnsupportedError
from . import apart, blas
from .kernel_plan import KernelPlan, kernel_plan
from .cpu_emit import (
    _Ctx, _Function, _Info, _Module, _Segment, _at_static_rows, _emit_copy, _emit_fused, _emit_op,
    _loop_nest, _nest, _nested_reads, _new_array, _ref, _row_assign, _segments, _shape, _width,
    runtime_imports)
from .cpu_products import (
    _ahead_posts, _chunk_products, _chunk_setup, _defer_product, _render_gemm, _render_quantized,
    _render_split_gemm, _rows_by_weights)

LLVM_VECTORIZER_OPTIONS = ("-runtime-memory-check-threshold=512",
                           "-vectorize-memory-check-threshold=512")
for _option in LLVM_VECTORIZER_OPTIONS:
    llvm_binding.set_option("stepnet", _option)

# ----------------------------------------------------------------------------
# code generation

# ----------------------------------------------------------------------------
# the program


def generate_source(program: ir.Program):
    """The generated module's source and a _Layout of its program() function."""
    sched = schedule.schedule(program)
    module, values = _Module(), {}
    module.plan = kernel_plan(program, sched)
    module.nested_reads = _nested_reads(sched)
    consts = list(module.plan.consts)
    params, top_inputs = _program_inputs(module, program, values, consts)
    _outputs_over_rows(module, program, values)
    _hoist(_Ctx(module, values, "hoist", module.prologue), sched, chunked=True)
    seqs = ir.rnn_parts(program.eqn)[0]
    top_levels = values[seqs[0]].levels
    ctx = _Ctx(module, values, "program", [])
    module.rows_by_steps = len(top_levels) == 1
    outs = _rnn_call(ctx, sched, "starts", "lengths", "num_seq")
    # a per-step product has at most one row per sequence of its net's level
    # (an inner net may run once over all of its level's sequences)
    max_rows = ", ".join(["num_seq"] + [f"{level}.shape[0] - 1" for level in top_levels[1:]])
    body = [f"starts, lengths = starts_and_lengths({top_levels[0]})",
            "num_seq = lengths.shape[0]"]
    if module.rows_by_steps:  # (``ROWS_IN_ORDER``; a nested net's rows are in order)
        arrays = [data for kind, _, data, levels in top_inputs
                  if kind == "sequence" and levels[0] == top_levels[0]]
        arrays += [o[1] for o in outs if o[0] == "dense_all" and o[1] in module.given_outputs]
        rows = " ".join(f"{a}.shape[0]," for a in arrays)
        body += ["if row_step != 1:", f"    rows_by_steps(starts, lengths, row_step, min(({rows})))"]
    body += [f"max_rows = max({max_rows})" if len(top_levels) > 1 else "max_rows = num_seq"]
    # the rows of the call: its sequences' items (its words, in a nested net)
    body.append(f"call_rows = {top_levels[-1]}[-1] - {top_levels[-1]}[0]")
    body += module.prologue + ctx.lines
    ret = ", ".join([o[1] for o in outs] + module.extra_returns)
    body.append(f"return ({ret},)" if ret else "return ()")  # (a backward with nothing per step)
    src = [
        "# generated by stepnet: do not edit",
        "import math",
        "import numpy as np",
        "from numba import njit",
        f"# BLAS: {blas.SIGNATURE}",
        f"# LLVM: {' '.join(LLVM_VECTORIZER_OPTIONS)}",
        "from stepnet.jit.apart import (",
        *textwrap.wrap(", ".join(sorted(("call_apart", "job_apart") + apart.HELPERS)) + ",", 90,
                       initial_indent="    ", subsequent_indent="    "),
        ")",
        "from stepnet.jit.ahead import AHEAD_WORDS, gemm_steps_ahead",
        "from stepnet.jit.atomics import as_read_only, wide_vectors",
        "from stepnet.jit.blas import gemm_own",
        "from stepnet.jit.threads import COLUMNS, RAISED, SHARES",
        *([f"from stepnet.jit.apart import {', '.join(apart.QUANTIZED_HELPERS)}, sums_buffer"]
          if any(s.kind == "quantized" for _, s in _every_stage(sched)) else []),
        *runtime_imports(),
        "",
        "# small_gemm's C entries the kernels call (link_helpers)",
        f"SMALL_GEMM_DTYPES = {tuple(sorted(module.small_gemm_dtypes))!r}",
        "",
    ]
    src += module.module_consts + [""]
    for fn in module.functions:
        src += fn + [""]
    src.append(_DECORATOR)
    # the consts its code reads, then weights concatenated by the caller for
    # merged GEMMs, the small-product rows (product_timing.small_rows_table), the
    # helper's board (threads.BOARD or threads.ALONE), the data rows' step
    # (``ROWS_IN_ORDER``), the inputs, and the output buffers the caller gives,
    # in the order of the outputs
    given = set(module.given_outputs)
    n = len(consts)
    params = (params[:n] + list(module.concatenated) + list(module.prepared)
              + ["small_rows", "board", "row_step"] + params[n:]
              + [o[1] for o in outs if o[1] in given])
    src.append(f"def program({', '.join(params)}):")
    src += ["    " + line for line in [_WIDE_VECTORS] + body]
    layout = _Layout(top_inputs, outs, module.concatenated, module.prepared, sched,
                     [o[0] in ("dense_all", "last") and o[1] in given for o in outs],
                     sorted(module.same_lod), module.largest_weights,
                     module.plan)
    return "\n".join(src) + "\n", layout


@dataclass
class _Layout:
    """What a call of the generated program() takes and returns."""

    top_inputs: list  # per program input: (kind, var, data ident, level idents)
    top_outputs: list  # per rnn output: (kind, ident, ...)
    concatenated: dict  # weights joined by the caller: ident -> constants (ir.Var)
    prepared: dict  # quantized weights the caller prepares: ident -> (op, constants per operand)
    schedule: schedule.Schedule
    given: list  # per rnn output: whether program() takes its buffer (last parameters)
    same_lod: list  # pairs of ragged static inputs' levels combined row by row
    largest_weights: int  # elements of the largest weights of a product (0: none)
    plan: KernelPlan  # what was decided before the code was written (its consts: the first parameters)


def _every_stage(sched):
    """``(section, stage)`` of ``sched`` and of every schedule nested in it."""
    for section, stage in sched.stages():
        yield section, stage
        if stage.kind == "rnn":
            yield from _every_stage(sched.nested[stage.eqns[0]])


def _program_inputs(module, program, values, consts):
    """program()'s parameters: the constants its code reads (``consts``; one
    that only products read joined to others is not passed), then each input
    (a ragged one as its data and levels); their infos go to ``values``."""
    params = []
    for v in program.consts:
        ident = module.fresh("c")
        module.const_vars[ident] = v
        values[v] = _Info("const", ident, v)
        if v in consts:
            params.append(ident)
            module.gargs.append(ident)
    statics = ir.rnn_parts(program.eqn)[1]
    top_inputs = []
    for v in program.inputs:
        if not v.lod_depth:
            ident = module.fresh("a")
            params.append(ident)
            values[v] = _Info("local", ident, v, width=_width(v))
            top_inputs.append(("dense", v, ident, None))
            continue
        if any(s is v for s in statics) and v.lod_depth > 1:
            raise UnsupportedError(
                f"static input {v.name} is a LoDTensor of {v.lod_depth} levels; the numba "
                "backend takes one level (a sub-sequence per sequence) at most"
            )
        data = module.fresh("x")
        levels = [module.fresh("L") for _ in range(v.lod_depth)]
        if v.lod_depth == 2:
            module.entry_levels.add(levels[1])
        params += [data] + levels
        module.gargs += levels + [data]
        dinfo = _Info("global", data, v, size=f"{data}.shape[0]", width=_width(v))
        values[v] = _Info("ragged", None, v, levels=levels, data=dinfo)
        top_inputs.append(("sequence", v, data, levels))
    return params, top_inputs


# ----------------------------------------------------------------------------
# hoisting: the const and hoisted stages of every body, in the prologue


def _outputs_over_rows(module, program, values):
    """``module.output_rows``, ``{step value: its all-steps output's buffer}``
    for the outputs the plan computes into their buffers before the loop
    (``KernelPlan.into_outputs``; ``_new_array``), the top-level net's dense
    all-steps outputs made here (before the hoisted stages). A value given
    as two outputs fills the first."""
    eqn = program.eqn
    if not module.plan.into_outputs:
        return
    _all_steps_arrays(_Ctx(module, values, "program", []), eqn)
    for out, res in zip(eqn.outputs, eqn.attrs["body"].outputs):
        if res in module.plan.into_outputs:
            module.output_rows.setdefault(res, values[out].data.ident)


def _hoist(ctx, sched, chunked=False):
    """Emit ``sched``'s const and hoisted stages into the prologue, then those
    of the nested bodies whose sequences are known (once per body).
    ``chunked``: the net runs once over all of its sequences (the top level,
    or a nested net that reads nothing of the enclosing step): its products
    of ``KernelPlan.chunked`` run by chunks of steps in its rnn function."""
    body = sched.body
    if body in ctx.module.hoisted_bodies:
        return
    ctx.module.hoisted_bodies.add(body)
    chunk_stages = ctx.module.plan.chunked.get(sched, frozenset()) if chunked else frozenset()
    seqs = ir.rnn_parts(sched.eqn)[0]
    for step_var, outer in zip(body.step_inputs, seqs):
        oi = ctx.values[outer]
        if oi.kind == "rows" and not step_var.lod_depth:
            # the rows of the enclosing step's ragged static input, or of a value
            # the step computes over them (an array of the call: ``_new_array``)
            if oi.ident not in ctx.module.gargs:
                raise UnsupportedError(f"numba backend: a nested step-net steps over {outer.name}, "
                                       "which the kernels hold in no array (use the interpreter)")
            ctx.values[step_var] = _Info("global", oi.ident, step_var, width=oi.width,
                                         size=f"{oi.ident}.shape[0]")
            continue
        if oi.kind != "ragged":
            raise UnsupportedError(f"step input {outer.name} is not a sequence")
        if step_var.lod_depth:  # (of one level: rows by entry, as a nested net's every step)
            segment = _Segment(None, None, oi.levels[1], by_entry=True) if len(oi.levels) == 2 else None
            ctx.values[step_var] = _Info("ragged", None, step_var, levels=oi.levels[1:],
                                         data=oi.data, segment=segment)
        else:
            d = oi.data
            ctx.values[step_var] = _Info("global", d.ident, step_var, offset=d.offset,
                                         width=d.width, size=d.size)
    # (a static input that is a constant of the enclosing step, such as
    # weights it computes: read where it is, by the hoisted products too)
    for sv, outer in zip(body.static_inputs, ir.rnn_parts(sched.eqn)[1]):
        if isinstance(outer, ir.Var) and outer in ctx.values and ctx.values[outer].kind == "const":
            ctx.values[sv] = ctx.values[outer]
    # a body's equations may be another's too (autodiff's recompute): each
    # value is computed once
    for stage in sched.const:
        if stage.outputs[0] not in ctx.values:
            _emit_op(ctx.at("const"), stage.eqns[0])
    split = ctx.module.plan.split[sched]
    for stage in sched.hoisted:
        if stage in split.values():  # a concat only a split product read
            continue
        if not all(v in ctx.values for v in stage.outputs):
            if stage in split:
                _render_split_gemm(ctx.at("hoist"), stage, split[stage])
            elif stage in chunk_stages and ctx.values[stage.left].kind == "global":
                _defer_product(ctx, sched, stage)
            else:
                _render_stage(ctx.at("hoist"), sched, stage)
    for stage in sched.step:
        if stage.kind == "rnn" and all(v in ctx.values for v in ir.rnn_parts(stage.eqns[0])[0]):
            _hoist(ctx, sched.nested[stage.eqns[0]])


def _render_stage(ctx, sched, stage):
    _STAGE_RENDERERS[stage.kind](ctx, sched, stage)


def _render_single(ctx, sched, stage):
    if not _rows_by_weights(ctx, stage.eqns[0]):
        _emit_op(ctx, stage.eqns[0])


def _render_elementwise(ctx, sched, stage):
    if ctx.mode == "step":
        _emit_fused(ctx, stage.eqns)
    else:  # hoisted: one op per stage
        _emit_op(ctx, stage.eqns[0])


def _render_rnn(ctx, sched, stage):
    e = stage.eqns[0]
    inner = sched.nested[e]
    if ctx.mode == "step":
        _emit_nested(ctx, inner)
        return
    # independent: once over every entry of its space, before any time loop
    _hoist(ctx, inner, chunked=True)
    level = _seq_levels(ctx, e)[0]
    st, ln = ctx.module.fresh("st"), ctx.module.fresh("ln")
    ctx.lines.append(f"{st}, {ln} = starts_and_lengths({level})")
    _rnn_call(ctx, inner, st, ln, f"{ln}.shape[0]")


_STAGE_RENDERERS = {
    "gemm": _render_gemm,
    "matmul": _render_single,
    "quantized": _render_quantized,
    "shape": _render_single,
    "elementwise": _render_elementwise,
    "rnn": _render_rnn,
}


# ----------------------------------------------------------------------------
# the time loop: one function per rnn equation


def _rnn_call(ctx, sched, start_expr, len_expr, count_expr):
    """Emit the function for ``sched``'s rnn and, into ctx.lines, its call.

    Returns per rnn output (kind, ident, ...) for the caller of program().
    """
    eqn = sched.eqn
    _, statics, inits = ir.rnn_parts(eqn)
    _all_steps_arrays(ctx, eqn)
    fname, params, fn_lines, result_infos = _rnn_function(ctx, sched)
    args, outs, hoisted_lasts = [start_expr, len_expr], [], []
    # the top-level net's rows may be by steps (program()'s ``row_step``); a
    # nested net's are its level's, a sequence's one after another
    row_step = "row_step" if start_expr == "starts" and ctx.module.rows_by_steps else "1"
    for v in list(inits) + list(statics):
        vi = ctx.values[v] if isinstance(v, ir.Var) else None
        if vi is not None and vi.kind == "rows":  # the rows of the enclosing step's static input
            args += [f"{vi.segment.starts}[:nb]", f"{vi.segment.stops}[:nb]"]
        elif vi is not None and vi.kind not in ("const", "ragged"):
            args.append(_batched_arg(ctx, vi))  # (a ragged static is a global)
    body = eqn.attrs["body"]
    for out, res, all_steps, ri, k in zip(eqn.outputs, body.outputs, eqn.attrs["all_steps"],
                                          result_infos, eqn.attrs["output_memory"]):
        if out in ctx.module.memory_outputs:
            buffer, level = ctx.module.memory_outputs[out]
            outs.append(("segment_memory", buffer, (level,)))
            if ctx.mode == "step":  # (a nested net's: a value over its enclosing step's static rows)
                segment = ctx.values[statics[eqn.attrs["ragged_memories"][k]]].segment
                ctx.values[out] = _Info("rows", buffer, out, width=_width(res), segment=segment)
                _segments(ctx)[out] = segment
        elif out in ctx.module.segment_outputs:
            od, pl, top = ctx.module.segment_outputs[out]
            ctx.module.extra_returns.append(pl)
            outs.append(("segment_all", od, (top,)))
        elif all_steps and res.lod_depth and ri.kind == "rows":  # (of nested nets' every steps)
            level = ri.segment.level
            oi = _Info("ragged", None, out, levels=(_seq_levels(ctx, eqn)[0], level),
                       data=_Info("global", ri.ident, res, width=ri.width, size=f"{level}[-1]"))
            ctx.values[out] = oi
            outs.append(("ragged_all", ri.ident, oi.levels))
        elif all_steps and res.lod_depth:
            oi = _Info("ragged", None, out, levels=(_seq_levels(ctx, eqn)[0],) + ri.levels,
                       data=ri.data)
            ctx.values[out] = oi
            outs.append(("ragged_all", oi.data.ident, oi.levels))
        elif all_steps:
            oi = ctx.values[out]
            outs.append(("dense_all", oi.data.ident, oi.levels))
        else:
            outs.append(_last_arg(ctx, out, res, count_expr, args, hoisted_lasts))
    # The function takes every array defined before its call (consts, data,
    # hoisted values, packed weights, output buffers) by name.
    gargs = list(ctx.module.gargs)
    fn = [f"def {fname}({', '.join(params + ['row_step'] + gargs)}):",
          "    " + _WIDE_VECTORS] + fn_lines
    fn.insert(0, _RNN_DECORATOR)
    ctx.module.functions.append(fn)
    # program()'s own nets (the top-level one, and the nested ones that need
    # nothing of its steps, run before its time loop: ``_render_rnn``)
    at_program = ctx.mode in ("program", "hoist")
    if at_program and ctx.module.plan.cut[sched]:
        ctx.lines += _shared_call(ctx, fname, args, [row_step] + gargs, len_expr)
    else:
        ctx.lines.append(f"call_apart({fname}, ({', '.join(args + [row_step] + gargs)}))")
    ctx.module.gargs.extend(hoisted_lasts)
    return outs


def _shared_call(ctx, fname, args, gargs, len_expr):
    """The lines calling rnn function ``fname`` over its sequences in two
    parts, ``0:cut`` on this thread and ``cut:`` on the helper thread
    (``threads.group_cut``, ``threads.run_jobs``): its per-sequence
    arguments ``args`` (the sequences' starts and lengths, their initial
    memories, static inputs and last-step outputs) cut, ``gargs`` (arrays
    of all rows, constants) whole; the rnn function called apart
    (``apart.job_apart``, ``apart.call_apart``: its code is compiled once,
    not again into program()'s). (Nothing here depends on the weights'
    sizes, so layers whose weights differ only in their input widths share
    one kernel.)"""
    own = ", ".join([f"{a}[:cut]" for a in args] + gargs)
    other = ", ".join([f"{a}[cut:]" for a in args] + gargs)
    return [f"cut = group_cut(board, {len_expr})",
            f"own = job_apart({fname}, ({own}))",
            f"other = job_apart({fname}, ({other}))",
            f"if run_jobs(board, own, other, cut < {len_expr}.shape[0]) == RAISED:",
            f"    call_apart({fname}, ({', '.join(args + gargs)}))"]  # (a part raised: raise it here)


def _all_steps_arrays(ctx, eqn):
    """The global arrays of ``eqn``'s dense all-steps outputs, one row per entry."""
    body = eqn.attrs["body"]
    for out, res, all_steps in zip(eqn.outputs, body.outputs, eqn.attrs["all_steps"]):
        if all_steps and not res.lod_depth and out not in ctx.values:  # (made once)
            seq = ctx.values[ir.rnn_parts(eqn)[0][0]]
            ident = ctx.module.fresh("o")
            dt = f"np.{np.dtype(out.dtype).name}"
            if seq.kind == "rows" and not seq.segment.by_entry:
                # over the enclosing step's ragged static input: a row per its row
                rows = f"{seq.ident}.shape[0]"
                ctx.module.prologue.append(f"{ident} = np.empty({_shape(rows, res.shape[1:])}, {dt})")
                ctx.module.gargs.append(ident)
                data = _Info("global", ident, res, width=_width(res), size=rows)  # (the net's writes)
                ctx.values[out] = _Info("rows", ident, out, width=_width(res), segment=seq.segment,
                                        data=data)
                _segments(ctx)[out] = seq.segment
                continue
            level = _seq_levels(ctx, eqn)[0]
            if ctx.mode == "program":  # the caller's buffer (a group's rows of it)
                ctx.module.given_outputs.append(ident)
            else:
                ctx.module.prologue.append(
                    f"{ident} = np.empty({_shape(level + '[-1]', res.shape[1:])}, {dt})"
                )
            ctx.module.gargs.append(ident)
            data = _Info("global", ident, res, width=_width(res), size=f"{level}[-1]")
            ctx.values[out] = _Info("ragged", None, out, levels=(level,), data=data,
                                    segment=_Segment(None, None, level, by_entry=True))


def _last_arg(ctx, out, res, count_expr, args, hoisted_lasts):
    """The buffer a dense last-step output is written to: the caller's result,
    one row per entry of the enclosing space (hoisted), or a step buffer."""
    if ctx.mode == "step":
        info = _new_array(ctx, out)
        args.append(f"{info.ident}[:nb]")
        return ("last", info.ident)
    ident = ctx.module.fresh("last")
    dt = f"np.{np.dtype(out.dtype).name}"
    if ctx.mode == "program":  # the caller's buffer (a group's rows of it)
        ctx.module.given_outputs.append(ident)
    else:
        ctx.lines.append(f"{ident} = np.empty({_shape(count_expr, res.shape[1:])}, {dt})")
    args.append(ident)
    if ctx.mode == "hoist":
        hoisted_lasts.append(ident)
        ctx.values[out] = _Info("global", ident, out, width=_width(out), size=f"({count_expr})")
    return ("last", ident)


def _seq_levels(ctx, eqn):
    """The LoD levels of ``eqn``'s sequences: a nested value's, or the level
    of rows computed from a nested net's every step (a sub-sequence each)."""
    info = ctx.values[ir.rnn_parts(eqn)[0][0]]
    if info.kind == "rows" and info.segment.by_entry:
        return (info.segment.level,)
    return info.levels


def _batched_arg(ctx, vi):
    """An expression for an [n, ...] array of a batched operand, in batch order."""
    if ctx.mode == "program":
        return vi.ident
    if vi.kind == "local" and vi.whole:
        return f"{vi.ident}[:nb]"
    tmp = _new_array(ctx.at("step"), ir.Var("tmp", vi.var.dtype, vi.var.shape))
    _emit_copy(ctx.at("step"), vi, tmp)
    return f"{tmp.ident}[:nb]"


def _rnn_function(ctx, sched):
    """The code of the function running ``sched``'s rnn: ``(name, params,
    body lines, the infos of the body's outputs)``. Its per-step values live
    in a scope of its own (the same body may be called twice)."""
    eqn = sched.eqn
    top = ctx.mode == "program"
    fn = _Function(materialized=frozenset(sched.materialized), top=top)
    fctx = _Ctx(ctx.module, collections.ChainMap({}, ctx.values), "step", [], fn)
    fname = ctx.module.fresh("rnn_")
    params = ["seq_start", "seq_len"]
    setup = _function_setup(fctx, eqn, params, top=top)
    chunks = ctx.module.chunks.get(sched.body, ())
    # (a nested net's call in the step may raise: its allocations)
    ahead = bool(chunks) and chunks[0].routine is None and not any(
        e.op == "rnn" for e in sched.body.eqns)
    if chunks:
        setup += _chunk_setup(chunks, ahead)
    last_params = _last_step_params(fctx, eqn, params, setup)
    step = _step_body(fctx, sched, last_params, chunks, ahead)
    if ahead:  # (after the step: its per-step products' weights are packed)
        setup.append(_ahead_posts(ctx.module))
    lines = ["    " + line for line in setup + fn.allocs]
    lines += ["    nb = num_seq", "    for step in range(num_steps):"]
    lines += ["        " + line for line in step]
    lines += ["    return 0"]
    results = [fctx.values.get(res) for res in eqn.attrs["body"].outputs]
    return fname, params, lines, results


def _function_setup(fctx, eqn, params, top):
    """Sort the sequences; copy initial memories and static inputs in sorted
    order (their params join ``params``)."""
    body = eqn.attrs["body"]
    _, statics, inits = ir.rnn_parts(eqn)
    module = fctx.module
    setup = [
        "num_seq = seq_len.shape[0]",
        "order, slen, sstart = sort_by_length(seq_start, seq_len)",
        "num_steps = slen[0] if num_seq > 0 else 0",
        "entries = np.empty(num_seq, np.int64)",
    ]
    ragged = eqn.attrs.get("ragged_memories", {})
    for k, (mem, init) in enumerate(zip(body.memories, inits)):
        if k in ragged:
            continue  # after the static input that gives its rows
        ident = module.fresh("m")
        dt = f"np.{np.dtype(mem.pre.dtype).name}"
        setup.append(f"{ident} = np.empty({_shape('num_seq', mem.pre.shape[1:])}, {dt})")
        src, src_row, src_shape = _init_source(fctx, init, mem.pre, params)
        setup += _row_assign(ident, "b", src, src_row, mem.pre.shape[1:], src_shape)
        fctx.values[mem.pre] = _Info("local", ident, mem.pre, width=_width(mem.pre))
    for sv, outer in zip(body.static_inputs, statics):
        oi = fctx.values[outer]
        if oi.kind == "const":
            fctx.values[sv] = oi
            continue
        if outer.lod_depth or sv.lod_depth:
            if top and oi.kind == "ragged" and outer.lod_depth == 1:  # rows of sequence order[b]
                level, data = oi.levels[0], oi.data.ident
                starts, stops = f"{level}[order[b]]", f"{level}[order[b] + 1]"
            elif (not top and oi.kind == "rows" and oi.ident in module.gargs
                  and not oi.segment.by_entry):
                # the enclosing step's static input: sequence b is its row order[b]
                level, data = oi.segment.level, oi.ident
                starts, stops = module.fresh("ms_in"), module.fresh("me_in")
                params += [starts, stops]
                starts, stops = f"{starts}[order[b]]", f"{stops}[order[b]]"
            else:
                raise UnsupportedError(
                    f"numba backend: ragged static input {outer.name} of a nested step-net that "
                    "is not the enclosing one's, or with a ragged memory (use backend='interpreter')")
            ms, me = module.fresh("ms"), module.fresh("me")
            setup += [f"{ms} = np.empty(num_seq, np.int64)", f"{me} = np.empty(num_seq, np.int64)"]
            setup += _nest(["for b in range(num_seq):"], [f"{ms}[b] = {starts}", f"{me}[b] = {stops}"])
            segment = _Segment(ms, me, level)
            fctx.values[sv] = _Info("rows", data, sv, width=_width(sv), segment=segment)
            fctx.fn.segments[sv] = segment
            continue
        p = module.fresh("s_in")
        params.append(p)
        ident = module.fresh("s")
        dt = f"np.{np.dtype(sv.dtype).name}"
        setup.append(f"{ident} = np.empty({_shape('num_seq', sv.shape[1:])}, {dt})")
        setup += _row_assign(ident, "b", p, "order[b]", sv.shape[1:])
        fctx.values[sv] = _Info("local", ident, sv, width=_width(sv))
    for k, i in ragged.items():
        setup += _ragged_memory(fctx, body.memories[k], inits[k], body.static_inputs[i], top)
    if not top and fctx.fn.segments and any(
            o.lod_depth and mi not in ragged for o, mi in zip(body.outputs, eqn.attrs["output_memory"])):
        raise UnsupportedError(f"numba backend: nested step-net {eqn.attrs['name']} gives a ragged "
                               "value over its static input to the enclosing step (use "
                               "backend='interpreter')")
    return setup


def _ragged_memory(fctx, mem, init, static, top):
    """A memory over a ragged static input's rows (a gradient accumulator): a
    buffer laid out as that input's data, made before the call (it is the
    memory's last-step output), read and written at the active rows' rows.
    A nested net's (its enclosing net's memory read by each sub-sequence)
    starts again at each call: the lines setting its sequences' rows."""
    module, segment = fctx.module, fctx.fn.segments[static]
    if not isinstance(init, ir.Literal):
        raise UnsupportedError(f"numba backend: ragged memory {mem.name} starts from a value")
    ident = module.fresh("rm")
    dt = f"np.{np.dtype(mem.pre.dtype).name}"
    value = module.literal(init.value, mem.pre.dtype)
    module.prologue.append(f"{ident} = np.full({_shape(segment.rows, mem.pre.shape[1:])}, "
                           f"{value}, {dt})")
    module.gargs.append(ident)
    fctx.values[mem.pre] = _Info("rows", ident, mem.pre, width=_width(mem.pre), segment=segment)
    fctx.fn.segments[mem.pre] = segment
    if top:
        return []
    return _nest(["for b in range(num_seq):"], [f"{ident}[{segment.starts}[b]:{segment.stops}[b]] = {value}"])


def _init_source(fctx, init, pre, params):
    """The expression for row b's initial value of a memory."""
    if isinstance(init, ir.Literal):
        return fctx.module.literal(init.value, pre.dtype), None, None
    ii = fctx.values[init]
    if ii.kind == "const":
        return ii.ident, None, init.shape
    p = fctx.module.fresh("init")
    params.append(p)
    return p, "order[b]", None


def _last_step_params(fctx, eqn, params, setup):
    """Per output: the param its last step is written to (started at the
    memory's init, or zeros), or None for all steps."""
    body = eqn.attrs["body"]
    last_params = []
    for res, out, all_steps, mem_index in zip(body.outputs, eqn.outputs, eqn.attrs["all_steps"],
                                              eqn.attrs["output_memory"]):
        if all_steps:
            last_params.append(None)
            continue
        if mem_index in eqn.attrs.get("ragged_memories", {}):  # the memory's buffer itself
            info = fctx.values[body.memories[mem_index].pre]
            fctx.module.memory_outputs[out] = (info.ident, info.segment.level)
            last_params.append(_MEMORY_BUFFER)
            continue
        if res.lod_depth:  # (a top-level net's: every step's, backends.CompiledStepNet.kernel_flags)
            raise UnsupportedError("numba backend: a nested step-net's last step of a ragged "
                                   "output is not supported (use backend='interpreter')")
        p = fctx.module.fresh("out_last")
        params.append(p)
        last_params.append(p)
        if mem_index >= 0:
            m = fctx.values[body.memories[mem_index].pre].ident
            setup += _row_assign(p, "order[b]", m, "b", res.shape[1:])
        else:
            zero = fctx.module.literal(0.0, res.dtype)
            setup += _row_assign(p, "b", zero, None, res.shape[1:])
    return last_params


_MEMORY_BUFFER = "memory buffer"  # a last-step output that is a ragged memory's buffer


def _step_body(fctx, sched, last_params, chunks=(), ahead=False):
    """One time step: the active prefix, the products of ``chunks`` at a
    chunk's first step, the step's stages, the outputs, the memory updates."""
    eqn, body = sched.eqn, sched.body
    step = ["while nb > 0 and slen[nb - 1] <= step:", "    nb -= 1"]
    pos = "slen[b] - 1 - step" if eqn.attrs["reverse"] else "step"
    step += _nest(["for b in range(nb):"], [f"entries[b] = sstart[b] + ({pos}) * row_step"])
    if chunks:
        step += _chunk_products(chunks, eqn.attrs["reverse"], ahead)
    for res, out, p in zip(body.outputs, eqn.outputs, last_params):
        if p is None and not res.lod_depth:  # one value may be several outputs
            fctx.fn.direct.setdefault(res, []).append(fctx.values[out].data)
    sctx = fctx.at("step", step)
    for mem in fctx.module.plan.in_place[sched]:  # the run computing its new value writes it there
        fctx.fn.in_place.add(mem.post)
        fctx.fn.direct.setdefault(mem.post, []).append(fctx.values[mem.pre])
    epilogues = fctx.module.plan.epilogues[sched]
    folded = {r for rs in epilogues.values() for r in rs}
    fctx.fn.unbuffered.update(fctx.module.plan.unbuffered[sched])
    concats = fctx.module.plan.concats[sched]
    for stage in concats:
        out = stage.outputs[0]
        buffer, offset = _new_array(sctx, out), 0
        for part in stage.eqns[0].inputs:
            fctx.fn.placed[part] = _Info("local", buffer.ident, part, offset=offset,
                                         width=out.shape[-1])
            offset += part.shape[-1]
    for stage in sched.step:
        if stage in epilogues:
            _emit_fused(sctx, stage.eqns, [r.eqns[0] for r in epilogues[stage]])
        elif stage not in folded and stage not in concats:
            _render_stage(sctx, sched, stage)
    step += _write_outputs(fctx, eqn, last_params)
    step += _update_memories(fctx, sched)
    return step


def _write_outputs(fctx, eqn, last_params):
    """Copy each output's step value where it goes (unless written in place)."""
    body, lines = eqn.attrs["body"], []
    for res, out, p in zip(body.outputs, eqn.outputs, last_params):
        ri = fctx.values[res]
        if p == _MEMORY_BUFFER:
            continue  # the buffer holds it
        if p is None and res in fctx.fn.segments and fctx.fn.segments[res].by_entry:
            continue  # its array holds every entry's rows (_new_array)
        if p is None and res in fctx.fn.segments:
            lines += _segment_output(fctx, eqn, res, out)
        elif p is None:
            if res.lod_depth or res in fctx.fn.written:
                continue  # written in place by the nested rnn or the fused loop
            oi = fctx.values[out].data
            if ri.ident == oi.ident:
                continue  # computed into the output before the loop (_outputs_over_rows)
            loops, idx = _loop_nest(res.shape, "step")
            lines += _nest(loops, [
                f"{_ref(oi, idx, 'step', res.shape)} = {_ref(ri, idx, 'step', res.shape)}"
            ])
        else:
            loops, idx = _loop_nest(res.shape, "step")
            dst = _ref(_Info("local", p, res), idx, "step", res.shape, row="order[b]")
            lines += _nest(
                ["for b in range(nb):", "if slen[b] == step + 1:"],
                _nest(loops[1:], [f"{dst} = {_ref(ri, idx, 'step', res.shape)}"]),
            )
    return lines


def _segment_output(fctx, eqn, res, out):
    """An all-steps output of a value over a ragged static input's rows:
    each step's rows at its entry's place (``pl[e]``: the rows before entry
    ``e``, counted in the prologue), a two-level output (sequence, step, rows)."""
    module = fctx.module
    segment = fctx.fn.segments[res]
    top = _seq_levels(fctx, eqn)[0]
    pl, od = module.fresh("pl"), module.fresh("od")
    s, t, k = module.fresh("s"), module.fresh("t"), module.fresh("k")
    dt = f"np.{np.dtype(res.dtype).name}"
    module.prologue += [f"{pl} = np.zeros({top}[-1] + 1, np.int64)"]
    module.prologue += _nest([f"for {s} in range(lengths.shape[0]):", f"for {t} in range(lengths[{s}]):"],
                             [f"{pl}[starts[{s}] + {t} + 1] = {segment.level}[{s} + 1] - "
                              f"{segment.level}[{s}]"])
    module.prologue += _nest([f"for {k} in range({top}[-1]):"], [f"{pl}[{k} + 1] += {pl}[{k}]"])
    module.prologue.append(f"{od} = np.empty({_shape(pl + '[-1]', res.shape[1:])}, {dt})")
    module.gargs += [pl, od]
    module.segment_outputs[out] = (od, pl, top)
    loops, idx = _loop_nest(res.shape, "step", segment=segment)
    dst = f"{od}[{', '.join([f'{pl}[e] + j - {segment.starts}[b]'] + idx[1:])}]"
    return _nest(loops, [f"{dst} = {_ref(fctx.values[res], idx, 'step', res.shape)}"])


def _update_memories(fctx, sched):
    """After the outputs (which may read a previous state): a new value in a
    buffer of its own is swapped in (schedule.swaps), anything else is copied
    (through a snapshot where a new value is another memory's old one)."""
    body, lines = sched.body, []
    sctx = fctx.at("step", lines)
    pres = {m.pre for m in body.memories}
    snaps = {}
    for mem in body.memories:
        if mem.post in pres and mem.post not in snaps:
            tmp = _new_array(sctx, ir.Var("snap", mem.post.dtype, mem.post.shape))
            _emit_copy(sctx, fctx.values[mem.post], tmp)
            snaps[mem.post] = tmp
    for mem in body.memories:
        if mem.post in fctx.fn.in_place:
            continue
        src = snaps.get(mem.post, fctx.values[mem.post])
        dst = fctx.values[mem.pre]
        if mem in sched.swaps:
            assert src.kind == "local" and src.ident in fctx.fn.buffers and src.whole
            lines.append(f"{dst.ident}, {src.ident} = {src.ident}, {dst.ident}")
        else:
            _emit_copy(sctx, src, dst)
    return lines


def _emit_nested(ctx, inner):
    """A nested rnn called once per step on the active rows' sub-sequences
    (or their rows of the enclosing step's ragged static input)."""
    seqs = ir.rnn_parts(inner.eqn)[0]
    static = next((ctx.values[v].segment for v in seqs
                   if ctx.values[v].kind == "rows" and not ctx.values[v].segment.by_entry), None)
    for v in seqs if static is not None else ():
        _at_static_rows(ctx, v, static)
    info = ctx.values[seqs[0]]
    starts, lens = ctx.module.fresh("st"), ctx.module.fresh("ln")
    ctx.fn.allocs.append(f"{starts} = np.empty(num_seq, np.int64)")
    ctx.fn.allocs.append(f"{lens} = np.empty(num_seq, np.int64)")
    if info.kind == "rows":
        first, stop = info.segment.bounds("entries[b]")
    else:
        level = info.levels[0]
        first, stop = f"{level}[entries[b]]", f"{level}[entries[b] + 1]"
    ctx.lines += _nest(["for b in range(nb):"], [f"{starts}[b] = {first}", f"{lens}[b] = {stop} - {first}"])
    _hoist(ctx.at("hoist", ctx.module.prologue), inner)
    _rnn_call(ctx, inner, f"{starts}[:nb]", f"{lens}[:nb]", "nb")


# Generated kernels are serial and release the GIL: parallelism comes from
# running groups of sequences on threads (NumbaProgram), not from parfors.
_DECORATOR = "@njit(cache=True, error_model='numpy', nogil=True, no_cfunc_wrapper=True)"
# an rnn function: called apart (stepnet.jit.apart) by program() and by
# other rnn functions, never from Python (it has no entry Python can call;
# neither has program() one for C, which nothing needs)
_RNN_DECORATOR = ("@njit(cache=True, error_model='numpy', nogil=True, no_cfunc_wrapper=True, "
                  "no_cpython_wrapper=True)")
# the first statement of each: LLVM vectorizes it with the CPU's widest
# vectors (atomics.wide_vectors: 512 bits on Intel's AVX-512 cores too)
_WIDE_VECTORS = "wide_vectors()"
