"""ONNX's recurrent nodes as stepnet step-nets.

- ``GRU``, ``LSTM``, ``RNN``: the node's weights and attributes make a
  :mod:`stepnet.nn` layer (``from_onnx``), built once per weights; each run
  calls each direction's step-net on the batch, ``sequence_lens`` its LoD, so
  Y is zero past each sequence's length and ``Y_h`` is each sequence's own
  last state, as the spec says. (The layer's own call, which also stacks
  layers, is used for the Gradient operator's pullback.)
- ``Scan``: the body graph is traced into a step-net. A body tensor of ONNX
  shape ``S`` is a step value: one sequence per row of a shared first axis
  when the body keeps rows apart, else one sequence of ``[1, *S]``; Scan 8
  has a batch axis, one sequence per batch entry, and its ``sequence_lens``
  becomes the LoD (scan outputs zero past each length, final states at each
  sequence's own last step). Reversed scan inputs are reversed before the run
  (Scan 8: within each sequence's length) and reversed scan outputs after it,
  so the step-net itself always runs forward. A body that does not trace (an
  op stepnet has no step form of, a recurrent node or control flow inside, an
  integer scan input) runs node by node: the specification's loop, the body
  run as a graph at each step.
"""

from __future__ import annotations

import numpy as np

from .. import dsl, nn
from ..backends import backend as backend_info
from ..pullback import vjp
from .. import ops as sn_ops
from ..errors import Error, ShapeError
from ..lod import LoDTensor
from .ops import NotRowWise, is_step

_COMMON = {"activation_alpha", "activation_beta", "activations", "clip", "direction",
           "hidden_size", "layout", "output_sequence"}
# the ONNX operators that are built-in layers, and the attributes each accepts
_LAYERS = {op: nn.layers.LAYERS[cell.name] for op, cell in nn.cells.ONNX_LAYERS.items()}
_ATTRS = {op: _COMMON | set(cell.onnx_attrs) for op, cell in nn.cells.ONNX_LAYERS.items()}


def _reraise(ctx, error):
    """A stepnet error raised while running a node, with the node named."""
    return type(error)(f"ONNX node {ctx.node!r} ({ctx.op}): {error}")


