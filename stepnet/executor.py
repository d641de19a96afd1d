"""The schedule executor: a step-net run by its schedule on loops compiled
once per install, with nothing compiled for the step-net itself (the tier
between the interpreter and the fused kernel).

The interpreter (:mod:`stepnet.interpreter`) is the reference: it runs every
equation of the body at every step, each step's inputs gathered from the
caller's rows, each GEMM on its own. The executor runs the schedule
(:mod:`stepnet.schedule`) the kernels render:

- the sequences in groups (one per thread it is given, where the call is
  big enough: ``threads.SPLIT_MIN_WORK``), each on its own thread as the
  kernels' sequence groups, NumPy's products then on one thread each; a
  lone group shares its products with the helper thread where a kernel's
  would (``plan.shares``), as the kernels' products do;
- in a group, the sequences sorted by length and every token laid out by
  steps once (step 0 of every sequence, then step 1, ...), so that a step's
  rows are one slice of each value, never a gather;
- a group's whole time loop as one call of one loop compiled once per
  install and dtype (``steps_loop``, kept in ``STEPNET_CACHE_DIR``; its
  programs :mod:`stepnet.executor_program`'s): each stage an instruction
  over one table of addresses, an elementwise run as a bytecode of its ops
  (each op's code the kernels'), a GEMM as the kernels' per-step product of
  the step's rows (a merged one's weights joined once a call), a concat by
  columns as copies, the hoisted stages by chunks of steps just before the
  steps that read them, into buffers of two chunks' rows that the chunks
  take in turns (a lone group's first hoisted product computed a chunk
  ahead on the helper, as the kernels'); the step inputs read, and the
  all-steps outputs written, at the caller's rows; the memories read and
  written in place in their sorted rows; the loop's program built once and
  run again by later groups of as many sequences, pointed at their arrays
  (``Steps.of``);
- where the loop does not run a step (``Executor.why_apart``), the time
  loop in Python: the hoisted stages once over every token, then each
  stage a call at each step (a GEMM one NumPy product, a run its bytecode,
  other stages op by op on NumPy), the step inputs gathered by steps first
  and the outputs put in the caller's order at the end.

It runs nested step-nets: one that reads no value of its enclosing step
first, on an executor of its own over every sub-sequence of the call (in
groups, each group over its own sequences' sub-sequences), its results rows
of the enclosing step as a step input's; one that does at each step, over
the step's sub-sequences. The groups are dealt the sequences by their rows
of data (a nested net's innermost rows). A ragged static input, and the values
made from it, are computed op by op at each step as on the interpreter; a
ragged output (a nested net's every step) and a memory of a ragged static
input's rows (a gradient's accumulator) are recorded and kept as the
interpreter does (:class:`_RaggedOutputs`), the time loop in Python.
:func:`why_not` says why another is left to the interpreter. Its results are
the same arithmetic in another order (the products' sums): within the
tolerance a kernel has, not bit for bit.
"""

from __future__ import annotations

import numpy as np

from . import ir, schedule as _schedule
from .errors import StepNetError
from .executor_loop import loop as _loop
from .executor_program import (
    BY_CALLER, KEPT_SIZES, Run, Steps, column_blocks, joined_weights, quantized_weights)
from .interpreter import _RaggedState, apply
from .lod import LoDTensor

def why_not(program: ir.Program, sched=None):
    """Why the executor does not run ``program`` (a sentence), or None where it does."""
    eqn = program.eqn
    body = eqn.attrs["body"]
    sched = sched or _schedule.schedule(program)
    seqs, statics, inits = ir.rnn_parts(eqn)
    # a step input of more LoD levels is the sequences of nested rnns, and
    # each step's sub-sequences read op by op as every other ragged value of
    # one level (the DSL refuses an op reading a value of two levels or more)
    deep = {v for v, s in zip(body.step_inputs, seqs) if s.lod_depth > 1}
    ragged_memories = eqn.attrs.get("ragged_memories", {})
    kept = [*(m.pre for k, m in enumerate(body.memories) if k not in ragged_memories),
            *(v for v in inits if isinstance(v, ir.Var))]
    if any(v.lod_depth for v in kept):
        return "a memory of its step is ragged and not of a ragged static input's rows"
    values = [*(v for v in body.step_inputs if v not in deep), *body.static_inputs,
              *(o for e in body.eqns for o in e.outputs)]
    if any(v.lod_depth > 1 for v in values):
        return "a value of its step has more than one LoD level"
    if deep & set(body.outputs):
        return "a step input of more than one LoD level is an output of its step"
    for e in body.eqns:
        why = why_not(_nested_program(e), sched.nested[e]) if e.op == "rnn" else None
        if why is not None:
            return f"its nested rnn {e.attrs['name']} is not run: {why}"
    return None


