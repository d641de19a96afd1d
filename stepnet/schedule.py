"""The schedule of a step-net: which work runs once, which runs per step, in
which stages. Every compiled backend renders it (``numba_cpu``, ``numba_cuda``)
and ``rnn.compile(backend).schedule`` prints it::

    sched = schedule(program)      # one Schedule per rnn body, nested ones inside
    check(sched)                   # raises StepNetError naming what is wrong
    print(sched)

A :class:`Schedule` holds, for one ``rnn`` equation's body, lists of
:class:`Stage` (a GEMM, a fused run of elementwise ops, ...). The rules, one
set for every backend:

1. **const**: an op whose operands are all constants (parameters, values
   computed from them alone, static inputs given a constant) runs once per
   call, before anything else (``W.T`` in a backward step).
2. **hoisted**: an op that reads no memory, no static input and no per-step
   value runs once over every entry of its space (every token) before any
   time loop, at every nesting depth. An elementwise op is hoisted only when
   a hoisted GEMM, matmul, shape op or reduction reads it: otherwise it costs
   one more pass over every token, while inside the step it fuses into a loop
   that runs anyway. A hoisted elementwise op is a stage of its own.
3. **GEMMs**: ``a @ W`` with ``a`` a 2-D step value and ``W`` a 2-D constant
   of the same dtype is a GEMM. The GEMMs of one body that share their left
   operand (and dtype) and are all hoisted, or all per step, are merged into
   one stage (one product, the weights joined by columns), placed where the
   first of them was. Any other matmul is a general (loop) ``matmul`` stage.
4. **independent nested rnns**: a nested rnn whose sequences are hoisted
   values (the enclosing step's own step inputs, or all-steps outputs of
   another hoisted rnn), whose static inputs and initial memories are
   constants or literals, and that gives no ragged last-step output, runs
   once over every sub-sequence before any time loop (a hoisted ``rnn``
   stage); its last-step outputs are then hoisted values, one row per entry.
5. **step**: the rest, in the IR's order (a topological order; autodiff
   builds its backward steps with :func:`fusion_order`). A run of consecutive
   elementwise ops with one output shape is one ``elementwise`` stage (its
   intermediates stay in registers); a merged GEMM's later members do not
   break a run (they were computed with the first). An elementwise run that
   no stage reads before the next elementwise run of its shape joins that
   run (a gate's bias added before the step's product: one loop, its value
   never stored). Every other op is a stage; a nested rnn is an ``rnn``
   stage, called once per step.
6. **materialized**: the per-step values stored in a buffer: every result of
   a non-elementwise stage, and the results of an elementwise stage that are
   read outside it, are outputs of the body, or are a memory's new value.
7. **swaps**: a memory whose new value a step stage writes into a buffer of
   its own (not a merged GEMM's column block, not another memory's previous
   state, not shared with another memory, not ragged) is double-buffered:
   swapped, not copied. The other memories are copied after the outputs are written.

Where the two backends differed before this module, the CPU's rules were
kept: CUDA used to hoist every elementwise op on hoisted values (a kernel and
a pass over every token each; now they fuse into the step's kernels), merged
no GEMMs (now one kernel per merged GEMM), and called a nested rnn
independent by a stricter test. CUDA still renders only the independent
nested rnns that read nothing but the enclosing step's own step inputs and
give last-step outputs only, and it copies every memory (a persistent kernel's
buffers are fixed for its whole launch), so ``swaps`` is a CPU rendering.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import ir, registry
from .errors import StepNetError

STAGE_KINDS = ("gemm", "matmul", "quantized", "elementwise", "shape", "rnn")


@dataclass(frozen=True, eq=False)
class Stage:
    """One unit of scheduled work: ``kind`` is one of :data:`STAGE_KINDS`.

    - ``gemm``: ``a @ W`` (W a 2-D constant); several equations sharing ``a``
      are one merged product with the weights joined by columns;
    - ``matmul``: one general matmul (a loop);
    - ``quantized``: a product by weights in fewer bits (``matmul_int8``,
      ``matmul_bf16``: :mod:`stepnet.ops.quantized`) by each backend's
      routine; several of one op sharing ``a`` are one, as a GEMM's;
    - ``elementwise``: a fused run of elementwise equations of one output shape;
    - ``shape``: one shape op or reduction (slice, concat, pad, transpose,
      broadcast_axis, sum);
    - ``rnn``: one nested ``rnn`` equation.
    """

    kind: str
    eqns: tuple

    @property
    def merged(self) -> bool:
        return self.kind in ("gemm", "quantized") and len(self.eqns) > 1

    @property
    def left(self):
        """A GEMM's left operand (shared by every equation of the stage)."""
        return self.eqns[0].inputs[0]

    @property
    def outputs(self) -> tuple:
        return tuple(v for e in self.eqns for v in e.outputs)