class RecurrentNode:
    """An ONNX GRU, LSTM or RNN node run by a ``stepnet.nn`` layer."""

    def __init__(self, ctx, attrs):
        self.ctx = ctx
        unknown = sorted(set(attrs) - _ATTRS[ctx.op])
        if unknown:
            raise ctx.unsupported(f"attribute {unknown[0]!r} is not supported")
        attrs = dict(attrs)
        self.layout = int(attrs.pop("layout", 0))
        if self.layout not in (0, 1):
            raise ctx.unsupported(f"attribute 'layout' = {self.layout}")
        if self.layout and ctx.opset < 14:
            raise ctx.unsupported(f"attribute 'layout' needs opset 14, the model has {ctx.opset}")
        attrs.pop("output_sequence", None)  # GRU/LSTM/RNN-1 and -3: Y is given when asked for
        if "hidden_size" not in attrs:
            raise ctx.unsupported("attribute 'hidden_size' is missing")
        self.attrs = attrs
        self.cls = _LAYERS[ctx.op]
        self.layer = None
        self.weights = None  # the arrays self.layer was built from
        self.compiled = {}  # (direction, backend) -> its step-net compiled
        self._full_offsets = {}  # (batch, length) -> the offsets of full sequences
        self._streaming = None  # (backend, each direction's prepared kernel): _run_streaming
        self._by_steps = None  # whether the prepared kernels' rows by steps agree (_run_by_steps)

    def _layer(self, W, R, B, P):
        ctx = self.ctx
        weights = (W, R, B, P)
        kept = self.weights
        if self.layer is not None and (
                (W is kept[0] and R is kept[1] and B is kept[2] and P is kept[3])  # the usual case
                or all(_same(a, b) for a, b in zip(weights, kept))):
            self.weights = weights
            return self.layer
        for name, w in (("W", W), ("R", R)):
            if np.ndim(w) != 3:
                raise ctx.unsupported(f"{name} must be 3-D, got shape {list(np.shape(w))}")
        if np.shape(W)[0] != (2 if self.attrs.get("direction") == "bidirectional" else 1):
            raise ctx.unsupported(f"W has {np.shape(W)[0]} directions, the node's direction is "
                                  f"{self.attrs.get('direction', 'forward')!r}")
        extra = {"P": P} if ctx.op == "LSTM" else {}
        if self.layer is not None and all(
                np.shape(a) == np.shape(b) for a, b in zip(weights, self.weights)):
            self.layer.set_onnx_weights(0, W, R, B, **extra)  # new step-nets
        else:
            self.layer = self.cls.from_onnx(W, R, B, **extra, **self.attrs)
        self.compiled, self._streaming = {}, None
        self.weights = weights
        return self.layer

    def _prepare(self, inputs):
        """The node's inputs checked: ``(X batch-first, W, R, B, P, lengths or
        None when every sequence is full, h0, c0)``, states in ONNX's layout 0."""
        ctx = self.ctx
        inputs = list(inputs) + [None] * (8 - len(inputs))
        X, W, R, B, lengths, h0 = inputs[:6]
        c0, P = (inputs[6], inputs[7]) if ctx.op == "LSTM" else (None, None)
        X = np.asarray(X)
        if X.ndim != 3:
            raise ctx.unsupported(f"X must be 3-D, got shape {list(X.shape)}")
        batch_first = X if self.layout else X.transpose(1, 0, 2)
        Bsz, T = batch_first.shape[:2]
        if lengths is not None:
            lengths = np.asarray(lengths)
            if lengths.shape != (Bsz,) or lengths.dtype.kind not in "iu":
                raise ctx.unsupported(f"sequence_lens must be integers of shape [{Bsz}], got "
                                      f"{lengths.dtype} {list(lengths.shape)}")
            bad = np.flatnonzero((lengths < 0) | (lengths > T))
            if bad.size:
                raise ctx.unsupported(f"sequence_lens[{bad[0]}] = {lengths[bad[0]]} is not in "
                                      f"[0, {T}]")
            if np.all(lengths == T):
                lengths = None
        if self.layout:
            h0, c0 = (None if s is None else np.asarray(s).transpose(1, 0, 2) for s in (h0, c0))
        return batch_first, W, R, B, P, lengths, h0, c0

    def run(self, inputs, backend):
        """The node's outputs, each direction's step-net called on the batch."""
        streaming = self._streaming
        if streaming is not None and streaming[0] == backend:
            outs = self._run_streaming(inputs, *streaming[1:])
            if outs is not None:
                return outs
        ctx = self.ctx
        X, W, R, B, P, lengths, h0, c0 = self._prepare(inputs)
        Bsz, T = X.shape[:2]
        try:
            layer = self._layer(W, R, B, P)
        except Error as e:
            raise _reraise(ctx, e) from e
        D, H, dtype = layer.num_directions, layer.hidden_size, layer.dtype
        if X.dtype.kind != "f":
            raise ctx.unsupported(f"X has dtype {X.dtype}, not floating point")
        widths = layer.state_widths()
        initial = []
        for s, (state, name) in enumerate(zip((h0, c0), ("initial_h", "initial_c"))):
            if state is not None and state.shape != (D, Bsz, widths[min(s, len(widths) - 1)]):
                shape = [Bsz, D, H] if self.layout else [D, Bsz, H]
                raise ShapeError(f"ONNX node {ctx.node!r} ({ctx.op}): {name} has shape "
                                 f"{list(np.shape(inputs[5 + s]))}, expected {shape}")
            initial.append(state if state is None or state.dtype == dtype else state.astype(dtype))
        if ctx.op != "LSTM":
            initial = initial[:1]
        directions = [self._direction(d, backend) for d in range(D)]
        out_dtype = np.float16 if X.dtype == np.float16 else dtype
        if not self.layout:
            outs = self._run_by_steps(X, [run.kernel for run in directions], initial, dtype,
                                      out_dtype, lengths)
            if outs is not None:
                return outs
        data, offsets = self._in_order(X, lengths, dtype)

        def one_direction(d):
            return directions[d](data, offsets, [None if s is None else s[d] for s in initial])

        from ..jit import threads  # (at the first run: importing stepnet starts no engine)

        try:  # both directions at once where worth a thread, as a layer's (layers.stack)
            results = threads.run_apart(one_direction, range(D),
                                        layer._direction_work(data.shape[0], [backend]))
        except Error as e:
            raise _reraise(ctx, e) from e
        if lengths is None:
            kernels = [run.kernel for run in directions]
            sizes = [widths[min(s, len(widths) - 1)] for s in range(len(initial))]
            self._streaming = (backend, kernels, sizes) if None not in kernels else None
            return self._outputs(results, Bsz, T, out_dtype)
        # Y made in the node's layout at once: each row of a direction's output
        # at its (step, sequence), zero past each length
        steps, seqs = _places(offsets)
        if self.layout:
            Y = np.zeros((Bsz, T, D, H), dtype)
            for d, r in enumerate(results):
                Y[seqs, steps, d] = r[0]
        else:
            Y = np.zeros((T, D, Bsz, H), dtype)
            for d, r in enumerate(results):
                Y[steps, d, seqs] = r[0]
        return self._outputs(results, Bsz, T, out_dtype, Y)

    def _run_by_steps(self, X, kernels, states, dtype, out_dtype, lengths=None):
        """The outputs of a time-major node (``X`` the batch-first view of
        ``[T, B, I]``, ``states`` ``[D, B, H]`` each or None, ``lengths``
        the sequences' lengths or None where every one is full) from each
        direction's prepared kernel (``kernels``) reading X's rows and
        writing Y's by steps (``numba_cpu.ROWS_IN_ORDER``; Y zero past each
        length): neither is copied to the sequences' order and back, nor Y
        scattered from it. None where a
        direction has no prepared kernel, or its run is split over threads,
        or a batch of one sequence or one step (its rows are in order), or
        where X is not a C-contiguous ``[T, B, I]`` array of the layer's
        dtype (a view of a batch-first array, as a Transpose node gives: the
        sequences' order is then the copy-free one); the first time, only if
        its results equal the sequences' order's bit for bit (else never
        again)."""
        Bsz, T, width = X.shape
        time_major = X.transpose(1, 0, 2)
        if (self._by_steps is False or T == 1 or Bsz == 1 or None in kernels
                or time_major.dtype != dtype or not time_major.flags.c_contiguous):
            return None
        rows = time_major.reshape(T * Bsz, width)
        offsets = self._lod(Bsz, T, lengths)

        def one_direction(d):
            return kernels[d].by_steps(rows, offsets, [None if s is None else s[d] for s in states],
                                       padded=lengths is not None)

        from ..jit import threads
        try:
            results = threads.run_apart(one_direction, range(len(kernels)),
                                        self.layer._direction_work(rows.shape[0], ["numba"]))
        except Error as e:
            raise _reraise(self.ctx, e) from e
        if any(r is None for r in results):
            return None
        H = self.layer.hidden_size
        Y = (results[0][0].reshape(T, 1, Bsz, H) if len(results) == 1
             else np.stack([r[0].reshape(T, Bsz, H) for r in results], axis=1))
        if self._by_steps is None:  # checked once against the sequences' order
            data, _ = self._in_order(X, lengths, dtype)
            expected = [kernels[d](data, offsets, [None if s is None else s[d] for s in states])
                        for d in range(len(kernels))]
            steps, seqs = _places(offsets)
            at = steps * Bsz + seqs  # (rows by steps, in the sequences' order)

            def by_steps_rows(y):
                rows = np.zeros((T * Bsz,) + y.shape[1:], y.dtype)
                rows[at] = y
                return rows

            self._by_steps = all(
                np.array_equal(r[0], by_steps_rows(e[0]), equal_nan=True)
                and all(np.array_equal(a, b, equal_nan=True) for a, b in zip(r[1:], e[1:]))
                for r, e in zip(results, expected))
            if not self._by_steps:
                return None
        return self._outputs(results, Bsz, T, out_dtype, Y)

    def _in_order(self, X, lengths, dtype):
        """The rows of ``X`` (batch-first) in the sequences' order, each
        sequence's steps up to its length (``lengths``; None: every step),
        in ``dtype``, and their offsets."""
        Bsz, T = X.shape[:2]
        data = (X.reshape(Bsz * T, X.shape[2]) if lengths is None
                else X[np.arange(T) < lengths[:, None]])
        return np.ascontiguousarray(data, dtype), self._lod(Bsz, T, lengths)

    def _lod(self, Bsz, T, lengths):
        """The offsets of ``Bsz`` sequences of ``lengths`` (None: all ``T``
        long, ``_offsets``)."""
        if lengths is None:
            return self._offsets(Bsz, T)
        return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

    def _offsets(self, Bsz, T):
        """The offsets of ``Bsz`` full sequences of ``T`` steps: one read-only
        array per batch and length, made once."""
        offsets = self._full_offsets.get((Bsz, T))
        if offsets is None:
            if len(self._full_offsets) > 64:
                self._full_offsets.clear()
            offsets = self._full_offsets[Bsz, T] = np.arange(0, (Bsz + 1) * T, T, dtype=np.int64)
            offsets.flags.writeable = False
        return offsets

    def _outputs(self, results, Bsz, T, out_dtype, Y=None):
        """``[Y, Y_h(, Y_c)]`` in the node's layout from each direction's
        ``[Y data, h_n(, c_n)]``; ``Y`` given (in the node's layout) where
        sequences are ragged."""
        D, H = len(results), self.layer.hidden_size
        if Y is None:
            Y = (results[0][0].reshape(Bsz, T, 1, H) if D == 1
                 else np.stack([r[0].reshape(Bsz, T, H) for r in results], axis=2))
            Y = Y if self.layout else Y.transpose(1, 2, 0, 3)
        outs = [np.ascontiguousarray(Y, out_dtype)]
        for s in range(len(results[0]) - 1):
            state = (results[0][1 + s][None] if D == 1
                     else np.stack([r[1 + s] for r in results]))          # [D, B, H]
            outs.append(np.ascontiguousarray(state.transpose(1, 0, 2) if self.layout else state,
                                             out_dtype))
        return outs

    def _run_streaming(self, inputs, kernels, sizes):
        """``run`` for the call a streaming model makes chunk after chunk, in a
        few comparisons: the weights of the last call (the same arrays), no
        ``sequence_lens``, X and the states (of widths ``sizes``) in the
        layer's dtype and the shapes it takes, each direction's kernel
        prepared (``kernels``). None for any other call: ``run`` then checks
        and converts everything."""
        n, X, kept = len(inputs), inputs[0], self.weights
        dtype = self.layer.dtype
        if (type(X) is not np.ndarray or X.ndim != 3 or X.dtype != dtype or n < 3
                or inputs[1] is not kept[0] or inputs[2] is not kept[1]
                or (inputs[3] if n > 3 else None) is not kept[2]
                or (n > 4 and inputs[4] is not None)
                or (inputs[7] if n > 7 else None) is not kept[3]):  # (P: LSTM only)
            return None
        if not self.layout:
            X = X.transpose(1, 0, 2)
        Bsz, T, width = X.shape
        states = []
        for s, size in enumerate(sizes):
            state = inputs[5 + s] if n > 5 + s else None
            if state is not None:
                if type(state) is not np.ndarray or state.dtype != dtype:
                    return None
                if self.layout:
                    state = state.transpose(1, 0, 2)
                if state.shape != (len(kernels), Bsz, size):
                    return None
            states.append(state)
        if not self.layout:
            outs = self._run_by_steps(X, kernels, states, dtype, dtype)
            if outs is not None:
                return outs
        data, offsets = self._in_order(X, None, dtype)
        results = None
        try:
            if data.flags.aligned and all(s is not None and s.flags.c_contiguous
                                          and s.flags.aligned for s in states):
                # every argument exact: each kernel's machine code called at once
                results = [kernel.direct(data, offsets, [s[d] for s in states])
                           for d, kernel in enumerate(kernels)]
                if any(r is None for r in results):
                    results = None
            if results is None:  # (both directions at once where worth a thread, as in run)
                from ..jit import threads

                results = threads.run_apart(
                    lambda d: kernels[d](data, offsets, [None if s is None else s[d] for s in states]),
                    range(len(kernels)), self.layer._direction_work(data.shape[0], ["numba"]))
        except Error as e:
            raise _reraise(self.ctx, e) from e
        return self._outputs(results, Bsz, T, dtype)

    def _direction(self, d, backend):
        """Direction ``d``'s step-net, compiled for ``backend``."""
        key = (d, backend)
        run = self.compiled.get(key)
        if run is None:
            states = 2 if self.ctx.op == "LSTM" else 1
            run = self.compiled[key] = _Direction(self.layer.step_net(0, d), backend, states)
        return run

    def forward(self, inputs, backend, keep=False):
        """``(outputs, pullback)``; with ``keep``, ``pullback(grads)`` maps one
        gradient (or None) per output to one per input (None where there is
        none), in ONNX's layouts. Without ``keep`` it is ``run``."""
        if not keep:
            return self.run(inputs, backend), None
        ctx = self.ctx
        inputs = list(inputs) + [None] * (8 - len(inputs))
        batch_first, W, R, B, P, lengths, h0, c0 = self._prepare(inputs)
        Bsz, T = batch_first.shape[:2]
        if lengths is None:
            lengths = np.full(Bsz, T, np.int64)

        def state(s):
            if s is None:
                return None
            s = np.asarray(s)
            return s.transpose(1, 0, 2) if self.layout else s

        try:
            layer = self._layer(W, R, B, P)
            feed = (batch_first, lengths)
            call = layer.vjp if keep else layer
            if ctx.op == "LSTM":
                initial = None if h0 is None and c0 is None else (h0, c0)
                out = call(feed, initial, backend=backend)
                (Y, (h_n, c_n)) = out[0] if keep else out
                states = [h_n, c_n]
            else:
                out = call(feed, h0, backend=backend)
                Y, h_n = out[0] if keep else out
                states = [h_n]
        except Error as e:
            raise _reraise(ctx, e) from e
        D, H = len(states[0]), layer.hidden_size
        Y = Y.reshape(Bsz, T, D, H)
        Y = Y if self.layout else Y.transpose(1, 2, 0, 3)
        states = [s.transpose(1, 0, 2) if self.layout else s for s in states]
        outs = [np.ascontiguousarray(Y)] + [np.ascontiguousarray(s) for s in states]
        if not keep:
            return outs, None
        layer_pullback = out[1]

        def pullback(grads):
            grads = list(grads) + [None] * (len(outs) - len(grads))
            dY = grads[0]
            if dY is not None:
                dY = np.asarray(dY)
                dY = (dY if self.layout else dY.transpose(2, 0, 1, 3)).reshape(Bsz, T, D * H)
            d_states = [None if g is None else state(np.asarray(g)) for g in grads[1:]]
            params = layer.parameters()
            names = ["X", "h0"] + (["c0"] if ctx.op == "LSTM" else [])
            try:
                found = layer_pullback([dY] + d_states, wrt=params + names)
            except Error as e:
                raise _reraise(ctx, e) from e
            by_param = {id(p): g for p, g in zip(params, found)}
            weights = layer.onnx_weights(0, value=lambda p: by_param[id(p)])
            dX, d_init = found[len(params)], found[len(params) + 1:]
            dX = dX if self.layout else dX.transpose(1, 0, 2)
            d_init = [state(g) for g in d_init]  # the transpose is its own inverse
            result = [dX, weights["W"], weights["R"], weights["B"], None, d_init[0]]
            if ctx.op == "LSTM":
                result += [d_init[1], weights.get("P")]
            return [None if g is None or x is None else np.asarray(g, np.asarray(x).dtype)
                    for g, x in zip(result, inputs)]

        return outs, pullback