def _nested_program(e):
    """A nested rnn as a program of its own: its sequences the inputs, and
    everything else it reads constants (the call's, or the step's rows: a
    nested rnn that reads a value of its step runs at each step)."""
    seqs = ir.rnn_parts(e)[0]
    return ir.Program(inputs=tuple(seqs), eqn=e, consts=tuple(
        v for v in dict.fromkeys(_schedule.free_vars(e)) if v not in seqs))


def compile_program(program: ir.Program, sched=None):
    """``run(args, consts, workers=1) -> outputs`` of ``program`` on the
    executor (the interpreter's contract; ``workers`` the threads it may
    use), or None where :func:`why_not` says why not."""
    sched = sched or _schedule.schedule(program)
    if why_not(program, sched) is not None:
        return None
    return Executor(program, sched)


class Executor:
    """One program run by its schedule: ``run(args, consts, workers=1)``."""

    def __init__(self, program, sched):
        self.program, self.sched = program, sched
        eqn = program.eqn
        self.name = eqn.attrs["name"]
        self.body = eqn.attrs["body"]
        self.reverse = bool(eqn.attrs["reverse"])
        self.all_steps = eqn.attrs["all_steps"]
        self.output_memory = eqn.attrs["output_memory"]
        self.seqs, self.statics, self.inits = ir.rnn_parts(eqn)
        # the nested rnns: those that read no value of the step (hoisted) run
        # first over every sub-sequence of the call, their results rows of the
        # step as its step inputs'; the others at each step, over its sub-sequences
        self.nested = {stage: Executor(_nested_program(stage.eqns[0]), sched.nested[stage.eqns[0]])
                       for stage in (*sched.hoisted, *sched.step) if stage.kind == "rnn"}
        # (first: those over the step inputs' sub-sequences alone; one's every
        # step, a ragged value of the enclosing step, is then each token's rows of it)
        self.first = [stage for stage in sched.hoisted if stage.kind == "rnn"
                      and not self.nested[stage].ragged_io
                      and set(ir.rnn_parts(stage.eqns[0])[0]) <= set(self.body.step_inputs)]
        self.by_steps = [v for v, s in zip(self.body.step_inputs, self.seqs) if s.lod_depth == 1]
        self.deep = [v for v, s in zip(self.body.step_inputs, self.seqs) if s.lod_depth > 1]  # (2+ levels)
        self.by_steps += [o for stage in self.first for o in stage.outputs]
        # the hoisted stages that are not row by row (a shape op, a general
        # matmul), and those reading them, run at each step on its rows instead
        self.whole, self.step, by_steps = [], [], {v for v in self.by_steps if not v.lod_depth}
        for stage in sched.hoisted:
            if stage in self.first:
                continue
            reads = {v for e in stage.eqns for v in e.inputs if isinstance(v, ir.Var) and v.batched}
            if stage.kind in ("gemm", "quantized", "elementwise") and reads <= by_steps \
                    and stage not in self.nested:
                self.whole.append(stage)
                by_steps.update(stage.outputs)
            else:
                self.step.append(stage)
        self.step += list(sched.step)
        # (the stages reading a ragged value, a ragged static input's rows or a
        # value made from them: op by op, as the interpreter)
        self.ragged = {stage for stage in self.step if stage.kind != "rnn" and any(
            isinstance(v, ir.Var) and v.lod_depth for e in stage.eqns for v in e.inputs)}
        self.products = [stage for stage in (*self.whole, *self.step)
                         if stage.kind in ("gemm", "quantized") and stage not in self.ragged]
        # a run stores the values read outside it (the schedule's
        # materialized ones, and those of the hoisted runs run by steps here)
        readers = {}
        for stage in (*sched.hoisted, *sched.step):
            for e in stage.eqns:
                for v in e.inputs:
                    readers.setdefault(v, set()).add(stage)
        kept = {*self.body.outputs, *(m.post for m in self.body.memories)}
        self.runs = {stage: Run.of(stage, {v for v in stage.outputs
                                            if v in kept or readers.get(v, {stage}) - {stage}})
                     for stage in (*self.whole, *self.step) if stage.kind == "elementwise"}
        # the dtype of the step's values, where they have one (the loop's)
        dtypes = {np.dtype(v.dtype) for v in (*self.body.step_inputs, *self.body.static_inputs,
                                              *(m.pre for m in self.body.memories),
                                              *(o for e in self.body.eqns for o in e.outputs))
                  if v.batched}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else None
        # the memories of a ragged static input's rows ({memory: static
        # input}) and the ragged outputs: kept and given out as the interpreter does
        self.ragged_memories = eqn.attrs.get("ragged_memories", {})
        self.ragged_io = bool(self.ragged_memories) or any(v.lod_depth for v in self.body.outputs)
        # why no group runs its time loop as one call of the loop (or None)
        self.why_apart = ("an output or a memory of its step is ragged" if self.ragged_io
                          else "a value of its step is ragged"
                          if any(v.lod_depth for v in self.by_steps) else Steps.why_not(self))
        self.how = None  # (how the last call's groups ran: "one call" or "step by step: why")
        self.kept_steps = {}  # (groups' loops by their number of sequences: Steps.of)
        self.kept_layouts = {}  # (groups' layouts by their offsets: _layout)
        # the widest value a step computes: the work per token, for groups
        self.work_width = max([int(np.prod(v.shape[1:], dtype=np.int64))
                               for v in (*self.body.step_inputs, *(o for e in self.body.eqns
                                                                   for o in e.outputs))
                               if v.batched] + [1])
        # the largest weights of a product: whether a lone group shares its
        # products with the helper (plan.shares)
        self.largest_weights = max([stage.left.shape[-1] * sum(v.shape[-1] for v in stage.outputs)
                                    for stage in (*self.whole, *self.step) if stage.kind == "gemm"]
                                   + [0])

    def prepare(self):
        """Have the loops of the elementwise runs compiled (or loaded), in the
        compile worker where tiered: once per install and dtype."""
        dtypes = {run.dtype for run in self.runs.values() if run is not None}
        for dtype in dtypes | ({self.dtype} if self.why_apart is None else set()):
            _loop(dtype)
        for inner in self.nested.values():
            inner.prepare()

    def __call__(self, args, consts, workers=1):
        from .interpreter import numpy_blas_threads
        from .jit import plan, threads

        env, offsets, rows, out = self._start(args, consts)
        lengths = np.diff(offsets)
        # (a nested net's work: its rows of data, the innermost, by its width)
        work = int(lengths.sum()) * self.work_width + sum(
            self.nested[stage].work_width * env[ir.rnn_parts(stage.eqns[0])[0][0]].data.shape[0]
            for stage in self.first)
        count = max(1, min(workers, lengths.shape[0]))
        # (groups on threads where each runs its steps in one call: a time
        # loop in Python holds the GIL, and two of them take turns on it)
        if count > 1 and (work < threads.SPLIT_MIN_WORK or self.why_apart is not None):
            count = 1
        nested = {}  # (in groups: the hoisted nested rnns' calls, each group running its part)
        if count == 1:
            self._first_over_all(env, workers)
        for stage in self.first if count > 1 else ():
            inner = self.nested[stage]
            call = inner._start([env[v] for v in ir.rnn_parts(stage.eqns[0])[0]], env)
            inner._first_over_all(call[0], 1)
            nested[inner] = call
            env.update(zip(stage.outputs, call[3].arrays))  # (rows each group writes)
        # (the sequences dealt by their data rows, most first, in a snake
        # 0, 1, 1, 0, ...: groups of about as many rows, a nested net's too)
        turn = np.arange(lengths.shape[0]) % (2 * count)
        group = np.minimum(turn, 2 * count - 1 - turn)
        by_rows = np.argsort(-rows, kind="stable")
        groups = [np.sort(by_rows[group == g]) for g in range(count)]
        # (one group shares its products with the helper where a kernel's
        # would: plan.shares, its sequences never cut)
        board = threads.board_for_one_group() if count == 1 and self.why_apart is None and \
            plan.shares(self, int(lengths.sum()), 1, workers) else threads.ALONE
        with numpy_blas_threads(1 if count > 1 else workers):
            threads.run_each(lambda group: self._group(env, offsets, group, out, board, nested),
                             groups)
        return out.results

    def _start(self, args, consts):
        """A call's values (``env``: its constants, the step inputs' rows of
        each token, the products' joined weights), its sequences' offsets,
        their rows of data (of a nested net's innermost sequences) and its
        outputs (:class:`_Outputs`), before any group runs."""
        outer = dict(zip(self.program.inputs, args))
        outer.update({v: consts[v] for v in self.program.consts})
        seq_args = [outer[v] for v in self.seqs]
        offsets = np.asarray(seq_args[0].levels[0], np.int64)
        lengths = np.diff(offsets)
        for v, X in zip(self.seqs[1:], seq_args[1:]):
            if not np.array_equal(np.diff(np.asarray(X.levels[0])), lengths):
                raise StepNetError(f"step inputs {self.seqs[0].name} and {v.name} of {self.name} "
                                   "have different LoD; every step input of one step-net must "
                                   "have the same lengths")
        env = dict(outer)
        # (a static input of no batch dimension is a constant of the call: the
        # constant stages and the products may read it)
        env.update({var: s.value if isinstance(s, ir.Literal) else env[s]
                    for var, s in zip(self.body.static_inputs, self.statics) if not var.batched})
        for stage in self.sched.const:
            for e in stage.eqns:
                _eval(e, env)
        # the step's rows of each token (the caller's order): the step inputs'
        # rows (of more levels: each token's sub-sequences, once a call),
        # and the nested rnns' results over each sub-sequence
        for var, X in zip(self.body.step_inputs, seq_args):
            env[var] = (np.asarray(X.data) if X.num_levels == 1
                        else LoDTensor(X.data, list(X.levels[1:])))
        for stage in self.products:
            (joined_weights if stage.kind == "gemm" else quantized_weights)(stage, env)
        rows = offsets
        for level in seq_args[0].levels[1:]:
            rows = np.asarray(level, np.int64)[rows]
        out = (_RaggedOutputs(self, outer, offsets) if self.ragged_io else
               _Outputs(self.body.outputs, self.all_steps, offsets))
        return env, offsets, np.diff(rows), out

    def _first_over_all(self, env, workers):
        """The hoisted nested rnns over every sub-sequence of the call."""
        for stage in self.first:
            self._nested_stage(stage, workers)(env, None, None)

    def _group(self, shared, offsets, sequences, out, board, nested=None):
        """Run the sequences ``sequences`` (the caller's indices) with the
        call's values ``shared``, writing their rows of the outputs ``out``
        (a run in one call sharing its products with the helper on
        ``board``), the groups of the hoisted nested rnns' calls ``nested``
        (``{executor: its _start}``) first over these sequences'
        sub-sequences, as the kernels' groups run them."""
        from .jit import threads

        env = dict(shared)
        layout = self._layout(offsets, sequences)
        if nested:
            tokens = np.sort(layout.perm)  # (the caller's rows of this group's tokens)
            for inner, (inner_env, inner_offsets, _, inner_out) in nested.items():
                inner._group(inner_env, inner_offsets, tokens, inner_out, threads.ALONE)
        data = {var: shared[var] for var in self.by_steps}
        for var, s in zip(self.body.static_inputs, self.statics):  # (per sequence: sorted)
            value = s.value if isinstance(s, ir.Literal) else shared[s]
            env[var] = (value.select(layout.order) if isinstance(value, LoDTensor)
                        else np.asarray(value)[layout.order] if var.batched else value)
        state = []  # (a ragged memory's: None, its state the call's, out.states)
        for k, (mem, init) in enumerate(zip(self.body.memories, self.inits)):
            value = init.value if isinstance(init, ir.Literal) else shared[init]
            rows = np.broadcast_to(np.asarray(value, mem.pre.dtype),
                                   (offsets.shape[0] - 1,) + tuple(mem.pre.shape[1:]))
            state.append(None if k in self.ragged_memories else np.array(rows[layout.order]))
        last = [None if every or m in self.ragged_memories or v.lod_depth else
                np.array(state[m]) if m >= 0 else
                np.zeros((layout.order.shape[0],) + tuple(v.shape[1:]), v.dtype)
                for v, every, m in zip(self.body.outputs, self.all_steps, self.output_memory)]
        statics = {v: env[v] for v in self.body.static_inputs if v.batched}
        places = {v: (values, False) for v, values in statics.items()}
        places.update({m.pre: (s, False) for m, s in zip(self.body.memories, state)
                       if s is not None})
        # (one call: the step inputs read, and the all-steps outputs written,
        # at the caller's rows)
        steps = Steps.of(self, env, layout, {**places, **{v: (x, BY_CALLER) for v, x in data.items()}},
                          [a if every else None for a, every in zip(out.arrays, self.all_steps)],
                          last, state)
        self.how = "one call" if isinstance(steps, Steps) else f"step by step: {steps}"
        if isinstance(steps, Steps):
            steps.run(layout, board)
            steps.keep(self)
            out.write(layout, [None] * len(last), last)
        else:
            rows = [np.empty((layout.tokens,) + tuple(v.shape[1:]), v.dtype)
                    if every and not v.lod_depth else None
                    for v, every in zip(self.body.outputs, self.all_steps)]
            for var, x in data.items():
                env[var] = x.select(layout.perm) if var.lod_depth else x[layout.perm]
                if not var.lod_depth:
                    places[var] = (env[var], True)
            for stage in self.whole:  # once over every token, by steps
                _stage(stage, env, layout.tokens, {})(env, layout.tokens, 0)
            full = {v: env[v] for v in (*self.by_steps,
                                        *(o for s in self.whole for o in s.outputs))}
            full.update({v: env[v].select(layout.perm) for v in self.deep})
            places.update({v: (values, True) for v, values in full.items() if not v.lod_depth})
            self._by_steps(env, layout, places, full, statics, state, rows, last, out)
            out.write(layout, rows, last)

    def _layout(self, offsets, sequences):
        """The :class:`_Layout` of a group, as an earlier call's where its
        sequences and lengths were the same (a few kept: read only)."""
        key = (offsets.tobytes(), sequences.tobytes())
        layout = self.kept_layouts.get(key)
        if layout is None:
            if len(self.kept_layouts) >= KEPT_SIZES:
                self.kept_layouts.clear()
            layout = self.kept_layouts[key] = _Layout(offsets, sequences, self.reverse)
        return layout

    def _by_steps(self, env, layout, places, full, statics, state, rows, last, out):
        """The time loop in Python, each stage a call at each step (ragged
        outputs recorded, and ragged memories kept, by ``out``: :class:`_RaggedOutputs`)."""
        stages = [self._nested_stage(stage) if stage.kind == "rnn" else
                  _by_ops(stage) if stage in self.ragged else
                  _stage(stage, env, layout.order.shape[0], places, self.runs.get(stage))
                  for stage in self.step]
        posts = [m.post for m in self.body.memories]
        for t in range(layout.num_steps):
            a, lo = int(layout.active[t]), int(layout.starts[t])
            for v, values in full.items():
                env[v] = _sequences(values, lo, a) if v.lod_depth else values[lo:lo + a]
            for v, values in statics.items():
                env[v] = _first(values, a)
            for k, (mem, s) in enumerate(zip(self.body.memories, state)):
                env[mem.pre] = s[:a] if s is not None else out.states[k].read(layout.order[:a])
            for stage in stages:
                stage(env, a, lo)
            for v, every, kept in zip(self.body.outputs, rows, last):
                if every is not None:
                    every[lo:lo + a] = env[v]
                elif kept is not None:  # (not a ragged output, nor a ragged memory's state)
                    kept[:a] = env[v]
            if self.ragged_io:
                out.record(env, layout, lo, a)
            # (a copy where a memory's new value is a memory's state: shifted states)
            new = [np.array(p) if s is not None and any(
                       np.may_share_memory(p, other) for other in state if other is not None)
                   else p for p, s in zip((env[v] for v in posts), state)]
            for k, (s, post) in enumerate(zip(state, new)):
                if s is None:
                    out.states[k].write(layout.order[:a], post)
                else:
                    s[:a] = post

    def _nested_stage(self, stage, workers=1):
        """``run(env, rows, lo)`` of a nested rnn's stage over the sub-sequences
        ``env`` holds: at a step, the step's rows' (a step input's, made by
        ``_by_steps``; a ragged static input's, a value of the step); before
        the time loop, every sub-sequence of the call."""
        inner, seqs = self.nested[stage], ir.rnn_parts(stage.eqns[0])[0]

        def run(env, rows, lo):
            env.update(zip(stage.outputs, inner([env[v] for v in seqs], env, workers)))
        return run


