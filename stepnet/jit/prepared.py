"""A kernel called many times with its constants laid out once: the
prepared call of the backend protocol (``CompiledStepNet.prepared``).

stepnet's public call binds and checks every input and lays out the weights
again on each call, which for a chunk of audio costs more than the kernel.
A front end that calls one step-net chunk after chunk (an ONNX streaming
node) takes a :class:`PreparedCall` instead: program()'s argument order,
its output buffers and its machine code are known here, in the backend, and
nowhere else.
"""

from __future__ import annotations

import numpy as np

from . import threads
from .numba_cpu import ROWS_IN_ORDER, compiled_entry, exactly, read_only
from ..errors import ShapeError
from ..lod import LoDTensor


class PreparedCall:
    """``call(data, offsets, states)`` for a program of one sequence input
    (one LoD level: ``data [tokens, I]``, ``offsets [B + 1]``) and dense
    inputs (``states``, ``[B, width]`` each, None: zeros), whose outputs are
    one all-steps output and last-step ones: returns ``[Y data [tokens,
    ...], last [B, ...], ...]``. Made by :meth:`of`.

    ``by_steps`` and ``direct`` are the same work for arguments laid out
    otherwise (rows by steps) or made exact by the caller; each returns None
    where the run is split over threads (``call`` then takes it).
    """

    def __init__(self, program, const_args):
        self.program, self.const_args = program, const_args
        eqn = program.program.eqn
        inputs = [spec[1] for spec in program.top_inputs]
        self.features, self.dtype = inputs[0].shape[1], np.dtype(inputs[0].dtype)
        self.widths = [v.shape[1] for v in inputs[1:]]
        self.n_out = len(eqn.outputs)
        self.outputs = [(tuple(v.shape[1:]), np.dtype(v.dtype)) for v in eqn.outputs]
        self.entry = program.module.program
        # the machine code compiled for exactly the public call's types (read-only
        # inputs, C-contiguous): no Numba dispatch a call (None: not compiled so)
        sample = [threads.ALONE, ROWS_IN_ORDER, read_only(np.zeros((1, self.features), self.dtype)),
                  read_only(np.zeros(2, np.int64))]
        sample += [read_only(np.zeros((1, w), self.dtype)) for w in self.widths]
        self.plain = compiled_entry(self.entry, const_args + sample + self._buffers(1, 1))

    @classmethod
    def of(cls, program, consts):
        """The prepared call of ``program`` (a compiled ``NumbaProgram``)
        with ``consts``, or None where the program is not of that form."""
        kinds_in = tuple(spec[0] for spec in program.top_inputs)
        kinds_out = tuple(spec[0] for spec in program.top_outputs)
        if (kinds_in[:1] != ("sequence",) or set(kinds_in[1:]) - {"dense"}
                or kinds_out[:1] != ("dense_all",) or set(kinds_out[1:]) - {"last"}
                or not all(program.given)
                or len(program.top_inputs[0][3]) != 1
                or any(len(spec[1].shape) != 2 for spec in program.top_inputs)):
            return None
        return cls(program, program.prepare(consts))

    def _buffers(self, rows, num_sequences, padded=False):
        """The output buffers program() takes (Y zeros where ``padded``:
        rows no step writes)."""
        (y_shape, y_dtype), *last = self.outputs
        return [(np.zeros if padded else np.empty)((rows,) + y_shape, y_dtype)] + [
            np.empty((num_sequences,) + shape, dtype) for shape, dtype in last]

    def _given(self, states, num_sequences):
        """The states, zeros where None."""
        if len(states) != len(self.widths):
            raise ShapeError(f"{len(states)} states given, the step-net takes {len(self.widths)}")
        return [np.zeros((num_sequences, w), self.dtype) if s is None else s
                for s, w in zip(states, self.widths)]

    def _splits(self, data, offsets):
        return self.program.splits(data.shape[0], self.features, offsets.shape[0] - 1)

    def __call__(self, data, offsets, states):
        data = np.asarray(data)
        if data.ndim != 2 or data.shape[1] != self.features or data.dtype.kind != "f":
            raise ShapeError(f"the data has shape {list(data.shape)} and dtype {data.dtype}, the "
                             f"step-net takes [tokens, {self.features}] of floating point")
        data = data.astype(self.dtype, copy=False)
        # (the kernel reads rows by them: integers from 0, never decreasing, ending at the rows)
        rows = LoDTensor(data, [offsets])
        offsets = rows.levels[0]
        states = self._given(states, len(offsets) - 1)
        for i, (state, width) in enumerate(zip(states, self.widths)):
            if np.shape(state) != (len(offsets) - 1, width):
                raise ShapeError(f"state {i} has shape {list(np.shape(state))}, the step-net takes "
                                 f"[{len(offsets) - 1}, {width}] (a row per sequence)")
        states = [np.asarray(state, self.dtype) for state in states]
        if self._splits(data, offsets):  # sequence groups on threads: the engine's own call
            results = self.program.run_prepared(self.const_args, [rows] + states)
            return [results[0].data] + list(results[1:])
        return self._one_group(data, offsets, states)

    def by_steps(self, data, offsets, states, padded=False):
        """``call``'s work where the rows of ``data`` are by steps (step 0
        of every sequence, then step 1, ...: ONNX's time-major X, ``padded``
        past each length under the longest) and Y's rows come back so (zero
        past each length where ``padded``)."""
        num_sequences = offsets.shape[0] - 1
        if data.shape[1] != self.features or self._splits(data, offsets):
            return None
        return self._one_group(data, offsets, self._given(states, num_sequences),
                               np.int64(num_sequences), padded)

    def direct(self, data, offsets, states):
        """``call``'s work where every argument is exact: ``data``
        C-contiguous and aligned of the kernel's dtype, ``offsets`` int64 and
        contiguous, every state given, of the kernel's dtype and shape,
        C-contiguous and aligned (nothing checked or copied: the machine
        code reads them as they lie)."""
        if self.plain is None or data.shape[1] != self.features or self._splits(data, offsets):
            return None
        return self._run(self.plain, data, offsets, states)

    def _one_group(self, data, offsets, states, row_step=ROWS_IN_ORDER, padded=False):
        # the machine code where every argument is exact, else the dispatcher
        if (self.plain is not None and exactly(data, self.dtype, 2)
                and exactly(offsets, np.int64, 1)
                and all(exactly(s, self.dtype, 2) for s in states)):
            return self._run(self.plain, data, offsets, states, row_step, padded)
        return self._run(self.entry, read_only(data), read_only(offsets),
                         [read_only(s) for s in states], row_step, padded)

    def _run(self, kernel, data, offsets, states, row_step=ROWS_IN_ORDER, padded=False):
        # program() on one group of sequences, into new output buffers
        rows, num_sequences = data.shape[0], offsets.shape[0] - 1
        outs = self._buffers(rows, num_sequences, padded)
        return list(kernel(*self.const_args, self.program.board(rows, num_sequences), row_step,
                           data, offsets, *states, *outs)[:self.n_out])
