"""Reverse mode: the backward of a step-net is a step-net (DESIGN.md §6).

For a forward ``rnn`` equation, :func:`backward_eqn` builds an ``rnn``
equation that runs the other way in time over the same LoD. Its step:

- **inputs**: the forward step inputs, each memory's previous state as kept by
  the forward (the *workspace*: one row per token and memory), and the
  cotangent of each all-steps output; static inputs as in the forward;
- **recompute**: the forward step's equations, verbatim. With the previous
  states given, none of them depends on a memory any more, so a backend hoists
  them out of the time loop (every ``h_prev @ U`` of the sequence is one GEMM);
- **pullback**: the gradient rules of the ops (``ops/grads.py``) in reverse,
  as IR equations; a nested step-net's pullback is a nested backward rnn;
- **memories**: each forward memory's adjoint (d loss / d its value, carried
  from step t+1 to t), started at the cotangent of its last-step output; an
  accumulator per static input; a first-step flag when a last-step output is
  not a memory;
- **outputs**: the adjoints' last values (gradients of the initial memories),
  the static accumulators, the step inputs' cotangents (all steps), and per
  constant the per-row terms of its gradient (all steps): ``x @ W`` gives the
  pair (x, g) whose sum over rows ``X^T G`` is one GEMM after the loop.

After the loop :class:`Pullback` sums the per-row terms, pushes them through
ops on constants alone (with the NumPy references) and maps them to the
Parameters and named inputs asked for.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from . import ir
from .errors import ShapeError, StepNetError, UnsupportedError
from .jit.blas import transposed_product
from .ir import Block, Eqn, Literal, Memory, Var
from .lod import LoDTensor
from .ops import registry

_counter = itertools.count()


def _new_var(name, dtype, shape, lod_depth=0):
    return Var(f"{name}_g{next(_counter)}", np.dtype(dtype), tuple(shape), lod_depth)


def _is_float(v) -> bool:
    return isinstance(v, Var) and np.dtype(v.dtype).kind == "f"


@dataclass(frozen=True, eq=False)
class Rows:
    """A constant's gradient as per-row terms: the sum over rows of ``value``
    reshaped to the constant's shape."""

    value: object


@dataclass(frozen=True, eq=False)
class Outer:
    """A matrix constant's gradient ``sum over rows of a^T g`` (``x @ W``)."""

    a: object
    g: object


class _BlockEmitter:
    """Appends the gradient rules' ops to a backward step (see ops/grads.py)."""

    def __init__(self):
        self.eqns = []
        self.producer = {}  # id(var) -> the equation this emitter made it with

    @staticmethod
    def val(v):
        return v  # the recompute defines every forward value in the backward step

    def op(self, name, *operands, **attrs):
        avals = registry.get(name).infer(list(operands), attrs)
        outs = tuple(_new_var(name, a.dtype, a.shape) for a in avals)
        eqn = Eqn(name, tuple(operands), outs, dict(attrs))
        self.eqns.append(eqn)
        self.producer[id(outs[0])] = eqn
        return outs[0]

    def _weight_matmul(self, v):
        """The ``a @ W`` equation (a one row per sequence, W constant) behind ``v``."""
        e = self.producer.get(id(v))
        if e is None or e.op != "matmul":
            return None
        a, w = e.inputs
        if (isinstance(w, Var) and not w.batched and len(w.shape) == 2 and a.batched
                and len(a.shape) == 2 and np.dtype(a.dtype) == np.dtype(w.dtype)):
            return e
        return None

    def sum_terms(self, terms):
        """The sum of a value's cotangent terms; ``a1 @ W1 + a2 @ W2 + ...``
        becomes one matmul ``[a1 a2 ...] @ [W1; W2; ...]`` (one GEMM per step
        for the recurrent weights of every gate)."""
        matmuls = [t for t in terms if self._weight_matmul(t) is not None]
        rest = [t for t in terms if self._weight_matmul(t) is None]
        if len(matmuls) >= 2:
            eqns = [self._weight_matmul(t) for t in matmuls]
            left = self.op("concat", *[e.inputs[0] for e in eqns], axis=1)
            right = self.op("concat", *[e.inputs[1] for e in eqns], axis=0)
            rest.append(self.op("matmul", left, right))
        else:
            rest += matmuls
        value = rest[0]
        for t in rest[1:]:
            value = self.op("add", value, t)
        return value

    @staticmethod
    def outer(a, g):
        return Outer(a, g)

    def unbroadcast(self, g, target):
        """The cotangent ``g`` (shaped like an op's result) reduced to the operand
        ``target``: summed over broadcast axes; for a constant operand, per-row
        terms (:class:`Rows`) whose sum over rows is the gradient."""
        if isinstance(g, Outer):
            return g
        gs, ts = g.shape, target.shape
        lead = len(gs) - len(ts)
        for j, n in enumerate(ts):
            ax = lead + j
            if n == 1 and gs[ax] != 1 and gs[ax] is not None:
                g = self.op("sum", g, axis=ax, keepdims=True)
        if target.batched:
            for _ in range(lead):
                g = self.op("sum", g, axis=1, keepdims=False)
            return g
        for _ in range(max(lead - 1, 0)):  # extra axes between the rows and the constant's
            g = self.op("sum", g, axis=1, keepdims=False)
        return Rows(g)