@dataclass(frozen=True, eq=False)
class Schedule:
    """The schedule of one ``rnn`` equation's body (see the module docstring).

    ``const``, ``hoisted`` and ``step`` are tuples of :class:`Stage`;
    ``materialized`` the per-step values stored in buffers (Vars);
    ``swaps`` the memories swapped (the others are copied); ``nested`` maps
    each nested ``rnn`` equation to its own Schedule.
    """

    eqn: ir.Eqn
    const: tuple
    hoisted: tuple
    step: tuple
    materialized: tuple
    swaps: tuple
    nested: dict

    @property
    def body(self) -> ir.Block:
        return self.eqn.attrs["body"]

    @property
    def independent_rnns(self) -> tuple:
        """The nested rnn equations run once before any time loop."""
        return tuple(s.eqns[0] for s in self.hoisted if s.kind == "rnn")

    def stages(self):
        """``(section, stage)`` for every stage, in the order they run."""
        for section in ("const", "hoisted", "step"):
            for stage in getattr(self, section):
                yield section, stage

    def __str__(self):
        return "\n".join(format_schedule(self))


# ----------------------------------------------------------------------------
# the rules


def is_elementwise(eqn) -> bool:
    """An op computing each element from its operands' elements (fusable)."""
    if eqn.op == "rnn":
        return False
    op = registry.get(eqn.op)
    return op.kind == "elementwise" or (op.elementwise_when is not None
                                        and op.elementwise_when(**eqn.attrs))


def is_gemm(eqn, is_const) -> bool:
    """``a @ W``: ``a`` a 2-D dense step value, ``W`` a 2-D constant of ``a``'s
    dtype (``is_const(var)`` says what is constant)."""
    if eqn.op != "matmul":
        return False
    a, w = eqn.inputs
    return (isinstance(a, ir.Var) and isinstance(w, ir.Var) and is_const(w)
            and a.batched and not a.lod_depth and len(a.shape) == 2 and len(w.shape) == 2
            and np.dtype(a.dtype) == np.dtype(w.dtype))


def group_by_left(items, left) -> list:
    """``items`` grouped by the identity of their left operand ``left(item)``
    (and its dtype), in order of first appearance: the GEMMs one merged
    product computes; autodiff sums the gradient terms ``a^T g`` the same way."""
    groups = {}
    for item in items:
        a = left(item)
        groups.setdefault((id(a), np.dtype(a.dtype).str), []).append(item)
    return [tuple(g) for g in groups.values()]


def _stage_kind(eqn, is_const) -> str:
    if eqn.op == "rnn":
        return "rnn"
    if is_gemm(eqn, is_const):
        return "gemm"
    if is_elementwise(eqn):
        return "elementwise"
    kind = registry.get(eqn.op).kind
    return kind if kind in ("matmul", "quantized") else "shape"


