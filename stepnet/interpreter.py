"""The reference executor: plain NumPy, one step-scope per time step.

This is the specification every other backend is tested against. Sequences
are sorted by length (longest first, stable), so the active batch at step t is
a prefix that shrinks as sequences end (Paddle's DynamicRNN); results go back
to the caller's order.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading

import numpy as np

from . import ir, registry
from .errors import LoDError, StepNetError
from .lod import LoDTensor


def eval_eqn(eqn, env, consts, scopes=None):
    """Run one equation; ``env`` and ``consts`` map id(Var) to arrays (or
    LoDTensors)."""
    args = [
        (env[id(v)] if id(v) in env else consts[id(v)]) if isinstance(v, ir.Var) else v.value
        for v in eqn.inputs
    ]
    results = run_rnn(eqn, args, consts, scopes) if eqn.op == "rnn" else [apply(eqn, args)]
    for var, value in zip(eqn.outputs, results):
        env[id(var)] = value


def apply(eqn, args):
    """One op (not an rnn) on its operands' values: its NumPy rule, or where
    an operand is ragged and the op does not take LoDTensors, on their rows
    (:func:`on_rows`)."""
    if any(isinstance(a, LoDTensor) for a in args) and not registry.get(eqn.op).takes_lod:
        return on_rows(eqn, args)
    return registry.get(eqn.op).numpy(*args, **eqn.attrs)


def on_rows(eqn, args):
    """An op with ragged operands (one-level LoDTensors of one LoD): on their
    rows, each batched dense operand repeated over its batch row's rows."""
    ragged = [a for a in args if isinstance(a, LoDTensor)]
    level = ragged[0].levels[0]
    offsets = np.asarray(level)
    for a in ragged[1:]:
        if a.levels[0] is not level and not np.array_equal(np.diff(a.levels[0]), np.diff(offsets)):
            raise LoDError(
                f"{eqn.op} computing {eqn.outputs[0].name}: its ragged operands have different "
                "LoD (static inputs of one step-net combined row by row must have the same lengths)"
            )
    counts = np.diff(offsets)
    rows = []
    for v, a in zip(eqn.inputs, args):
        if isinstance(a, LoDTensor):
            rows.append(np.asarray(a.data)[offsets[0]:offsets[-1]])
        elif isinstance(v, ir.Var) and v.batched:
            rows.append(np.repeat(a, counts, axis=0))
        else:
            rows.append(a)
    out = registry.get(eqn.op).numpy(*rows, **eqn.attrs)
    if offsets[0] == 0 and np.shape(out)[:1] == (offsets[-1],):  # (the operands' LoD: no checks)
        return LoDTensor._trusted(np.asarray(out), [level])
    return LoDTensor(out, [offsets - offsets[0]])


def _take_rows(value, rows):
    """Rows (or top-level sequences) ``rows`` of a per-sequence value."""
    if isinstance(value, LoDTensor):
        return value.select(rows)
    return value[rows]


def _empty_piece(var, num):
    """A ragged value of ``num`` sequences, all empty, shaped like ``var``."""
    levels = [[0] * (num + 1)] + [[0]] * (var.lod_depth - 1)
    return LoDTensor(np.zeros((0,) + var.shape[1:], var.dtype), levels)


def _prepend_level(value: LoDTensor, counts) -> LoDTensor:
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return LoDTensor(value.data, [offsets] + list(value.levels))