class _EagerEmitter:
    """The same rules computed with NumPy, for ops on constants alone."""

    def __init__(self, env):
        self.env = env

    def val(self, v):
        return v.value if isinstance(v, Literal) else self.env[id(v)]

    @staticmethod
    def op(name, *operands, **attrs):
        args = [o.value if isinstance(o, Literal) else o for o in operands]
        return registry.get(name).numpy(*args, **attrs)

    @staticmethod
    def unbroadcast(g, target):
        return sum_to_shape(g, target.shape)


# ----------------------------------------------------------------------------
# building the backward step-net


def kept_values(body: Block) -> tuple:
    """What the forward keeps per step for the backward (the workspace): each
    memory's previous state, and the result of each ``h @ U`` with constant
    weights that depends on a memory (a per-step product in the forward). The
    backward recomputes the rest: products of the step inputs alone (``x @ W``)
    are one hoisted GEMM there, cheaper than storing them step by step."""
    pres = tuple(m.pre for m in body.memories)
    dependent = {id(v) for v in ir.memory_dependent(body)}
    products = tuple(
        e.outputs[0] for e in body.eqns
        if e.op == "matmul" and id(e.outputs[0]) in dependent and isinstance(e.inputs[1], Var)
        and not e.inputs[1].batched
    )
    return pres + products


def augment(eqn: Eqn):
    """``eqn`` with its kept values (:func:`kept_values`) added as all-steps
    outputs. Returns the new equation and the added output vars."""
    body = eqn.attrs["body"]
    kept = kept_values(body)
    new_body = Block(body.step_inputs, body.static_inputs, body.memories, body.eqns,
                     body.outputs + kept)
    extra = tuple(_new_var(f"{v.name}_ws", v.dtype, v.shape, v.lod_depth + 1) for v in kept)
    memory_of = {id(m.pre): i for i, m in enumerate(body.memories)}
    attrs = dict(eqn.attrs, body=new_body,
                 all_steps=tuple(eqn.attrs["all_steps"]) + (True,) * len(kept),
                 output_memory=tuple(eqn.attrs["output_memory"])
                 + tuple(memory_of.get(id(v), -1) for v in kept))
    return Eqn("rnn", eqn.inputs, eqn.outputs + extra, attrs), extra


@dataclass
class BackwardOutputs:
    """Where the gradients are among a backward rnn equation's outputs (indices)."""

    inits: list  # per forward memory: index of d(init), or None
    statics: list  # per forward static input: index, or None
    sequences: list  # per forward sequence input: index of its all-steps cotangent, or None
    contribs: list = field(default_factory=list)  # (const Var, Rows/Outer of indices)
    injected: list = field(default_factory=list)  # forward output indices seeded by the flag
    values: list = field(default_factory=list)  # the enclosing var of each output index


