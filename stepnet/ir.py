"""The step-net IR: a few frozen dataclasses that print like a jaxpr.

A step-net is one ``rnn`` equation holding a sub-graph (a :class:`Block`), the
way ``lax.scan`` holds a jaxpr. Its meaning, for one sequence, is this loop::

    state = [init for each memory]
    for t in (range(T) if not reverse else reversed(range(T))):
        step_scope = {step inputs: x[t], statics, memory pre values: state}
        run the block's equations in step_scope
        state = [step_scope[memory.post] for each memory]
        all_steps_out[t] = step_scope[output]        # for all-steps outputs
    last_out = step_scope[output] at the last step processed

and the batch is every sequence of the level stepped over, each with its own T.

Values (:class:`Var`) carry a full shape in which a leading ``None`` is the batch
axis: one row per active sequence of the enclosing block (``f32[B,64]``). A
value with ``lod_depth = k > 0`` is ragged: each batch row owns a k-level nested
sequence of rows (a LoDTensor whose top level is the batch). Constants
(parameters, captured arrays) have no batch axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import StepNetError
from . import registry
from .values import Literal, Var

__all__ = ["Block", "Eqn", "Literal", "Memory", "Program", "Var", "check", "format_program",
           "dependent", "iter_eqns", "memory_dependent", "rnn_parts"]


@dataclass(frozen=True, eq=False)
class Eqn:
    """``outputs = op(inputs, **attrs)``."""

    op: str
    inputs: tuple  # of Var | Literal
    outputs: tuple  # of Var
    attrs: dict = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Memory:
    """A recurrent state: ``pre`` is its value at t-1, ``post`` at t."""

    name: str
    pre: Var
    post: Var


@dataclass(frozen=True, eq=False)
class Block:
    """The body of one time step."""

    step_inputs: tuple  # of Var: this step's element of each sequence input
    static_inputs: tuple  # of Var: per-sequence constants
    memories: tuple  # of Memory
    eqns: tuple  # of Eqn
    outputs: tuple  # of Var


def rnn_parts(eqn: Eqn):
    """Split an ``rnn`` equation's inputs into (sequences, statics, memory inits)."""
    n_seq, n_static = eqn.attrs["num_sequence_inputs"], eqn.attrs["num_static_inputs"]
    return (
        eqn.inputs[:n_seq],
        eqn.inputs[n_seq:n_seq + n_static],
        eqn.inputs[n_seq + n_static:],
    )


@dataclass(frozen=True, eq=False)
class Program:
    """A top-level step-net: named inputs, constants and one ``rnn`` equation.

    ``inputs`` are the arrays bound by name at call time (sequence inputs,
    static inputs, per-sequence initial memories); ``consts`` are parameters
    and captured arrays, whose arrays the front end passes at each run keyed by
    their Var (``RNNOp.const_values()``).
    """

    inputs: tuple  # of Var
    consts: tuple  # of Var
    eqn: Eqn


# ----------------------------------------------------------------------------
# printing


def _fmt_attr(value) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(_fmt_attr(v) for v in value) + (",)" if len(value) == 1 else ")")
    return repr(value)


def format_eqn(eqn: Eqn, indent: int = 0) -> list:
    pad = "  " * indent
    outs = " ".join(repr(v) for v in eqn.outputs)
    ins = " ".join(v.name if isinstance(v, Var) else repr(v) for v in eqn.inputs)
    if eqn.op != "rnn":
        attrs = "".join(
            f" {k}={_fmt_attr(v)}" for k, v in sorted(eqn.attrs.items())
        )
        attrs = f"[{attrs.strip()}]" if attrs else ""
        return [f"{pad}{outs} = {eqn.op}{attrs} {ins}"]
    seqs, statics, inits = rnn_parts(eqn)
    a = eqn.attrs
    head = (
        f"{pad}{outs} = rnn[name={a['name']} reverse={a['reverse']} "
        f"all_steps={_fmt_attr(a['all_steps'])}] "
        f"sequences=({' '.join(_name(v) for v in seqs)}) "
        f"statics=({' '.join(_name(v) for v in statics)}) "
        f"inits=({' '.join(_name(v) for v in inits)}) {{"
    )
    return [head] + format_block(a["body"], indent + 1) + [f"{pad}}}"]


def _name(v) -> str:
    return v.name if isinstance(v, Var) else repr(v)


def format_block(block: Block, indent: int = 0) -> list:
    pad = "  " * indent
    lines = []
    if block.step_inputs:
        lines.append(f"{pad}step inputs: " + " ".join(repr(v) for v in block.step_inputs))
    if block.static_inputs:
        lines.append(f"{pad}static inputs: " + " ".join(repr(v) for v in block.static_inputs))
    for mem in block.memories:
        lines.append(f"{pad}memory {mem.name}: pre {mem.pre!r} -> post {mem.post.name}")
    for eqn in block.eqns:
        lines.extend(format_eqn(eqn, indent))
    lines.append(f"{pad}outputs: " + " ".join(v.name for v in block.outputs))
    return lines


