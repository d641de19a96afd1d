"""ONNX's ``GRU``, ``LSTM`` and ``RNN`` nodes as stepnet step-nets.

The node's weights and attributes make a :mod:`stepnet.nn` layer
(``from_onnx``), built once per weights; each run calls each direction's
step-net on the batch, ``sequence_lens`` its LoD, so Y is zero past each
sequence's length and ``Y_h`` is each sequence's own last state, as the spec
says. (The layer's own call, which also stacks layers, is used for the
Gradient operator's pullback.) The ``Scan`` node is :mod:`stepnet.onnx.scan`.
"""

from __future__ import annotations

import weakref

import numpy as np

from .. import nn
from ..errors import Error, ShapeError
from ..lod import LoDTensor
from .ops import is_step

_COMMON = {"activation_alpha", "activation_beta", "activations", "clip", "direction",
           "hidden_size", "layout", "output_sequence"}
# the ONNX operators that are built-in layers, and the attributes each accepts
_LAYERS = {op: nn.layers.LAYERS[cell.name] for op, cell in nn.cells.ONNX_LAYERS.items()}
_ATTRS = {op: _COMMON | set(cell.onnx_attrs) for op, cell in nn.cells.ONNX_LAYERS.items()}


def node_error(ctx, error):
    """A stepnet error raised while running a node, with the node named
    (once: an error that names it already is given as it is)."""
    named = str(error).startswith("ONNX node")
    return type(error)(str(error) if named else f"ONNX node {ctx.node!r} ({ctx.op}): {error}")