def backward_eqn(eqn: Eqn, kept, cts, top: bool):
    """The backward ``rnn`` equations of the forward ``rnn`` equation ``eqn``.

    ``kept``: per kept value (:func:`kept_values`), the enclosing value holding
    it at every step (the workspace); ``cts``: per output of ``eqn``, the enclosing value holding its
    cotangent, or None. Returns ``([equation, ...], BackwardOutputs)``: the
    time loop, and maybe a memory-free step-net for the work after it; output
    indices in BackwardOutputs refer to ``BackwardOutputs.values``.
    """
    body = eqn.attrs["body"]
    seqs, statics, _ = ir.rnn_parts(eqn)
    name = eqn.attrs["name"]
    em = _BlockEmitter()
    kept_vars = kept_values(body)
    step_inputs = list(body.step_inputs) + list(kept_vars)
    seq_operands = list(seqs) + list(kept)
    recomputed = {id(v) for v in kept_vars}
    static_inputs = list(body.static_inputs)
    static_operands = list(statics)
    memories, mem_inits = [], []
    outputs, all_steps, out_memory = [], [], []
    ct, contribs = _Cotangents(em), {}

    def add(var, g):
        if g is None or not _is_float(var):
            return
        if isinstance(g, (Rows, Outer)) or not var.batched:
            if not isinstance(g, (Rows, Outer)):
                g = Rows(g)
            contribs.setdefault(id(var), (var, []))[1].append(g)
            return
        if np.dtype(g.dtype) != np.dtype(var.dtype):
            raise UnsupportedError(
                f"gradient of {name}: {var.name} is {np.dtype(var.dtype)} but meets "
                f"{np.dtype(g.dtype)} values; gradients need one float dtype per step-net"
            )
        if var.lod_depth and id(var) in ct:
            raise UnsupportedError(
                f"gradient of {name}: the ragged value {var.name} is read twice; "
                "gradients of a ragged value used by several ops are not supported"
            )
        ct.append(var, g)

    # the recompute: the forward step, nested step-nets keeping their workspace
    inner_pres = {}
    for e in body.eqns:
        if e.op == "rnn":
            e_aug, extra = augment(e)
            em.eqns.append(e_aug)
            inner_pres[id(e)] = extra
        elif id(e.outputs[0]) not in recomputed:  # kept values are read, not recomputed
            em.eqns.append(e)

    # seeds: adjoints carried from the next step, output cotangents
    adjoints = [_new_var(f"d_{m.name}", m.pre.dtype, m.pre.shape) for m in body.memories]
    adjoint_init = [Literal(0.0)] * len(body.memories)
    injected = []
    for k, (res, flag, g) in enumerate(zip(body.outputs, eqn.attrs["all_steps"], cts)):
        if g is None:
            continue
        if flag:
            dy = _new_var(f"d_{res.name}", res.dtype, res.shape, res.lod_depth)
            step_inputs.append(dy)
            seq_operands.append(g)
            add(res, dy)
            continue
        if res.lod_depth:
            raise UnsupportedError(
                f"gradient of {name}: the last step of the ragged output {res.name}"
            )
        mi = next((i for i, m in enumerate(body.memories) if m.post is res), None)
        if mi is not None and isinstance(adjoint_init[mi], Literal):
            adjoint_init[mi] = g  # d(post) at the last step = this output's cotangent
            continue
        if not top and eqn.attrs["output_memory"][k] >= 0:
            raise UnsupportedError(
                f"gradient of {name}: a nested step-net whose last-step output {res.name} "
                "is a memory's previous state (or a memory given twice)"
            )
        s = _new_var(f"d_{res.name}_last", res.dtype, res.shape)
        static_inputs.append(s)
        static_operands.append(g)
        injected.append((k, res, s))
    for m, adj in zip(body.memories, adjoints):
        add(m.post, adj)
    flags = {}  # (rank, dtype) -> a first-step flag memory of that rank
    for _, res, s in injected:
        key = (len(res.shape), np.dtype(res.dtype).str)
        if key not in flags:
            flags[key] = _new_var("first_step", res.dtype, (None,) + (1,) * (len(res.shape) - 1))
            memories.append(Memory("first_step", flags[key],
                                   em.op("mul", flags[key], Literal(0.0))))
            mem_inits.append(Literal(1.0))
        add(res, em.op("mul", s, flags[key]))

    # the pullback, last op first
    for e in reversed(body.eqns):
        if e.op == "rnn":
            _pull_nested(e, inner_pres[id(e)], ct, add, em)
            continue
        out = e.outputs[0]
        g = ct.get(id(out))
        if g is None or not out.batched or not _is_float(out):
            continue  # ops on constants alone are pulled back after the loop
        grads = registry.get(e.op).grad(em, e, g)
        for v, gv in zip(e.inputs, grads):
            if gv is not None and _is_float(v):
                add(v, em.unbroadcast(gv, v))

    result = BackwardOutputs([], [], [], injected=[k for k, _, _ in injected])

    def output(var, flag, memory=-1):
        for i, (v, f, m) in enumerate(zip(outputs, all_steps, out_memory)):
            if v is var and f == flag and m == memory:
                return i  # one value given once
        outputs.append(var)
        all_steps.append(flag)
        out_memory.append(memory)
        return len(outputs) - 1

    def factor(var):
        """An Outer factor: a top-level step input is read from the input itself."""
        if top:
            for v, operand in zip(step_inputs, seq_operands):
                if v is var:
                    return operand
        return output(var, True)

    for m, adj, init in zip(body.memories, adjoints, adjoint_init):
        post = ct.get(id(m.pre))
        if post is None:
            post = em.op("mul", adj, Literal(0.0))
        memories.append(Memory(f"d_{m.name}", adj, post))
        mem_inits.append(init)
        result.inits.append(output(post, False, len(memories) - 1))
    for sv in body.static_inputs:
        g = ct.get(id(sv))
        if g is None:
            result.statics.append(None)
            continue
        acc = _new_var(f"d_{sv.name}", sv.dtype, sv.shape)
        memories.append(Memory(f"d_{sv.name}", acc, em.op("add", acc, g)))
        mem_inits.append(Literal(0.0))
        result.statics.append(output(memories[-1].post, False, len(memories) - 1))
    for sv in body.step_inputs:
        g = ct.get(id(sv))
        result.sequences.append(None if g is None else output(g, True))
    for var, terms in contribs.values():
        for term in _merge_terms(terms, em):
            if isinstance(term, Rows):
                result.contribs.append((var, Rows(output(term.value, True))))
            else:
                result.contribs.append((var, Outer(factor(term.a), output(term.g, True))))

    eqns = _live_eqns(em.eqns, outputs, memories)
    loop_eqns, post_eqns = _split_after_loop(eqns, outputs, all_steps, memories)
    attrs = {
        "name": f"{name}_grad",
        "reverse": not eqn.attrs["reverse"],
        "num_static_inputs": len(static_operands),
    }
    if not post_eqns:
        block = Block(tuple(step_inputs), tuple(static_inputs), tuple(memories),
                      _schedule(eqns), tuple(outputs))
        loop = _rnn_eqn(block, seq_operands, static_operands, mem_inits, all_steps,
                        out_memory, attrs)
        result.values = list(loop.outputs)
        return [loop], result
    # The ops that neither the memories nor the last-step outputs need run after
    # the time loop, over every step at once (dX = G @ W^T is one GEMM): a second
    # step-net without memories reads what they need as all-steps outputs.
    post_defined = {id(o) for e in post_eqns for o in e.outputs}
    loop_outputs, loop_flags, loop_memory = [], [], []
    post_outputs = []
    where = []
    for v, flag, m in zip(outputs, all_steps, out_memory):
        if id(v) in post_defined:
            where.append(("post", len(post_outputs)))
            post_outputs.append(v)
        else:
            where.append(("loop", len(loop_outputs)))
            loop_outputs.append(v)
            loop_flags.append(flag)
            loop_memory.append(m)
    step_ids = {id(v): (v, o) for v, o in zip(step_inputs, seq_operands)}
    static_ids = {id(v): (v, o) for v, o in zip(static_inputs, static_operands)}
    post_steps, post_seq_operands, post_statics, post_static_operands = [], [], [], []
    exported = []  # loop values the post step reads: (var, index among loop outputs)
    seen = set()
    for e in post_eqns:
        for v in e.inputs:
            if not isinstance(v, Var) or id(v) in post_defined or id(v) in seen or not v.batched:
                continue
            seen.add(id(v))
            if id(v) in step_ids:
                post_steps.append(v)
                post_seq_operands.append(step_ids[id(v)][1])
            elif id(v) in static_ids:
                post_statics.append(v)
                post_static_operands.append(static_ids[id(v)][1])
            else:
                given = [i for i, (w, f) in enumerate(zip(loop_outputs, loop_flags))
                         if w is v and f]
                exported.append((v, given[0] if given else len(loop_outputs)))
                if not given:
                    loop_outputs.append(v)
                    loop_flags.append(True)
                    loop_memory.append(-1)
    block = Block(tuple(step_inputs), tuple(static_inputs), tuple(memories),
                  _schedule(loop_eqns), tuple(loop_outputs))
    loop = _rnn_eqn(block, seq_operands, static_operands, mem_inits, loop_flags, loop_memory,
                    attrs)
    post_steps = [v for v, _ in exported] + post_steps
    post_seq_operands = [loop.outputs[i] for _, i in exported] + post_seq_operands
    post_block = Block(tuple(post_steps), tuple(post_statics), (), _schedule(post_eqns),
                       tuple(post_outputs))
    post = _rnn_eqn(post_block, post_seq_operands, post_static_operands, [],
                    [True] * len(post_outputs), [-1] * len(post_outputs),
                    dict(attrs, name=f"{name}_grad_rest", num_static_inputs=len(post_statics)))
    result.values = [loop.outputs[i] if part == "loop" else post.outputs[i]
                     for part, i in where]
    return [loop, post], result


