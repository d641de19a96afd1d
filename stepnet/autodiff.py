"""Reverse mode: the backward of a step-net is a step-net (docs/design.md §6).

For a forward ``rnn`` equation, :func:`backward_eqn` builds an ``rnn``
equation that runs the other way in time over the same LoD. Its step:

- **inputs**: the forward step inputs, each memory's previous state as kept by
  the forward (the *workspace*: one row per token and memory), and the
  cotangent of each all-steps output; static inputs as in the forward;
- **recompute**: the forward step's equations, verbatim. With the previous
  states given, none of them depends on a memory any more, so a backend hoists
  them out of the time loop (every ``h_prev @ U`` of the sequence is one GEMM);
- **pullback**: the gradient rules of the ops (their registry entries) in reverse,
  as IR equations; a nested step-net's pullback is a nested backward rnn;
- **memories**: each forward memory's adjoint (d loss / d its value, carried
  from step t+1 to t), started at the cotangent of its last-step output; an
  accumulator per static input (over a ragged static input's own rows: a
  *ragged memory*, attrs ``ragged_memories``); a first-step flag when a
  last-step output is not a memory;
- **outputs**: the adjoints' last values (gradients of the initial memories),
  the static accumulators, the step inputs' cotangents (all steps), and per
  constant the per-row terms of its gradient (all steps): ``x @ W`` gives the
  pair (x, g) whose sum over rows ``X^T G`` is one GEMM after the loop.

This module builds programs (IR to IR); :mod:`stepnet.pullback` runs them:
after the loop it sums the per-row terms, pushes them through ops on
constants alone and maps them to the Parameters and named inputs asked for.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from . import ir, registry, schedule
from .errors import UnsupportedError
from .ir import Block, Eqn, Literal, Memory, Var

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


def grad_rule(op):
    """The gradient rule of ``op`` (the records in stepnet/ops/)."""
    rule = registry.get(op).grad
    if rule is None:
        raise UnsupportedError(f"op {op!r} has no gradient rule")
    return rule


class _BlockEmitter:
    """Appends the gradient rules' ops to a backward step (the records in stepnet/ops/)."""

    def __init__(self):
        self.eqns = []
        self.producer = {}  # id(var) -> the equation this emitter made it with

    @staticmethod
    def val(v):
        return v  # the recompute defines every forward value in the backward step

    def op(self, name, *operands, **attrs):
        avals = registry.get(name).infer(list(operands), attrs)
        outs = tuple(_new_var(name, a.dtype, a.shape, a.lod_depth) for a in avals)
        eqn = Eqn(name, tuple(operands), outs, dict(attrs))
        self.eqns.append(eqn)
        self.producer[id(outs[0])] = eqn
        return outs[0]

    def _weight_matmul(self, v):
        """The GEMM ``a @ W`` (``a`` a step value, ``W`` a constant) behind ``v``."""
        e = self.producer.get(id(v))
        if e is not None and schedule.is_gemm(e, lambda w: not w.batched):
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
        if g.lod_depth and not target.lod_depth and target.batched:
            g = self.op("seq_sum", g)  # a dense value met a ragged one: summed over its rows
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


# ops whose gradient reads none of their operands' values: a kept product
# moves to the end of a chain of them (``kept_values``)
_SUMS = ("add", "sub")


def kept_values(body: Block) -> tuple:
    """What the forward keeps per step for the backward (the workspace): each
    memory's previous state, and for each ``h @ U`` with constant weights that
    depends on a memory (a per-step product in the forward) the sum it is the
    start of: while a value's one use is an ``add`` or ``sub`` of its shape
    and LoD depth (``x @ W + h @ U + b``), that use's result is kept instead.
    The gradients of sums read no values, so the backward needs only the sum
    (a gate's pre-activation), and recomputes neither ``h @ U`` nor the
    products of the step inputs alone (``x @ W``) that were added to it. It
    recomputes the rest: other products of the step inputs alone as one
    hoisted GEMM, the elementwise ops inside its step."""
    pres = tuple(m.pre for m in body.memories)
    dependent = {id(v) for v in ir.memory_dependent(body)}
    uses = {}
    for e in body.eqns:
        for v in e.inputs:
            uses.setdefault(id(v), []).append(e)
    results = {id(v) for v in body.outputs} | {id(m.post) for m in body.memories}
    kept, seen = [], set()
    for e in body.eqns:
        v = e.outputs[0]
        if (e.op != "matmul" or id(v) not in dependent or not isinstance(e.inputs[1], Var)
                or e.inputs[1].batched or v.lod_depth):
            continue
        while id(v) not in results and len(uses.get(id(v), ())) == 1:
            use = uses[id(v)][0]
            total = use.outputs[0]
            if (use.op not in _SUMS or total.shape != v.shape or total.dtype != v.dtype
                    or total.lod_depth != v.lod_depth):  # (a sum over ragged rows: larger)
                break
            v = total
        if id(v) not in seen:
            seen.add(id(v))
            kept.append(v)
    return pres + tuple(kept)


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
    step = _BackwardStep(eqn, kept, top)
    inner_pres = step.recompute()
    adjoints, adjoint_init = step.seed(cts)
    step.pull_back(inner_pres)
    result = step.collect(adjoints, adjoint_init)
    return step.equations(result), result


