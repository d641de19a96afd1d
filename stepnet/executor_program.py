"""The schedule executor's programs (:mod:`stepnet.executor`): an
elementwise run of a step as a bytecode of its ops (:class:`Run`), and a
group's whole time loop as instructions of the compiled loop
(:class:`Steps`, ``executor_loop.steps_loop``) over one table of addresses:
each operand's and result's address, row stride, whether a row holds the
run's width of values (else one, broadcast), and how a step moves its
first row."""

from __future__ import annotations

import numpy as np

from . import executor_loop, ir
from .executor_loop import LOOP_OPS, registers_of

# the rows a hoisted stage computes at a time (by chunks of steps), as the
# kernels' chunks: its results are read back from the cache
CHUNK_ROWS = 128


# the loops kept for groups of one number of sequences (a call's groups are
# about as many sequences each: one each, Steps.keep), and the numbers of
# sequences kept at once (a new one beyond them forgets the others: calls of
# ever new batch sizes keep no more than this many loops' buffers)
KEPT_STEPS, KEPT_SIZES = 4, 8


def joined_weights(stage, env):
    """A (merged) GEMM stage's weights joined by columns, contiguous: once a
    call, kept in the call's ``env`` under the stage (each group's reads it)."""
    joined = env.get(stage)
    if joined is None:
        weights = [env[e.inputs[1]] for e in stage.eqns]
        joined = env[stage] = np.ascontiguousarray(
            weights[0] if len(weights) == 1 else np.concatenate(weights, axis=1))
    return joined


def quantized_weights(stage, env):
    """A quantized product stage's weights as its routine reads them
    (``quantized.prepared``), made once a call and kept in the call's
    ``env`` under ``(stage, 0)`` (``matmul_int8``'s packed weights,
    ``matmul_bf16``'s) and ``(stage, 1)`` (int8's scales): arrays of the
    call, where a kept loop's table is pointed again."""
    from .jit import quantized

    int8 = stage.eqns[0].op == "matmul_int8"
    if (stage, 0) not in env:
        operands = [[env[e.inputs[i]] for e in stage.eqns]
                    for i in range(1, len(stage.eqns[0].inputs))]
        prepared = quantized.prepared(stage.eqns[0].op, operands)
        env.update(((stage, i), x) for i, x in enumerate(prepared if int8 else (prepared,)))
    return (env[stage, 0], env[stage, 1]) if int8 else env[stage, 0]


def column_blocks(stage, buffer, by_steps, places):
    """A product stage's results as column blocks of ``buffer``, added to
    ``places``: ``[(var, block)]``."""
    cuts = np.cumsum([0] + [v.shape[-1] for v in stage.outputs])
    parts = [(v, buffer[:, lo:hi]) for v, lo, hi in zip(stage.outputs, cuts[:-1], cuts[1:])]
    places.update({v: (block, by_steps) for v, block in parts})
    return parts