def _rnn_eqn(block, seq_operands, static_operands, inits, all_steps, out_memory, attrs):
    outs = tuple(
        _new_var(f"{v.name}_out", v.dtype, v.shape, v.lod_depth + 1 if flag else v.lod_depth)
        for v, flag in zip(block.outputs, all_steps)
    )
    attrs = dict(attrs, body=block, all_steps=tuple(all_steps), output_memory=tuple(out_memory),
                 num_sequence_inputs=len(seq_operands))
    return Eqn("rnn", tuple(seq_operands) + tuple(static_operands) + tuple(inits), outs, attrs)


def _split_after_loop(eqns, outputs, all_steps, memories):
    """(loop eqns, post eqns): post are the ops that only all-steps outputs
    need; empty unless they include a matmul (else the split only adds copies)."""
    need = {id(m.post) for m in memories}
    need |= {id(v) for v, flag in zip(outputs, all_steps) if not flag}
    loop = set()
    for e in reversed(eqns):
        if e.op == "rnn" or any(id(o) in need for o in e.outputs):
            loop.add(id(e))
            need.update(id(v) for v in e.inputs if isinstance(v, Var))
    post = [e for e in eqns if id(e) not in loop]
    if not any(registry.get(e.op).kind == "matmul" for e in post):
        return eqns, []
    # values of constants alone (W.T) that the work after the loop reads are
    # computed there too
    post_ids = {id(e) for e in post}
    need = {id(v) for e in post for v in e.inputs if isinstance(v, Var)}
    for e in reversed(eqns):
        if id(e) in loop and e.op != "rnn" and any(id(o) in need for o in e.outputs) \
                and not any(isinstance(v, Var) and v.batched for v in e.inputs):
            post_ids.add(id(e))
            need.update(id(v) for v in e.inputs if isinstance(v, Var))
    return [e for e in eqns if id(e) in loop], [e for e in eqns if id(e) in post_ids]


