"""What the Numba backend decides about a kernel, from its schedule, before
:mod:`stepnet.jit.cpu_codegen` writes it (and decides none of it again): a
checked :class:`KernelPlan`, which ``compiled.explain()`` prints."""

from __future__ import annotations

import collections
from typing import NamedTuple

from .. import ir, registry
from . import blas


class KernelPlan(NamedTuple):
    """Per net (its :class:`stepnet.schedule.Schedule`), what its code does beyond it."""
    consts: tuple  # the program's constants the code reads (the others only joined by the caller)
    chunked: dict  # sched -> its hoisted products run by chunks of steps (top level, independent nets)
    split: dict  # sched -> {hoisted product: the concat it reads as a sum of products}
    in_place: dict  # sched -> memories whose new value is written over the old
    concats: dict  # sched -> step concats whose parts are computed into the concat's buffer
    epilogues: dict  # sched -> {elementwise run: the reductions it folds its values into}
    unbuffered: dict  # sched -> all-steps outputs its fused runs store to the outputs alone
    cut: dict  # net program() runs over all its sequences -> whether it cuts them with the helper
    dequantized: dict  # sched -> int8 products only its step's runs read: dequantized as they read
    into_outputs: frozenset  # the top net's all-steps outputs computed before its loop into their buffers

    @property
    def cuts_sequences(self) -> bool:
        """Whether program() cuts the sequences of every net it runs with the helper."""
        return all(self.cut.values())

    def check(self) -> KernelPlan:
        """The plan, or ``AssertionError`` where it names work its net does not schedule."""
        for sched in self.split:
            hoisted, step = set(sched.hoisted), set(sched.step)
            assert self.chunked.get(sched, frozenset()) <= hoisted, sched
            assert all(g in hoisted and c in hoisted for g, c in self.split[sched].items()), sched
            assert all(m in sched.body.memories for m in self.in_place[sched]), sched
            assert all(c in step for c in self.concats[sched]), sched
            assert all(r in step and set(rs) <= step for r, rs in self.epilogues[sched].items()), sched
            assert self.unbuffered[sched] <= set(sched.body.outputs), sched
            assert all(s.kind == "quantized" and s in hoisted | step
                       for s in self.dequantized[sched]), sched
        assert set(self.cut) <= set(self.split), self.cut
        top = next(iter(self.split))
        assert all(any(v in s.outputs for s in top.hoisted) for v in self.into_outputs), self.into_outputs
        return self

    def __str__(self):
        def names(vs):
            return ", ".join(dict.fromkeys(v.name for v in vs)) or "none"

        lines = [f"kernel: constants read: {names(self.consts)}"]
        for sched in self.split:
            lines.append(f"net of {names(sched.eqn.outputs)}:")
            start = len(lines)
            for what, stages in (
                    ("products by chunks of steps", self.chunked.get(sched, ())),
                    ("products of a concat as sums", self.split[sched]),
                    ("concats written in place", self.concats[sched]),
                    ("runs folding reductions", self.epilogues[sched]),
                    ("int8 sums dequantized by the runs reading them", self.dequantized[sched])):
                if stages:
                    lines.append(f"  {what}: " + "; ".join(names(s.outputs) for s in stages))
            for what, values in (
                    ("memories updated in place", [m.post for m in self.in_place[sched]]),
                    ("outputs stored by their run alone", self.unbuffered[sched]),
                    ("outputs computed before the loop into their buffers",
                     self.into_outputs if sched is next(iter(self.split)) else ())):
                if values:
                    lines.append(f"  {what}: {names(values)}")
            if self.cut.get(sched):
                lines.append("  its sequences cut with the helper where the call's plan shares")
            if len(lines) == start:
                lines.append("  as scheduled")
        return "\n".join(lines)