class _Direction:
    """One direction of a GRU, LSTM or RNN node: its step-net compiled,
    called on ``(data [tokens, I], offsets [B + 1], states)`` (a state None:
    zeros) to give ``[Y data [tokens, H], h_n [B, H](, c_n)]``.

    It calls ``rnn.compile(backend)``. On the Numba backend, after the first
    call, it calls the kernel's entry point itself with the weights prepared
    once (:func:`_prepared_kernel`): stepnet's call binds and checks every
    input and lays out the weights again on each call, which costs more than
    the kernel itself for a chunk of audio."""

    def __init__(self, rnn, backend, states):
        self.rnn = rnn
        self.flags = (True,) + (False,) * states
        self.compiled = rnn.compile(backend)
        self.kernel = None
        self.tried = not backend_info(backend).host_code

    def __call__(self, data, offsets, states):
        if self.kernel is not None:
            return self.kernel(data, offsets, states)
        feeds = {"x": LoDTensor(data, [offsets])}
        for name, state in zip(("h", "c"), states):
            if state is not None:
                feeds[name] = state
        # a new kernel's first calls may answer on the interpreter (its first
        # tier): the prepared call is tried once the kernel itself answers
        kernel_answers = getattr(self.compiled._runner(self.flags), "ready", True)
        outs = self.compiled(output_all_steps=self.flags, **feeds)
        outs = [outs[0].data] + [np.asarray(o) for o in outs[1:]]
        if not self.tried and kernel_answers:
            self.tried = True
            self.kernel = _prepared_kernel(self.rnn, self.compiled, self.flags, data, offsets,
                                           states, outs)
        return outs