class _Cotangents:
    """Each value's cotangent terms, summed when the cotangent is first read
    (every term is in by then: the pullback runs consumers first)."""

    def __init__(self, em):
        self.em = em
        self.terms = {}
        self.sums = {}

    def __contains__(self, key):
        return key in self.terms

    def append(self, var, g):
        assert id(var) not in self.sums, f"cotangent of {var.name} grew after it was read"
        self.terms.setdefault(id(var), []).append(g)

    def get(self, key):
        if key not in self.sums:
            terms = self.terms.get(key)
            self.sums[key] = self.em.sum_terms(terms) if terms else None
        return self.sums[key]


def _pull_nested(e, pres, ct, add, em):
    """Pull back through a nested rnn ``e``: its backward rnn, placed in the step."""
    cts = [ct.get(id(o)) for o in e.outputs]
    if all(g is None for g in cts):
        return
    bwd, res = backward_eqn(e, pres, cts, top=False)
    em.eqns.extend(bwd)
    seqs, statics, inits = ir.rnn_parts(e)
    outs = res.values
    for v, i in zip(inits, res.inits):
        if isinstance(v, Var):
            add(v, em.unbroadcast(outs[i], v))
    for v, i in zip(statics, res.statics):
        if i is not None:
            add(v, outs[i])
    for v, i in zip(seqs, res.sequences):
        if i is not None:
            add(v, outs[i])
    for var, term in res.contribs:
        if isinstance(term, Rows):
            add(var, Rows(outs[term.value]))
        else:
            add(var, Outer(outs[term.a], outs[term.g]))


def _merge_terms(terms, em):
    """Per-row terms of one constant: same-shaped dense Rows summed, Outer
    pairs with the same left factor summed; ragged terms (from nested
    step-nets) stay apart."""
    merged, rows, outers = [], {}, {}
    for t in terms:
        if isinstance(t, Rows) and not t.value.lod_depth:
            key = t.value.shape
            rows[key] = Rows(em.op("add", rows[key].value, t.value)) if key in rows else t
        elif isinstance(t, Outer) and not t.a.lod_depth:
            key = id(t.a)
            outers[key] = Outer(t.a, em.op("add", outers[key].g, t.g)) if key in outers else t
        else:
            merged.append(t)
    return list(rows.values()) + list(outers.values()) + merged


def _live_eqns(eqns, outputs, memories) -> tuple:
    """The equations that the outputs and memory updates need."""
    need = {id(v) for v in outputs} | {id(m.post) for m in memories}
    live = []
    for e in reversed(eqns):
        if any(id(o) in need for o in e.outputs):
            live.append(e)
            need.update(id(v) for v in e.inputs if isinstance(v, Var))
    return tuple(reversed(live))


def _schedule(eqns) -> tuple:
    """A topological order that runs elementwise ops as early as their operands
    allow, grouped by shape, so a backend fuses them into few loops between the
    matmuls (the rules emit them interleaved)."""
    defined_by = {id(o): i for i, e in enumerate(eqns) for o in e.outputs}
    deps = [{defined_by[id(v)] for v in e.inputs if isinstance(v, Var) and id(v) in defined_by}
            for e in eqns]
    done, order, shape = set(), [], None
    pending = list(range(len(eqns)))
    while pending:
        ready = [i for i in pending if deps[i] <= done]
        fusable = [i for i in ready if eqns[i].op != "rnn"
                   and registry.get(eqns[i].op).kind == "elementwise"]
        same = [i for i in fusable if eqns[i].outputs[0].shape == shape]
        pick = (same or fusable or ready)[0]
        shape = eqns[pick].outputs[0].shape
        order.append(pick)
        done.add(pick)
        pending.remove(pick)
    return tuple(eqns[i] for i in order)


# ----------------------------------------------------------------------------
# top-level programs


def forward_program(program: ir.Program) -> ir.Program:
    eqn, _ = augment(program.eqn)
    out = ir.Program(program.inputs, program.consts, eqn)
    ir.check(out)
    return out