def kernel_plan(program: ir.Program, sched) -> KernelPlan:
    """The plan of ``program``'s kernel, ``sched`` its schedule."""
    chunked, split, in_place, concats, epilogues, unbuffered, dequantized = {}, {}, {}, {}, {}, {}, {}
    consts, read, weights, cut = set(program.consts), set(), [0], {}
    reads = _reads(sched)

    def plan_net(net, once):  # once: the net runs once over all of its sequences
        if net in split:
            return
        if once:
            chunked[net] = _chunked_products(net, set().union(
                *(r for other, r in reads.items() if other.body is not net.body)))
        split[net] = _split_products(net)
        in_place[net] = tuple(_updated_in_place(net))
        concats[net] = tuple(_concats_in_place(net))
        epilogues[net] = _reduction_epilogues(net)
        unbuffered[net] = _unbuffered(net)
        dequantized[net] = _dequantized(net)
        weights.extend(s.left.shape[-1] * sum(v.shape[-1] for v in s.outputs)
                       for s in net.step if s.kind in ("gemm", "quantized"))
        if once:
            cut[net] = _sequences_apart(net)
        read.update(_consts_read(net, consts))
        for section, stage in net.stages():
            if stage.kind == "rnn":
                plan_net(net.nested[stage.eqns[0]], section != "step")

    plan_net(sched, True)
    if max(weights) < _GROUP_MIN_WEIGHTS:
        cut = dict.fromkeys(cut, False)
    return KernelPlan(tuple(v for v in program.consts if v in read), chunked, split, in_place,
                      concats, epilogues, unbuffered, cut, dequantized,
                      _into_outputs(sched, chunked[sched], split[sched])).check()


def _reads(sched):
    """``{net: the Vars its stages read}`` of ``sched``'s net and every net
    nested in it."""
    found = {sched: {v for _, stage in sched.stages() for e in stage.eqns for v in e.inputs
                     if isinstance(v, ir.Var)}}
    for _, stage in sched.stages():
        if stage.kind == "rnn":
            found.update(_reads(sched.nested[stage.eqns[0]]))
    return found


def _into_outputs(sched, chunked, split):
    """The top net's dense all-steps outputs (of sequences of one level) a
    hoisted stage computes into an array of its own (not a merged product's
    column block, a nested net's output, a product by chunks of steps, a
    concat only a split product reads): computed into the outputs' buffers
    instead, with no copy a step."""
    if not all(v.lod_depth == 1 for v in ir.rnn_parts(sched.eqn)[0]):
        return frozenset()
    made = {v for s in sched.hoisted if s.kind != "rnn" and not s.merged and s not in chunked
            and s not in split.values() for v in s.outputs}
    return frozenset(res for res, all_steps in zip(sched.body.outputs, sched.eqn.attrs["all_steps"])
                     if all_steps and not res.lod_depth and res in made)


# a kernel whose steps multiply by smaller weights than this (a net of a
# few units) never gives sequences to the helper: too few rows of it to be
# worth a second core are too many for one group (NumbaProgram.splits cuts
# them into groups on Python's threads first), and the lines that cut them
# cost its kernel about a third more to compile
_GROUP_MIN_WEIGHTS = 1024


def _sequences_apart(sched) -> bool:
    """Whether a net computes each sequence from its own rows only: it may
    run over any part of its sequences (their arguments cut alike), as its
    outputs are the caller's buffers (rows of all steps, or one per
    sequence) and it reads no ragged static input (whose rows it finds by
    the sequence's index)."""
    return not (sched.eqn.attrs.get("ragged_memories")
                or any(v.lod_depth for v in sched.body.outputs)
                or any(isinstance(v, ir.Var) and v.lod_depth for v in ir.rnn_parts(sched.eqn)[1]))


def _consts_read(sched, consts):
    """The program's ``consts`` that one net's code reads: every one an
    equation (or the net's output or memory) takes, but the weights of merged
    products whose weights are all constants (the caller joins those: the
    products read the joined ones)."""
    read = set()
    for _, stage in sched.stages():
        # (a quantized product's weights, always constants, the caller prepares)
        joined = stage.kind == "quantized" or stage.kind == "gemm" and stage.merged and all(
            e.inputs[1] in consts for e in stage.eqns)
        for e in stage.eqns:
            read.update(v for v in (e.inputs[:1] if joined else e.inputs) if v in consts)
    body = sched.body
    read.update(v for v in (*body.outputs, *(m.post for m in body.memories)) if v in consts)
    return read


# products of fewer columns stay before the loop: their results over every
# token (under 1 KB a token in float32) are a fraction of those the chunks
# are for, and the chunks' code adds to each kernel's compile time
_CHUNK_MIN_COLUMNS = 256