def fusion_order(eqns) -> tuple:
    """A topological order of ``eqns`` that runs elementwise ops as early as
    their operands allow, grouped by output shape, so that they fuse into few
    stages between the matmuls (autodiff's gradient rules emit them
    interleaved)."""
    defined_by = {o: i for i, e in enumerate(eqns) for o in e.outputs}
    deps = [{defined_by[v] for v in e.inputs if isinstance(v, ir.Var) and v in defined_by}
            for e in eqns]
    done, order, shape = set(), [], None
    pending = list(range(len(eqns)))
    while pending:
        ready = [i for i in pending if deps[i] <= done]
        fusable = [i for i in ready if is_elementwise(eqns[i])]
        same = [i for i in fusable if eqns[i].outputs[0].shape == shape]
        pick = (same or fusable or ready)[0]
        shape = eqns[pick].outputs[0].shape
        order.append(pick)
        done.add(pick)
        pending.remove(pick)
    return tuple(eqns[i] for i in order)


# ----------------------------------------------------------------------------
# building a schedule


def schedule(target, consts=None) -> Schedule:
    """The schedule of a :class:`~stepnet.ir.Program` (its step inputs are
    given before any time loop), or of one ``rnn`` equation with ``consts``
    (default: every operand its blocks read without defining it that has no
    batch axis)."""
    if isinstance(target, ir.Program):
        seqs = ir.rnn_parts(target.eqn)[0]
        return _build(target.eqn, set(target.consts), set(seqs))
    if consts is None:
        consts = {v for v in free_vars(target) if not v.batched}
    return _build(target, set(consts), set(ir.rnn_parts(target)[0]))


def free_vars(eqn) -> list:
    """The Vars that ``eqn`` and its nested blocks read without defining."""
    free = [v for v in eqn.inputs if isinstance(v, ir.Var)]
    if eqn.op == "rnn":
        body = eqn.attrs["body"]
        defined = set(body.step_inputs) | set(body.static_inputs)
        defined |= {m.pre for m in body.memories}
        for e in body.eqns:
            free += [v for v in free_vars(e) if v not in defined]
            defined.update(e.outputs)
    return free


def _build(eqn, const, outer_hoisted) -> Schedule:
    """``const``: the constants (grows with this body's const results);
    ``outer_hoisted``: the enclosing values given before any time loop."""
    body = eqn.attrs["body"]
    seqs, statics, _ = ir.rnn_parts(eqn)
    const = set(const) | {sv for sv, v in zip(body.static_inputs, statics) if v in const}
    hoisted = {sv for sv, v in zip(body.step_inputs, seqs) if v in outer_hoisted}
    placed = _place(body, const, hoisted)
    is_const = const.__contains__
    const_stages = tuple(Stage(_stage_kind(e, is_const), (e,))
                         for e in body.eqns if placed[e] == "const")
    hoisted_stages = _stages([e for e in body.eqns if placed[e] == "hoisted"], is_const,
                             fuse=False)
    step_stages = _stages([e for e in body.eqns if placed[e] == "step"], is_const, fuse=True)
    nested = {}
    for e in body.eqns:
        if e.op == "rnn":
            nested[e] = _build(e, const, hoisted)
    materialized = _materialized(body, step_stages)
    return Schedule(eqn, const_stages, hoisted_stages, step_stages, materialized,
                    _swaps(body, step_stages), nested)


def _place(body, const, hoisted) -> dict:
    """Each equation of ``body`` -> "const", "hoisted" or "step". ``hoisted``
    grows with the values hoisted here."""
    placed, candidates = {}, []
    for e in body.eqns:
        ins = [v for v in e.inputs if isinstance(v, ir.Var)]
        if e.op == "rnn":
            independent = _independent(e, const, hoisted)
            placed[e] = "hoisted" if independent else "step"
            if independent:
                hoisted.update(e.outputs)
        elif all(v in const for v in ins):
            placed[e] = "const"
            const.update(e.outputs)
        elif all(v in const or v in hoisted for v in ins):
            candidates.append(e)
            hoisted.update(e.outputs)
        else:
            placed[e] = "step"
    # an elementwise op is hoisted only for a hoisted op that is not one (a
    # hoisted nested rnn too, which read it when it was placed)
    keep = {e for e in body.eqns if placed.get(e) == "hoisted"}
    readers = {}
    for e in candidates + list(keep):
        for v in e.inputs:
            readers.setdefault(v, []).append(e)
    for e in reversed(candidates):
        if not is_elementwise(e) or any(r in keep for r in readers.get(e.outputs[0], ())):
            keep.add(e)
    for e in candidates:
        placed[e] = "hoisted" if e in keep else "step"
        if e not in keep:
            hoisted.difference_update(e.outputs)
    return placed