class _Layout:
    """The tokens of a group of sequences by steps: the sequences
    (``sequences``, the caller's indices) sorted by length (longest first,
    ``order``: sorted position -> caller's sequence), step ``t``'s
    ``active[t]`` sequences' rows at ``starts[t]:starts[t] + active[t]``,
    ``perm[i]`` the caller's row of token ``i``."""

    def __init__(self, offsets, sequences, reverse):
        lengths = np.diff(offsets)[sequences]
        by_length = np.argsort(-lengths, kind="stable")
        self.order = sequences[by_length]
        sorted_lengths = lengths[by_length]
        self.num_steps = int(sorted_lengths[0]) if sorted_lengths.shape[0] else 0
        steps = np.arange(self.num_steps)
        # (the sequences longer than each step: the lengths are sorted, longest first)
        self.active = np.searchsorted(-sorted_lengths, -steps, side="left")
        self.starts = (np.cumsum(self.active) - self.active).astype(np.int64)
        self.tokens = int(lengths.sum())
        step = np.repeat(steps, self.active)
        seq = np.arange(self.tokens) - np.repeat(self.starts, self.active)  # (sorted position)
        position = sorted_lengths[seq] - 1 - step if reverse else step
        self.perm = (offsets[:-1][self.order][seq] + position).astype(np.int64)


