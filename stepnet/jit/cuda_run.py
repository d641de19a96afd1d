"""A call of a compiled CUDA program (:mod:`stepnet.jit.numba_cuda` writes its
kernels): the call's sequences sorted and each step's rows packed
(:class:`_Batch`), its inputs, memories and outputs on the device, the
hoisted kernels and then the time loop (one persistent kernel, or each
step's kernels), and the outputs back in the caller's layout.
"""

from __future__ import annotations

import os

import numpy as np

from .. import ir, registry
from ..errors import LoDError, UnsupportedError
from ..lod import LoDTensor

try:  # numba.cuda imports without a GPU; is_available() says whether one (or the simulator) is there
    from numba import cuda
except ImportError:  # pragma: no cover - numba always ships cuda
    cuda = None

# num_seq * widest step value up to which the whole loop is one persistent
# kernel; above it a stage has enough work for the GPU's threads that a
# launch per stage and step costs less than looping on one block per
# multiprocessor (where measured, the persistent kernel was clearly faster
# below this bound and slower well above it: docs/cuda.md, *The persistent
# kernel's bound*)
PERSISTENT_MAX_ELEMENTS = 1 << 17
THREADS = 128  # threads per block of a stage kernel, and of a persistent kernel over few elements
# threads per block of a persistent kernel over more elements than one block of
# THREADS per multiprocessor takes: 256 threads of at most 255 registers each
# fit one block on a multiprocessor (64K registers), as the cooperative launch
# needs
PERSISTENT_THREADS = 256


def _device(a):
    return cuda.to_device(np.ascontiguousarray(a))