class RecurrentNode:
    """An ONNX GRU, LSTM or RNN node run by a ``stepnet.nn`` layer."""

    def __init__(self, ctx, attrs, quantized=False):
        self.ctx = ctx
        # onnxruntime's DynamicQuantizeLSTM: an LSTM node whose W and R are
        # int8 (transposed: [directions, input, 4 * hidden]) with their
        # scales and zero points, run as the LSTM layer sn.quantize makes
        self.quantized = quantized
        self.op = "LSTM" if quantized else ctx.op
        self._dequantized = {}  # name -> (its int8 array, dequantized): _float_weights
        self._given = ()  # the inputs of the last call (DynamicQuantizeLSTM): _run_streaming
        unknown = sorted(set(attrs) - _ATTRS[self.op])
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
        self.cls = _LAYERS[self.op]
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
                or all(same_array(a, b) for a, b in zip(weights, kept))):
            return self.layer
        for name, w in (("W", W), ("R", R)):
            if np.ndim(w) != 3:
                raise ctx.unsupported(f"{name} must be 3-D, got shape {list(np.shape(w))}")
        if np.shape(W)[0] != (2 if self.attrs.get("direction") == "bidirectional" else 1):
            raise ctx.unsupported(f"W has {np.shape(W)[0]} directions, the node's direction is "
                                  f"{self.attrs.get('direction', 'forward')!r}")
        extra = {"P": P} if self.op == "LSTM" else {}
        if self.quantized:
            from ..quantize import quantize

            self.layer = quantize(self.cls.from_onnx(W, R, B, **extra, **self.attrs), "int8")
        elif self.layer is not None and all(
                np.shape(a) == np.shape(b) for a, b in zip(weights, self.weights)):
            self.layer.set_onnx_weights(0, W, R, B, **extra)  # new step-nets
        else:
            self.layer = self.cls.from_onnx(W, R, B, **extra, **self.attrs)
        self.compiled, self._streaming = {}, None
        self.weights = tuple(_kept(w) for w in weights)
        return self.layer

    def _prepare(self, inputs):
        """The node's inputs checked: ``(X batch-first, W, R, B, P, lengths or
        None when every sequence is full, h0, c0)``, states in ONNX's layout 0."""
        ctx = self.ctx
        inputs = list(inputs) + [None] * (12 - len(inputs))
        X, W, R, B, lengths, h0 = inputs[:6]
        c0, P = (inputs[6], inputs[7]) if self.op == "LSTM" else (None, None)
        if self.quantized:
            self._given = inputs  # (what _run_streaming compares the next call's with)
            W, R = (self._float_weights(name, w, *inputs[at:at + 2])
                    for name, w, at in (("W", W, 8), ("R", R, 10)))
        X = np.asarray(X)
        if X.ndim != 3:
            raise ctx.bad_input(f"X must be 3-D, got shape {list(X.shape)}")
        if np.ndim(W) == 3 and X.shape[2] != np.shape(W)[2]:
            raise ctx.bad_input(f"X has {X.shape[2]} features (its last axis), and W "
                                f"{list(np.shape(W))} takes {np.shape(W)[2]}")
        batch_first = X if self.layout else X.transpose(1, 0, 2)
        Bsz, T = batch_first.shape[:2]
        if lengths is not None:
            lengths = np.asarray(lengths)
            if lengths.shape != (Bsz,) or lengths.dtype.kind not in "iu":
                raise ctx.bad_input(f"sequence_lens must be integers of shape [{Bsz}] (a length "
                                    f"per sequence of X), got {lengths.dtype} "
                                    f"{list(lengths.shape)}")
            bad = np.flatnonzero((lengths < 0) | (lengths > T))
            if bad.size:
                raise ctx.bad_input(f"sequence_lens[{bad[0]}] = {lengths[bad[0]]} is not in "
                                    f"[0, {T}] (X's steps)")
            if np.all(lengths == T):
                lengths = None
        if self.layout:
            h0, c0 = (None if s is None else np.asarray(s).transpose(1, 0, 2) for s in (h0, c0))
        return batch_first, W, R, B, P, lengths, h0, c0

    def _float_weights(self, name, w, scale, zero_point):
        """A DynamicQuantizeLSTM's int8 weights ``w`` [D, rows, 4H] dequantized
        into an LSTM node's layout [D, 4H, rows] (kept while ``w`` is: the
        layer is built once), which the layer quantizes again by columns."""
        kept = self._dequantized.get(name)
        if kept is not None and all(same_array(a, b) for a, b in zip((w, scale, zero_point), kept[0])):
            return kept[1]
        given = (w, scale, zero_point)
        ctx = self.ctx
        if w is None or scale is None:
            raise ctx.unsupported(f"{name} and its scale are required")
        w = np.asarray(w)
        if w.dtype not in (np.int8, np.uint8) or w.ndim != 3:
            raise ctx.unsupported(f"{name} must be int8 or uint8 [directions, rows, 4 * hidden], got "
                                  f"{w.dtype} {list(w.shape)}")
        D, _, width = w.shape
        scale = np.asarray(scale, np.float32)
        zero = np.zeros((), np.float32) if zero_point is None else np.asarray(zero_point, np.float32)
        for what, a in (("scale", scale), ("zero point", zero)):
            if a.size not in (1, D, D * width):
                raise ctx.unsupported(f"{name}'s {what} has shape {list(a.shape)}: one per "
                                      f"direction or per direction and column")
        def spread(a):  # (one value, one per direction, or one per direction and column)
            return a.reshape(() if a.size == 1 else (D, 1, width) if a.size == D * width else (D, 1, 1))

        dequantized = (w.astype(np.float32) - spread(zero)) * spread(scale)
        found = np.ascontiguousarray(dequantized.transpose(0, 2, 1))
        self._dequantized[name] = (tuple(_kept(a) for a in given), found)
        return found

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
            raise node_error(ctx, e) from e
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
        if self.op != "LSTM":
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
            raise node_error(ctx, e) from e
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
        writing Y's by steps (``PreparedCall.by_steps``; Y zero past each
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
            raise node_error(self.ctx, e) from e
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
            offsets = self._full_offsets[Bsz, T] = np.arange(Bsz + 1, dtype=np.int64) * T
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
        if self.quantized:  # (the int8 arrays given, and their scales, the same as last time)
            if n < 12 or any(inputs[i] is not self._given[i] or _fed(inputs[i])
                             for i in (1, 2, 8, 9, 10, 11)):
                return None
            kept = (inputs[1], inputs[2], kept[2], kept[3])
        dtype = self.layer.dtype
        if (type(X) is not np.ndarray or X.ndim != 3 or X.dtype != dtype or n < 3
                or not _unchanged(inputs[1], kept[0]) or not _unchanged(inputs[2], kept[1])
                or not _unchanged(inputs[3] if n > 3 else None, kept[2])
                or (n > 4 and inputs[4] is not None)
                or not _unchanged(inputs[7] if n > 7 else None, kept[3])):  # (P: LSTM only)
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
            raise node_error(self.ctx, e) from e
        return self._outputs(results, Bsz, T, dtype)

    def _direction(self, d, backend):
        """Direction ``d``'s step-net, compiled for ``backend``."""
        key = (d, backend)
        run = self.compiled.get(key)
        if run is None:
            states = 2 if self.op == "LSTM" else 1
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
            if self.op == "LSTM":
                initial = None if h0 is None and c0 is None else (h0, c0)
                out = call(feed, initial, backend=backend)
                (Y, (h_n, c_n)) = out[0] if keep else out
                states = [h_n, c_n]
            else:
                out = call(feed, h0, backend=backend)
                Y, h_n = out[0] if keep else out
                states = [h_n]
        except Error as e:
            raise node_error(ctx, e) from e
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
            names = ["X", "h0"] + (["c0"] if self.op == "LSTM" else [])
            try:
                found = layer_pullback([dY] + d_states, wrt=params + names)
            except Error as e:
                raise node_error(ctx, e) from e
            by_param = {id(p): g for p, g in zip(params, found)}
            weights = layer.onnx_weights(0, value=lambda p: by_param[id(p)])
            dX, d_init = found[len(params)], found[len(params) + 1:]
            dX = dX if self.layout else dX.transpose(1, 0, 2)
            d_init = [state(g) for g in d_init]  # the transpose is its own inverse
            result = [dX, weights["W"], weights["R"], weights["B"], None, d_init[0]]
            if self.op == "LSTM":
                result += [d_init[1], weights.get("P")]
            return [None if g is None or x is None else np.asarray(g, np.asarray(x).dtype)
                    for g, x in zip(result, inputs)]

        return outs, pullback