def backward_program(program: ir.Program, ct_present):
    """The backward program: inputs are the forward's sequence and static
    inputs, the workspace (one LoD input per memory) and the cotangents
    (all-steps ones as LoD inputs, last-step ones dense)."""
    eqn = program.eqn
    body = eqn.attrs["body"]
    seqs, statics, _ = ir.rnn_parts(eqn)
    pres = [_new_var(f"{v.name}_ws", v.dtype, v.shape, 1) for v in kept_values(body)]
    cts = []
    for out, present in zip(eqn.outputs, ct_present):
        cts.append(_new_var(f"d_{out.name}", out.dtype, out.shape, out.lod_depth)
                   if present else None)
    bwd, layout = backward_eqn(eqn, pres, cts, top=True)
    inputs = tuple(seqs) + tuple(statics) + tuple(pres) + tuple(c for c in cts if c is not None)
    programs = [ir.Program(inputs, program.consts, bwd[0])]
    if len(bwd) == 2:  # the work after the loop reads the loop's outputs and inputs
        operands, seen = [], set()
        for v in bwd[1].inputs:
            if isinstance(v, Var) and id(v) not in seen:
                seen.add(id(v))
                operands.append(v)
        programs.append(ir.Program(tuple(operands), program.consts, bwd[1]))
    for prog in programs:
        ir.check(prog)
    return programs, layout


def const_only_eqns(program: ir.Program) -> list:
    """Equations of any block whose operands are all constants (or literals)."""
    consts = {id(v) for v in program.consts}
    out = []
    for e in ir.iter_eqns(program.eqn.attrs["body"]):
        if e.op == "rnn":
            continue
        if all(isinstance(v, Literal) or id(v) in consts for v in e.inputs):
            out.append(e)
            consts.update(id(v) for v in e.outputs)
    return out


def reduce_terms(layout, outputs, inputs) -> dict:
    """Sum the per-row terms: ``{id(const var): gradient}``. A term's index is
    an output of the backward rnn; a Var is one of its inputs (``inputs``:
    id(var) -> value)."""
    grads = {}

    def rows(ref):
        return (inputs[id(ref)] if isinstance(ref, Var) else outputs[ref]).data

    for var, term in layout.contribs:
        if isinstance(term, Rows):
            r = rows(term.value)
            g = r.reshape(r.shape[0], int(np.prod(r.shape[1:]))).sum(0).reshape(var.shape)
        else:
            g = transposed_product(rows(term.a), rows(term.g))
        grads[id(var)] = grads[id(var)] + g if id(var) in grads else g
    return grads


def pull_consts(program, grads, const_values) -> dict:
    """Push gradients of values computed from constants alone back to the
    constants they read (NumPy, after the loop)."""
    eqns = const_only_eqns(program)
    if not eqns:
        return grads
    env = {id(v): const_values[v.name] for v in program.consts}
    for e in eqns:
        args = [v.value if isinstance(v, Literal) else env[id(v)] for v in e.inputs]
        env[id(e.outputs[0])] = registry.get(e.op).numpy(*args, **e.attrs)
    em = _EagerEmitter(env)
    for e in reversed(eqns):
        g = grads.get(id(e.outputs[0]))
        if g is None or not _is_float(e.outputs[0]):
            continue
        for v, gv in zip(e.inputs, registry.get(e.op).grad(em, e, g)):
            if gv is not None and _is_float(v):
                gv = em.unbroadcast(gv, v)
                grads[id(v)] = grads[id(v)] + gv if id(v) in grads else gv
    return grads


# ----------------------------------------------------------------------------
# the public API: gradients, vjp, workspaces