def _independent(e, const, hoisted) -> bool:
    """A nested rnn that reads no per-step value of its enclosing step (rule 4)."""
    seqs, statics, inits = ir.rnn_parts(e)
    if not all(v in hoisted for v in seqs):
        return False
    if not all(v in const for v in statics + inits if isinstance(v, ir.Var)):
        return False
    body = e.attrs["body"]
    return all(all_steps or not res.lod_depth
               for res, all_steps in zip(body.outputs, e.attrs["all_steps"]))


def _stages(eqns, is_const, fuse) -> tuple:
    """Stages of ``eqns`` in order: GEMMs sharing a left operand merged at the
    first one's place; with ``fuse``, runs of elementwise ops of one output
    shape fused (the per-step rule; hoisted elementwise ops stay apart)."""
    # the products merged: GEMMs, and the quantized products of one op
    products = [[e for e in eqns if is_gemm(e, is_const)]]
    products += [[e for e in eqns if e.op == op] for op in dict.fromkeys(
        e.op for e in eqns if _stage_kind(e, is_const) == "quantized")]
    group_of = {}
    for group in (g for members in products for g in group_by_left(members, lambda e: e.inputs[0])):
        for e in group:
            group_of[e] = group
    stages = []
    for e in eqns:
        kind = _stage_kind(e, is_const)
        if kind in ("gemm", "quantized"):
            group = group_of[e]
            if group[0] is e:
                stages.append(Stage(kind, group))
            continue  # a later member: computed with the first
        stages.append(Stage(kind, (e,)))
    return _joined_runs(stages) if fuse else tuple(stages)


def _joined_runs(stages) -> tuple:
    """Rule 5's runs: each elementwise stage that no stage reads before the
    next elementwise stage of its shape moves into that one (consecutive
    ones first of all)."""
    stages, k = list(stages), 0
    while k < len(stages):
        j = _run_to_join(stages, k)
        if j is None:
            k += 1
        else:
            stages[j] = Stage("elementwise", stages[k].eqns + stages[j].eqns)
            del stages[k]
    return tuple(stages)


def _run_to_join(stages, k):
    """The index of the elementwise stage that stage ``k`` joins, or None."""
    run = stages[k]
    if run.kind != "elementwise":
        return None
    shape = (run.eqns[0].outputs[0].shape, run.eqns[0].outputs[0].lod_depth)
    outs = set(run.outputs)
    for j in range(k + 1, len(stages)):
        later = stages[j]
        if later.kind == "elementwise" and shape == (later.eqns[0].outputs[0].shape,
                                                     later.eqns[0].outputs[0].lod_depth):
            return j
        if any(v in outs for e in later.eqns for v in free_vars(e)):
            return None
    return None


def _materialized(body, step_stages) -> tuple:
    """Rule 6, in stage order."""
    stage_of = {v: s for s in step_stages for v in s.outputs}
    needed = set(body.outputs) | {m.post for m in body.memories}
    for s in step_stages:
        for e in s.eqns:
            needed.update(v for v in e.inputs if isinstance(v, ir.Var)
                          and stage_of.get(v) is not None and stage_of[v] is not s)
    return tuple(v for s in step_stages for v in s.outputs
                 if s.kind != "elementwise" or v in needed)


def _swaps(body, step_stages) -> tuple:
    """Rule 7: the memories whose new value is swapped in."""
    own = {v for s in step_stages if not s.merged for v in s.outputs}
    pres = {m.pre for m in body.memories}
    posts = [m.post for m in body.memories]
    return tuple(m for m in body.memories
                 if m.post in own and m.post not in pres and posts.count(m.post) == 1
                 and not m.pre.lod_depth)  # a ragged memory keeps the rows of ended sequences


# ----------------------------------------------------------------------------
# checking