def _places(offsets):
    """Each row of sequences laid out by ``offsets``: its step and its
    sequence."""
    lengths = np.diff(offsets)
    return (np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths),
            np.repeat(np.arange(lengths.shape[0]), lengths))


def _prepared_kernel(rnn, compiled, flags, data, offsets, states, expected):
    """``call(data, offsets, states)`` running the Numba program of ``rnn``
    with its constant arguments laid out once, or None.

    The constants come from the program's ``prepare``; a run big enough for
    sequence groups on threads goes through its ``run_prepared``, a small one
    (a chunk of audio) calls the kernel's machine code directly
    (:func:`stepnet.jit.numba_cpu.compiled_entry`, where its arguments are
    exactly the types it was compiled for; else its entry point). It reads the
    program's layout (``top_inputs``, ``top_outputs``, ``given``, ``module.program``), and
    is used only if its first results equal, bit for bit, those of the public
    call it replaces. ``call.direct(data, offsets, states)`` is the same for
    arguments the caller made exact (no checks of layout, no copies): the
    streaming node's call (``RecurrentNode._run_streaming``), cheaper per
    chunk of audio than ``call``'s."""
    from ..jit import threads
    from ..jit.numba_cpu import ROWS_IN_ORDER, compiled_entry, exactly, read_only  # (loaded)

    try:
        run = compiled._runner(flags)
        run = getattr(run, "numba_program", run)  # a TieredProgram's kernel
        const_args = run.prepare(rnn.const_values())
        n = len(flags) - 1
        if (tuple(spec[0] for spec in run.top_inputs) != ("sequence",) + ("dense",) * n
                or tuple(spec[0] for spec in run.top_outputs) != ("dense_all",) + ("last",) * n):
            return None
        if not all(run.given):
            return None
        entry = run.module.program
        width, features = expected[1].shape[1], data.shape[1]
        y_shape, y_dtype = expected[0].shape[1:], expected[0].dtype
        last_shapes = [(e.shape[1:], e.dtype) for e in expected[1:]]
        data_dtype, plain = data.dtype, None  # plain: the kernel without Numba's dispatch

        def buffers(rows, num_sequences, padded=False):  # the output buffers program() takes
            return [(np.zeros if padded else np.empty)((rows,) + y_shape, y_dtype)] + [
                np.empty((num_sequences,) + shape, dtype) for shape, dtype in last_shapes]

        def given(states, num_sequences, dtype):
            # the initial states, zeros (one array) where None
            if all(s is not None for s in states):
                return list(states)
            zeros = np.zeros((num_sequences, width), dtype)
            return [zeros if s is None else s for s in states]

        def call(data, offsets, states):
            if data.shape[1] != features:  # (the public call checks this, and more)
                raise ShapeError(f"X has {data.shape[1]} features per step, the node's weights "
                                 f"take {features}")
            states = given(states, len(offsets) - 1, data.dtype)
            if run.splits(data.shape[0], data.shape[1], len(offsets) - 1):
                # big enough for sequence groups on threads: the engine's own call
                results = run.run_prepared(const_args, [LoDTensor(data, [offsets])] + states)
                return [results[0].data] + list(results[1:1 + n])
            return one_group(data, offsets, states)

        def one_group(data, offsets, states, row_step=ROWS_IN_ORDER, padded=False):
            # run_group with the kernel's machine code where every argument
            # is exact, else through its dispatcher
            if (plain is not None and exactly(data, data_dtype, 2)
                    and exactly(offsets, np.int64, 1)
                    and all(exactly(s, data_dtype, 2) for s in states)):
                return list(run_group(plain, data, offsets, states, row_step, padded))
            return list(run_group(entry, read_only(data), read_only(offsets),
                                  [read_only(s) for s in states], row_step, padded))

        def run_group(kernel, data, offsets, states, row_step=ROWS_IN_ORDER, padded=False):
            # program() (its machine code, or its dispatcher) on one group of
            # sequences, into new output buffers (Y zeros where rows are
            # padded: those no step writes)
            rows, num_sequences = data.shape[0], offsets.shape[0] - 1
            outs = buffers(rows, num_sequences, padded)
            return kernel(*const_args, run.board(rows, num_sequences), row_step, data, offsets,
                          *states, *outs)[:1 + n]

        def by_steps(data, offsets, states, padded=False):
            # call's work for sequences whose rows are by steps (ONNX's
            # time-major X, ``padded`` past lengths under its T; Y's rows
            # come back so, zero past each length): None where the run is
            # split over threads (its groups are ranges of rows)
            num_sequences = offsets.shape[0] - 1
            if data.shape[1] != features or run.splits(data.shape[0], features, num_sequences):
                return None
            return one_group(data, offsets, given(states, num_sequences, data.dtype),
                             np.int64(num_sequences), padded)

        def direct(data, offsets, states):
            # call's work where the caller made every argument exact: ``data``
            # C-contiguous and aligned of the kernel's dtype, ``offsets`` int64
            # and contiguous, ``states`` given, of the kernel's dtype and shape,
            # C-contiguous and aligned; None where call is to take the run (its
            # width is wrong, or it is split over threads)
            if data.shape[1] != features or run.splits(data.shape[0], features,
                                                       offsets.shape[0] - 1):
                return None
            return run_group(plain, data, offsets, states)

        got = call(data, offsets, states)  # compiles nothing new: the public call's types
        sample = [threads.ALONE, ROWS_IN_ORDER, read_only(np.zeros((1, features), data_dtype)),
                  read_only(np.zeros(2, np.int64))]
        sample += [read_only(np.zeros((1, width), data_dtype))] * n + buffers(1, 1)
        plain = compiled_entry(entry, const_args + sample)
        if plain is not None:  # the results below are the plain kernel's
            got = call(data, offsets, states)
        if len(got) == len(expected) and all(
                a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
                for a, b in zip(got, expected)):
            call.direct = direct if plain is not None else (lambda data, offsets, states: None)
            call.by_steps = by_steps
            return call
    except Exception:  # noqa: BLE001  (any mismatch of layout: the public call stays)
        pass
    return None