class Pullback:
    """The backward of one forward run of a step-net, its workspace kept.

    ``pullback(grad_outputs, wrt=None, accumulate=False, out=None)`` returns one
    gradient per ``wrt`` (default: the step-net's Parameters); it may be called
    any number of times. ``workspace_bytes`` is the size of what is kept per
    step: each memory's previous state, one row per token.
    """

    def __init__(self, rnn, flags, backend, args, outputs, workspace, consts, values):
        self.rnn = rnn
        self.values = values  # binding name -> the value this run was given
        self.flags = flags
        self.backend = backend
        self.args = args
        self.outputs = outputs
        self.workspace = workspace
        self.consts = consts

    @property
    def workspace_bytes(self) -> int:
        return int(sum(w.data.nbytes for w in self.workspace))

    def __call__(self, grad_outputs, wrt=None, accumulate=False, out=None):
        rnn = self.rnn
        wrt = rnn.parameters() if wrt is None else list(wrt)
        targets = [_resolve(rnn, item, self.values) for item in wrt]
        program = rnn.program(self.flags)
        cts = _check_grad_outputs(rnn, program, self.outputs, grad_outputs)
        present = tuple(c is not None for c in cts)
        runs, layout = _compiled_backward(rnn, self.backend, self.flags, present)
        seqs, statics, _ = ir.rnn_parts(program.eqn)
        position = {id(v): i for i, v in enumerate(program.inputs)}
        args = [self.args[position[id(v)]] for v in tuple(seqs) + tuple(statics)]
        args += list(self.workspace)
        for c, res, flag in zip(cts, self.outputs, self.flags):
            if c is not None:
                args.append(LoDTensor(c, res.levels) if flag else c)
        values = {}
        for run, prog in runs:
            if not values:
                values.update((id(v), a) for v, a in zip(prog.inputs, args))
            outs = run([values[id(v)] for v in prog.inputs], self.consts)
            values.update((id(v), a) for v, a in zip(prog.eqn.outputs, outs))
        results = [values[id(v)] for v in layout.values]
        inputs = values
        grads = pull_consts(program, reduce_terms(layout, results, inputs), self.consts)
        lengths = np.diff(np.asarray(self.args[position[id(seqs[0])]].levels[0]))
        d_inits = []
        for i in layout.inits:
            d_inits.append(np.array(results[i]))
        for k in layout.injected:  # empty sequences: a last-step output is the init itself
            mi = program.eqn.attrs["output_memory"][k]
            if mi >= 0:
                d_inits[mi][lengths == 0] += cts[k][lengths == 0]
        found = []
        for kind, key, like in targets:
            if kind == "const":
                g = grads.get(id(key))
                g = np.zeros(like.shape, like.dtype) if g is None else g
            elif kind == "sequence":
                i = layout.sequences[[id(v) for v in seqs].index(id(key))]
                g = np.zeros(like.data.shape) if i is None else results[i].data
            elif kind == "static":
                i = layout.statics[[id(v) for v in statics].index(id(key))]
                g = np.zeros(np.shape(like)) if i is None else results[i]
            else:
                inits = ir.rnn_parts(program.eqn)[2]
                g = d_inits[[id(v) for v in inits].index(id(key))]
                g = sum_to_shape(g, np.shape(like))
            found.append(np.asarray(g).astype(like.dtype, copy=False).reshape(np.shape(like)))
        return _deliver(found, wrt, accumulate, out)


def sum_to_shape(g, shape):
    """Sum ``g`` down to ``shape``: the adjoint of NumPy broadcasting."""
    g = np.asarray(g)
    while g.ndim > len(shape):
        g = g.sum(0)
    for ax, n in enumerate(shape):
        if n == 1 and g.shape[ax] != 1:
            g = g.sum(ax, keepdims=True)
    return g


def _deliver(found, wrt, accumulate, out):
    """Fresh arrays, or written (``accumulate``: added) into ``out``."""
    if out is None:
        if accumulate:
            raise StepNetError("accumulate=True needs out=[one array per wrt]")
        return found
    if len(out) != len(found):
        raise StepNetError(f"out has {len(out)} arrays for {len(found)} wrt entries")
    for i, (buf, g) in enumerate(zip(out, found)):
        if not isinstance(buf, np.ndarray) or buf.shape != g.shape:
            raise ShapeError(
                f"out[{i}]: needs an ndarray of shape {list(g.shape)} for wrt[{i}], got "
                f"{list(np.shape(buf))}"
            )
        if accumulate:
            buf += g
        else:
            buf[...] = g
    return list(out)


def _resolve(rnn, item, values):
    """A wrt entry as (kind, key, like): a constant var, or a binding's var and
    the value it was given."""
    from .tracing import Parameter

    if isinstance(item, str):
        b = rnn.bindings.get(item)
        if b is None:
            raise StepNetError(
                f"wrt: {item!r} is not an input of {rnn.name}; its inputs are "
                f"{sorted(rnn.bindings)}"
            )
        return b.kind, b.var, _like(values[item])
    for var, source in rnn.frame.state.consts.values():
        if source is item or (isinstance(source, Parameter) and source.value is item):
            value = source.value if isinstance(source, Parameter) else np.asarray(source)
            return "const", var, value
    if isinstance(item, (np.ndarray, LoDTensor)):
        for name, b in rnn.bindings.items():
            if values[name] is item:
                return b.kind, b.var, _like(item)
    what = repr(item) if isinstance(item, Parameter) else type(item).__name__
    raise StepNetError(
        f"wrt: {what} is not read by {rnn.name}: give its Parameters, or the names "
        f"of its inputs {sorted(rnn.bindings)}"
    )


def _like(value):
    from .tracing import Parameter

    if isinstance(value, LoDTensor):
        return value
    return np.asarray(value.value if isinstance(value, Parameter) else value)