def run_rnn(eqn, args, consts, scopes=None):
    """Run an ``rnn`` equation over its sequences (the reference loop).

    ``args`` holds, per operand: a LoDTensor for each sequence input (one top
    sequence per sequence of this rnn), an array or LoDTensor with one row per
    sequence for each static input, and for each memory init an array with one
    row per sequence, a broadcastable array, or a scalar. Returns one value per
    output: a LoDTensor of all steps, or one row per sequence for last steps.
    """
    body = eqn.attrs["body"]
    reverse = eqn.attrs["reverse"]
    seq_args, static_args, init_args = ir.rnn_parts(ir.Eqn("", tuple(args), (), eqn.attrs))
    lengths = _sequence_lengths(eqn, seq_args)
    num_seq = len(lengths)
    order = np.argsort(-lengths, kind="stable")  # sorted position -> caller's sequence
    sorted_lengths = lengths[order]
    starts = seq_args[0].levels[0][:-1][order]
    num_steps = int(sorted_lengths[0]) if num_seq else 0

    # (a static input of no batch dimension, a constant of the enclosing
    # step read by a nested net, is the same for every sequence: no rows taken)
    statics = [_take_rows(s, order) if var.batched else s
               for var, s in zip(body.static_inputs, static_args)]
    ragged, inits, state = _initial_memories(eqn, static_args, init_args, num_seq, order)
    outputs = _Outputs(eqn, inits, lengths)
    for step in range(num_steps):
        active = int(np.count_nonzero(sorted_lengths > step))
        rows = order[:active]
        pos = (sorted_lengths[:active] - 1 - step) if reverse else np.full(active, step)
        entries = starts[:active] + pos  # level-0 entry of each active sequence
        env = _step_inputs(body, seq_args, statics, entries, active)
        for k, (mem, s) in enumerate(zip(body.memories, state)):
            env[id(mem.pre)] = ragged[k].read(rows) if k in ragged else s[:active]
        inner_scopes = {} if scopes is not None else None
        for inner in body.eqns:
            eval_eqn(inner, env, consts, inner_scopes)
        for i, mem in enumerate(body.memories):
            if i in ragged:
                ragged[i].write(rows, env[id(mem.post)])
                continue
            state[i] = state[i].copy()
            state[i][:active] = env[id(mem.post)]
        outputs.record(env, rows, pos, entries)
        if scopes is not None:
            scope = {v.name: env[id(v)] for v in _block_vars(body)}
            scope["__rows__"] = rows.copy()
            scope["__positions__"] = pos.copy()
            scope.update(inner_scopes)
            scopes.setdefault(eqn.attrs["name"], []).append(scope)
    return outputs.results(ragged, seq_args[0].levels[0])


def _sequence_lengths(eqn, seq_args):
    """The length of each sequence (the caller's order), the same for every
    step input of the rnn."""
    seq_vars, _, _ = ir.rnn_parts(eqn)
    lengths = np.diff(seq_args[0].levels[0])
    for var, X in zip(seq_vars[1:], seq_args[1:]):
        if not np.array_equal(np.diff(X.levels[0]), lengths):
            raise StepNetError(
                f"step inputs {seq_vars[0].name} and {var.name} of {eqn.attrs['name']} have "
                "different LoD; every step input of one step-net must have the same lengths"
            )
    return lengths


def _initial_memories(eqn, static_args, init_args, num_seq, order):
    """Each memory's start: ``{index: _RaggedState}`` for the ragged memories,
    and for the others the initial value in the caller's order and the state
    in sorted order (None for a ragged memory)."""
    body = eqn.attrs["body"]
    inits, state = [], []  # in the caller's order, and in sorted order
    # a ragged memory has the rows of a ragged static input: its state is kept
    # in that input's layout (the caller's order), its rows read and written
    # per step
    ragged = {k: _RaggedState(static_args[i], init_args[k], body.memories[k].pre.dtype)
              for k, i in eqn.attrs.get("ragged_memories", {}).items()}
    for k, (mem, init) in enumerate(zip(body.memories, init_args)):
        if k in ragged:
            inits.append(None)
            state.append(None)
            continue
        full = np.broadcast_to(np.asarray(init, mem.pre.dtype), (num_seq,) + mem.pre.shape[1:])
        inits.append(full)
        state.append(np.array(full[order]))
    return ragged, inits, state