class ScanNode:
    """An ONNX Scan node run as a step-net traced from its body graph, or node
    by node where the body does not trace."""

    def __init__(self, ctx, attrs, body):
        self.ctx = ctx
        known = {"body", "num_scan_inputs", "directions", "scan_input_axes",
                 "scan_input_directions", "scan_output_axes", "scan_output_directions"}
        unknown = sorted(set(attrs) - known)
        if unknown:
            raise ctx.unsupported(f"attribute {unknown[0]!r} is not supported")
        if ctx.opset < 8:
            raise ctx.unsupported(f"Scan needs opset 8 or later, the model has {ctx.opset}")
        self.body = body
        self.M = int(attrs["num_scan_inputs"])
        self.N = len(body.input_names) - self.M
        self.K = len(body.output_names) - self.N
        if self.N < 0 or self.K < 0:
            raise ctx.unsupported(f"the body has {len(body.input_names)} inputs and "
                                  f"{len(body.output_names)} outputs for {self.M} scan inputs")
        if ctx.opset == 8:
            for name in ("scan_input_axes", "scan_input_directions", "scan_output_axes",
                         "scan_output_directions"):
                if name in attrs:
                    raise ctx.unsupported(f"attribute {name!r} is not in Scan-8")
            self.in_dirs = list(attrs.get("directions", [0] * self.M))
            self.in_axes, self.out_axes, self.out_dirs = [1] * self.M, [1] * self.K, [0] * self.K
        else:
            if "directions" in attrs:
                raise ctx.unsupported("attribute 'directions' is Scan-8's; use scan_input_directions")
            self.in_dirs = list(attrs.get("scan_input_directions", [0] * self.M))
            self.in_axes = list(attrs.get("scan_input_axes", [0] * self.M))
            self.out_dirs = list(attrs.get("scan_output_directions", [0] * self.K))
            self.out_axes = list(attrs.get("scan_output_axes", [0] * self.K))
        for name, values, n in (("scan input directions", self.in_dirs, self.M),
                                ("scan input axes", self.in_axes, self.M),
                                ("scan output directions", self.out_dirs, self.K),
                                ("scan output axes", self.out_axes, self.K)):
            if len(values) != n:
                raise ctx.unsupported(f"{len(values)} {name} for {n} values")
        for d in self.in_dirs + self.out_dirs:
            if d not in (0, 1):
                raise ctx.unsupported(f"direction {d} is not 0 or 1")
        # traced step-nets by what they were traced on: key -> (captured arrays, rnn or None)
        self.nets = {}

    def run(self, inputs, backend, captures):
        """``captures``: the outer-scope arrays the body reads, by name."""
        return self.forward(inputs, backend, captures)[0]

    def forward(self, inputs, backend, captures, keep=False, wrt_captures=()):
        """``(outputs, pullback)``; with ``keep``, ``pullback(grads)`` maps one
        gradient (or None) per output to ``(one per input, {capture name:
        gradient} for wrt_captures)``.

        Scan 9+ first tries one sequence per row of axis 0 (every state and scan
        slice has the same first dimension, the body keeps rows apart); if the
        body mixes rows (:class:`~stepnet.onnx.ops.NotRowWise`) it runs as one
        sequence. Scan 8 runs one sequence per batch entry."""
        ctx = self.ctx
        if ctx.opset == 8:
            lengths, states, scans = inputs[0], inputs[1:1 + self.N], inputs[1 + self.N:]
        else:
            lengths, states, scans = None, inputs[:self.N], inputs[self.N:]
        if len(scans) != self.M or any(x is None for x in list(states) + list(scans)):
            raise ctx.unsupported(f"expects {self.N} states and {self.M} scan inputs, got "
                                  f"{len(states)} and {len(scans)}")
        states = [np.asarray(s) for s in states]
        scans = [np.asarray(x) for x in scans]
        given = (states, scans)
        float16 = any(a.dtype == np.float16 for a in states + scans)
        if float16:  # computed in float32, given back as float16 (docs/design.md §4)
            states, scans = ([a.astype(np.float32) if a.dtype == np.float16 else a for a in arrays]
                             for arrays in (states, scans))
        if ctx.opset == 8:
            layouts = [lambda: self._batched(states, scans, lengths)]
        else:
            layouts = [lambda: self._rows(states, scans), lambda: self._single(states, scans)]
        rnn = None
        for make_layout in layouts:
            layout = make_layout()
            if layout is None:
                continue
            # boolean scan inputs (masks) run as 0/1 and are compared back to booleans
            layout.masks = tuple(x.dtype == np.bool_ for x in layout.seqs)
            layout.seqs = [x.astype(np.float32) if x.dtype == np.bool_ else x for x in layout.seqs]
            rnn = self._net(layout, captures, float16)
            if rnn is not None:
                break
        if rnn is None:  # the body does not trace into a step-net: node by node
            if keep:
                raise ctx.unsupported("the Gradient through a Scan whose body runs node by node "
                                      "(it holds an op stepnet does not trace)")
            return self._loop(*given, lengths, backend, captures), None
        flags = (False,) * self.N + (True,) * self.K
        feeds = {f"scan{j}": s for j, s in enumerate(layout.seqs)}
        feeds.update({f"state{i}": s for i, s in enumerate(layout.inits)})
        try:
            if keep:
                outs, rnn_pullback = vjp(rnn, output_all_steps=flags, backend=backend, **feeds)
            else:
                outs = rnn(output_all_steps=flags, backend=backend, **feeds)
        except Error as e:
            raise _reraise(ctx, e) from e
        outs = list(outs) if self.N + self.K > 1 else [outs]  # one output comes unwrapped
        results = [layout.final_out(f) for f in outs[:self.N]]
        results += [self._scan_out(layout, k, y) for k, y in enumerate(outs[self.N:])]
        results = [np.array(y, order="C") for y in results]
        if float16:
            results = [y.astype(np.float16) if y.dtype == np.float32 else y for y in results]
        if not keep:
            return results, None

        def pullback(grads):
            grads = list(grads) + [None] * (len(results) - len(grads))
            cts = []
            for i, g in enumerate(grads):
                if g is not None:
                    g = np.asarray(g, np.float32 if float16 else results[i].dtype)
                    g = layout.final_in(g) if i < self.N else self._scan_out_back(layout, i - self.N, g)
                    g = np.ascontiguousarray(g)
                cts.append(g)
            names = list(feeds)
            arrays = [captures[n] for n in wrt_captures]
            try:
                found = rnn_pullback(cts, wrt=names + arrays)
            except Error as e:
                raise _reraise(ctx, e) from e
            by_name = dict(zip(names, found))
            d_states = [layout.final_back(by_name[f"state{i}"]) for i in range(self.N)]
            d_scans = [self._scan_in_back(layout, j, by_name[f"scan{j}"]) for j in range(self.M)]
            d_inputs = ([None] if ctx.opset == 8 else []) + d_states + d_scans
            d_inputs = [None if g is None or x is None or np.asarray(x).dtype.kind != "f"
                        else np.asarray(g, np.asarray(x).dtype) for g, x in zip(d_inputs, inputs)]
            return d_inputs, dict(zip(wrt_captures, found[len(names):]))

        return results, pullback

    # -- layouts: how the node's arrays become the step-net's feeds ----------------

    def _single(self, states, scans):
        """Scan 9+ as one sequence: each scan input's axis moved first."""
        seqs, T = [], None
        for j, (x, axis, d) in enumerate(zip(scans, self.in_axes, self.in_dirs)):
            if not -x.ndim <= axis < x.ndim:
                raise self.ctx.unsupported(f"scan input {j}: axis {axis} for rank {x.ndim}")
            x = np.moveaxis(x, axis, 0)
            x = np.ascontiguousarray(x[::-1] if d else x)
            if T is not None and x.shape[0] != T:
                raise self.ctx.unsupported(f"scan input {j} has {x.shape[0]} steps, scan input "
                                           f"0 has {T}")
            T = x.shape[0]
            seqs.append(LoDTensor(x, [[0, T]]))
        return _Layout("whole", seqs, [s[None] for s in states], T=T,
                       final_out=lambda f: f[0], final_in=lambda g: g[None],
                       final_back=lambda g: g[0])

    def _rows(self, states, scans):
        """Scan 9+ as one sequence per row of axis 0; None when the shapes do not allow it."""
        steps = []  # each scan input as [B, T, ...]: a view when it is laid out so
        for j, (x, axis, d) in enumerate(zip(scans, self.in_axes, self.in_dirs)):
            if not -x.ndim <= axis < x.ndim:
                raise self.ctx.unsupported(f"scan input {j}: axis {axis} for rank {x.ndim}")
            if x.ndim < 2:
                return None
            x = np.moveaxis(x, axis % x.ndim, 0)
            x = np.moveaxis(x[::-1] if d else x, 0, 1)
            steps.append(x)
        firsts = {a.shape[0] if a.ndim else None for a in states} | {x.shape[0] for x in steps}
        if len(firsts) != 1 or None in firsts or len({x.shape[1] for x in steps}) != 1:
            return None
        (B,), T = firsts, steps[0].shape[1]
        offsets = np.arange(B + 1, dtype=np.int64) * T
        seqs = [LoDTensor(np.ascontiguousarray(x).reshape((B * T,) + x.shape[2:]), [offsets])
                for x in steps]
        identity = lambda a: a  # noqa: E731
        return _Layout("rows", seqs, list(states), T=T, B=B, final_out=identity,
                       final_in=identity, final_back=identity)

    def _batched(self, states, scans, lengths):
        """Scan 8: ``[batch, sequence, ...]`` scan inputs, ``[batch, ...]`` states."""
        ctx = self.ctx
        B, T = scans[0].shape[:2] if scans[0].ndim >= 2 else (None, None)
        for j, x in enumerate(scans):
            if x.ndim < 2 or x.shape[:2] != (B, T):
                raise ctx.unsupported(f"scan input {j} has shape {list(x.shape)}, expected "
                                      f"[{B}, {T}, ...]")
        for i, s in enumerate(states):
            if s.ndim < 1 or s.shape[0] != B:
                raise ctx.unsupported(f"state {i} has shape {list(s.shape)}, expected [{B}, ...]")
        lengths = np.full(B, T, np.int64) if lengths is None else np.asarray(lengths)
        if lengths.shape != (B,) or lengths.dtype.kind not in "iu":
            raise ctx.unsupported(f"sequence_lens must be integers of shape [{B}]")
        bad = np.flatnonzero((lengths < 0) | (lengths > T))
        if bad.size:
            raise ctx.unsupported(f"sequence_lens[{bad[0]}] = {lengths[bad[0]]} is not in [0, {T}]")
        seqs = [LoDTensor.from_padded(_reverse_within(x, lengths) if d else x, lengths)
                for x, d in zip(scans, self.in_dirs)]
        identity = lambda a: a  # noqa: E731
        return _Layout("batched", seqs, states, T=T, B=B, lengths=lengths, final_out=identity,
                       final_in=identity, final_back=identity)

    def _scan_out(self, layout, k, y):
        """An all-steps output of the step-net as the node's scan output ``k``."""
        if layout.kind == "batched":
            return _padded(y, layout.T)
        data = y.data
        if layout.kind == "rows":  # [B*T, ...] -> [T, B, ...]
            data = data.reshape((layout.B, layout.T) + data.shape[1:]).swapaxes(0, 1)
        return np.moveaxis(data[::-1] if self.out_dirs[k] else data, 0, self.out_axes[k])

    def _scan_out_back(self, layout, k, g):
        """The adjoint of ``_scan_out``: a gradient of scan output ``k`` as rows."""
        if layout.kind == "batched":
            return LoDTensor.from_padded(g, layout.lengths).data
        g = np.moveaxis(g, self.out_axes[k], 0)
        g = g[::-1] if self.out_dirs[k] else g
        if layout.kind == "rows":
            g = g.swapaxes(0, 1).reshape((layout.B * layout.T,) + g.shape[2:])
        return g

    def _scan_in_back(self, layout, j, g):
        """A gradient with respect to the rows of scan input ``j``, in the input's shape."""
        if layout.kind == "batched":
            g = _padded(LoDTensor(g, layout.seqs[j].levels), layout.T)
            return _reverse_within(g, layout.lengths) if self.in_dirs[j] else g
        if layout.kind == "rows":
            g = g.reshape((layout.B, layout.T) + g.shape[1:]).swapaxes(0, 1)
        return np.moveaxis(g[::-1] if self.in_dirs[j] else g, 0, self.in_axes[j])

    # -- node by node ---------------------------------------------------------------

    def _loop(self, states, scans, lengths, backend, captures):
        """The Scan as its specification's loop, the body run as a graph at
        each step (recurrent nodes in it are step-nets of their own)."""
        if self.ctx.opset == 8:
            return self._loop8(states, scans, lengths, backend, captures)
        steps = []
        for j, (x, axis, d) in enumerate(zip(scans, self.in_axes, self.in_dirs)):
            if not -x.ndim <= axis < x.ndim:
                raise self.ctx.unsupported(f"scan input {j}: axis {axis} for rank {x.ndim}")
            x = np.moveaxis(x, axis, 0)
            steps.append(x[::-1] if d else x)
        T = steps[0].shape[0] if steps else 0
        for j, x in enumerate(steps):
            if x.shape[0] != T:
                raise self.ctx.unsupported(f"scan input {j} has {x.shape[0]} steps, scan input "
                                           f"0 has {T}")
        finals, ys = self._steps(list(states), steps, T, backend, captures)
        outs = []
        for k, y in enumerate(ys):
            y = y[::-1] if self.out_dirs[k] else y
            outs.append(np.ascontiguousarray(np.moveaxis(y, 0, self.out_axes[k] % y.ndim)))
        return list(finals) + outs

    def _steps(self, states, slices, T, backend, captures):
        """``T`` steps of the body from ``states`` over ``slices`` (each
        ``[T, ...]``): the final states and each scan output stacked ``[T, ...]``."""
        body = self.body
        ys = [[] for _ in range(self.K)]
        for t in range(T):
            env = {n: captures[n] for n in body.dynamic_captures}
            env.update(zip(body.input_names[:self.N], states))
            env.update(zip(body.input_names[self.N:], (x[t] for x in slices)))
            body.run(env, backend)
            outs = [env[n] for n in body.output_names]
            states = outs[:self.N]
            for k, y in enumerate(outs[self.N:]):
                ys[k].append(np.asarray(y))
        stacked = []
        for k, y in enumerate(ys):
            if y:
                stacked.append(np.stack(y))
            else:
                arg = body.output_args[self.N + k]
                shape = [d if isinstance(d, int) else 0 for d in (arg.shape or [])]
                stacked.append(np.zeros([0] + shape, body.output_dtypes[self.N + k] or np.float32))
        return [np.asarray(s) for s in states], stacked

    def _loop8(self, states, scans, lengths, backend, captures):
        """Scan 8: each batch entry its own loop over its length."""
        B, T = scans[0].shape[:2] if scans and scans[0].ndim >= 2 else (None, None)
        for j, x in enumerate(scans):
            if x.ndim < 2 or x.shape[:2] != (B, T):
                raise self.ctx.unsupported(f"scan input {j} has shape {list(x.shape)}, expected "
                                           f"[{B}, {T}, ...]")
        lengths = np.full(B, T, np.int64) if lengths is None else np.asarray(lengths)
        finals, outs = [[] for _ in range(self.N)], [[] for _ in range(self.K)]
        for b in range(B):
            n = int(lengths[b])
            slices = [x[b, :n][::-1] if d else x[b, :n] for x, d in zip(scans, self.in_dirs)]
            final, ys = self._steps([s[b] for s in states], slices, n, backend, captures)
            for i, f in enumerate(final):
                finals[i].append(f)
            for k, y in enumerate(ys):
                outs[k].append(y)
        results = [np.stack(f) for f in finals]
        for ys in outs:
            inner = next((y.shape[1:] for y in ys if len(y)), ys[0].shape[1:])
            padded = np.zeros((B, T) + tuple(inner), ys[0].dtype)
            for b, y in enumerate(ys):
                padded[b, :len(y)] = y
            results.append(padded)
        return results

    # -- tracing ----------------------------------------------------------------

    def _net(self, layout, captures, float16):
        """The step-net for this layout, traced once per shapes and captured
        arrays; None when the body mixes rows in the rows layout or holds an
        op that does not trace on step values."""
        key = (layout.kind, layout.masks, tuple((a.shape[1:], a.dtype.str) for a in
                                              [*layout.inits, *(s.data for s in layout.seqs)]),
               tuple((n, np.shape(v), np.asarray(v).dtype.str) for n, v in captures.items()))
        cached = self.nets.get(key)
        if cached is not None and all(_same(a, b) for a, b in zip(cached[0], captures.values())):
            return cached[1]
        try:
            rnn = self._trace(layout, captures, float16)
        except NotRowWise:
            if layout.kind != "rows":
                raise
            rnn = None
        except Error:  # an op or a dtype (integer scan inputs) that does not trace:
            rnn = None  # the body runs node by node, where a real error shows again
        self.nets[key] = (tuple(captures.values()), rnn)
        return rnn

    def _trace(self, layout, captures, float16):
        body = self.body
        rnn = dsl.create_rnn_op(name=self.ctx.node)
        with rnn.stepnet():
            env = {k: v.astype(np.float32) if float16 and np.asarray(v).dtype == np.float16 else v
                   for k, v in captures.items()}
            for j, (name, x) in enumerate(zip(body.input_names[self.N:], layout.seqs)):
                v = rnn.add_input(x, name=f"scan{j}")
                env[name] = sn_ops.greater(v, 0.5) if layout.masks[j] else v
            memories = []
            for i, (name, s) in enumerate(zip(body.input_names[:self.N], layout.inits)):
                m = rnn.add_memory(init=s, shape=s.shape[1:], name=f"state{i}")
                memories.append(m)
                env[name] = m.pre_state()
            body.run(env, backend=None, step=True, rows=layout.kind == "rows",
                     float16_as_float32=float16)
            outs = []
            for i, name in enumerate(body.output_names):
                v = env[name]
                if not is_step(v):
                    raise self.ctx.unsupported(f"body output {name!r} does not depend on a state "
                                               "or scan input")
                if i < self.N:
                    memories[i].update(v)
                    v = memories[i]
                outs.append(v)
            rnn.add_outputs(*outs)
        return rnn