def _check_grad_outputs(rnn, program, outputs, grad_outputs):
    outs = program.eqn.outputs
    if not isinstance(grad_outputs, (list, tuple)):
        grad_outputs = [grad_outputs]
    if len(grad_outputs) != len(outs):
        raise StepNetError(
            f"grad_outputs has {len(grad_outputs)} entries; {rnn.name} has {len(outs)} "
            "outputs (use None for an output that gets no gradient)"
        )
    cts = []
    for k, (g, res, var) in enumerate(zip(grad_outputs, outputs, outs)):
        if g is None:
            cts.append(None)
            continue
        if isinstance(g, LoDTensor):
            g = g.data
        g = np.asarray(g)
        expected = res.data.shape if isinstance(res, LoDTensor) else np.shape(res)
        if g.shape != tuple(expected):
            raise ShapeError(
                f"grad_outputs[{k}] (output {var.name}) has shape {list(g.shape)}; the output's "
                f"data has shape {list(expected)}"
            )
        cts.append(np.ascontiguousarray(g, dtype=var.dtype))
    return cts


def _compiled_forward(rnn, backend, flags):
    from .backends import _module

    key = ("forward", backend, flags)
    cache = rnn._gradient_programs
    if key not in cache:
        cache[key] = _module(backend).compile_program(forward_program(rnn.program(flags)))
    return cache[key]


def _compiled_backward(rnn, backend, flags, present):
    from .backends import _module

    key = ("backward", backend, flags, present)
    cache = rnn._gradient_programs
    if key not in cache:
        programs, layout = backward_program(rnn.program(flags), present)
        module = _module(backend)
        cache[key] = ([(module.compile_program(p), p) for p in programs], layout)
    return cache[key]


def forward_with_workspace(rnn, output_all_steps=True, backend=None, **bindings):
    """Run ``rnn`` keeping its workspace: ``(outputs as rnn() returns, Pullback)``."""
    from .backends import default_backend

    if rnn.block is None:
        raise StepNetError("the step-net is not defined yet: use `with rnn.stepnet():`")
    if not rnn._top:
        raise StepNetError(f"{rnn.name} is a nested step-net; differentiate its enclosing one")
    backend = backend or default_backend()
    flags = rnn.all_steps_flags(output_all_steps)
    args = rnn.bind(**bindings)
    consts = rnn.const_values()
    results = _compiled_forward(rnn, backend, flags)(args, consts)
    n = len(rnn.block.outputs)
    outputs, workspace = list(results[:n]), list(results[n:])
    float16 = rnn.float16_input(bindings)
    values = {name: bindings.get(name, b.value) for name, b in rnn.bindings.items()}
    pullback = Pullback(rnn, flags, backend, args, outputs, workspace, consts, values)
    shown = [o.astype(np.float16) for o in outputs] if float16 else outputs
    return (shown[0] if n == 1 else tuple(shown)), pullback


def vjp(obj, *args, output_all_steps=True, backend=None, **inputs):
    """Run ``obj`` (a step-net or a ``stepnet.nn`` layer) once, keeping its
    workspace: returns ``(outputs, pullback)``; ``pullback(grad_outputs,
    wrt=None)`` gives one gradient per ``wrt`` (default: the Parameters)."""
    from .dsl import RNNOp

    if isinstance(obj, RNNOp):
        if args:
            raise StepNetError("vjp of a step-net takes its inputs by name: vjp(rnn, X=...)")
        return forward_with_workspace(obj, output_all_steps, backend, **inputs)
    if hasattr(obj, "vjp"):
        return obj.vjp(*args, backend=backend, **inputs)
    raise StepNetError(f"vjp: expects a step-net or a stepnet.nn layer, got {type(obj).__name__}")


def gradients(obj, wrt, grad_outputs, output_all_steps=True, backend=None, accumulate=False,
              out=None, **inputs):
    """Gradients of ``obj``'s outputs, weighted by ``grad_outputs``, with respect
    to each entry of ``wrt`` (DESIGN.md §6, docs/gradients.md)."""
    from .dsl import RNNOp

    kept = getattr(obj, "_workspace", None)
    if isinstance(obj, RNNOp):
        flags = obj.all_steps_flags(output_all_steps) if obj.block is not None else None
        if kept is not None and not inputs and kept.flags == flags and (
                backend is None or backend == kept.backend):
            pullback = kept
        else:
            _, pullback = forward_with_workspace(obj, output_all_steps, backend, **inputs)
        return pullback(grad_outputs, wrt, accumulate=accumulate, out=out)
    if hasattr(obj, "vjp"):
        if inputs:
            _, pullback = obj.vjp(backend=backend, **inputs)
        elif kept is not None:
            pullback = kept
        else:
            raise StepNetError(
                f"gradients of a {type(obj).__name__} layer need its input: pass X=... (and "
                "its initial state), or call the layer with keep_workspace=True first"
            )
        return pullback(grad_outputs, wrt, accumulate=accumulate, out=out)
    raise StepNetError(
        f"gradients: expects a step-net or a stepnet.nn layer, got {type(obj).__name__}"
    )


__all__ = ["Pullback", "augment", "backward_eqn", "backward_program", "forward_program",
           "gradients", "vjp"]