class _BackwardStep:
    """The step of a backward rnn while it is built (:func:`backward_eqn`): its
    step inputs (with the enclosing operands), static inputs, memories and
    outputs, and the cotangent terms of the forward step's values."""

    def __init__(self, eqn, kept, top):
        body = eqn.attrs["body"]
        seqs, statics, _ = ir.rnn_parts(eqn)
        self.eqn, self.body, self.top = eqn, body, top
        self.name = eqn.attrs["name"]
        constant = next((v for v in body.static_inputs if not v.batched), None)
        if constant is not None:
            raise UnsupportedError(
                f"gradient of {self.name}: the nested step-net reads {constant.name}, a constant "
                "its enclosing step computes (such as tanh(W) of a Parameter W); compute it in the "
                "nested step-net itself, where it has its gradient")
        self.em = _BlockEmitter()
        self.kept_vars = kept_values(body)
        self.step_inputs = list(body.step_inputs) + list(self.kept_vars)
        self.seq_operands = list(seqs) + list(kept)
        self.static_inputs = list(body.static_inputs)
        self.static_operands = list(statics)
        self.memories, self.mem_inits = [], []
        self.ragged_memories = {}  # memory index -> the static input whose rows it has
        self.outputs, self.all_steps, self.out_memory = [], [], []
        self.ct = _Cotangents(self.em)
        self.contribs = {}  # id(constant) -> (constant, its Rows/Outer terms)
        self.injected = []  # (output index, forward output, its last-step cotangent)

    def add(self, var, g):
        """Add the cotangent term ``g`` of the forward value ``var``."""
        if g is None or not _is_float(var):
            return
        if isinstance(g, (Rows, Outer)) or not var.batched:
            if not isinstance(g, (Rows, Outer)):
                g = Rows(g)
            self.contribs.setdefault(id(var), (var, []))[1].append(g)
            return
        if np.dtype(g.dtype) != np.dtype(var.dtype):
            raise UnsupportedError(
                f"gradient of {self.name}: {var.name} is {np.dtype(var.dtype)} but meets "
                f"{np.dtype(g.dtype)} values; gradients need one float dtype per step-net"
            )
        self.ct.append(var, g)

    def recompute(self) -> dict:
        """The forward step's equations (kept values are read, not recomputed),
        nested step-nets keeping their workspace: {id(nested eqn): its
        workspace outputs}."""
        recomputed = {id(v) for v in self.kept_vars}
        inner_pres = {}
        for e in self.body.eqns:
            if e.op == "rnn":
                e_aug, extra = augment(e)
                self.em.eqns.append(e_aug)
                inner_pres[id(e)] = extra
            elif id(e.outputs[0]) not in recomputed:
                self.em.eqns.append(e)
        return inner_pres

    def seed(self, cts):
        """The adjoints carried from the next step and the outputs' cotangents:
        ``(adjoints, their initial values)``."""
        body, eqn = self.body, self.eqn
        adjoints = [_new_var(f"d_{m.name}", m.pre.dtype, m.pre.shape) for m in body.memories]
        adjoint_init = [Literal(0.0)] * len(body.memories)
        for k, (res, flag, g) in enumerate(zip(body.outputs, eqn.attrs["all_steps"], cts)):
            if g is None:
                continue
            if flag:
                dy = _new_var(f"d_{res.name}", res.dtype, res.shape, res.lod_depth)
                self.step_inputs.append(dy)
                self.seq_operands.append(g)
                self.add(res, dy)
                continue
            if res.lod_depth:
                raise UnsupportedError(
                    f"gradient of {self.name}: the last step of the ragged output {res.name}"
                )
            mi = next((i for i, m in enumerate(body.memories) if m.post is res), None)
            if mi is not None and isinstance(adjoint_init[mi], Literal):
                adjoint_init[mi] = g  # d(post) at the last step = this output's cotangent
                continue
            if not self.top and eqn.attrs["output_memory"][k] >= 0:
                raise UnsupportedError(
                    f"gradient of {self.name}: a nested step-net whose last-step output "
                    f"{res.name} is a memory's previous state (or a memory given twice)"
                )
            s = _new_var(f"d_{res.name}_last", res.dtype, res.shape)
            self.static_inputs.append(s)
            self.static_operands.append(g)
            self.injected.append((k, res, s))
        for m, adj in zip(body.memories, adjoints):
            self.add(m.post, adj)
        self._inject_last_steps()
        return adjoints, adjoint_init

    def _inject_last_steps(self):
        """A last-step cotangent that is not a memory's enters at the first
        backward step only: times a flag memory, 1 at the first step, then 0."""
        flags = {}  # (rank, dtype) -> a first-step flag memory of that rank
        em = self.em
        for _, res, s in self.injected:
            key = (len(res.shape), np.dtype(res.dtype).str)
            if key not in flags:
                flags[key] = _new_var("first_step", res.dtype,
                                      (None,) + (1,) * (len(res.shape) - 1))
                self.memories.append(Memory("first_step", flags[key],
                                            em.op("mul", flags[key], Literal(0.0))))
                self.mem_inits.append(Literal(1.0))
            self.add(res, em.op("mul", s, flags[key]))

    def pull_back(self, inner_pres):
        """The gradient rules of the step's ops, last op first."""
        em, ct = self.em, self.ct
        for e in reversed(self.body.eqns):
            if e.op == "rnn":
                _pull_nested(e, inner_pres[id(e)], ct, self.add, em)
                continue
            out = e.outputs[0]
            g = ct.get(id(out))
            if g is None or not out.batched or not _is_float(out):
                continue  # ops on constants alone are pulled back after the loop
            grads = grad_rule(e.op)(em, e, g)
            for v, gv in zip(e.inputs, grads):
                if gv is not None and _is_float(v):
                    self.add(v, em.unbroadcast(gv, v))

    def output(self, var, flag, memory=-1) -> int:
        """The index of the backward rnn's output giving ``var`` (one value given once)."""
        for i, (v, f, m) in enumerate(zip(self.outputs, self.all_steps, self.out_memory)):
            if v is var and f == flag and m == memory:
                return i
        self.outputs.append(var)
        self.all_steps.append(flag)
        self.out_memory.append(memory)
        return len(self.outputs) - 1

    def factor(self, var):
        """An Outer factor: a top-level step input is read from the input itself."""
        if self.top:
            for v, operand in zip(self.step_inputs, self.seq_operands):
                if v is var:
                    return operand
        return self.output(var, True)

    def collect(self, adjoints, adjoint_init) -> BackwardOutputs:
        """The memories (adjoints, static accumulators) and the outputs."""
        body, em, ct = self.body, self.em, self.ct
        result = BackwardOutputs([], [], [], injected=[k for k, _, _ in self.injected])
        for m, adj, init in zip(body.memories, adjoints, adjoint_init):
            post = ct.get(id(m.pre))
            if post is None:
                post = em.op("mul", adj, Literal(0.0))
            self.memories.append(Memory(f"d_{m.name}", adj, post))
            self.mem_inits.append(init)
            result.inits.append(self.output(post, False, len(self.memories) - 1))
        for sv in body.static_inputs:
            g = ct.get(id(sv))
            if g is None:
                result.statics.append(None)
                continue
            if sv.lod_depth:  # an accumulator over the static input's own rows
                self.ragged_memories[len(self.memories)] = self.static_inputs.index(sv)
            acc = _new_var(f"d_{sv.name}", sv.dtype, sv.shape, sv.lod_depth)
            self.memories.append(Memory(f"d_{sv.name}", acc, em.op("add", acc, g)))
            self.mem_inits.append(Literal(0.0))
            result.statics.append(self.output(self.memories[-1].post, False,
                                              len(self.memories) - 1))
        for sv in body.step_inputs:
            g = ct.get(id(sv))
            result.sequences.append(None if g is None else self.output(g, True))
        for var, terms in self.contribs.values():
            for term in _merge_terms(terms, em):
                if isinstance(term, Rows):
                    result.contribs.append((var, Rows(self.output(term.value, True))))
                else:
                    result.contribs.append(
                        (var, Outer(self.factor(term.a), self.output(term.g, True))))
        return result

    def equations(self, result) -> list:
        """The backward rnn equation, and a second one for the work after the
        loop when there is some (:func:`_split_after_loop`); fills
        ``result.values``."""
        eqns = _live_eqns(self.em.eqns, self.outputs, self.memories)
        loop_eqns, post_eqns = _split_after_loop(eqns, self.outputs, self.all_steps,
                                                 self.memories)
        attrs = {
            "name": f"{self.name}_grad",
            "reverse": not self.eqn.attrs["reverse"],
            "num_static_inputs": len(self.static_operands),
            "ragged_memories": dict(self.ragged_memories),
        }
        if not post_eqns:
            loop = self._loop(eqns, self.outputs, self.all_steps, self.out_memory, attrs)
            result.values = list(loop.outputs)
            return [loop]
        return self._loop_and_after(loop_eqns, post_eqns, attrs, result)

    def _loop(self, eqns, outputs, flags, memory, attrs):
        block = Block(tuple(self.step_inputs), tuple(self.static_inputs), tuple(self.memories),
                      schedule.fusion_order(eqns), tuple(outputs))
        return _rnn_eqn(block, self.seq_operands, self.static_operands, self.mem_inits, flags,
                        memory, attrs)

    def _loop_and_after(self, loop_eqns, post_eqns, attrs, result):
        """The ops that neither the memories nor the last-step outputs need run
        after the time loop, over every step at once (dX = G @ W^T is one
        GEMM): a second step-net without memories reads what they need as
        all-steps outputs."""
        post_defined = {id(o) for e in post_eqns for o in e.outputs}
        loop_outputs, loop_flags, loop_memory = [], [], []
        post_outputs, where = [], []
        for v, flag, m in zip(self.outputs, self.all_steps, self.out_memory):
            if id(v) in post_defined:
                where.append(("post", len(post_outputs)))
                post_outputs.append(v)
            else:
                where.append(("loop", len(loop_outputs)))
                loop_outputs.append(v)
                loop_flags.append(flag)
                loop_memory.append(m)
        step_ids = {id(v): (v, o) for v, o in zip(self.step_inputs, self.seq_operands)}
        static_ids = {id(v): (v, o) for v, o in zip(self.static_inputs, self.static_operands)}
        post_steps, post_seq_operands, post_statics, post_static_operands = [], [], [], []
        exported = []  # loop values the post step reads: (var, index among loop outputs)
        seen = set()
        for v in (v for e in post_eqns for v in e.inputs):
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
        loop = self._loop(loop_eqns, loop_outputs, loop_flags, loop_memory, attrs)
        post_steps = [v for v, _ in exported] + post_steps
        post_seq_operands = [loop.outputs[i] for _, i in exported] + post_seq_operands
        post_block = Block(tuple(post_steps), tuple(post_statics), (),
                           schedule.fusion_order(post_eqns), tuple(post_outputs))
        post = _rnn_eqn(post_block, post_seq_operands, post_static_operands, [],
                        [True] * len(post_outputs), [-1] * len(post_outputs),
                        dict(attrs, name=f"{self.name}_grad_rest",
                             num_static_inputs=len(post_statics), ragged_memories={}))
        result.values = [loop.outputs[i] if part == "loop" else post.outputs[i]
                         for part, i in where]
        return [loop, post]


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
        # (an op reading a ragged value stays in the loop: its rows are the
        # step's memory rows, and the work after it reads what it gives)
        ragged = any(isinstance(v, Var) and v.lod_depth for v in e.inputs)
        if e.op == "rnn" or ragged or any(id(o) in need for o in e.outputs):
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
    """Per-row terms of one constant: same-shaped dense Rows summed, and Outer
    pairs with the same left factor summed (``a^T g1 + a^T g2 = a^T (g1 + g2)``:
    products sharing their left operand, grouped as the schedule groups GEMMs);
    ragged terms (from nested step-nets) stay apart."""
    rows, outers, apart = {}, [], []
    for t in terms:
        if isinstance(t, Rows) and not t.value.lod_depth:
            key = t.value.shape
            rows[key] = Rows(em.op("add", rows[key].value, t.value)) if key in rows else t
        elif isinstance(t, Outer) and not t.a.lod_depth:
            outers.append(t)
        else:
            apart.append(t)
    merged = []
    for group in schedule.group_by_left(outers, lambda t: t.a):
        g = group[0].g
        for t in group[1:]:
            g = em.op("add", g, t.g)
        merged.append(Outer(group[0].a, g))
    return list(rows.values()) + merged + apart


def _live_eqns(eqns, outputs, memories) -> tuple:
    """The equations that the outputs and memory updates need."""
    need = {id(v) for v in outputs} | {id(m.post) for m in memories}
    live = []
    for e in reversed(eqns):
        if any(id(o) in need for o in e.outputs):
            live.append(e)
            need.update(id(v) for v in e.inputs if isinstance(v, Var))
    return tuple(reversed(live))


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


def sum_to_shape(g, shape):
    """Sum ``g`` down to ``shape``: the adjoint of NumPy broadcasting."""
    g = np.asarray(g)
    while g.ndim > len(shape):
        g = g.sum(0)
    for ax, n in enumerate(shape):
        if n == 1 and g.shape[ax] != 1:
            g = g.sum(ax, keepdims=True)
    return g


__all__ = ["augment", "backward_eqn", "backward_program", "forward_program", "sum_to_shape"]