class _Layout:
    """How one Scan run maps onto a step-net: ``kind`` is "rows", "whole" or
    "batched"; ``seqs`` the step inputs, ``inits`` the memories' initial
    values, and the maps of the final states to and from the node's layout."""

    def __init__(self, kind, seqs, inits, T, B=1, lengths=None, final_out=None, final_in=None,
                 final_back=None):
        self.kind, self.seqs, self.inits, self.T, self.B, self.lengths = kind, seqs, inits, T, B, lengths
        self.final_out, self.final_in, self.final_back = final_out, final_in, final_back
        self.masks = ()  # per step input: fed as 0/1 for a boolean scan input


def _same(a, b) -> bool:
    """The same array: the same object, or equal values (a weight computed
    again on each run by the graph around the node)."""
    if a is b:
        return True
    if a is None or b is None or is_step(a) or is_step(b):
        return False
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _reverse_within(x, lengths):
    """Each sequence ``b`` of ``x [B, T, ...]`` reversed over its first ``lengths[b]`` steps."""
    x = x.copy()
    for b, n in enumerate(lengths):
        x[b, :n] = x[b, :n][::-1]
    return x


def _padded(y: LoDTensor, T):
    """All-steps rows back into ``[B, T, ...]``, zero past each length."""
    return y.to_padded(steps=T)[0]