def _chunked_products(sched, outside):
    """A net's hoisted products (``x @ W`` over every token) of
    ``_CHUNK_MIN_COLUMNS`` columns or more that only its step's elementwise
    runs read, where its step values are dense: no net of another body
    reads them (``outside``; a gradient program's nets share the forward's
    hoisted values, each computed once: cpu_codegen._hoist). The rnn function computes
    them per chunk of steps for its own sequences (about ``_CHUNK_ROWS``
    rows at a time), just before the steps that read them: the results are
    read back from the cache, where every token's results, computed before
    the time loop, would be written to memory and read back from it (20-26
    MB for a GRU or an LSTM of 256 units over 6400 tokens; 11 MB for W6's
    words)."""
    body = sched.body
    if (sched.eqn.attrs.get("ragged_memories") or any(v.lod_depth for v in body.step_inputs)
            or any(v.lod_depth for v in body.static_inputs)):
        return frozenset()
    read_elsewhere = set(body.outputs) | {m.post for m in body.memories} | outside
    for section, stage in sched.stages():  # (a nested net's reads are in outside)
        if section != "step" or stage.kind != "elementwise":
            for e in stage.eqns:
                read_elsewhere.update(v for v in e.inputs if isinstance(v, ir.Var))
    return frozenset(stage for stage in sched.hoisted
                     if stage.kind in ("gemm", "quantized")
                     and sum(v.shape[-1] for v in stage.outputs) >= _CHUNK_MIN_COLUMNS
                     and not read_elsewhere.intersection(stage.outputs))


def _dequantized(sched):
    """A net's int8 products (``matmul_int8``, in its step or before it)
    whose results only its step's elementwise runs read: the product leaves
    its int32 sums and each row's scale (``quantized.int8_row_sums``), and
    the runs dequantize each sum as they read it, with no pass of the
    product's own over its results (a load, a multiply and a store per
    element: on AMX, about as long as the sums themselves)."""
    body = sched.body
    read_elsewhere = set(body.outputs) | {m.post for m in body.memories}
    for section, stage in sched.stages():
        if section != "step" or stage.kind != "elementwise":
            for e in stage.eqns:
                read_elsewhere.update(_every_operand(e))
    return frozenset(stage for stage in (*sched.hoisted, *sched.step)
                     if stage.kind == "quantized" and stage.eqns[0].op == "matmul_int8"
                     and not read_elsewhere.intersection(stage.outputs))


def _every_operand(e):
    """The Vars ``e`` reads, those of a nested rnn's body included."""
    found = [v for v in e.inputs if isinstance(v, ir.Var)]
    if e.op == "rnn":
        for inner in e.attrs["body"].eqns:
            found += _every_operand(inner)
    return found


def _split_products(sched):
    """``{gemm stage: concat stage}`` for hoisted products ``concat(a_1, ...,
    a_n; axis=1) @ concat(W_1, ..., W_n; axis=0)`` (autodiff's merged input
    gradient) whose concat nothing else reads: they run as ``sum a_i @ W_i``,
    without copying every token's ``a_i`` into one array first."""
    if blas.DETERMINISTIC:  # the summation order is part of the result
        return {}
    concats = {s.outputs[0]: s for s in sched.hoisted
               if s.kind == "shape" and s.eqns[0].op == "concat" and s.eqns[0].attrs["axis"] == 1}
    weights = {s.outputs[0]: s.eqns[0] for s in sched.const
               if s.eqns[0].op == "concat" and s.eqns[0].attrs["axis"] == 0}
    body = sched.body
    uses = collections.Counter(v for e in body.eqns for v in e.inputs if isinstance(v, ir.Var))
    uses.update(v for v in body.outputs if isinstance(v, ir.Var))
    uses.update(m.post for m in body.memories)
    split = {}
    for stage in sched.hoisted:
        if stage.kind != "gemm" or stage.merged or stage.left not in concats:
            continue
        concat, joined = concats[stage.left], weights.get(stage.eqns[0].inputs[1])
        if (joined is None or uses[stage.left] != 1
                or len(joined.inputs) != len(concat.eqns[0].inputs)
                or any(not isinstance(v, ir.Var) or v.shape[-1] != w.shape[0]
                       for v, w in zip(concat.eqns[0].inputs, joined.inputs))):
            continue
        split[stage] = concat
    return split


