"""What every built-in recurrent layer shares (``_RecurrentLayer``): its
options, weights, step-nets and runs; the layer classes are in ``layers``,
their layouts in ``layouts``, the backward of a call in ``layer_pullback``."""

from __future__ import annotations

import numbers
import operator

import numpy as np

from .. import dsl, sizes
from ..backends import backend as backend_info
from ..pullback import forward_with_workspace
from ..errors import ShapeError, StepNetError, UnsupportedError
from ..lod import LoDTensor, device_array, host_array
from ..tracing import Parameter, compute_dtype, current_frame
from . import cells
from .layer_pullback import LayerPullback
from .layouts import _Layouts

DIRECTIONS = ("forward", "reverse", "bidirectional_concat", "bidirectional_sum")
# cell name -> its layer class and its cell class (each registers itself)
LAYERS, CELLS = {}, {}


class _RecurrentLayer(_Layouts):
    """What every built-in layer shares; see the module docstring. A
    subclass names its cell (``cell = "gru"``, a key of ``cells.CELLS``)
    and reads everything else of it from that record, ``kind``."""

    cell = None
    kind = None
    _one_step = False  # a cell class (``_Cell``): one step, not a layer over sequences
    quantized = None  # "int8" or "bf16": its step-nets' products (``sn.quantize``)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.kind = cells.CELLS[cls.cell]
        (CELLS if cls._one_step else LAYERS).setdefault(cls.cell, cls)

    def __init__(self, input_size, hidden_size, num_layers=1, direction="forward",
                 combine="per_layer", activations=None, activation_alpha=None,
                 activation_beta=None, clip=None, dtype=np.float32, seed=None, *,
                 linear_before_reset=False, peephole=False, proj_size=0, input_forget=False,
                 bias=True):
        name = type(self).__name__
        self.bias = _flag(bias, f"{name}: bias")
        self.input_size = _positive(input_size, f"{name}: input_size")
        self.hidden_size = _positive(hidden_size, f"{name}: hidden_size")
        self.num_layers = _positive(num_layers, f"{name}: num_layers")
        if direction not in DIRECTIONS:
            raise StepNetError(f"{name}: direction {direction!r} is not one of {list(DIRECTIONS)}")
        if combine not in ("per_layer", "final"):
            raise StepNetError(f"{name}: combine {combine!r} is not 'per_layer' or 'final'")
        self.direction, self.combine = direction, combine
        self.num_directions = 2 if direction.startswith("bidirectional") else 1
        self.dtype = compute_dtype(np.dtype(dtype), f"{name}: dtype")
        if self.dtype not in (np.float32, np.float64):
            raise StepNetError(f"{name}: dtype must be float32 or float64, not {self.dtype}")
        self.clip = None if clip is None else _number(clip, f"{name}: clip")
        if self.clip is not None and not self.clip > 0:
            raise StepNetError(f"{name}: clip must be positive, got {clip}")
        self.linear_before_reset = _flag(linear_before_reset, f"{name}: linear_before_reset")
        self.peephole = _flag(peephole, f"{name}: peephole")
        self.proj_size = 0 if not proj_size else _positive(proj_size, f"{name}: proj_size")
        if self.proj_size >= self.hidden_size:
            raise StepNetError(f"{name}: proj_size must lie in [0, hidden_size), got {proj_size}")
        self.input_forget = _flag(input_forget, f"{name}: input_forget")
        self._set_activations(activations, activation_alpha, activation_beta)
        self._nets = {}  # (layer, direction) -> its step-net, built on first use
        self._workspace = None  # kept by a call with keep_workspace=True
        self._init_parameters(np.random.default_rng(seed))

    def __getstate__(self):
        """Pickled without a kept workspace (its step-nets drop their kernels)."""
        return dict(self.__dict__, _workspace=None)

    def __setstate__(self, state):
        """A copy's gate weights side by side again (a copy of a view is an
        array of its own): the same Parameters, given views of new arrays."""
        self.__dict__.update(state)
        self.__dict__.setdefault("bias", True)  # (pickled before layers had the option)
        for params in self._params.values():
            self._join_gate_weights(params)

    # -- configuration ----------------------------------------------------------

    @property
    def output_size(self):
        """Width of one direction's output (the projection's with proj_size)."""
        return self.proj_size or self.hidden_size

    def _set_activations(self, names, alphas, betas):
        where = type(self).__name__
        per_direction = len(self.kind.activations)
        if names is None:
            names = list(self._default_activations()) * self.num_directions
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise StepNetError(f"{where}: activations must be a list of names, got {names!r}")
        alphas = None if alphas is None else _numbers(alphas, f"{where}: activation_alpha")
        betas = None if betas is None else _numbers(betas, f"{where}: activation_beta")
        names = [cells.canonical_activation(n, where) for n in names]
        if len(names) == per_direction and self.num_directions == 2:
            # one direction's functions, with their alphas and betas, for both
            names = names * 2
            alphas = None if alphas is None else list(alphas) * 2
            betas = None if betas is None else list(betas) * 2
        if len(names) != per_direction * self.num_directions:
            raise StepNetError(
                f"{where}: activations lists {len(names)} functions; a {self.direction} "
                f"{self.kind.title} takes {per_direction} per direction"
            )
        self.activations = names
        self.activation_alpha = None if alphas is None else [float(a) for a in alphas]
        self.activation_beta = None if betas is None else [float(b) for b in betas]
        funcs, self._activation_specs = cells.resolve_activations(
            names, self.activation_alpha, self.activation_beta)
        self._acts = [funcs[d * per_direction:(d + 1) * per_direction]
                      for d in range(self.num_directions)]

    def _default_activations(self):
        return self.kind.activations

    def layer_input_size(self, layer):
        """Width of the input that ``layer`` reads.

        Parameters
        ----------
        layer : int
            A layer index, 0 the first.

        Returns
        -------
        int
            ``input_size`` for layer 0; above it, the width of one direction's
            output (``output_size``), twice that for a ``bidirectional_concat``
            stack combined per layer.

        Raises
        ------
        StepNetError
            ``layer`` is not an int in ``[0, num_layers)``.
        """
        layer = self._layer_index(layer, "layer_input_size")
        if layer == 0:
            return self.input_size
        if self.combine == "per_layer" and self.direction == "bidirectional_concat":
            return 2 * self.output_size
        return self.output_size

    def _layer_index(self, layer, method):
        """``layer`` as an int in ``[0, num_layers)``, or a StepNetError that
        names ``method`` and the valid range."""
        return _index(layer, self.num_layers, f"{type(self).__name__}.{method}: layer",
                      f"num_layers={self.num_layers}")

    def _direction_index(self, d, method):
        return _index(d, self.num_directions, f"{type(self).__name__}.{method}: direction",
                      f"direction={self.direction!r}")

    def _init_parameters(self, rng):
        """PyTorch's initialization: every weight and bias ``U(-k, k)``,
        ``k = 1/sqrt(hidden_size)``."""
        k = 1.0 / np.sqrt(self.hidden_size)
        H, P = self.hidden_size, self.output_size
        gates = len(self.kind.gates)
        sizes.check_all(f"the parameters of {type(self).__name__}(hidden_size={H})", [
            (f"l{layer}_{self._direction_name(d)}_{kind}", shape, self.dtype)
            for layer in range(self.num_layers) for d in range(self.num_directions)
            for kind, shape in (("W", (self.layer_input_size(layer), gates * H)),
                                ("R", (P, gates * H)), ("proj", (H, P if self.proj_size else 0)))])
        self._params = {}
        for layer in range(self.num_layers):
            for d in range(self.num_directions):
                I = self.layer_input_size(layer)

                def draw(*shape):
                    return rng.uniform(-k, k, shape).astype(self.dtype)

                arrays = {
                    "W": {g: draw(I, H) for g in self.kind.gates},
                    "R": {g: draw(P, H) for g in self.kind.gates},
                    "Wb": {g: draw(H) if self.bias else np.zeros(H) for g in self.kind.gates},
                    "Rb": {g: draw(H) if self.bias else np.zeros(H) for g in self.kind.gates},
                }
                if self.peephole:
                    arrays["P"] = {g: draw(H) for g in cells.PEEPHOLES}
                if self.proj_size:
                    arrays["proj"] = draw(H, P)
                self._set_layer(layer, d, arrays)

    def _set_layer(self, layer, d, arrays):
        prefix = f"l{layer}_{self._direction_name(d)}"
        params = {}
        for kind, value in arrays.items():
            if isinstance(value, dict):
                params[kind] = {g: Parameter(np.ascontiguousarray(v, self.dtype),
                                             name=f"{prefix}_{kind}_{g}")
                                for g, v in value.items()}
            else:
                params[kind] = Parameter(np.ascontiguousarray(value, self.dtype),
                                         name=f"{prefix}_{kind}")
        self._join_gate_weights(params)
        self._params[(layer, d)] = params
        self._nets.pop((layer, d), None)  # rebuilt with the new Parameters

    def _join_gate_weights(self, params):
        """The gate weights of each kind (``W``, ``R``) that a step reads as
        one product as one array, side by side in the order it reads them
        (``cells.joined_gates``), each gate's Parameter given its columns (a
        view): the Numba kernel's join of them is then that array, not a
        copy a call."""
        for kind in ("W", "R"):
            gates = params[kind]
            group = cells.joined_gates(self.cell, kind, self.linear_before_reset,
                                       self.input_forget)
            joined = np.ascontiguousarray(
                np.concatenate([gates[g].value for g in group], axis=1))
            start = 0
            for g in group:
                width = gates[g].value.shape[1]
                gates[g].value = joined[:, start:start + width]
                start += width

    def parameters(self):
        """Every weight, layer by layer and direction by direction (without
        ``bias=False``'s zero biases, which stay as they are)."""
        out = []
        for key in sorted(self._params):
            for kind, value in self._params[key].items():
                if self.bias or kind not in ("Wb", "Rb"):
                    out.extend(value.values() if isinstance(value, dict) else [value])
        return out

    # -- the step-nets ------------------------------------------------------------

    def _is_reverse(self, d):
        """Direction ``d`` (0 or 1) runs from each sequence's end to its start."""
        return d == 1 or self.direction == "reverse"

    def _direction_name(self, d):
        return "rev" if self._is_reverse(d) else "fwd"

    def step(self, x, state, layer=0, direction=0, attention=None):
        """One step of this layer's recurrence inside another step-net's block.

        The weights are the layer's Parameters, so training the enclosing
        step-net trains them, and its PyTorch/ONNX conversions hold. Outside
        a block, on NumPy arrays, it computes one step eagerly.

        Parameters
        ----------
        x : Value or ndarray
            The step's input ``[B, layer_input_size(layer)]``.
        state : MemoryHandle, Value or ndarray, or a pair of them
            The previous state ``[B, output_size]`` (LSTM: a pair ``(h, c)``,
            ``c`` ``[B, hidden_size]``). A memory handle (from ``add_memory``)
            is updated, as ``h.update`` would; a step value or array is only
            read.
        layer : int, default 0
            Whose weights: a layer in ``[0, num_layers)``.
        direction : int, default 0
            Whose weights: 0 the first direction, 1 the reverse one of a
            bidirectional layer.
        attention : Value or ndarray, optional
            AUGRU only, and required there: the step's score per sequence,
            ``[B, 1]``, which scales the update gate (``z' = (1 - a) * z``).

        Returns
        -------
        Value, MemoryHandle or ndarray, or a pair of them
            The new state (LSTM: ``(h, c)``); a memory handle given as the
            state comes back, standing for its updated value.

        Raises
        ------
        StepNetError
            No such layer or direction; an LSTM state that is not a pair;
            ``attention`` missing for an AUGRU or given to another layer.
        ShapeError
            ``attention`` is not ``[B, 1]``.
        """
        name = type(self).__name__
        if not 0 <= layer < self.num_layers or not 0 <= direction < self.num_directions:
            raise StepNetError(f"{name}.step: no layer {layer}, direction {direction} (the layer "
                               f"has {self.num_layers} layer(s), {self.num_directions} direction(s))")
        kind = self.kind
        pair = len(kind.states) > 1
        if pair and not (isinstance(state, (tuple, list)) and len(state) == len(kind.states)):
            many = "a pair" if len(kind.states) == 2 else f"{len(kind.states)} states"
            raise StepNetError(f"{name}.step: the state of an {kind.title} is {many} "
                               f"({', '.join(kind.states)})")
        states = [_StepState.of(v) for v in (state if pair else (state,))]
        if (attention is None) == kind.attention:
            raise StepNetError(f"{name}.step: " + (f"an {kind.title} step takes its attention "
                                                   "score" if attention is None else
                                                   "attention is for AUGRU only"))
        shape = tuple(getattr(attention, "shape", None) or np.shape(attention))
        if attention is not None and (len(shape) != 2 or shape[1] != 1):
            raise ShapeError(f"{name}.step: attention must be one score per sequence, [B, 1]; "
                             f"got shape {['B' if n is None else n for n in shape]}")
        if self.quantized:
            raise UnsupportedError(f"{name}.step: a quantized layer runs over sequences only; call "
                                   "the float layer's step in a step-net and quantize that")
        params = self._params[(layer, direction)]
        if current_frame() is None:  # eager, on arrays: the Parameters' values
            params = {key: ({g: v.value for g, v in value.items()} if isinstance(value, dict)
                            else value.value) for key, value in params.items()}
        kind.step(x, states, params, self._acts[direction], self, attention)
        new = tuple(v.new if isinstance(v, _StepState) else v for v in states)
        return new if pair else new[0]

    def step_net(self, layer, d):
        """The step-net of layer ``layer``, direction ``d``.

        Built on first use with this layer's Parameters and kept (until
        ``set_onnx_weights`` replaces them). Its inputs are ``x`` (and ``a``,
        the attention, for an AUGRU) and its memories (``kind.states``: ``h``,
        and ``c`` for an LSTM); its outputs are ``h`` at every step, then each memory's last
        value.

        Parameters
        ----------
        layer : int
            The layer, in ``[0, num_layers)``.
        d : int
            The direction: 0 the first (forward, or reverse for
            ``direction="reverse"``), 1 the reverse one of a bidirectional
            layer.

        Returns
        -------
        RNNOp

        Raises
        ------
        StepNetError
            ``layer`` is not an int in ``[0, num_layers)``, or ``d`` not one
            in ``[0, num_directions)``.
        """
        key = (self._layer_index(layer, "step_net"), self._direction_index(d, "step_net"))
        layer, d = key
        if key not in self._nets:
            I = self.layer_input_size(layer)
            X = LoDTensor.from_lengths(np.zeros((1, I), self.dtype), [[1]])
            rnn = dsl.create_rnn_op(reverse=self._is_reverse(d),
                                    name=f"{self.cell}_l{layer}_{self._direction_name(d)}")
            with rnn.stepnet():
                x = rnn.add_input(X, name="x")
                attention = None
                if self.kind.attention:
                    A = LoDTensor.from_lengths(np.zeros((1, 1), self.dtype), [[1]])
                    attention = rnn.add_input(A, name="a")
                memories = [rnn.add_memory(shape=[w], dtype=self.dtype, name=name)
                            for name, w in zip(self.kind.states, self.state_widths())]
                self.kind.step(x, memories, self._params[key], self._acts[d], self, attention)
                rnn.add_outputs(memories[0], *memories)
            if self.quantized:
                from ..quantize import quantize_step_net

                rnn = quantize_step_net(rnn, self.quantized)
            self._nets[key] = rnn
        return self._nets[key]

    def __str__(self):
        lines = [repr(self)]
        for layer in range(self.num_layers):
            for d in range(self.num_directions):
                lines.append(f"-- layer {layer}, {('forward', 'reverse')[self._is_reverse(d)]} --")
                lines.append(self.step_net(layer, d).ir())
        return "\n".join(lines)

    def __repr__(self):
        opts = [f"{self.input_size}", f"{self.hidden_size}"]
        if self.num_layers != 1:
            opts.append(f"num_layers={self.num_layers}")
        if self.direction != "forward":
            opts.append(f"direction={self.direction!r}")
            if self.num_layers > 1 and self.num_directions == 2:
                opts.append(f"combine={self.combine!r}")
        opts += self._repr_options()
        where = type(self).__name__
        defaults = [cells.canonical_activation(n, where) for n in self._default_activations()]
        if self.activations != defaults * self.num_directions:
            opts.append(f"activations={self.activations!r}")
        for name in ("activation_alpha", "activation_beta"):
            if getattr(self, name) is not None:
                opts.append(f"{name}={getattr(self, name)!r}")
        if self.clip is not None:
            opts.append(f"clip={self.clip}")
        if not self.bias:
            opts.append("bias=False")
        opts.append(f"dtype={self.dtype.name}")
        return f"{type(self).__name__}({', '.join(opts)})"

    def _repr_options(self):
        return []

    def __call__(self, X, h0=None, backend=None, keep_workspace=False):
        """``Y, h_n = layer(X, h0=None)``; see docs/design.md §5.

        Parameters
        ----------
        X : LoDTensor or tuple
            A LoDTensor ``[N, input_size]`` with at least one level (the
            layer runs over the sequences of its finest level), or
            ``(padded, lengths)`` with ``padded`` ``[B, T, input_size]`` and
            ``lengths`` ``[B]``. Floating point; float16 is computed in the
            layer's dtype and given back as float16.
        h0 : array_like, optional
            The initial state ``[num_layers * num_directions, B,
            hidden_size]``, indexed ``layer * num_directions + direction``.
            None: zeros.
        backend : str, optional
            ``"interpreter"``, ``"numba"`` or ``"cuda"``; None:
            ``default_backend()``.
        keep_workspace : bool, default False
            Keep this run's workspace, so that ``sn.gradients(layer, ...)``
            without inputs runs only the backward.

        Returns
        -------
        Y : LoDTensor or ndarray
            Every step's output, ``num_directions * hidden_size`` wide for
            ``bidirectional_concat``, else ``hidden_size``: a LoDTensor with
            X's LoD, or ``[B, T, width]`` padded with zeros when X was padded.
        h_n : ndarray
            Each sequence's last state, ``[num_layers * num_directions, B,
            hidden_size]``, indexed as ``h0``.

        Raises
        ------
        ShapeError
            ``X`` is not a LoDTensor with a level or a padded pair, or its
            width or dtype does not fit; ``h0`` has another shape.
        BackendError
            The backend is unknown or not available.
        """
        Y, (h_n,) = self._forward(X, None, [h0], backend, keep_workspace)
        return Y, h_n

    # -- running ------------------------------------------------------------------

    def _run(self, X, attention, initial, backend, tape=None):
        """X: a one-level LoDTensor of this layer's dtype. ``initial``: per
        state, ``None`` or ``[L*D, B, width]``. Returns Y's data, and per state
        ``[L*D, B, width]``. With ``tape`` (a dict), each step-net's pullback is
        kept in it by (layer, direction)."""
        L, D = self.num_layers, self.num_directions
        B = X.num_sequences
        states = [np.zeros((L * D, B, w), self.dtype) for w in self.state_widths()]
        # a concat's joined output, per layer whose directions are combined:
        # each direction copies its columns in on its own thread, right after
        # its run (while the other may still run), not both after both
        width = self.state_widths()[0]
        joined = {layer: np.empty((X.data.shape[0], D * width), self.dtype) for layer in range(L)
                  if D == 2 and self.direction == "bidirectional_concat"
                  and (self.combine == "per_layer" or layer == L - 1)}

        def run_one(layer, d, inp):
            feeds = {"x": inp}
            if attention is not None:
                feeds["a"] = attention
            names = ("h", "c")
            for s, init in enumerate(initial):
                if init is not None:
                    feeds[names[s]] = init[layer * D + d]
            rnn = self.step_net(layer, d)
            flags = (True,) + (False,) * len(states)
            if tape is None:
                outs = rnn(output_all_steps=flags, backend=backend, **feeds)
            else:
                outs, tape[layer, d] = forward_with_workspace(rnn, flags, backend, **feeds)
            for s in range(len(states)):  # (a state given back on the device: copied here)
                states[s][layer * D + d] = host_array(outs[1 + s])
            if layer in joined:  # (two directions are joined on the host)
                joined[layer][:, d * width:(d + 1) * width] = outs[0].to_host().data
            return outs[0]

        def combined(ys, layer):
            if len(ys) == 1:
                return ys[0].data
            if self.direction == "bidirectional_sum":
                return ys[0].to_host().data + ys[1].to_host().data
            return joined[layer]

        Y = self.stack(X, run_one,
                       lambda ys, layer: LoDTensor._trusted(combined(ys, layer), X.levels),
                       self._direction_work(X.data.shape[0], [backend]))
        return Y.data, states

    def _direction_work(self, rows, backends):
        """The elements a direction's step-net runs over, as
        ``threads.run_apart`` weighs them: 0 unless every run is on Numba,
        whose kernels release the GIL (its directions then run at the same
        time, each on half of the threads: each kernel's products take every
        sequence's row, which runs them faster than half of them)."""
        apart = all(backend_info(b).releases_gil for b in backends)
        return rows * self.hidden_size if apart else 0

    def stack(self, X, run, combine, work=0):
        """Run the stack on ``X`` in the order of ``self.combine``.

        ``combine="per_layer"``: each layer reads the previous layer's
        combined directions; ``"final"``: each direction's whole stack runs on
        its own and only the tops are combined. The directions run at the
        same time where their ``work`` is worth it (``threads.run_apart``).

        Parameters
        ----------
        X : LoDTensor
            The input of layer 0.
        run : callable
            ``run(layer, d, input) -> output``: runs one (layer, direction)
            step-net on ``input``.
        combine : callable
            ``combine(outputs, layer) -> output``: joins the directions'
            outputs (a list, one per direction) of ``layer`` (the top one's,
            for ``"final"``) into the next layer's input.
        work : int, default 0
            The elements one direction's run covers, as
            ``threads.run_apart`` weighs them; 0 runs the directions one after
            the other.

        Returns
        -------
        object
            What ``combine`` returns for the top layer.
        """
        L, D = self.num_layers, self.num_directions

        def directions(fn):
            from ..jit import threads  # (at the first run: importing stepnet starts no engine)

            return threads.run_apart(fn, range(D), work)

        if self.combine == "per_layer" or D == 1:
            inp = X
            for layer in range(L):
                inp = combine(directions(lambda d, layer=layer, inp=inp: run(layer, d, inp)),
                              layer)
            return inp

        def whole_stack(d):
            inp = X
            for layer in range(L):
                inp = run(layer, d, inp)
            return inp

        return combine(directions(whole_stack), L - 1)

    def state_widths(self):
        """The width of each recurrent state: ``(H,)``; LSTM ``(H or proj, H)``."""
        return (self.output_size,) + (self.hidden_size,) * (len(self.kind.states) - 1)

    def _check_input(self, X):
        """``X`` as (one-level LoDTensor over the finest sequences, how to give
        Y back: its layout and dtype). float16 input is computed in the
        layer's dtype and given back as float16 (docs/design.md §4)."""
        name = type(self).__name__
        if isinstance(X, tuple) and len(X) == 2:
            padded, lengths = X
            if device_array(padded) is not None:
                raise UnsupportedError(f"{name}: a padded input on the GPU; pass a LoDTensor "
                                       "of its rows (LoDTensor(rows_on_the_gpu, lod))")
            padded = np.asarray(padded)
            if padded.ndim != 3:
                raise ShapeError(f"{name}: padded input must be [B, T, input_size], got "
                                 f"shape {list(padded.shape)}")
            flat = LoDTensor.from_padded(padded, lengths)
            back = ("padded", padded.shape[1])
        elif isinstance(X, LoDTensor):
            if X.num_levels == 0:
                raise ShapeError(f"{name}: input LoDTensor has no LoD level")
            flat = X if X.num_levels == 1 else LoDTensor(X.data, [X.levels[-1]])
            back = ("lod", X.levels)
        else:
            raise ShapeError(f"{name}: input must be a LoDTensor or (padded [B, T, I], lengths), "
                             f"got {type(X).__name__}")
        if flat.data.ndim != 2 or flat.data.shape[1] != self.input_size:
            raise ShapeError(f"{name}: input has feature shape {list(flat.data.shape[1:])}, the "
                             f"layer expects [{self.input_size}] (input_size)")
        if flat.dtype.kind != "f":
            raise ShapeError(f"{name}: input dtype {flat.dtype} is not floating point")
        back = back + (np.float16 if flat.dtype == np.float16 else self.dtype,)
        if flat.dtype != self.dtype:
            flat = flat.astype(self.dtype)
        return flat, back

    def _check_state(self, value, width, what, batch):
        if value is None:
            return None
        value = host_array(value)  # (one on the GPU is copied: a row per sequence)
        self._check_state_shape(value.shape, width, what, batch)
        return np.ascontiguousarray(value, self.dtype)

    def _check_state_shape(self, shape, width, what, batch):
        """Refuse an initial state ``what`` of ``shape`` for ``batch``
        sequences and a state of ``width`` (a ShapeError naming both)."""
        expected = (self.num_layers * self.num_directions, batch, width)
        if tuple(shape) != expected:
            raise ShapeError(f"{type(self).__name__}: {what} has shape {list(shape)}, expected "
                             f"[num_layers * num_directions, B, {width}] = {list(expected)}")

    def _give_back(self, data, back, flat):
        if flat.on_device:  # (X on the GPU: Y there too, in the layer's dtype)
            Y = LoDTensor._trusted(data, back[1])
            return Y.to_device() if isinstance(data, np.ndarray) else Y
        data = data.astype(back[2], copy=False)
        if back[0] == "lod":  # the input's own (checked) levels
            return LoDTensor._trusted(data, back[1])
        return LoDTensor._trusted(data, flat.levels).to_padded(steps=back[1])[0]

    def _forward(self, X, attention, initial, backend, keep_workspace=False):
        flat, back = self._check_input(X)
        if keep_workspace and flat.on_device:
            raise UnsupportedError(f"{type(self).__name__}: a layer's gradients take rows on the "
                                   "host (a step-net's take them on the GPU); pass X.to_host()")
        if attention is not None:
            attention = self._check_attention(attention, X, flat, back)
        B = flat.num_sequences
        names = ("h0", "c0")
        initial = [self._check_state(v, w, names[i], B)
                   for i, (v, w) in enumerate(zip(initial, self.state_widths()))]
        tape = {} if keep_workspace else None
        data, states = self._run(flat, attention, initial, backend, tape)
        Y = self._give_back(data, back, flat)
        if keep_workspace:
            self._workspace = LayerPullback(self, tape, flat, back, data.shape[1],
                                            attention is not None)
        if flat.on_device:
            from numba import cuda

            return Y, [cuda.to_device(h) for h in states]
        return Y, [h.astype(back[2], copy=False) for h in states]

    def vjp(self, *args, backend=None, **kwargs):
        """``(outputs, pullback)``: the layer's outputs as a call returns them,
        and the pullback of that run (see ``stepnet.vjp``).

        The pullback is also kept as the layer's workspace, as a call with
        ``keep_workspace=True`` keeps it.

        Parameters
        ----------
        *args
            The call's positional arguments: ``X``, then the initial state
            (AUGRU: the attention, then the initial state).
        backend : str, optional
            The backend; None: ``default_backend()``.
        **kwargs
            The call's keyword arguments (``h0=``, ``initial=``,
            ``attention=``).

        Returns
        -------
        outputs
            What the call returns.
        pullback : LayerPullback
            ``pullback(grad_outputs, wrt=None, accumulate=False, out=None)``:
            ``grad_outputs`` is ``[dY, dh_n]`` (LSTM ``[dY, dh_n, dc_n]``,
            None for zeros); ``wrt`` holds the layer's Parameters and
            ``"X"``, ``"h0"``, ``"c0"``, ``"attention"`` (default: the
            Parameters).
        """
        outputs = self(*args, backend=backend, keep_workspace=True, **kwargs)
        return outputs, self._workspace