class _Outputs:
    """A call's outputs, which each group writes its rows of: all-steps
    values at the caller's rows, last-step ones at its sequences."""

    def __init__(self, outputs, all_steps, offsets):
        num_seq, tokens = offsets.shape[0] - 1, int(offsets[-1] - offsets[0])
        self.offsets = offsets
        # (every token's rows an all-steps value's group writes; a sequence of
        # no steps keeps zeros as its last-step values)
        self.arrays = [np.empty((tokens,) + tuple(v.shape[1:]), v.dtype) if every else
                       np.zeros((num_seq,) + tuple(v.shape[1:]), v.dtype)
                       for v, every in zip(outputs, all_steps)]
        self.all_steps = all_steps

    def write(self, layout, rows, last):
        """A group's outputs into the call's: all-steps ones from ``rows``
        (by steps; None: written in place), last-step ones from ``last``."""
        for array, every, kept in zip(self.arrays, rows, last):
            if every is not None:
                array[layout.perm] = every
            elif kept is not None:
                array[layout.order] = kept

    @property
    def results(self):
        # (the offsets a valid input's: nothing to check)
        return [LoDTensor._trusted(array, [self.offsets]) if every else array
                for array, every in zip(self.arrays, self.all_steps)]


class _RaggedOutputs(_Outputs):
    """A call's outputs where one of them is ragged (a nested net's every
    step) or a memory has a ragged static input's rows (a gradient's
    accumulator), the groups running step by step: the dense ones as
    :class:`_Outputs`, each step's ragged values recorded (one gather of
    their rows at the end), those memories' states kept in the caller's
    order (the interpreter's ``_RaggedState``)."""

    def __init__(self, executor, outer, offsets):
        def value(v):
            return v.value if isinstance(v, ir.Literal) else outer[v]

        body = executor.body
        super().__init__(body.outputs, [every and not v.lod_depth for v, every in
                                        zip(body.outputs, executor.all_steps)], offsets)
        self.executor = executor
        self.states = {k: _RaggedState(value(executor.statics[i]), value(executor.inits[k]),
                                       body.memories[k].pre.dtype)
                       for k, i in executor.ragged_memories.items()}
        self.steps = {i: [] for i, v in enumerate(body.outputs) if v.lod_depth}

    def record(self, env, layout, lo, rows):
        """Record a step's ragged outputs: its ``rows`` sequences', from token ``lo``."""
        for i, kept in self.steps.items():
            kept.append((layout.perm[lo:lo + rows], env[self.executor.body.outputs[i]]))

    @property
    def results(self):
        found, ex = super().results, self.executor
        for i, v in enumerate(ex.body.outputs):
            if not ex.all_steps[i] and ex.output_memory[i] in self.states:
                found[i] = self.states[ex.output_memory[i]].value()
            elif i in self.steps:
                found[i] = self._ragged(self.steps[i], v, ex.all_steps[i])
        return found

    def _ragged(self, steps, var, every):
        """A ragged output from its steps' values: every token's (its rows
        under the call's LoD), or each sequence's last step's."""
        lengths = np.diff(self.offsets)
        piece = np.zeros(int(lengths.sum()), np.int64)  # (each token's rows)
        for entries, value in steps:
            piece[entries] = np.diff(value.levels[0])
        starts = np.concatenate([[0], np.cumsum(piece)])
        like = np.asarray(steps[0][1].data) if steps else np.empty((0,) + tuple(var.shape[1:]),
                                                                     var.dtype)
        data = np.empty((int(starts[-1]),) + like.shape[1:], like.dtype)  # (the values' own)
        for entries, value in steps:
            offsets = np.asarray(value.levels[0])
            data[_rows(starts[entries], piece[entries])] = value.data[
                _rows(offsets[:-1], piece[entries])]
        if every:
            return LoDTensor(data, [np.concatenate([[0], np.cumsum(lengths)]), starts])
        # (each sequence's last step: its last token, or its first where reversed)
        last = (self.offsets[:-1] if self.executor.reverse else self.offsets[1:] - 1)[lengths > 0]
        sizes = np.zeros(lengths.shape[0], np.int64)
        sizes[lengths > 0] = piece[last]
        return LoDTensor(data[_rows(starts[last], piece[last])],
                         [np.concatenate([[0], np.cumsum(sizes)])])