def _updated_in_place(sched):
    """The ragged memories (gradient accumulators) whose new value one fused
    run computes from the old value at the same element, where nothing else
    reads either: the run writes it over the old value (no copy per step)."""
    body = sched.body
    readers = collections.defaultdict(set)
    for stage in sched.step:
        for e in stage.eqns:
            for v in e.inputs:
                readers[v].add(stage)
    out = []
    for k, mem in enumerate(body.memories):
        run = next((s for s in sched.step if mem.post in s.outputs), None)
        as_outputs = [(flag, m) for v, flag, m in zip(body.outputs, sched.eqn.attrs["all_steps"],
                                                      sched.eqn.attrs["output_memory"])
                      if v is mem.post]
        if (mem.pre.lod_depth and run is not None and run.kind == "elementwise"
                and readers[mem.pre] <= {run} and not readers[mem.post]
                and all(not flag and m == k for flag, m in as_outputs)
                and sum(m.post is mem.post for m in body.memories) == 1):
            out.append(mem)
    return out


def _concats_in_place(sched):
    """The step's concats along the last axis of values ``[B, n]`` computed
    by fused runs (no memory's new value among them): each run stores its
    part straight into the part's column block of the concat's buffer, and
    the concat copies nothing."""
    run_of = {v: s for s in sched.step for v in s.outputs}
    posts = {m.post for m in sched.body.memories}
    found, placed = [], set()
    for stage in sched.step:
        e = stage.eqns[0]
        if stage.kind != "shape" or e.op != "concat":
            continue
        out, parts = e.outputs[0], e.inputs
        if (len(out.shape) != 2 or out.shape[0] is not None or out.lod_depth
                or e.attrs["axis"] not in (1, -1) or len(set(parts)) != len(parts)):
            continue
        if all(isinstance(v, ir.Var) and not v.lod_depth and v not in posts
               and v not in placed and run_of.get(v) is not None
               and run_of[v].kind == "elementwise" for v in parts):
            found.append(stage)
            placed.update(parts)
    return found


def _reduction_epilogues(sched):
    """``{elementwise stage: [reduction stages]}``: each a segment op
    (seq_sum, seq_max) or a sum over the last axis of a value of that run that
    nothing else reads. The run folds the value into the reduction's result
    in its own loop (the reduction runs early: its result is ready before its
    own place), and the value is never stored. A last-axis sum accumulates in
    a register around the innermost loop (an element of memory updated at
    every iteration would keep the loop from vectorizing)."""
    body = sched.body
    uses = collections.Counter(v for e in body.eqns for v in read_operands(e))
    uses.update(body.outputs)
    uses.update(m.post for m in body.memories)
    run_of = {v: stage for stage in sched.step if stage.kind == "elementwise"
              for v in stage.outputs}
    fused = {}
    for stage in sched.step:
        e = stage.eqns[0]
        x = e.inputs[0]
        row_sum = e.op == "sum" and e.attrs["axis"] % len(x.shape) == len(x.shape) - 1 \
            and x.shape[-1] is not None
        if stage.kind != "shape" or not (row_sum or registry.get(e.op).segment is not None):
            continue
        if x in run_of and uses[x] == 1:
            fused.setdefault(run_of[x], []).append(stage)
    return fused


def _unbuffered(sched):
    """The all-steps outputs computed by a fused run that no other stage of a
    step reads but fused runs (which read them back at the entry's row): the
    run stores them to the outputs alone, with no per-step buffer (every
    store stream more is a run-time alias check more, and too many keep LLVM
    from vectorizing the loop)."""
    body = sched.body
    if any(s.kind == "rnn" for s in sched.step):  # a nested body may read any value
        return frozenset()
    run_of = {v: s for s in sched.step for v in s.outputs}
    read_elsewhere = {v for s in sched.step if s.kind != "elementwise" for e in s.eqns
                      for v in read_operands(e) if run_of.get(v) is not s}
    read_elsewhere.update(m.post for m in body.memories)
    outputs = tuple(zip(body.outputs, sched.eqn.attrs["all_steps"]))
    read_elsewhere.update(res for res, all_steps in outputs if not all_steps)
    return frozenset(res for res, all_steps in outputs
                     if all_steps and not res.lod_depth and res not in read_elsewhere
                     and res in run_of and run_of[res].kind == "elementwise")


def read_operands(e):
    """The operands whose values ``e``'s code reads (``seq_expand`` reads its
    second operand's LoD only)."""
    code = None if e.op == "rnn" else registry.get(e.op).numba
    if isinstance(code, str):
        return [v for k, v in enumerate(e.inputs)
                if isinstance(v, ir.Var) and f"{{{k}}}" in code]
    return [v for v in e.inputs if isinstance(v, ir.Var)]