class _Direction:
    """One direction of a GRU, LSTM or RNN node: its step-net compiled,
    called on ``(data [tokens, I], offsets [B + 1], states)`` (a state None:
    zeros) to give ``[Y data [tokens, H], h_n [B, H](, c_n)]``.

    It calls ``rnn.compile(backend)``. Where the backend runs machine code
    here, after the first call that its kernel answers, it takes the
    kernel's prepared call (``CompiledStepNet.prepared``: the weights laid
    out once, ``self.kernel``): stepnet's call binds and checks every input
    and lays out the weights again on each call, which costs more than the
    kernel itself for a chunk of audio. The prepared call is kept only if
    its first results equal, bit for bit, those of the public call it
    replaces."""

    def __init__(self, rnn, backend, states):
        self.rnn = rnn
        self.flags = (True,) + (False,) * states
        self.compiled = rnn.compile(backend)
        self.kernel = None
        self.tried = not self.compiled.capabilities.host_code

    def __call__(self, data, offsets, states):
        if self.kernel is not None:
            return self.kernel(data, offsets, states)
        feeds = {"x": LoDTensor(data, [offsets])}
        for name, state in zip(("h", "c"), states):
            if state is not None:
                feeds[name] = state
        # (None while a new kernel answers on the interpreter: asked again later)
        call = None if self.tried else self.compiled.prepared(self.flags)
        outs = self.compiled(output_all_steps=self.flags, **feeds)
        outs = [outs[0].data] + [np.asarray(o) for o in outs[1:]]
        if call is not None:
            self.tried = True
            got = call(data, offsets, states)
            if all(a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b)
                   for a, b in zip(got, outs)):
                self.kernel = call
        return outs


def _places(offsets):
    """Each row of sequences laid out by ``offsets``: its step and its
    sequence."""
    lengths = np.diff(offsets)
    return (np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths),
            np.repeat(np.arange(lengths.shape[0]), lengths))


_CONSTANTS = weakref.WeakValueDictionary()  # id -> each session's read-only constant


def session_constant(a):
    """``a``, one of a session's constants (an initializer, what constants
    compute, a memoized value), made read-only and known as such to ``_fed``."""
    if isinstance(a, np.ndarray):
        a.flags.writeable = False
        _CONSTANTS[id(a)] = a
    return a


def _fed(a) -> bool:
    """Whether ``a`` may change in place between calls: any array (a feed of
    the caller's, read-only or not, or a value the graph computed) but one of
    the session's constants (``session_constant``)."""
    return isinstance(a, np.ndarray) and _CONSTANTS.get(id(a)) is not a


def _kept(a):
    """What a node keeps of an array it was built from, to tell the next
    call's apart: a constant itself (the same object next time: its identity
    says it is unchanged), anything else a copy of its values."""
    return a.copy() if _fed(a) else a


def _unchanged(a, kept) -> bool:
    """Whether ``a`` holds what ``kept`` (:func:`_kept`) was made of: the same
    constant, or an array that may have changed with ``kept``'s values."""
    return a is kept or _fed(a) and same_array(a, kept)


def same_array(a, b) -> bool:
    """The same array: the same object, or equal values (a weight computed
    again on each run by the graph around the node)."""
    if a is b:
        return True
    if a is None or b is None or is_step(a) or is_step(b):
        return False
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