def format_program(program: Program) -> str:
    lines = ["{ lambda " + " ".join(repr(v) for v in program.consts) + " ; "
             + " ".join(repr(v) for v in program.inputs) + " ."]
    lines.extend(format_eqn(program.eqn, 1))
    lines.append("  in (" + " ".join(v.name for v in program.eqn.outputs) + ") }")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# walking and checking


def iter_eqns(block: Block):
    """Every equation of a block and of the blocks nested in it, depth first."""
    for eqn in block.eqns:
        yield eqn
        if eqn.op == "rnn":
            yield from iter_eqns(eqn.attrs["body"])


def ragged_step_read(block: Block):
    """A step input of ``block`` or of a block nested in it that is ragged in
    its step (an input of two LoD levels or more) and read by an op other
    than a nested rnn (the CUDA backend refuses it), or None."""
    for body in [block] + [e.attrs["body"] for e in iter_eqns(block) if e.op == "rnn"]:
        ragged = {id(v) for v in body.step_inputs if v.lod_depth}
        for e in body.eqns:
            seqs = rnn_parts(e)[0] if e.op == "rnn" else ()
            for v in e.inputs[len(seqs):]:
                if id(v) in ragged:
                    return v
    return None


def dependent(block: Block, roots) -> set:
    """The vars ``block`` computes whose value depends on one of ``roots``."""
    reached = {id(v) for v in roots}
    result = set()
    for eqn in block.eqns:
        if any(isinstance(v, Var) and id(v) in reached for v in eqn.inputs):
            for out in eqn.outputs:
                reached.add(id(out))
                result.add(out)
    return result


def memory_dependent(block: Block) -> set:
    """The vars of ``block`` whose value depends on a memory's previous state.

    Everything else can be computed for all time steps at once (hoisted).
    """
    return dependent(block, [m.pre for m in block.memories])


def check(program: Program) -> None:
    """Validate the IR's invariants; raises StepNetError naming what is wrong.

    Every var is defined once before it is used, within its block or as a
    constant; memories' post values are defined in their block; an rnn's
    operands fit its body.
    """
    consts = {id(v) for v in program.consts}
    seen = set()
    for v in program.inputs + program.consts:
        if id(v) in seen:
            raise StepNetError(f"IR check: {v.name} is declared twice")
        seen.add(id(v))

    def check_eqn(eqn, defined):
        for v in eqn.inputs:
            if isinstance(v, Var) and id(v) not in defined and id(v) not in consts:
                raise StepNetError(f"IR check: {v.name} is used by {eqn.op} before it is defined")
        if eqn.op == "rnn":
            seqs, statics, inits = rnn_parts(eqn)
            body = eqn.attrs["body"]
            if len(seqs) != len(body.step_inputs) or len(statics) != len(body.static_inputs):
                raise StepNetError(f"IR check: rnn {eqn.attrs['name']} operands do not fit its body")
            if len(inits) != len(body.memories) or len(eqn.outputs) != len(body.outputs):
                raise StepNetError(f"IR check: rnn {eqn.attrs['name']} memories/outputs mismatch")
            ragged = eqn.attrs.get("ragged_memories", {})
            for k, mem in enumerate(body.memories):
                source = body.static_inputs[ragged[k]] if k in ragged else None
                if mem.pre.lod_depth != (source.lod_depth if source is not None else 0):
                    raise StepNetError(f"IR check: memory {mem.name} of {eqn.attrs['name']} is "
                                       "ragged without a ragged static input giving its rows")
            check_block(body)
        else:
            op = registry.get(eqn.op)
            avals = op.infer(list(eqn.inputs), eqn.attrs)
            for out, aval in zip(eqn.outputs, avals):
                if (out.shape, np.dtype(out.dtype), out.lod_depth) != (
                        aval.shape, np.dtype(aval.dtype), aval.lod_depth):
                    raise StepNetError(
                        f"IR check: {eqn.op} produces {aval.type_str()} but {out!r} is declared"
                    )
        for out in eqn.outputs:
            if id(out) in defined:
                raise StepNetError(f"IR check: {out.name} is defined twice")
            defined.add(id(out))

    def check_block(block):
        defined = {id(v) for v in block.step_inputs + block.static_inputs}
        defined |= {id(m.pre) for m in block.memories}
        for eqn in block.eqns:
            check_eqn(eqn, defined)
        for mem in block.memories:
            if id(mem.post) not in defined and id(mem.post) not in consts:
                raise StepNetError(f"IR check: memory {mem.name} has no update in its block")
            if (mem.post.shape, mem.post.dtype, mem.post.lod_depth) != (
                    mem.pre.shape, mem.pre.dtype, mem.pre.lod_depth):
                raise StepNetError(f"IR check: memory {mem.name} changes type across a step")
        for out in block.outputs:
            if id(out) not in defined and id(out) not in consts:
                raise StepNetError(f"IR check: output {out.name} is not defined in its block")

    check_eqn(program.eqn, {id(v) for v in program.inputs})