class Run:
    """An elementwise run of a step as one loop over its rows: a group's
    ``start`` gives ``step(env, rows, lo) -> bool``, which computes the
    run's stored values into ``env``; False (nothing computed) where an
    operand is not laid out as the loop reads (the stage then runs op by op
    on NumPy); no ``step`` while the loop is not compiled.

    The bytecode (``code``, a row per instruction: opcode, register,
    operands) loads each operand's rows into a register (or its one value,
    a broadcast; rows one after another, or one row, are read where they
    are instead), computes each op register to register, and stores the
    values read after the run; a register holds a tile of the run's rows
    (:func:`executor_loop.registers_of`), each op one loop over it."""

    def __init__(self, stage, dtype, width, operands, code, stored, registers):
        self.stage, self.dtype, self.width = stage, dtype, width
        self.operands, self.code, self.stored = operands, code, stored
        self.registers = registers  # (how many)

    @classmethod
    def of(cls, stage, stored):
        """The run's loop, storing ``stored`` (the values read outside it),
        or None where an op is not one the loop computes or the values are
        not one float dtype of rows ``[B]`` or ``[B, W]``."""
        shape = stage.eqns[0].outputs[0].shape
        dtype = np.dtype(stage.eqns[0].outputs[0].dtype)
        if dtype not in (np.float32, np.float64) or len(shape) not in (1, 2) or None in shape[1:]:
            return None
        width = shape[1] if len(shape) == 2 else 1
        operands, code, register = [], [], {}
        for e in stage.eqns:
            if e.op not in LOOP_OPS or e.attrs or np.dtype(e.outputs[0].dtype) != dtype:
                return None
            sources = []
            for v in e.inputs:
                if v not in register:  # an operand from outside the run: loaded
                    if isinstance(v, ir.Var) and np.dtype(v.dtype) != dtype:
                        return None
                    register[v] = len(register)
                    code.append((0, register[v], len(operands), 0, 0))
                    operands.append(v)
                sources.append(register[v])
            out = e.outputs[0]
            register[out] = len(register)
            code.append((2 + LOOP_OPS.index(e.op), register[out], *sources,
                         *([0] * (3 - len(sources)))))
        stored = [v for e in stage.eqns for v in e.outputs if v in stored]
        code += [(1, register[v], len(operands) + k, 0, 0) for k, v in enumerate(stored)]
        return cls(stage, dtype, width, operands, np.array(code, np.int64), stored, len(register))

    def table(self, env, num_seq, places, by_steps=False):
        """The run's rows of the loop's table (each operand's, then each
        stored value's: ``[address, row stride in bytes, 1 where a row holds
        width values else 0 (one, broadcast), the stride by which a step's
        first token moves its first row]``), the operands NumPy makes anew
        at each step (``batched``: their rows are set at each step), the
        call's constants the table points into (kept alive by the caller)
        and the stored values' buffers, made here and added to ``places``
        (``{var: (array, by_steps)}``, where the group keeps a step's values:
        its rows of ``array`` are the first, or with ``by_steps`` those from
        the step's first token; the stored values' too where ``by_steps``:
        a hoisted run's). None where a constant cannot be read so."""
        table = np.zeros((len(self.operands) + len(self.stored), 4), np.int64)
        kept, batched = [], []
        for k, v in enumerate(self.operands):
            row = _row(v, env, places, self.width, self.dtype, kept)
            if row is None and not (isinstance(v, ir.Var) and v.batched):
                return None
            if row is None:
                batched.append((k, v))
            else:
                table[k] = row
        outs = [np.empty((num_seq,) + tuple(v.shape[1:]), self.dtype) for v in self.stored]
        for k, (v, y) in enumerate(zip(self.stored, outs), len(self.operands)):
            table[k] = _buffer_row(y, by_steps)
            places[v] = (y, by_steps)
        return table, batched, kept, outs

    def start(self, env, num_seq, places):
        """``step(env, rows, lo) -> bool`` for one group of a call whose
        constants are in ``env`` (:meth:`table`), or None while the loop is
        not compiled: the loop run for the one run at one step."""
        entry = executor_loop.entry_point(self.dtype)
        made = self.table(env, num_seq, places) if entry is not None else None
        if made is None:
            return None
        table, batched, kept, outs = made
        width, itemsize = self.width, self.dtype.itemsize
        prog = np.array([[0, 0, len(self.code), width, 0, 0, 0, 0, 0, 0]], np.int64)
        active, starts = np.zeros(1, np.int64), np.zeros(1, np.int64)
        registers, scratch = registers_of(self.registers, width, self.dtype), np.empty(0, self.dtype)
        code = self.code
        from .jit.threads import ALONE

        def step(env, rows, lo):
            for k, v in batched:
                x = env[v]
                at = _layout(x, rows, width, itemsize) if type(x) is np.ndarray \
                    and x.dtype == self.dtype else None
                if at is None:
                    return False
                table[k, 0] = x.__array_interface__["data"][0]
                table[k, 1], table[k, 2] = at
            active[0], starts[0] = rows, lo
            entry(prog, code, table, active, starts, registers, scratch, ALONE, _LIBRARY_ONLY,
                  _NO_PERM)
            for v, y in zip(self.stored, outs):
                env[v] = y[:rows]
            return True
        step.kept = kept  # (the constants whose addresses the table holds)
        return step