def check(sched: Schedule, const=None, outer_hoisted=None) -> None:
    """Validate a schedule; raises StepNetError naming what is wrong.

    Every equation of the body is scheduled exactly once; const stages read
    only constants and hoisted ones no per-step value; every stage reads only
    values defined before it (or earlier in it); each stage holds what its
    kind says (merged GEMMs share their left operand); ``materialized``
    covers every per-step value read outside its stage and every output and
    memory update computed in the step; each swap is a memory whose new value
    a step stage writes in a buffer of its own; nested schedules check too.
    """
    body, name = sched.body, sched.eqn.attrs["name"]

    def fail(what):
        raise StepNetError(f"schedule check ({name}): {what}")

    if const is None:
        const = {v for v in free_vars(sched.eqn) if not v.batched}
    seqs, statics, _ = ir.rnn_parts(sched.eqn)
    outer_hoisted = set(seqs) if outer_hoisted is None else outer_hoisted
    const = set(const) | {sv for sv, v in zip(body.static_inputs, statics) if v in const}
    hoisted = {sv for sv, v in zip(body.step_inputs, seqs) if v in outer_hoisted}
    step_values = set(body.step_inputs) | set(body.static_inputs) | {m.pre for m in body.memories}
    scheduled = [e for _, s in sched.stages() for e in s.eqns]
    if len(scheduled) != len(set(scheduled)) or set(scheduled) != set(body.eqns):
        twice = {e.outputs[0].name for e in scheduled if scheduled.count(e) > 1}
        missing = {e.outputs[0].name for e in body.eqns if e not in scheduled}
        extra = {e.outputs[0].name for e in scheduled if e not in body.eqns}
        fail(f"equations not scheduled exactly once (twice: {sorted(twice)}, missing: "
             f"{sorted(missing)}, not in the body: {sorted(extra)})")
    defined = set()
    for section, stage in sched.stages():
        _check_stage(stage, fail, const.__contains__)
        allowed = {"const": const, "hoisted": const | hoisted}.get(section)
        inside = set()
        for e in stage.eqns:
            for v in e.inputs:
                if not isinstance(v, ir.Var):
                    continue
                if allowed is not None and v not in allowed:
                    fail(f"{section} stage computing {e.outputs[0].name} reads {v.name}, "
                         "which is not available there")
                if v not in defined and v not in inside and v not in const and v not in hoisted \
                        and v not in step_values:
                    fail(f"{e.outputs[0].name} reads {v.name} before its stage runs")
            inside.update(e.outputs)
        defined |= inside
        if section == "const":
            const |= inside
        elif section == "hoisted":
            hoisted |= inside
        if stage.kind == "rnn":
            inner = sched.nested.get(stage.eqns[0])
            if inner is None:
                fail(f"nested rnn {stage.eqns[0].attrs['name']} has no schedule")
            check(inner, const, hoisted)
    _check_materialized(sched, fail)
    _check_swaps(sched, fail)


def _check_stage(stage, fail, is_const):
    if stage.kind not in STAGE_KINDS or not stage.eqns:
        fail(f"a stage of kind {stage.kind!r} with {len(stage.eqns)} equations")
    first = stage.eqns[0]
    if stage.kind == "gemm":
        for e in stage.eqns:
            if not is_gemm(e, is_const):
                fail(f"gemm stage holds {e.op} {e.outputs[0].name}, not a product by a constant")
            if e.inputs[0] is not first.inputs[0]:
                fail(f"merged gemm: {e.outputs[0].name} has left operand {e.inputs[0].name}, "
                     f"not {first.inputs[0].name}")
    elif stage.kind == "elementwise":
        for e in stage.eqns:
            if not is_elementwise(e) or e.outputs[0].shape != first.outputs[0].shape:
                fail(f"elementwise stage holds {e.op} {e.outputs[0].name} of shape "
                     f"{e.outputs[0].type_str()}")
    elif stage.kind == "quantized":
        for e in stage.eqns:
            if e.op != first.op or registry.get(e.op).kind != "quantized" or e.inputs[0] is not \
                    first.inputs[0]:
                fail(f"quantized stage holds {e.op} {e.outputs[0].name}, not a {first.op} of "
                     f"{first.inputs[0].name}")
    elif len(stage.eqns) != 1 or (stage.kind == "rnn") != (first.op == "rnn") or (
            stage.kind == "matmul" and first.op != "matmul"):
        fail(f"{stage.kind} stage holds {[e.op for e in stage.eqns]}")