def _persistent_grid(count):
    """(blocks, threads per block) of the persistent kernel over ``count``
    elements a stage: all blocks must be resident at once for its grid-wide
    sync (a cooperative launch), so at most one per multiprocessor, of
    ``PERSISTENT_THREADS`` where blocks of ``THREADS`` would loop; the
    simulator syncs a grid of one block only."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return 1, THREADS
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    threads = THREADS if count <= sms * THREADS else PERSISTENT_THREADS
    return max(1, min(sms, (count + threads - 1) // threads)), threads


def _launch(kernel, count, *args):
    if count <= 0:
        return
    blocks = (count + THREADS - 1) // THREADS
    kernel[blocks, THREADS](*args)


class _Run:
    """``run(args, consts)``: one call of the compiled program."""

    def __init__(self, program, kernels, namespace):
        self.program, self.k, self.ns = program, kernels, namespace
        # (kernel, width, the names of the arrays it takes) of the stages before
        # the loop, and (kernel, width, space, names) of those of each step
        self.hoisted = [(namespace[n], w, used) for g, n, w, _, used in kernels.kernel_names
                        if g == "hoisted"]
        self.stepped = [(namespace[n], w, space, used) for g, n, w, space, used
                        in kernels.kernel_names if g == "step"]

    def __call__(self, args, consts, scopes=None):
        if scopes is not None:
            raise UnsupportedError("cuda backend: keep_scopes=True needs backend='interpreter'")
        batch = _Batch(self.program, self.k, args, consts)
        if batch.steps == 0:  # no step to run: empty all-steps outputs, initial states
            return _no_steps(batch.eqn, self.k.body, batch.initial, batch.seq_args,
                             batch.num_seq, batch.ragged_args)
        device = self._inputs(batch, consts)
        self._run(batch, device)
        return self._outputs(batch, device)

    def _inputs(self, b, consts):
        """``{name: device array}``: the call's inputs laid out as the kernels
        read them (rows in sorted sequence order, each step's rows packed),
        its memories and outputs started, the buffers and constants."""
        k, body = self.k, self.k.body
        device = {}
        for i, X in enumerate(b.seq_args):
            if X.num_levels == 1:
                device[f"seq{i}"] = _device(X.data.reshape(len(X.data), -1)[b.gather])
            else:  # read by nested step-nets only: not on the device as rows
                device[f"seq{i}"] = cuda.device_array((1, 1), np.float32)
        position = {id(v): i for i, v in enumerate(body.step_inputs)}
        for n, (e, inner) in enumerate(k.nested):
            inner_args = [LoDTensor(b.seq_args[position[id(v)]].data,
                                    b.seq_args[position[id(v)]].levels[1:])
                          for v in ir.rnn_parts(e)[0]]
            for j, (o, value) in enumerate(zip(e.outputs, inner(inner_args, consts))):
                # one row per sub-sequence = per token of this net, packed like its step inputs
                rows = np.asarray(value, o.dtype).reshape(len(value), -1)
                device[f"nest{n}_{j}"] = _device(rows[b.gather])
        for i, v in enumerate(b.statics):
            if i in k.ragged:
                data = np.asarray(b.by_var[id(v)].data)
                device[f"static{i}"] = _device(data[b.ragged.pack].reshape(b.ragged.rows, -1))
                continue
            device[f"static{i}"] = _device(np.asarray(b.by_var[id(v)])[b.order]
                                           .reshape(b.num_seq, -1))
        if b.ragged is not None:
            device["mstart"], device["row_of"] = _device(b.ragged.mstart), _device(b.ragged.row_of)
        mem_init = self._memories(b, device)
        for kk, (out, all_steps) in enumerate(zip(body.outputs, b.eqn.attrs["all_steps"])):
            width = k.values[id(out)].width
            if not all_steps and b.eqn.attrs["output_memory"][kk] in k.ragged_memories:
                device[f"out{kk}"] = cuda.device_array((1, 1), out.dtype)  # the memory's buffer is it
                continue
            if all_steps:
                rows = int(b.moffs[-1]) if out.lod_depth else b.total
                device[f"out{kk}"] = cuda.device_array((max(rows, 1), width), out.dtype)
            else:
                mi = b.eqn.attrs["output_memory"][kk]
                start = mem_init[mi][b.order] if mi >= 0 else \
                    np.zeros((b.num_seq,) + out.shape[1:], out.dtype)
                device[f"out{kk}"] = _device(np.asarray(start, out.dtype).reshape(b.num_seq, -1))
        for name, kind, width, dtype in k.buffers:
            rows = {"token": b.total, "mrow": b.ragged.rows if b.ragged else 0}.get(kind, b.num_seq)
            device[name] = cuda.device_array((max(rows, 1), width), dtype)
        for e in k.host_eqns:
            vals = [b.const_env[id(v)] if isinstance(v, ir.Var) else v.value for v in e.inputs]
            b.const_env[id(e.outputs[0])] = registry.get(e.op).numpy(*vals, **e.attrs)
        for name, weights in k.joined:
            device[name] = _device(np.concatenate([b.const_env[id(w)] for w in weights], axis=1)
                                   .ravel())
        needed = set(k.used_names)
        for v_id, info in k.values.items():
            if info.kind == "const" and info.name in needed and info.name not in device:
                device[info.name] = _device(np.ravel(np.asarray(b.const_env[v_id], info.dtype)))
        return device

    def _memories(self, b, device):
        """The memories started on the device (a ragged one: one row per row
        of the ragged static inputs) and snapshots' buffers; the initial
        values of the others, broadcast to every sequence (None for a ragged
        one)."""
        k, body = self.k, self.k.body
        mem_init = []
        for i, (mem, v) in enumerate(zip(body.memories, b.inits)):
            if i in k.ragged_memories:
                width = k.values[id(mem.pre)].width
                device[f"mem{i}"] = _device(np.full((max(b.ragged.rows, 1), width), b.initial(v),
                                                    mem.pre.dtype))
                mem_init.append(None)
                continue
            full = np.broadcast_to(np.asarray(b.initial(v), mem.pre.dtype),
                                   (b.num_seq,) + tuple(mem.pre.shape[1:]))
            mem_init.append(full)
            device[f"mem{i}"] = _device(full[b.order].reshape(b.num_seq, -1))
        for i in k.snapshots:
            device[f"snap{i}"] = cuda.device_array(
                (b.num_seq, k.values[id(body.memories[i].pre)].width), body.memories[i].pre.dtype)
        return mem_init

    def _run(self, b, device):
        """The hoisted stages' kernels over every token, then the time loop:
        one persistent kernel where the widest step fits, else each step's
        kernels launched step by step."""
        k = self.k
        for kernel, width, names in self.hoisted:
            _launch(kernel, b.total * width, b.total, 0, 0, *[device[n] for n in names])
        if b.num_seq * k.widest <= PERSISTENT_MAX_ELEMENTS:
            blocks, threads = _persistent_grid(b.num_seq * k.widest)
            self.ns["persistent"][blocks, threads](b.steps, _device(b.nbs), _device(b.offs),
                                                   _device(b.moffs),
                                                   *[device[n] for n in k.used_names])
            return
        stepped = [(kernel, width, space, [device[n] for n in names])
                   for kernel, width, space, names in self.stepped]
        for t in range(b.steps):
            nb, off, moff = int(b.nbs[t]), int(b.offs[t]), int(b.moffs[t])
            for kernel, width, space, kernel_args in stepped:
                rows = b.ragged.mstart[nb] if space == "mrow" else nb
                _launch(kernel, rows * width, nb, off, moff, *kernel_args)

    def _outputs(self, b, device):
        """The outputs back on the host in the caller's layout."""
        k, body, eqn = self.k, self.k.body, b.eqn
        results = []
        for kk, (out, all_steps) in enumerate(zip(body.outputs, eqn.attrs["all_steps"])):
            mi = eqn.attrs["output_memory"][kk]
            if not all_steps and mi in k.ragged_memories:  # back to the static input's layout
                like = b.by_var[id(b.statics[k.ragged_memories[mi]])]
                data = np.empty(np.shape(like.data), out.dtype)
                data[b.ragged.pack] = device[f"mem{mi}"].copy_to_host()[:b.ragged.rows].reshape(
                    (b.ragged.rows,) + tuple(out.shape[1:]))
                results.append(LoDTensor(data, like.levels))
                continue
            host = device[f"out{kk}"].copy_to_host()
            if all_steps and out.lod_depth:  # (sequence, step, that sequence's rows)
                results.append(b.ragged.all_steps(host, out, b.nbs, b.sorted_lengths, b.order,
                                                  b.seq_args[0].levels[0], eqn.attrs["reverse"]))
            elif all_steps:
                data = np.empty((b.total,) + tuple(out.shape[1:]), out.dtype)
                data[b.gather] = host[:b.total].reshape((b.total,) + tuple(out.shape[1:]))
                results.append(LoDTensor(data, [b.seq_args[0].levels[0]]))
            else:
                last = np.empty((b.num_seq,) + tuple(out.shape[1:]), out.dtype)
                last[b.order] = host.reshape((b.num_seq,) + tuple(out.shape[1:]))
                results.append(last)
        return results


class _Batch:
    """A call's sequences as the kernels take them: sorted longest first
    (``order``), the active rows of each step (``nbs``) and where they start
    among the packed rows (``offs``; ``moffs`` for the ragged static inputs'
    rows), the token of each packed row (``gather``), the arguments by var."""

    def __init__(self, program, k, args, consts):
        self.eqn = program.eqn
        self.by_var = {id(v): a for v, a in zip(program.inputs, args)}
        seqs, self.statics, self.inits = (list(p) for p in ir.rnn_parts(self.eqn))
        self.seq_args = [self.by_var[id(v)] for v in seqs]
        lengths = np.diff(np.asarray(self.seq_args[0].levels[0])).astype(np.int64)
        self.num_seq = len(lengths)
        self.order = np.argsort(-lengths, kind="stable")
        self.sorted_lengths = lengths[self.order]
        self.steps = steps = int(self.sorted_lengths[0]) if self.num_seq else 0
        self.nbs = np.array([np.count_nonzero(self.sorted_lengths > t) for t in range(steps)],
                            np.int64)
        self.offs = np.concatenate([[0], np.cumsum(self.nbs)[:-1]]).astype(np.int64) if steps \
            else self.nbs
        self.total = int(lengths.sum())
        self.const_env = {id(v): np.asarray(consts[v]) for v in program.consts}
        self.ragged_args = [self.by_var[id(self.statics[i])] for i in k.ragged]
        if steps == 0:
            return
        self.ragged = _RaggedRows(self.ragged_args, [self.statics[i].name for i in k.ragged],
                                  self.order) if k.ragged else None
        self.moffs = self.ragged.step_offsets(self.nbs) if self.ragged else \
            np.zeros(steps + 1, np.int64)
        # packed row r (step t, sorted position b) holds token starts[order[b]] + position
        starts = np.asarray(self.seq_args[0].levels[0][:-1])[self.order]
        self.gather = np.empty(self.total, np.int64)
        for t in range(steps):
            nb = self.nbs[t]
            pos = (self.sorted_lengths[:nb] - 1 - t) if self.eqn.attrs["reverse"] \
                else np.full(nb, t)
            self.gather[self.offs[t]:self.offs[t] + nb] = starts[:nb] + pos

    def initial(self, v):
        """A memory's init: bound by name, a literal or a constant."""
        if isinstance(v, ir.Literal):
            return v.value
        return self.by_var[id(v)] if id(v) in self.by_var else self.const_env[id(v)]


class _RaggedRows:
    """The rows of the ragged static inputs (one LoD for all), packed in
    sorted sequence order: sequence b's rows are ``mstart[b]`` to
    ``mstart[b + 1]``, row r belongs to ``row_of[r]``; ``pack`` maps packed
    rows to the inputs' own rows."""

    def __init__(self, statics, names, order):
        offsets = np.asarray(statics[0].levels[0])
        counts = np.diff(offsets)
        for value, name in zip(statics[1:], names[1:]):
            if not np.array_equal(np.diff(np.asarray(value.levels[0])), counts):
                raise LoDError(f"cuda backend: the ragged static inputs {names[0]} and {name} have "
                               "different lengths (one LoD for all of them on this backend)")
        ordered = counts[order]
        self.mstart = np.concatenate([[0], np.cumsum(ordered)]).astype(np.int64)
        self.row_of = np.repeat(np.arange(len(order)), ordered).astype(np.int64)
        parts = [np.arange(offsets[s], offsets[s + 1]) for s in order]
        self.pack = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        self.rows = int(self.mstart[-1])
        self.counts = counts  # rows per sequence, the caller's order
        if self.rows == 0:  # kernels read these arrays: never empty
            self.row_of = np.zeros(1, np.int64)

    def step_offsets(self, nbs):
        """Where each step's rows start in a ragged all-steps output (one more
        entry: the total)."""
        return np.concatenate([[0], np.cumsum(self.mstart[nbs])]).astype(np.int64)

    def all_steps(self, host, out, nbs, sorted_lengths, order, level, reverse):
        """A ragged all-steps output written step by step (each step its
        active sequences' rows in packed order) as a LoDTensor of levels
        (sequence, step, rows)."""
        lengths = np.diff(np.asarray(level))
        entry_rows = np.repeat(self.counts, lengths)  # rows of each step of each sequence
        inner = np.concatenate([[0], np.cumsum(entry_rows)]).astype(np.int64)
        per_step = self.mstart[nbs]
        t = np.repeat(np.arange(len(nbs)), per_step)
        r = np.concatenate([np.arange(n) for n in per_step]) if len(per_step) else t
        b = self.row_of[r]
        position = sorted_lengths[b] - 1 - t if reverse else t
        dest = inner[np.asarray(level)[:-1][order[b]] + position] + r - self.mstart[b]
        data = np.empty((int(inner[-1]),) + tuple(out.shape[1:]), out.dtype)
        data[dest] = host[:len(dest)].reshape((len(dest),) + tuple(out.shape[1:]))
        return LoDTensor(data, [np.asarray(level), inner])


def _no_steps(eqn, body, initial, seq_args, num_seq, ragged_args):
    inits = ir.rnn_parts(eqn)[2]
    ragged_memories = eqn.attrs.get("ragged_memories", {})
    statics = [i for i, v in enumerate(body.static_inputs) if v.lod_depth]
    results = []
    for k, (out, all_steps) in enumerate(zip(body.outputs, eqn.attrs["all_steps"])):
        shape = tuple(out.shape[1:])
        mi = eqn.attrs["output_memory"][k]
        if not all_steps and mi in ragged_memories:
            like = ragged_args[statics.index(ragged_memories[mi])]
            results.append(LoDTensor(np.full(np.shape(like.data), initial(inits[mi]), out.dtype),
                                     like.levels))
            continue
        if all_steps:
            results.append(LoDTensor(np.zeros((0,) + shape, out.dtype), [seq_args[0].levels[0]]))
            continue
        mi = eqn.attrs["output_memory"][k]
        start = (np.broadcast_to(np.asarray(initial(inits[mi]), out.dtype), (num_seq,) + shape)
                 if mi >= 0 else np.zeros((num_seq,) + shape, out.dtype))
        results.append(np.array(start))
    return results