def _rows(starts, lengths):
    """The rows of pieces ``lengths`` long from ``starts``, one after another."""
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())


def _eval(e, env):
    env[e.outputs[0]] = apply(e, [v.value if isinstance(v, ir.Literal) else env[v] for v in e.inputs])


def _by_ops(stage):
    """``run(env, rows, lo)`` of a stage op by op on NumPy."""
    def run(env, rows, lo):
        for e in stage.eqns:
            _eval(e, env)
    return run


def _sequences(value, first, count):
    """Sequences ``first`` to ``first + count`` of a ragged value: a view of their rows."""
    offsets = np.asarray(value.levels[0])
    return LoDTensor(value.data[offsets[first]:offsets[first + count]],
                     [offsets[first:first + count + 1] - offsets[first]])


def _first(value, count):
    """The first ``count`` sequences' rows of a per-sequence value (a ragged
    one's: a view of its rows)."""
    return _sequences(value, 0, count) if isinstance(value, LoDTensor) else value[:count]


def _stage(stage, env, max_rows, places, run=None):
    """``stage(env, rows)`` running one stage in a group (``env`` holding the
    call's constants), its results' buffers made once: a GEMM as one product
    (a merged one's weights joined), an elementwise run as its loop (``run``,
    a :class:`Run`, where there is one and it is compiled), any other op by
    op on NumPy. ``places``: where the group keeps a step's values
    (:meth:`Run.start`), with this stage's buffers added."""
    if stage.kind == "gemm":
        joined = joined_weights(stage, env)
        return _product(stage, max_rows, places, np.result_type(joined, stage.left.dtype),
                        lambda a, out: np.matmul(a, joined, out=out))
    if stage.kind == "quantized":
        from .jit import quantized

        rows = quantized.ROUTINES[stage.eqns[0].op][1]
        prepared = quantized_weights(stage, env)  # (once a call, as the loop reads them)
        return _product(stage, max_rows, places, np.float32,
                        lambda a, out: rows(np.ascontiguousarray(a), prepared, out))
    loop = run.start(env, max_rows, places) if run is not None else None

    def op_by_op(env, rows, first):
        if loop is None or not loop(env, rows, first):
            for e in stage.eqns:
                _eval(e, env)
    return op_by_op


def _product(stage, max_rows, places, dtype, product):
    """A product stage (a GEMM, a quantized product; merged ones' results
    column blocks of one buffer) as ``_stage`` gives it: ``product(a, out)``
    computes the step's rows of the left operand into ``out``."""
    buffer = np.empty((max_rows, sum(v.shape[-1] for v in stage.outputs)), dtype)
    parts = column_blocks(stage, buffer, False, places)
    left = stage.left

    def run(env, rows, first):
        product(env[left], buffer[:rows])
        for v, block in parts:
            env[v] = block[:rows]
    return run