def _step_inputs(body, seq_args, statics, entries, active):
    """The environment of one step, its step and static inputs bound: the
    ``entries`` (level-0) of the sequence inputs, the first ``active`` rows of
    the (sorted) static inputs."""
    env = {}
    for var, X in zip(body.step_inputs, seq_args):
        if X.num_levels == 1:
            env[id(var)] = X.data[entries]
        else:
            env[id(var)] = LoDTensor(X.data, list(X.levels[1:])).select(entries)
    for var, s in zip(body.static_inputs, statics):
        env[id(var)] = _take_rows(s, np.arange(active)) if var.batched else s
    return env


class _Outputs:
    """An rnn's outputs as its steps give them: every step's value, and each
    sequence's last; then the results, in the caller's order."""

    def __init__(self, eqn, inits, lengths):
        body = eqn.attrs["body"]
        self.outputs = body.outputs
        self.all_steps = eqn.attrs["all_steps"]
        self.output_memory = eqn.attrs["output_memory"]
        self.lengths = lengths
        num_seq = len(lengths)
        # Last-step outputs start as the memory's initial value (empty sequences
        # keep it) or zeros.
        self.last = []
        for out, mem_index in zip(body.outputs, self.output_memory):
            if out.lod_depth:
                self.last.append([None] * num_seq)
            elif mem_index >= 0:
                self.last.append(np.array(inits[mem_index]))  # indexed by caller's rows below
            else:
                self.last.append(np.zeros((num_seq,) + out.shape[1:], out.dtype))
        total_rows = int(lengths.sum())
        self.dense_all = [
            np.zeros((total_rows,) + out.shape[1:], out.dtype) if not out.lod_depth else None
            for out in body.outputs
        ]
        self.ragged_all = [{} for _ in body.outputs]  # (sequence, position) -> piece

    def record(self, env, rows, pos, entries):
        """Keep one step's outputs: ``rows`` the active sequences (the caller's
        indices), ``pos`` their positions, ``entries`` their level-0 entries."""
        for i, out in enumerate(self.outputs):
            value = env[id(out)]
            if out.lod_depth:
                for b in range(len(rows)):
                    piece = value.select([b])
                    self.ragged_all[i][(int(rows[b]), int(pos[b]))] = piece
                    self.last[i][rows[b]] = piece
            else:
                self.dense_all[i][entries] = value
                self.last[i][rows] = value

    def results(self, ragged, offsets):
        """One value per output: a LoDTensor of all steps (level 0 ``offsets``),
        or each sequence's last step (a ragged memory's final state)."""
        results = []
        num_seq = len(self.lengths)
        for i, out in enumerate(self.outputs):
            if not self.all_steps[i] and self.output_memory[i] in ragged:
                results.append(ragged[self.output_memory[i]].value())
                continue
            if not out.lod_depth:
                if self.all_steps[i]:
                    results.append(LoDTensor(self.dense_all[i], [offsets]))
                else:
                    results.append(self.last[i])
                continue
            if self.all_steps[i]:
                pieces = [
                    self.ragged_all[i][(s, p)]
                    for s in range(num_seq) for p in range(int(self.lengths[s]))
                ]
                inner = LoDTensor.concat(pieces) if pieces else _empty_piece(out, 0)
                results.append(_prepend_level(inner, self.lengths))
            else:
                pieces = [p if p is not None else _empty_piece(out, 1) for p in self.last[i]]
                results.append(LoDTensor.concat(pieces) if pieces else _empty_piece(out, 0))
        return results


class _RaggedState:
    """A ragged memory's state: rows laid out as the ragged static input
    ``like`` (one sub-sequence per sequence, the caller's order)."""

    def __init__(self, like, init, dtype):
        self.levels = like.levels
        self.data = np.zeros(like.data.shape, dtype) + np.asarray(init, dtype)

    def _rows(self, sequences):
        offsets = np.asarray(self.levels[0])
        parts = [np.arange(offsets[s], offsets[s + 1]) for s in sequences]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def read(self, sequences):
        return LoDTensor(self.data, self.levels).select(sequences)

    def write(self, sequences, value):
        self.data[self._rows(sequences)] = value.data

    def value(self):
        return LoDTensor(self.data.copy(), self.levels)