class Steps:
    """A group's whole time loop as one call of the compiled loop: each
    stage of a step an instruction of a program over one table of addresses
    (:meth:`Run.table`'s rows): an elementwise run as its bytecode, a GEMM
    as the kernels' per-step product, a concat by columns, the outputs'
    rows and the memories' new values as copies (runs of a load and a
    store). ``of`` gives it, or why the group runs step by step."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.prog, self.code, self.table, self.kept = [], [], [], []
        self.registers, self.width, self.scratch = 1, 1, 0
        self.ahead = 0  # (the scratch rows' values of a chunk's product computed ahead)
        self.arrays = self.points = None  # (the loop's arguments; where it points: of)

    @staticmethod
    def why_not(executor):
        """Why no group of ``executor``'s calls runs as one call (a
        sentence), or None: what the loop does not compute."""
        if executor.ragged:
            return "a value of its step is ragged"
        if executor.dtype not in (np.float32, np.float64):
            return "its step's values are not of one float dtype"
        for stage in (*executor.whole, *executor.step):
            if not (stage.kind == "gemm" or executor.runs.get(stage) is not None
                    or stage.kind == "quantized" and executor.dtype == np.float32
                    or stage in executor.step and all(concat_columns(e) for e in stage.eqns)):
                ops = ", ".join(sorted({e.op for e in stage.eqns}))
                return f"it has a {stage.kind} stage the loop does not run ({ops})"
        return None

    @classmethod
    def of(cls, executor, env, layout, places, rows, last, state):
        """The loop of one group (its ``layout``, ``places`` as
        :meth:`Run.table`'s; the call's all-steps outputs ``rows``, written
        at the caller's rows, the group's last-step ones ``last``, the
        memories' ``state``), or why it runs step by step (a sentence).

        A group of as many sequences as an earlier one's, whose arrays are
        laid out as that one's were, runs that group's loop again (kept by
        ``executor.kept_steps`` between calls: :meth:`keep`), its table
        pointed at this call's arrays (:meth:`_again`): a call's Python
        work is then a few lookups, not the loop's build."""
        if executor.why_apart is not None:
            return executor.why_apart
        num_seq = layout.order.shape[0]
        try:  # (one group's at a time: groups of as many sequences at once take one each)
            again = executor.kept_steps.get(num_seq, []).pop()
        except IndexError:
            again = None
        if again is not None and again._again(env, places, rows, last, state):
            return again
        self = cls(executor.dtype)
        if executor_loop.entry_point(self.dtype) is None:
            return "the executor's loop is not compiled yet"
        if layout.num_steps == 0:
            return self  # (nothing to run)
        arrays = _arrays(env, places, rows, last, state)  # (before the build adds its own)
        why = self._build(executor, env, num_seq, places, rows, last, state)
        if why is None:
            self.arrays = [np.array(self.prog, np.int64).reshape(-1, 10),
                           np.array(self.code, np.int64).reshape(-1, 5),
                           np.array(self.table, np.int64).reshape(-1, 4),
                           registers_of(self.registers, self.width, self.dtype),
                           np.empty(max(self.scratch + self.ahead, 1), self.dtype)]
            self.points = self._points(arrays)
            self.num_seq = num_seq
        return why or self

    def keep(self, executor):
        """Keep this loop for the executor's next group of as many sequences
        (where its table's every address is a call's array or its own)."""
        if self.points is not None:
            if self.num_seq not in executor.kept_steps and len(executor.kept_steps) >= KEPT_SIZES:
                executor.kept_steps.clear()
            kept = executor.kept_steps.setdefault(self.num_seq, [])
            if len(kept) < KEPT_STEPS:
                kept.append(self)

    def _again(self, env, places, rows, last, state):
        """Point the table at a new call's arrays (``of``'s), the rows that
        pointed into an array at the same offsets into the new one: False
        (nothing changed) where one is missing or laid out otherwise."""
        keys, where, which, offsets = self.points
        addresses = []
        for key, layout in keys:
            x = _array(key, env, places, rows, last, state)
            if type(x) is not np.ndarray or (x.shape, x.strides, x.dtype) != layout:
                return False
            addresses.append(x.ctypes.data)
        self.arrays[2][where, 0] = np.array(addresses, np.int64)[which] + offsets
        return True

    def _points(self, arrays):
        """Where the table points into the call's ``arrays`` (by key: the
        ``_arrays``): ``([(key, (shape, strides, dtype))], the table's rows
        pointing into one, which one, their offsets from its address)``;
        None where the table reads a value of the call copied (``_row`` keeps
        such a copy in a list: a later call's values would not be read), or
        a value two of the call's arrays share (views of one buffer: a later
        call's may lie apart). Every other address is the loop's own (its
        buffers, a literal's values)."""
        if any(type(x) is list for x in self.kept):
            return None
        calls = {}  # (each array once, under its first key)
        for key, x in arrays.items():
            if type(x) is np.ndarray and x.size:
                calls.setdefault(id(x), (key, x))
        calls = list(calls.values())
        bases = np.array([x.ctypes.data for _, x in calls], np.int64)
        spans = np.array([_span(x, base) for (_, x), base in zip(calls, bases.tolist())],
                         np.int64).reshape(-1, 2)
        addresses = self.arrays[2][:, 0]
        inside = (spans[:, 0] <= addresses[:, None]) & (addresses[:, None] < spans[:, 1])
        count = inside.sum(axis=1)
        if np.any(count > 1):
            return None
        where = np.flatnonzero(count)
        used, which = np.unique(inside[where].argmax(axis=1), return_inverse=True)
        keys = [(calls[i][0], (calls[i][1].shape, calls[i][1].strides, calls[i][1].dtype))
                for i in used.tolist()]
        return keys, where, which.astype(np.int64), addresses[where] - bases[used][which]

    def _build(self, executor, env, num_seq, places, rows, last, state):
        """The instructions and table of ``of``'s loop: None, or why the
        group runs step by step."""
        # the hoisted stages by chunks of steps of about CHUNK_ROWS rows, each
        # just before the steps that read it, into buffers of two chunks' rows
        # (read back from the cache, and no call's every token's written out;
        # one half the helper's where it computes the next chunk's product)
        chunk = max(1, CHUNK_ROWS // max(num_seq, 1))
        for stage in executor.whole:
            if not self._stage(stage, executor.runs.get(stage), env, chunk * num_seq, places,
                               chunk):
                return f"a value its hoisted {stage.kind} stage reads is not laid out as the loop reads"
        for stage in executor.step:
            if not self._stage(stage, executor.runs.get(stage), env, num_seq, places):
                return f"a value its {stage.kind} stage reads is not laid out as the loop reads"
        memories = executor.body.memories
        copies = [(v, kept, False) if every is None else (v, every, BY_CALLER)
                  for v, every, kept in zip(executor.body.outputs, rows, last)]
        posts = []
        for mem, s in zip(memories, state):  # (shifted states: through a copy)
            place = places.get(mem.post)
            if place is not None and any(np.may_share_memory(place[0], x) for x in state):
                aside = np.empty_like(s)
                self.kept.append(aside)
                copies.append((mem.post, aside, False))
                posts.append((_buffer_row(aside, False), s))
            else:
                posts.append((mem.post, s))
        copies += [(v, s, False) for v, s in posts]
        first = len(self.prog)
        for v, to, by_steps in copies:
            source = v if isinstance(v, list) else _row(v, env, places, _width(to), self.dtype,
                                                        self.kept)
            if not self._copy(source, to, by_steps):
                return f"{getattr(v, 'name', 'a value')} is not laid out as the loop reads"
        self._stores_for_copies(first, state)
        return None

    def _stores_for_copies(self, first, state):
        """The copies (the instructions from ``first``) of rows that the
        step's last run stores made stores of that run instead (its
        register stored where the copy would put it), and a store of the
        run then read by nothing dropped: no rows written to a buffer and
        read back. Not into a memory's state where a copy reads a state
        (a shifted state's aside, an output of a memory's pre): the run
        would have written it first."""
        run = first - 1
        if run < 0 or self.prog[run][0] != 0 or self.prog[run][6] != 0:
            return
        a, b, width = self.prog[run][1:4]
        stores = {tuple(self.table[x]): r for op, r, x, _, _ in self.code[a:b] if op == 1}
        spans = [_span(s, s.ctypes.data) for s in state if s.size]
        copies = [(p, self.code[p[1]][2], self.code[p[1] + 1][2]) for p in self.prog[first:]]

        def in_state(row):
            return any(lo <= self.table[row][0] < hi for lo, hi in spans)
        states_read = any(in_state(source) for _, source, _ in copies)
        left, added = [], []
        for p, source, to in copies:
            register = stores.get(tuple(self.table[source]))
            if register is None or p[3] != width or states_read and in_state(to):
                left.append((p, source, to))
            else:
                added.append((1, register, to, 0, 0))
        # (the rows the instructions before the run and the copies left read: a
        # store of the run nothing reads is dropped)
        read = {tuple(self.table[x]) for p in self.prog[:run] if p[0] == 0
                for op, _, x, _, _ in self.code[p[1]:p[2]] if op == 0}
        read |= {tuple(self.table[p[1]]) for p in self.prog[:run] if p[0] == 1}
        read |= {tuple(self.table[source]) for _, source, _ in left}
        code = [c for c in self.code[a:b] if c[0] != 1 or tuple(self.table[c[2]]) in read] + added
        self.code[a:] = code
        self.prog[run:] = [(0, a, a + len(code), *self.prog[run][3:])]
        for p, source, to in left:  # (the copies left, after the run)
            self.code += [(0, 0, source, 0, 0), (1, 0, to, 0, 0)]
            self.prog.append((0, len(self.code) - 2, len(self.code), *p[3:]))

    def run(self, layout, board):
        """Run the group's every step (``layout``'s) in one call, its
        products shared with the helper on ``board``."""
        if self.arrays is None:  # (no step)
            return
        prog, code, table, registers, scratch = self.arrays
        entry = executor_loop.entry_point(self.dtype)
        entry(prog, code, table, np.ascontiguousarray(layout.active, np.int64), layout.starts,
              registers, scratch, board, _small_rows(self.dtype), layout.perm)

    def _run(self, code, table, width, registers, chunk=0, rows=0):
        """Add a run: its bytecode reading the table's rows ``table`` (at
        every step, or with ``chunk`` over its steps' rows every ``chunk``
        steps, its buffers' halves of ``rows`` rows)."""
        base, first = len(self.table), len(self.code)
        self.table += [list(row) for row in table]
        self.code += [(op, r, x + base if op < 2 else x, y, z) for op, r, x, y, z in code]
        self.prog.append((0, first, len(self.code), width, 0, 0, chunk, rows, 0, 0))
        self.registers, self.width = max(self.registers, registers), max(self.width, width)

    def _stage(self, stage, run, env, num_rows, places, chunk=0):
        """Add a stage's instructions, its results' buffers (``num_rows``
        rows) to ``places``: a step's stage, or with ``chunk`` a hoisted one
        over at most ``num_rows`` rows every ``chunk`` steps (its results
        ``BY_CHUNK``, in buffers of two halves: the chunk's, and the next
        one's, which the helper may be computing). False where a value it
        reads is not laid out as the loop reads."""
        itemsize, by_steps = self.dtype.itemsize, BY_CHUNK if chunk > 0 else False
        halves = 2 if chunk > 0 else 1
        if run is not None:
            made = run.table(env, halves * num_rows, places, by_steps)
            if made is None or made[1]:
                return False
            self.kept += [*made[2], *made[3]]
            self._run(run.code.tolist(), made[0], run.width, run.registers, chunk,
                      num_rows if chunk > 0 else 0)
            return True
        if stage.kind in ("gemm", "quantized"):
            weights = self._weights(stage, env)
            if weights is None:
                return False
            k, n, rows_of_weights, arrays = weights
            left = _row(stage.left, env, places, k, self.dtype, self.kept)
            if left is None or not left[1] or not left[2]:
                return False
            apart = left[3] == executor_loop.BY_CALLER or left[1] != k * itemsize
            if apart:  # (rows at the caller's, or apart: copied together first)
                self.scratch = max(self.scratch, num_rows * k)
            # (the first hoisted product whose rows are there before the chunk's
            # runs: computed a chunk ahead, where the helper is free)
            ahead = chunk > 0 and left[3] != executor_loop.BY_CHUNK and stage.kind == "gemm" \
                and not any(row[9] for row in self.prog)
            self.ahead = num_rows * k if ahead and apart else self.ahead
            buffer = np.empty((halves * num_rows, n), self.dtype)
            column_blocks(stage, buffer, by_steps, places)
            self.kept += [*arrays, buffer]
            kind = 1 if stage.kind == "gemm" else 2 if stage.eqns[0].op == "matmul_int8" else 3
            base = len(self.table)
            self.table += [left, *rows_of_weights, _buffer_row(buffer, by_steps)]
            self.prog.append((kind, base, base + 1, base + 1 + len(rows_of_weights), k, n, chunk,
                              num_rows, sum(row[0] == kind for row in self.prog), int(ahead)))
            return True
        for e in stage.eqns:  # concats by columns (why_not)
            out = e.outputs[0]
            y = np.empty((num_rows, out.shape[1]), self.dtype)
            self.kept.append(y)
            at = 0
            for v in e.inputs:
                to = y[:, at:at + v.shape[1]]
                if not self._copy(_row(v, env, places, _width(to), self.dtype, self.kept), to,
                                  False):
                    return False
                at += v.shape[1]
            places[out] = (y, False)
        return True

    def _weights(self, stage, env):
        """A product stage's weights: ``(k, n, their table rows, the arrays
        they point into)``, or None where the loop cannot read them (a
        GEMM's of another dtype). A GEMM's joined weights, one row; a
        quantized product's prepared weights (``quantized_weights``), a row
        of their address and shape, then an int8 product's scales' address."""
        if stage.kind == "gemm":
            joined = joined_weights(stage, env)
            if joined.dtype != self.dtype:
                return None
            return (*joined.shape, [[joined.ctypes.data, 0, 1, 0]], [joined])
        prepared = [env[stage, 0]] + ([env[stage, 1]] if (stage, 1) in env else [])
        rows = [[prepared[0].ctypes.data, *prepared[0].shape, *[0] * (3 - prepared[0].ndim)]]
        rows += [[x.ctypes.data, 0, 1, 0] for x in prepared[1:]]
        return (stage.left.shape[-1], sum(v.shape[-1] for v in stage.outputs), rows, prepared)

    def _copy(self, source, to, by_steps):
        """Add a copy of a step's rows read by the table row ``source`` into
        ``to`` (rows of a buffer, from the step's first token where
        ``by_steps``); False where either is not laid out for the loop."""
        if to.size == 0:  # (nothing to copy: a value of no columns)
            return True
        if source is None or to.dtype != self.dtype or to.ndim > 2 \
                or to.ndim == 2 and to.strides[1] != to.itemsize:
            return False
        self._run([(0, 0, 0, 0, 0), (1, 0, 1, 0, 0)], [source, _buffer_row(to, by_steps)],
                  _width(to), 1)
        return True


def _arrays(env, places, rows, last, state):
    """The arrays of a group's call the loop's table may point into, by key
    (:func:`_array`'s)."""
    found = {("place", v): x for v, (x, _) in places.items()}
    found.update((("env", k), x) for k, x in env.items())
    found.update((("rows", i), x) for i, x in enumerate(rows))
    found.update((("last", i), x) for i, x in enumerate(last))
    found.update((("state", i), x) for i, x in enumerate(state))
    return found


def _array(key, env, places, rows, last, state):
    """The array of ``key`` (``_arrays``') in a group's call, or None."""
    kind, k = key
    if kind == "place":
        return places.get(k, (None,))[0]
    if kind == "env":
        return env.get(k)
    return {"rows": rows, "last": last, "state": state}[kind][k]


def _span(x, address):
    """The addresses ``[lo, hi)`` of the values of an array at ``address``."""
    lo = hi = address
    for n, stride in zip(x.shape, x.strides):
        lo, hi = lo + min(0, (n - 1) * stride), hi + max(0, (n - 1) * stride)
    return lo, hi + x.itemsize


def _small_rows(dtype):
    """The kernels' ``small_rows`` (``blas.pack``'s: up to how many rows a
    product of ``dtype`` runs stepnet's own loop) where measured or kept,
    else a table giving every product to the library (never measured here:
    the compile worker measures them after its first kernel)."""
    from .jit import product_timing

    table = product_timing.small_rows_table(measure=False, float64=dtype == np.float64)
    return _LIBRARY_ONLY if table is None else np.array(table)


_LIBRARY_ONLY = np.array([[1 << 62], [0], [0]], np.int64)  # (small_rows: no own loop)
_NO_PERM = np.zeros(0, np.int64)  # (the Python loop's runs read no row at the caller's)


def _width(array):
    return int(np.prod(array.shape[1:], dtype=np.int64))


def _buffer_row(array, by_steps):
    """The table row of a buffer's rows (of contiguous values)."""
    stride = array.strides[0]
    return [array.ctypes.data, stride, 1, _first_row_stride(stride, by_steps)]


# where a group keeps a value (``places``' second item): its rows from its
# first (False), from the step's first token (True), at the caller's rows
# of each token (BY_CALLER: the group's ``layout.perm``), or in a buffer of
# two chunks' rows from the chunk's first token, in the half of the chunk's
# parity (BY_CHUNK: a hoisted stage's results in the loop)
BY_CALLER = "the caller's rows"
BY_CHUNK = "the chunk's rows"


def _first_row_stride(stride, by_steps):
    """The table's last column: the stride by which the step's first token
    moves a value's first row, or the loop's mark of rows placed otherwise
    (``executor_loop.BY_CALLER``, ``BY_CHUNK``)."""
    if by_steps is BY_CALLER or by_steps is BY_CHUNK:
        return executor_loop.BY_CALLER if by_steps is BY_CALLER else executor_loop.BY_CHUNK
    return stride if by_steps else 0


def concat_columns(e):
    """Whether ``e`` is a concat of 2-D batched values by columns."""
    return (e.op == "concat" and len(e.outputs[0].shape) == 2 and e.attrs.get("axis") in (1, -1)
            and all(isinstance(v, ir.Var) and v.batched and len(v.shape) == 2 for v in e.inputs))


def _row(v, env, places, width, dtype, kept):
    """The loop's table row reading ``v`` in rows of ``width`` values (see
    :meth:`Run.table`): where the group keeps it (``places``) or, a value
    of the call, once (kept alive in ``kept``); None where the loop cannot
    read it so."""
    itemsize = dtype.itemsize
    if isinstance(v, ir.Var) and v.batched:
        x, by_steps = places.get(v, (None, False))
        if type(x) is np.ndarray and x.dtype == dtype and x.size == 0:
            return [x.ctypes.data, 0, 1, 0]  # (a value of no columns: nothing read)
        at = (_layout(x, x.shape[0], width, itemsize)
              if type(x) is np.ndarray and x.dtype == dtype and x.ndim else None)
        return None if at is None else [x.ctypes.data, at[0], at[1],
                                        _first_row_stride(at[0], by_steps)]
    value = v.value if isinstance(v, ir.Literal) else env[v]
    x = np.ascontiguousarray(value, dtype)
    at = _layout(x, 1, width, itemsize)
    if at is None:
        return None
    # (a value of the call copied: kept in a list, not as an array of the
    # loop's own, which Steps would point a later call at)
    kept.append(x if x is value or isinstance(v, ir.Literal) else [x])
    return [x.ctypes.data, 0, at[1], 0]


def _layout(x, rows, width, itemsize):
    """``(row stride in bytes, 1 where a row holds ``width`` values else 0)``
    of an operand ``x`` of a run over ``rows`` rows of ``width``, or None
    where the loop cannot read it so."""
    shape, strides = x.shape, x.strides
    if x.ndim == 0:
        return 0, 0
    unit = shape[-1] == width and (width == 1 or strides[-1] == itemsize)
    # (rows of its own first: a value of one row is read as rows, which a
    # product's left operand needs, not as a broadcast)
    if x.ndim == 2 and shape[0] == rows and unit:
        return strides[0], 1
    if x.ndim == 2 and shape == (rows, 1):
        return strides[0], 0
    if shape in ((1,), (1, 1)):
        return 0, 0
    if (x.ndim == 1 or shape[0] == 1) and unit:
        return 0, 1
    if x.ndim == 1 and width == 1 and shape[0] == rows:
        return strides[0], 0
    return None