class _StepState:
    """A state given to :meth:`_RecurrentLayer.step` as the cells read it:
    a memory handle itself, or a value wrapped as one that is not updated."""

    def __init__(self, value):
        self.value, self.new = value, None

    @staticmethod
    def of(v):
        return v if isinstance(v, dsl.MemoryHandle) else _StepState(v)

    def pre_state(self):
        return self.value

    def update(self, v):
        self.new = v


def _index(i, n, what, why):
    """``i`` as an int in ``[0, n)``; else a StepNetError: ``{what} {i} is out
    of range [0, n) ({why})``."""
    try:
        if isinstance(i, (bool, np.bool_)):
            raise TypeError
        index = operator.index(i)
    except TypeError:
        raise StepNetError(f"{what} must be an int, got {i!r}") from None
    if not 0 <= index < n:
        raise StepNetError(f"{what} {index} is out of range [0, {n}) ({why})")
    return index


def _flag(value, what):
    if not isinstance(value, (bool, np.bool_)):
        raise StepNetError(f"{what} must be True or False, got {value!r}")
    return bool(value)


def _number(value, what):
    value = value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise StepNetError(f"{what} must be a number, got {value!r}")
    return float(value)


def _numbers(values, what):
    """``values`` (a list or tuple of real numbers) as floats."""
    values = values.tolist() if isinstance(values, np.ndarray) and values.ndim == 1 else values
    if not isinstance(values, (list, tuple)):
        raise StepNetError(f"{what} must be a list of numbers, got {values!r}")
    return [_number(v, what) for v in values]


def _positive(value, what):
    try:
        whole = isinstance(value, numbers.Real) and not isinstance(value, bool) \
            and int(value) == value and value >= 1
    except (OverflowError, ValueError):  # (inf, nan)
        whole = False
    if not whole:
        raise StepNetError(f"{what} must be a positive integer, got {value!r}")
    return int(value)