def _block_vars(block):
    yield from block.step_inputs
    yield from block.static_inputs
    for mem in block.memories:
        yield mem.pre
    for eqn in block.eqns:
        yield from eqn.outputs


def run_program(program: ir.Program, args, consts: dict, scopes=None):
    """Run a top-level program on bound arguments (in ``program.inputs`` order);
    ``consts`` maps constant names to arrays."""
    env = {id(v): a for v, a in zip(program.inputs, args)}
    const_env = {id(v): consts[v] for v in program.consts}
    eval_eqn(program.eqn, env, const_env, scopes)
    return [env[id(v)] for v in program.eqn.outputs]


def compile_program(program: ir.Program):
    """The interpreter "compiles" a program into a call of :func:`run_program`."""

    def run(args, consts, scopes=None):
        return run_program(program, args, consts, scopes)

    return run


_OPEN_COUNTS = []  # the counts the open numpy_blas_threads blocks ask for
_COUNT_BEFORE = [None]  # NumPy's count before the first of them opened
_APPLIED = [None]  # the count the open blocks set
_COUNTS_LOCK = threading.Lock()


@functools.cache
def _numpy_blas_setter():
    """``set(n) -> previous``: the number of threads NumPy's own OpenBLAS
    uses, or None where it cannot be set (a NumPy built on another BLAS).
    (OpenBLAS's ``openblas_set_num_threads_local``: the process's count in
    the pthreads builds NumPy's wheels carry, not the calling thread's.)"""
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*.so*"))):
        try:
            set_local = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        set_local.argtypes, set_local.restype = [ctypes.c_int], ctypes.c_int
        return set_local
    return None


class numpy_blas_threads:
    """NumPy's products on at most ``count`` threads while the block runs
    (any thread's: the count is the process's; the fewest any open block
    asks for, never more than before), as before once every block has ended.

    For NumPy work that runs beside stepnet's own: an ONNX session's small
    GEMMs beside Numba's threads (one thread), and the interpreter answering
    while the compile worker takes a core (:func:`numpy_blas_beside_a_compile`).
    OpenBLAS's pool synchronizes each product by spinning, and with one of
    its threads off its core every product waits for it: where cores are
    few, a run slows down many times over. (A class, and the count set only
    where it changes: a block is entered at every call of a small model.)"""

    __slots__ = ("count",)

    def __init__(self, count):
        self.count = count

    def __enter__(self):
        set_count = _numpy_blas_setter()
        if set_count is None:
            return
        with _COUNTS_LOCK:
            if not _OPEN_COUNTS:  # (one call: the count set, and the one before it given)
                _COUNT_BEFORE[0], _APPLIED[0] = set_count(self.count), self.count
            _OPEN_COUNTS.append(self.count)
            _apply(set_count, min(_COUNT_BEFORE + _OPEN_COUNTS))

    def __exit__(self, *exc):
        set_count = _numpy_blas_setter()
        if set_count is None:
            return
        with _COUNTS_LOCK:
            _OPEN_COUNTS.remove(self.count)
            _apply(set_count, min(_COUNT_BEFORE + _OPEN_COUNTS))


def _apply(set_count, count):
    """NumPy's count set to ``count`` where the open blocks set another."""
    if _APPLIED[0] != count:
        set_count(count)
        _APPLIED[0] = count


def numpy_blas_on_one_thread():
    """:func:`numpy_blas_threads` of one thread."""
    return numpy_blas_threads(1)


def cores_beside_a_compile() -> int:
    """Every core this process may use but one, the compile worker's (one
    where there are two)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - 1)


def numpy_blas_beside_a_compile():
    """:func:`numpy_blas_threads` on :func:`cores_beside_a_compile`."""
    return numpy_blas_threads(cores_beside_a_compile())