def _check_materialized(sched, fail):
    body = sched.body
    stage_of = {v: s for s in sched.step for v in s.outputs}
    kept = set(sched.materialized)
    needed = [(v, "an output or memory update") for v in body.outputs + tuple(
        m.post for m in body.memories)]
    for s in sched.step:
        for e in s.eqns:
            needed += [(v, f"read by {e.outputs[0].name}") for v in e.inputs
                       if isinstance(v, ir.Var) and stage_of.get(v) not in (None, s)]
    for v, why in needed:
        if v in stage_of and v not in kept:
            fail(f"{v.name} is {why} but not materialized")
    for v in kept:
        if v not in stage_of:
            fail(f"{v.name} is materialized but no step stage computes it")


def _check_swaps(sched, fail):
    own = {v for s in sched.step if not s.merged for v in s.outputs}
    pres = {m.pre for m in sched.body.memories}
    posts = [m.post for m in sched.body.memories]
    for m in sched.swaps:
        if m not in sched.body.memories:
            fail(f"swapped memory {m.name} is not a memory of this body")
        if m.post not in own or m.post in pres or posts.count(m.post) != 1:
            fail(f"memory {m.name} is swapped but its new value {m.post.name} has no buffer "
                 "of its own")


# ----------------------------------------------------------------------------
# printing


def format_schedule(sched: Schedule, indent: int = 0) -> list:
    pad = "  " * indent
    a = sched.eqn.attrs
    lines = [f"{pad}schedule of rnn {a['name']} (reverse={a['reverse']}) {{"]
    for section, title in (("const", "const (once per call)"),
                           ("hoisted", "hoisted (once over every entry, before the loops)"),
                           ("step", "step (per time step)")):
        stages = getattr(sched, section)
        lines.append(f"{pad}  {title}:" + ("" if stages else " none"))
        for stage in stages:
            lines += _format_stage(sched, stage, indent + 2)
    lines.append(f"{pad}  materialized: " + (" ".join(v.name for v in sched.materialized)
                                            or "none"))
    lines.append(f"{pad}  swaps: " + (" ".join(f"{m.name}<->{m.post.name}" for m in sched.swaps)
                                     or "none"))
    return lines + [f"{pad}}}"]


def _format_stage(sched, stage, indent) -> list:
    pad = "  " * indent
    if stage.kind in ("gemm", "quantized"):
        outs = " ".join(repr(v) for v in stage.outputs)
        weights = " ".join(e.inputs[1].name for e in stage.eqns)
        name = "gemm" if stage.kind == "gemm" else stage.eqns[0].op
        merged = f"[merged {len(stage.eqns)}]" if stage.merged else ""
        return [f"{pad}{name}{merged}: {outs} = {stage.left.name} @ ({weights})"]
    if stage.kind == "rnn":
        e = stage.eqns[0]
        where = "independent, once per call" if e in sched.independent_rnns else "per step"
        outs = " ".join(repr(v) for v in e.outputs)
        lines = [f"{pad}rnn[{where}]: {outs} ="]
        return lines + format_schedule(sched.nested[e], indent + 1)
    if stage.kind == "elementwise" and len(stage.eqns) > 1:
        shape = stage.eqns[0].outputs[0].type_str()
        lines = [f"{pad}elementwise[fused {len(stage.eqns)}, {shape}]:"]
        return lines + [line for e in stage.eqns for line in ir.format_eqn(e, indent + 1)]
    return [f"{pad}{stage.kind}: " + ir.format_eqn(stage.eqns[0])[0]]


__all__ = ["STAGE_KINDS", "Schedule", "Stage", "check", "format_schedule", "fusion_order",
           "group_by_left", "is_elementwise", "is_gemm", "schedule"]
