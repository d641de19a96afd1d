"""The built-in recurrent layers: RNN, LSTM, GRU, AUGRU and MGU over LoD
batches; each reads its cell's record (``cells.CELLS``).

Each (layer, direction) of a layer is one step-net (``cells.py`` writes its
step), built on the first call and run on any backend; nothing here has a
private fast path. A call runs the step-nets layer after layer (``combine=
"per_layer"``: each layer reads both directions' combined outputs, as PyTorch
and ONNX stack) or direction after direction (``combine="final"``: each
direction's whole stack runs on its own and the stacks are combined at the
end, as oneDNN does).

Weights are kept per gate in ONNX's gate order; ``onnx_weights(l)`` gives
layer ``l`` in ONNX's layout, ``from_onnx``/``to_onnx`` and
``from_torch``/``to_torch`` convert (PyTorch's GRU gates are r, z, n and its
GRU is ONNX's ``linear_before_reset=1``; its LSTM gates are i, f, g, o).
"""

from __future__ import annotations

import operator

import numpy as np

from .. import dsl, sizes
from ..backends import backend as backend_info
from ..pullback import _deliver, forward_with_workspace
from ..errors import ShapeError, StepNetError, UnsupportedError, optional_import
from ..lod import LoDTensor
from ..tracing import Parameter, compute_dtype, current_frame
from . import cells

DIRECTIONS = ("forward", "reverse", "bidirectional_concat", "bidirectional_sum")
_ONNX_DIRECTION = {"forward": "forward", "reverse": "reverse",
                   "bidirectional_concat": "bidirectional"}
_FROM_ONNX_DIRECTION = {"forward": "forward", "reverse": "reverse",
                        "bidirectional": "bidirectional_concat"}
# cell name -> its layer class and its cell class (each registers itself)
LAYERS, CELLS = {}, {}


class _RecurrentLayer:
    """What every built-in layer shares; see the module docstring. A
    subclass names its cell (``cell = "gru"``, a key of ``cells.CELLS``)
    and reads everything else of it from that record, ``kind``."""

    cell = None
    kind = None
    _one_step = False  # a cell class (``_Cell``): one step, not a layer over sequences

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.kind = cells.CELLS[cls.cell]
        (CELLS if cls._one_step else LAYERS).setdefault(cls.cell, cls)

    def __init__(self, input_size, hidden_size, num_layers=1, direction="forward",
                 combine="per_layer", activations=None, activation_alpha=None,
                 activation_beta=None, clip=None, dtype=np.float32, seed=None, *,
                 linear_before_reset=False, peephole=False, proj_size=0, input_forget=False):
        name = type(self).__name__
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
        self.clip = cells.float_or_none(clip)
        if self.clip is not None and not self.clip > 0:
            raise StepNetError(f"{name}: clip must be positive, got {clip}")
        self.linear_before_reset = bool(linear_before_reset)
        self.peephole = bool(peephole)
        self.proj_size = int(proj_size or 0)
        if self.proj_size < 0 or (self.proj_size and self.proj_size >= self.hidden_size):
            raise StepNetError(f"{name}: proj_size must lie in [0, hidden_size), got {proj_size}")
        self.input_forget = bool(input_forget)
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
                    "Wb": {g: draw(H) for g in self.kind.gates},
                    "Rb": {g: draw(H) for g in self.kind.gates},
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
        """Every weight, layer by layer and direction by direction."""
        out = []
        for key in sorted(self._params):
            for value in self._params[key].values():
                out.extend(value.values() if isinstance(value, dict) else [value])
        return out

    # -- ONNX layout --------------------------------------------------------------

    def onnx_weights(self, layer, value=None):
        """Layer ``layer``'s weights in ONNX's layout.

        ``D`` is the number of directions, ``G`` of gates (RNN 1, MGU 2,
        GRU and AUGRU 3, LSTM 4, in ONNX's gate order), ``H`` is ``hidden_size``,
        ``I`` the layer's input width and ``Hr`` the state's width
        (``proj_size`` with a projection, else ``H``).

        Parameters
        ----------
        layer : int
            The layer, in ``[0, num_layers)``.
        value : callable, optional
            ``value(parameter) -> array``: what to lay out for each of the
            layer's Parameters. None: its value. A lookup of gradients by
            Parameter gives the gradients in ONNX's layout.

        Returns
        -------
        dict of str to ndarray
            ``"W"`` ``[D, G*H, I]``, ``"R"`` ``[D, G*H, Hr]``, ``"B"``
            ``[D, 2*G*H]`` (the input biases, then the recurrent ones); with
            peepholes ``"P"`` ``[D, 3*H]`` (gates i, o, f); with a projection
            ``"proj"`` ``[D, Hr, H]`` (PyTorch's ``weight_hr``).

        Raises
        ------
        StepNetError
            ``layer`` is not an int in ``[0, num_layers)``.
        """
        layer = self._layer_index(layer, "onnx_weights")
        value = value or (lambda p: p.value)
        gates = self.kind.gates
        out = {"W": [], "R": [], "B": []}
        for d in range(self.num_directions):
            p = self._params[(layer, d)]
            out["W"].append(np.concatenate([value(p["W"][g]).T for g in gates], 0))
            out["R"].append(np.concatenate([value(p["R"][g]).T for g in gates], 0))
            out["B"].append(np.concatenate([value(p["Wb"][g]) for g in gates]
                                           + [value(p["Rb"][g]) for g in gates]))
            if self.peephole:
                out.setdefault("P", []).append(
                    np.concatenate([value(p["P"][g]) for g in cells.PEEPHOLES]))
            if self.proj_size:
                out.setdefault("proj", []).append(value(p["proj"]).T)
        return {k: np.stack(v) for k, v in out.items()}

    def set_onnx_weights(self, layer, W, R, B=None, P=None, proj=None):
        """Set layer ``layer``'s weights from ONNX's layout (see ``onnx_weights``).

        The layer gets new Parameters (copies, in its dtype); its step-nets
        are rebuilt on their next use.

        Parameters
        ----------
        layer : int
            The layer, in ``[0, num_layers)``.
        W : array_like
            ``[D, G*H, I]``, the input weights of each direction.
        R : array_like
            ``[D, G*H, Hr]``, the recurrent weights.
        B : array_like, optional
            ``[D, 2*G*H]``, the input biases then the recurrent ones. None:
            zeros.
        P : array_like, optional
            ``[D, 3*H]``, the peephole weights (gates i, o, f); read only with
            ``peephole``. None: zeros.
        proj : array_like, optional
            ``[D, Hr, H]``, the projection (PyTorch's ``weight_hr``); required
            with ``proj_size``, ignored without.

        Raises
        ------
        StepNetError
            ``layer`` is not an int in ``[0, num_layers)``.
        ShapeError
            An array whose shape is not the one expected.
        """
        layer = self._layer_index(layer, "set_onnx_weights")
        gates = self.kind.gates
        G, H, D = len(gates), self.hidden_size, self.num_directions
        I, Hr = self.layer_input_size(layer), self.output_size
        W, R = np.asarray(W), np.asarray(R)
        B = np.zeros((D, 2 * G * H), W.dtype) if B is None else np.asarray(B)
        expected = {"W": ((D, G * H, I), W), "R": ((D, G * H, Hr), R), "B": ((D, 2 * G * H), B)}
        if self.peephole:
            P = np.zeros((D, 3 * H), W.dtype) if P is None else np.asarray(P)
            expected["P"] = ((D, 3 * H), P)
        if self.proj_size:
            expected["proj"] = ((D, Hr, H), np.asarray(proj))
        for key, (shape, value) in expected.items():
            if value.shape != shape:
                raise ShapeError(f"{type(self).__name__} layer {layer}: {key} has shape "
                                 f"{list(value.shape)}, expected {list(shape)}")
        for d in range(D):
            arrays = {
                "W": {g: W[d, j * H:(j + 1) * H].T for j, g in enumerate(gates)},
                "R": {g: R[d, j * H:(j + 1) * H].T for j, g in enumerate(gates)},
                "Wb": {g: B[d, j * H:(j + 1) * H] for j, g in enumerate(gates)},
                "Rb": {g: B[d, (G + j) * H:(G + j + 1) * H] for j, g in enumerate(gates)},
            }
            if self.peephole:
                arrays["P"] = {g: P[d, j * H:(j + 1) * H] for j, g in enumerate(cells.PEEPHOLES)}
            if self.proj_size:
                arrays["proj"] = expected["proj"][1][d].T
            self._set_layer(layer, d, arrays)

    @classmethod
    def from_onnx(cls, W, R, B=None, P=None, **attrs):
        """A one-layer layer from an ONNX GRU/LSTM/RNN node's inputs and
        attributes.

        Parameters
        ----------
        W : array_like
            ``[D, G*H, I]``, the node's input weights; ``I`` is the layer's
            ``input_size``. Its dtype is the layer's when it is float32 or
            float64, else float32.
        R : array_like
            ``[D, G*H, H]``, the recurrent weights; ``H`` is ``hidden_size``
            unless the attributes give it.
        B : array_like, optional
            ``[D, 2*G*H]``, the biases. None: zeros.
        P : array_like, optional
            ``[D, 3*H]``, the peephole weights: LSTM only (it turns
            ``peephole`` on).
        **attrs
            The node's attributes: ``hidden_size``, ``direction``
            (``"forward"``, ``"reverse"`` or ``"bidirectional"``, str or
            bytes), ``activations``, ``activation_alpha``,
            ``activation_beta``, ``clip``, ``linear_before_reset`` (GRU),
            ``input_forget`` (LSTM); ``layout`` is accepted and ignored (it is
            the layout of X and Y, not of the weights).

        Returns
        -------
        layer
            An instance of this class with ``num_layers=1``.

        Raises
        ------
        ShapeError
            ``W`` or ``R`` is not 3-D, or a weight's shape does not fit.
        StepNetError
            An unknown direction or attribute, or ``P`` given to a layer
            other than an LSTM.
        """
        W, R = np.asarray(W), np.asarray(R)
        if W.ndim != 3 or R.ndim != 3:
            raise ShapeError(f"{cls.__name__}.from_onnx: W and R must be 3-D, got "
                             f"{list(W.shape)} and {list(R.shape)}")
        attrs = dict(attrs)
        hidden = int(attrs.pop("hidden_size", R.shape[2]))
        direction = attrs.pop("direction", "forward")
        if isinstance(direction, bytes):
            direction = direction.decode()
        if direction not in _FROM_ONNX_DIRECTION:
            raise StepNetError(f"{cls.__name__}.from_onnx: direction {direction!r} is not "
                               f"forward, reverse or bidirectional")
        attrs.pop("layout", None)  # the layout of X and Y, not of the weights
        activations = attrs.pop("activations", None)
        if activations is not None:
            activations = [a.decode() if isinstance(a, bytes) else a for a in activations]
        kwargs = {
            "direction": _FROM_ONNX_DIRECTION[direction],
            "activations": activations,
            "activation_alpha": attrs.pop("activation_alpha", None),
            "activation_beta": attrs.pop("activation_beta", None),
            "clip": attrs.pop("clip", None),
            "dtype": W.dtype if W.dtype in (np.float32, np.float64) else np.float32,
        }
        kwargs.update(cls._onnx_options(attrs, P))
        if attrs:
            raise StepNetError(f"{cls.__name__}.from_onnx: unknown attribute(s) {sorted(attrs)}")
        layer = cls(W.shape[2], hidden, **kwargs)
        layer.set_onnx_weights(0, W, R, B, P)
        return layer

    @classmethod
    def _onnx_options(cls, attrs, P):
        """The layer options an ONNX node's attributes and peepholes give."""
        if P is not None and "peephole" not in cls.kind.options:
            raise StepNetError(f"{cls.__name__}.from_onnx: P (peepholes) is an LSTM input")
        options = {a: bool(attrs.pop(a, 0)) for a in cls.kind.onnx_attrs}
        return dict(options, peephole=P is not None) if "peephole" in cls.kind.options else options

    def to_onnx(self):
        """The ONNX node's inputs and attributes: a dict (W, R, B, P with
        peepholes, hidden_size, direction, activations, activation_alpha,
        activation_beta, clip, and linear_before_reset or input_forget), or a
        list of such dicts, one per layer, for a stack."""
        name = type(self).__name__
        if self.kind.onnx is None:
            raise UnsupportedError(f"{name}: ONNX has no {self.kind.title} operator")
        if self.direction not in _ONNX_DIRECTION:
            raise UnsupportedError(f"{name}: ONNX has no {self.direction} direction")
        if self.proj_size:
            raise UnsupportedError(f"{name}: ONNX's LSTM has no projection (proj_size)")
        if self.num_layers > 1 and self.combine == "final" and self.num_directions == 2:
            raise UnsupportedError(f"{name}: ONNX stacks layers per layer, not combine='final'")
        nodes = []
        for layer in range(self.num_layers):
            node = self.onnx_weights(layer)
            node.update(
                hidden_size=self.hidden_size,
                direction=_ONNX_DIRECTION[self.direction],
                activations=list(self.activations),
                activation_alpha=[a for _, a, _ in self._activation_specs if a is not None],
                activation_beta=[b for _, _, b in self._activation_specs if b is not None],
                clip=self.clip,
            )
            node.update({a: int(getattr(self, a)) for a in self.kind.onnx_attrs})
            nodes.append(node)
        return nodes[0] if self.num_layers == 1 else nodes

    # -- PyTorch layout -----------------------------------------------------------

    @classmethod
    def from_torch(cls, module):
        """A layer with the weights (and dtype) of a ``torch.nn.RNN``, ``LSTM``
        or ``GRU``.

        The gates are reordered from PyTorch's order to ONNX's; a GRU comes
        with ``linear_before_reset=True`` (PyTorch's GRU), an LSTM with its
        ``proj_size``.

        Parameters
        ----------
        module : torch.nn.RNN, torch.nn.GRU or torch.nn.LSTM
            Exactly the class that matches this layer's (not a subclass);
            float32 or float64; any number of layers, one or two directions,
            with or without biases.

        Returns
        -------
        layer
            An instance of this class.

        Raises
        ------
        StepNetError
            ``module`` is of another class, or of another dtype.
        UnsupportedError
            PyTorch is not installed.
        """
        torch = _torch_of(cls, "from_torch")
        expected = getattr(torch.nn, cls.kind.torch)
        if type(module) is not expected:
            raise StepNetError(f"{cls.__name__}.from_torch expects a {expected.__name__}, "
                               f"got {type(module).__name__}")
        first = module.weight_ih_l0.detach()
        dtype = {torch.float32: np.float32, torch.float64: np.float64}.get(first.dtype)
        if dtype is None:
            raise StepNetError(f"{cls.__name__}.from_torch: dtype {first.dtype} is not "
                               f"float32 or float64")
        kwargs = {
            "num_layers": module.num_layers,
            "direction": "bidirectional_concat" if module.bidirectional else "forward",
            "dtype": dtype,
        }
        kwargs.update(cls._torch_options(module))
        layer = cls(module.input_size, module.hidden_size, **kwargs)
        order = cls.kind.torch_gates
        H = module.hidden_size
        for l in range(module.num_layers):
            arrays = {"W": [], "R": [], "B": [], "proj": []}
            for d in range(layer.num_directions):
                sfx = f"_l{l}" + ("_reverse" if d else "")

                def get(name, sfx=sfx):
                    t = getattr(module, name + sfx, None)
                    return None if t is None else t.detach().cpu().numpy().astype(dtype)

                w_ih, w_hh = get("weight_ih"), get("weight_hh")
                b_ih = get("bias_ih") if module.bias else np.zeros(len(order) * H, dtype)
                b_hh = get("bias_hh") if module.bias else np.zeros(len(order) * H, dtype)
                # PyTorch's gate blocks in ONNX's gate order
                rows = [order.index(g) for g in cls.kind.gates]

                def reorder(a, rows=rows):
                    return _gate_blocks(a, H, rows)

                arrays["W"].append(reorder(w_ih))
                arrays["R"].append(reorder(w_hh))
                arrays["B"].append(np.concatenate([reorder(b_ih), reorder(b_hh)]))
                if layer.proj_size:
                    arrays["proj"].append(get("weight_hr"))
            layer.set_onnx_weights(l, np.stack(arrays["W"]), np.stack(arrays["R"]),
                                    np.stack(arrays["B"]),
                                    proj=np.stack(arrays["proj"]) if layer.proj_size else None)
        return layer

    @classmethod
    def _torch_options(cls, module):
        return {}

    def to_torch(self):
        """The same weights in a ``torch.nn.RNN``, ``LSTM`` or ``GRU``
        (``batch_first=False``, PyTorch's default).

        Returns
        -------
        torch.nn.Module
            In the layer's dtype.

        Raises
        ------
        UnsupportedError
            PyTorch is not installed, or the layer uses what PyTorch lacks: a
            reverse or summed direction, ``combine="final"`` on a
            bidirectional stack, ``clip``, other activations, a sigmoid RNN,
            a GRU without ``linear_before_reset``, an LSTM's peepholes or
            ``input_forget``.
        """
        torch = _torch_of(self, "to_torch")
        name = type(self).__name__
        reasons = self._torch_unsupported()
        if self.direction not in ("forward", "bidirectional_concat"):
            reasons.append(f"direction {self.direction!r}")
        if self.combine == "final" and self.num_layers > 1 and self.num_directions == 2:
            reasons.append("combine='final'")
        if self.clip is not None:
            reasons.append("clip")
        if list(self.activations) != list(self._default_activations()) * self.num_directions:
            reasons.append(f"activations {self.activations}")
        if reasons:
            raise UnsupportedError(f"{name}.to_torch: PyTorch has no {', '.join(reasons)}")
        module = getattr(torch.nn, self.kind.torch)(
            self.input_size, self.hidden_size, self.num_layers,
            bidirectional=self.num_directions == 2, **self._torch_kwargs())
        order = self.kind.torch_gates
        H = self.hidden_size
        tdtype = {np.float32: torch.float32, np.float64: torch.float64}[self.dtype.type]
        module = module.to(tdtype)
        with torch.no_grad():
            for l in range(self.num_layers):
                onnx = self.onnx_weights(l)
                G = len(order)
                for d in range(self.num_directions):
                    sfx = f"_l{l}" + ("_reverse" if d else "")
                    rows = [self.kind.gates.index(g) for g in order]

                    def reorder(a, rows=rows):
                        return _gate_blocks(a, H, rows)

                    b = onnx["B"][d]
                    values = {"weight_ih": reorder(onnx["W"][d]), "weight_hh": reorder(onnx["R"][d]),
                              "bias_ih": reorder(b[:G * H]), "bias_hh": reorder(b[G * H:])}
                    if self.proj_size:
                        values["weight_hr"] = onnx["proj"][d]
                    for key, value in values.items():
                        getattr(module, key + sfx).copy_(torch.from_numpy(np.ascontiguousarray(value)))
        return module

    def _torch_unsupported(self):
        return []

    def _torch_kwargs(self):
        """The keywords of this layer's ``torch.nn`` constructor beyond the sizes."""
        return {}

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
        if self.clip is not None:
            opts.append(f"clip={self.clip}")
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
            for s in range(len(states)):
                states[s][layer * D + d] = outs[1 + s]
            if layer in joined:
                joined[layer][:, d * width:(d + 1) * width] = outs[0].data
            return outs[0]

        def combined(ys, layer):
            if len(ys) == 1:
                return ys[0].data
            if self.direction == "bidirectional_sum":
                return ys[0].data + ys[1].data
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
        value = np.asarray(value)
        shape = (self.num_layers * self.num_directions, batch, width)
        if value.shape != shape:
            raise ShapeError(f"{type(self).__name__}: {what} has shape {list(value.shape)}, "
                             f"expected [num_layers * num_directions, B, {width}] = {list(shape)}")
        return np.ascontiguousarray(value, self.dtype)

    def _give_back(self, data, back, flat):
        data = data.astype(back[2], copy=False)
        if back[0] == "lod":  # the input's own (checked) levels
            return LoDTensor._trusted(data, back[1])
        return LoDTensor._trusted(data, flat.levels).to_padded(steps=back[1])[0]

    def _forward(self, X, attention, initial, backend, keep_workspace=False):
        flat, back = self._check_input(X)
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


class LayerPullback:
    """The backward of one call of a layer (``layer.vjp`` or
    ``keep_workspace=True``): each (layer, direction) step-net's pullback, run
    in reverse order through the stacking and the direction combination.

    ``pullback(grad_outputs, wrt=None, accumulate=False, out=None)``:
    ``grad_outputs`` is ``[dY, dh_n]`` (LSTM ``[dY, dh_n, dc_n]``), None for
    zeros; ``wrt`` holds Parameters of the layer and ``"X"``, ``"h0"``, ``"c0"``,
    ``"attention"`` (AUGRU: one gradient per token, ``[tokens, 1]``).
    """

    def __init__(self, layer, tape, flat, back, width, has_attention):
        self.layer = layer
        self.tape = tape
        self.flat = flat
        self.back = back
        self.width = width
        self.has_attention = has_attention

    @property
    def workspace_bytes(self) -> int:
        return sum(pb.workspace_bytes for pb in self.tape.values())

    def _rows(self, dY):
        """dY (shaped like Y) as rows ``[tokens, width]`` in the layer's dtype."""
        flat, layer = self.flat, self.layer
        shape = (flat.data.shape[0], self.width)
        if dY is None:
            return np.zeros(shape, layer.dtype)
        if isinstance(dY, LoDTensor):
            dY = dY.data
        dY = np.asarray(dY)
        if self.back[0] == "padded":
            lengths = np.diff(np.asarray(flat.levels[0]))
            expected = (len(lengths), self.back[1], self.width)
            if dY.shape != expected:
                raise ShapeError(f"grad_outputs[0] (dY) has shape {list(dY.shape)}; Y is "
                                 f"{list(expected)}")
            return np.ascontiguousarray(
                np.concatenate([dY[b, :n] for b, n in enumerate(lengths)] or [dY[:0, 0]]),
                layer.dtype)
        if dY.shape != shape:
            raise ShapeError(f"grad_outputs[0] (dY) has shape {list(dY.shape)}; Y's data is "
                             f"{list(shape)}")
        return np.ascontiguousarray(dY, layer.dtype)

    def __call__(self, grad_outputs, wrt=None, accumulate=False, out=None):
        layer = self.layer
        wrt = layer.parameters() if wrt is None else list(wrt)
        widths = layer.state_widths()
        names = ("h", "c")[:len(widths)]
        if len(grad_outputs) != 1 + len(widths):
            raise StepNetError(f"grad_outputs: {type(layer).__name__} has {1 + len(widths)} "
                               f"outputs ({', '.join(['Y'] + [n + '_n' for n in names])}), "
                               f"got {len(grad_outputs)} gradients")
        L, D = layer.num_layers, layer.num_directions
        B = self.flat.num_sequences
        d_states = []
        for name, w, g in zip(names, widths, grad_outputs[1:]):
            expected = (L * D, B, w)
            if g is not None and np.shape(g) != expected:
                raise ShapeError(f"grad_outputs: d{name}_n has shape {list(np.shape(g))}, "
                                 f"expected {list(expected)}")
            d_states.append(g)
        param_grads = {}
        d_init = [np.zeros((L * D, B, w), layer.dtype) for w in widths]
        d_attention = [0] * (L * D)  # (summed in this order: the same bits on every run)
        feeds = ["x"] + (["a"] if self.has_attention else []) + list(names)

        def pull(i, d, dy):
            pullback = self.tape[i, d]
            params = pullback.rnn.parameters()
            cts = [dy] + [None if g is None else g[i * D + d] for g in d_states]
            grads = pullback(cts, wrt=params + feeds)
            for p, g in zip(params, grads):
                param_grads[id(p)] = param_grads[id(p)] + g if id(p) in param_grads else g
            rest = grads[len(params):]
            if self.has_attention:
                d_attention[i * D + d] = rest.pop(1)
            for s in range(len(widths)):
                d_init[s][i * D + d] = rest[1 + s]
            return rest[0]

        def split(dy):
            if D == 1:
                return [dy]
            if layer.direction == "bidirectional_sum":
                return [dy, dy]
            H = layer.output_size
            return [np.ascontiguousarray(dy[:, :H]), np.ascontiguousarray(dy[:, H:])]

        # the directions at the same time, as the forward ran them (layer.stack)
        work = layer._direction_work(self.flat.data.shape[0],
                                     [pb.backend for pb in self.tape.values()])

        def directions(fn):
            from ..jit import threads  # (at the first run: importing stepnet starts no engine)

            return threads.run_apart(fn, range(D), work)

        dy = self._rows(grad_outputs[0])
        if layer.combine == "per_layer" or D == 1:
            for i in reversed(range(L)):
                parts = split(dy)
                dy = sum(directions(lambda d, i=i, parts=parts: pull(i, d, parts[d])))
            dX = dy
        else:
            parts = split(dy)

            def whole_stack(d):
                part = parts[d]
                for i in reversed(range(L)):
                    part = pull(i, d, part)
                return part

            dX = sum(directions(whole_stack))
        found = []
        own = {id(p) for p in layer.parameters()}
        for item in wrt:
            if isinstance(item, Parameter):
                if id(item) not in own:
                    raise StepNetError(f"wrt: {item!r} is not a parameter of this layer")
                g = param_grads.get(id(item), np.zeros_like(item.value))
            elif isinstance(item, str) and item == "X":
                g = layer._give_back(dX, self.back, self.flat)
                g = g.data if isinstance(g, LoDTensor) else g
            elif isinstance(item, str) and item in ("h0", "c0")[:len(widths)]:
                g = d_init[("h0", "c0").index(item)]
            elif isinstance(item, str) and item == "attention" and self.has_attention:
                g = sum(d_attention)
            else:
                raise StepNetError(
                    f"wrt: {item!r} is neither a Parameter of this layer nor one of "
                    f"{['X'] + [n + '0' for n in names] + (['attention'] if self.has_attention else [])}"
                )
            found.append(g)
        return _deliver(found, wrt, accumulate, out)


def _gate_blocks(a, H, order):
    """The ``H``-row gate blocks of ``a`` in the order ``order`` (indices)."""
    return np.concatenate([a[j * H:(j + 1) * H] for j in order], 0)


def _torch_of(layer, method):
    """PyTorch for ``layer.method`` (a layer or its class), which converts to
    or from ``torch.nn``: UnsupportedError when PyTorch has no such layer."""
    name = f"{getattr(layer, '__name__', type(layer).__name__)}.{method}"
    if layer.kind.torch is None:
        raise UnsupportedError(f"{name}: PyTorch has no {layer.kind.title}")
    return optional_import("torch", name, "pip install torch==2.13.0")


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


def _positive(value, what):
    if int(value) != value or value < 1:
        raise StepNetError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


class RNN(_RecurrentLayer):
    """Elman RNN: ``h = f(x Wi + Wbi + Rbi + h_prev Ri)``, ``f`` from
    ``nonlinearity`` ("tanh", "relu", "sigmoid") unless ``activations`` names it.

    Parameters
    ----------
    input_size : int
        Width of each token of the input.
    hidden_size : int
        Width of the recurrent state.
    num_layers : int, default 1
        Layers stacked, each reading the previous one's output.
    nonlinearity : {"tanh", "relu", "sigmoid"}, default "tanh"
        The activation ``f``.
    direction : {"forward", "reverse", "bidirectional_concat", "bidirectional_sum"}, default "forward"
        Which way each layer runs; the bidirectional ones run both ways and
        concatenate or add the two directions' outputs.
    combine : {"per_layer", "final"}, default "per_layer"
        How a bidirectional stack is combined: after every layer (each
        layer reads both directions' combined outputs, as PyTorch and ONNX
        stack), or at the end (each direction's whole stack runs on its own).
    activations : list of str, optional
        ONNX activation names (1 per direction, ``["Tanh"]``, or ``nonlinearity``'s by default); a
        list for one direction serves both.
    activation_alpha, activation_beta : list of float, optional
        The activations' alpha and beta, as ONNX's attributes.
    clip : float, optional
        Bounds every activation's input to ``[-clip, clip]`` (ONNX's cell
        clip); positive. None: no clipping.
    dtype : dtype, default float32
        The weights' and computation's dtype: float32 or float64 (float16
        computes in float32).
    seed : int, optional
        Seed of the initialization (PyTorch's: every weight and bias drawn
        from ``U(-k, k)``, ``k = 1/sqrt(hidden_size)``).

    Raises
    ------
    StepNetError
        An option out of range (a size that is not a positive integer, an
        unknown direction, a wrong number of activations, ...).

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> rnn = sn.nn.RNN(4, 8, nonlinearity="relu", seed=0)
    >>> X = sn.LoDTensor.from_lengths(np.ones((5, 4), np.float32), [[2, 3]])
    >>> Y, h_n = rnn(X, backend="interpreter")
    >>> Y.data.shape, h_n.shape
    ((5, 8), (1, 2, 8))
    """

    cell = "rnn"

    def __init__(self, input_size, hidden_size, num_layers=1, nonlinearity="tanh", *,
                 direction="forward", combine="per_layer", activations=None, activation_alpha=None,
                 activation_beta=None, clip=None, dtype=np.float32, seed=None):
        names = {"tanh": "Tanh", "relu": "Relu", "sigmoid": "Sigmoid"}
        if nonlinearity not in names:
            raise StepNetError(f"RNN: nonlinearity {nonlinearity!r} is not tanh, relu or sigmoid")
        self.nonlinearity = nonlinearity
        self._nonlinearity_name = names[nonlinearity]
        super().__init__(input_size, hidden_size, num_layers, direction=direction, combine=combine,
                         activations=activations, activation_alpha=activation_alpha,
                         activation_beta=activation_beta, clip=clip, dtype=dtype, seed=seed)

    def _default_activations(self):
        return (self._nonlinearity_name,)

    def _repr_options(self):
        return [] if self.nonlinearity == "tanh" else [f"nonlinearity={self.nonlinearity!r}"]

    @classmethod
    def _torch_options(cls, module):
        return {"nonlinearity": module.nonlinearity}

    def _torch_unsupported(self):
        return ["sigmoid RNN"] if self.nonlinearity == "sigmoid" else []

    def _torch_kwargs(self):
        return {"nonlinearity": self.nonlinearity}


class GRU(_RecurrentLayer):
    """ONNX's GRU (gates z, r, h); ``linear_before_reset=True`` is PyTorch's
    GRU (the candidate's recurrent bias kept separate, inside ``r * (...)``).

    Parameters
    ----------
    input_size : int
        Width of each token of the input.
    hidden_size : int
        Width of the recurrent state.
    num_layers : int, default 1
        Layers stacked, each reading the previous one's output.
    linear_before_reset : bool, default False
        Apply the reset gate after the candidate's recurrent product
        (PyTorch's GRU) rather than before it (ONNX's default).
    direction : {"forward", "reverse", "bidirectional_concat", "bidirectional_sum"}, default "forward"
        Which way each layer runs; the bidirectional ones run both ways and
        concatenate or add the two directions' outputs.
    combine : {"per_layer", "final"}, default "per_layer"
        How a bidirectional stack is combined: after every layer (each
        layer reads both directions' combined outputs, as PyTorch and ONNX
        stack), or at the end (each direction's whole stack runs on its own).
    activations : list of str, optional
        ONNX activation names (2 per direction, ``["Sigmoid", "Tanh"]`` by default); a
        list for one direction serves both.
    activation_alpha, activation_beta : list of float, optional
        The activations' alpha and beta, as ONNX's attributes.
    clip : float, optional
        Bounds every activation's input to ``[-clip, clip]`` (ONNX's cell
        clip); positive. None: no clipping.
    dtype : dtype, default float32
        The weights' and computation's dtype: float32 or float64 (float16
        computes in float32).
    seed : int, optional
        Seed of the initialization (PyTorch's: every weight and bias drawn
        from ``U(-k, k)``, ``k = 1/sqrt(hidden_size)``).

    Raises
    ------
    StepNetError
        An option out of range (a size that is not a positive integer, an
        unknown direction, a wrong number of activations, ...).

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> gru = sn.nn.GRU(4, 8, direction="bidirectional_concat", seed=0)
    >>> X = sn.LoDTensor.from_lengths(np.ones((5, 4), np.float32), [[2, 3]])
    >>> Y, h_n = gru(X, backend="interpreter")
    >>> Y.data.shape, h_n.shape
    ((5, 16), (2, 2, 8))
    """

    cell = "gru"

    def __init__(self, input_size, hidden_size, num_layers=1, linear_before_reset=False, *,
                 direction="forward", combine="per_layer", activations=None, activation_alpha=None,
                 activation_beta=None, clip=None, dtype=np.float32, seed=None):
        super().__init__(input_size, hidden_size, num_layers,
                         linear_before_reset=linear_before_reset, direction=direction, combine=combine,
                         activations=activations, activation_alpha=activation_alpha,
                         activation_beta=activation_beta, clip=clip, dtype=dtype, seed=seed)

    def _repr_options(self):
        return ["linear_before_reset=True"] if self.linear_before_reset else []

    @classmethod
    def _torch_options(cls, module):
        return {"linear_before_reset": True}

    def _torch_unsupported(self):
        return [] if self.linear_before_reset else ["GRU with linear_before_reset=False"]


class AUGRU(GRU):
    """oneDNN's attention-update GRU: the update gate is scaled by each
    token's attention score, ``z' = (1 - a) * z``. Called as
    ``layer(X, attention)``, ``attention`` one score per token of X.

    ONNX and PyTorch have no AUGRU: ``to_onnx``, ``from_torch`` and
    ``to_torch`` raise UnsupportedError; ``from_onnx`` reads a GRU node's
    weights.

    Parameters
    ----------
    input_size : int
        Width of each token of the input.
    hidden_size : int
        Width of the recurrent state.
    num_layers : int, default 1
        Layers stacked, each reading the previous one's output.
    linear_before_reset : bool, default False
        Apply the reset gate after the candidate's recurrent product
        (PyTorch's GRU) rather than before it (ONNX's default).
    direction : {"forward", "reverse", "bidirectional_concat", "bidirectional_sum"}, default "forward"
        Which way each layer runs; the bidirectional ones run both ways and
        concatenate or add the two directions' outputs. Both directions read
        the same attention scores.
    combine : {"per_layer", "final"}, default "per_layer"
        How a bidirectional stack is combined: after every layer, or at the
        end (each direction's whole stack runs on its own).
    activations : list of str, optional
        ONNX activation names (2 per direction, ``["Sigmoid", "Tanh"]`` by
        default); a list for one direction serves both.
    activation_alpha, activation_beta : list of float, optional
        The activations' alpha and beta, as ONNX's attributes.
    clip : float, optional
        Bounds every activation's input to ``[-clip, clip]`` (ONNX's cell
        clip); positive. None: no clipping.
    dtype : dtype, default float32
        The weights' and computation's dtype: float32 or float64 (float16
        computes in float32).
    seed : int, optional
        Seed of the initialization (PyTorch's: every weight and bias drawn
        from ``U(-k, k)``, ``k = 1/sqrt(hidden_size)``).

    Raises
    ------
    StepNetError
        An option out of range (a size that is not a positive integer, an
        unknown direction, a wrong number of activations, ...).

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> augru = sn.nn.AUGRU(4, 8, seed=0)
    >>> X = sn.LoDTensor.from_lengths(np.ones((5, 4), np.float32), [[2, 3]])
    >>> A = sn.LoDTensor(np.full((5, 1), 0.5, np.float32), X.lod)
    >>> Y, h_n = augru(X, A, backend="interpreter")
    >>> Y.data.shape, h_n.shape
    ((5, 8), (1, 2, 8))
    """

    cell = "augru"


    def __call__(self, X, attention, h0=None, backend=None, keep_workspace=False):
        """``Y, h_n = layer(X, attention, h0=None)``.

        Parameters
        ----------
        X : LoDTensor or tuple
            A LoDTensor ``[N, input_size]`` with at least one level (the
            layer runs over the sequences of its finest level), or
            ``(padded, lengths)`` with ``padded`` ``[B, T, input_size]`` and
            ``lengths`` ``[B]``. Floating point; float16 is computed in the
            layer's dtype and given back as float16.
        attention : LoDTensor or tuple
            One score per token of X: a LoDTensor ``[N]`` or ``[N, 1]`` whose
            finest level is X's, or, when X is padded, ``(padded, lengths)``
            with ``padded`` ``[B, T]`` or ``[B, T, 1]``.
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
            Every step's output, as for :class:`GRU`.
        h_n : ndarray
            Each sequence's last state, ``[num_layers * num_directions, B,
            hidden_size]``.

        Raises
        ------
        ShapeError
            ``X``, ``attention`` or ``h0`` does not fit (attention's LoD must
            be X's, one score per token).
        BackendError
            The backend is unknown or not available.
        """
        Y, (h_n,) = self._forward(X, attention, [h0], backend, keep_workspace)
        return Y, h_n

    def _check_attention(self, attention, X, flat, back):
        """``attention`` as a one-level LoDTensor [tokens, 1] with ``flat``'s LoD."""
        if back[0] == "padded":
            padded, lengths = attention
            padded = np.asarray(padded)
            attention = LoDTensor.from_padded(padded.reshape(padded.shape[:2] + (1,)), lengths)
        if not isinstance(attention, LoDTensor):
            raise ShapeError(f"AUGRU: attention must be a LoDTensor, got {type(attention).__name__}")
        A = attention if attention.num_levels == 1 else LoDTensor(attention.data,
                                                                  [attention.levels[-1]])
        if A.num_levels != 1 or not np.array_equal(A.levels[0], flat.levels[0]):
            raise ShapeError(f"AUGRU: attention has LoD {attention.lod}, the input has "
                             f"{X.lod if isinstance(X, LoDTensor) else flat.lod}; they must match")
        data = A.data.reshape(len(A.data), -1)
        if data.shape[1] != 1:
            raise ShapeError(f"AUGRU: attention must hold one score per token, got feature "
                             f"shape {list(A.data.shape[1:])}")
        return LoDTensor(np.ascontiguousarray(data, self.dtype), A.levels)


class LSTM(_RecurrentLayer):
    """ONNX's LSTM (gates i, o, f, c; ``peephole`` weights i, o, f;
    ``input_forget`` couples f = 1 - i) with PyTorch's ``proj_size``.

    Parameters
    ----------
    input_size : int
        Width of each token of the input.
    hidden_size : int
        Width of the recurrent state.
    num_layers : int, default 1
        Layers stacked, each reading the previous one's output.
    peephole : bool, default False
        Peephole weights: the input, output and forget gates also read the
        cell state.
    proj_size : int, default 0
        PyTorch's projection: ``h`` is projected to this width (in ``[0,
        hidden_size)``; 0: none).
    input_forget : bool, default False
        Couple the forget gate to the input gate, ``f = 1 - i``.
    direction : {"forward", "reverse", "bidirectional_concat", "bidirectional_sum"}, default "forward"
        Which way each layer runs; the bidirectional ones run both ways and
        concatenate or add the two directions' outputs.
    combine : {"per_layer", "final"}, default "per_layer"
        How a bidirectional stack is combined: after every layer (each
        layer reads both directions' combined outputs, as PyTorch and ONNX
        stack), or at the end (each direction's whole stack runs on its own).
    activations : list of str, optional
        ONNX activation names (3 per direction, ``["Sigmoid", "Tanh", "Tanh"]`` by default); a
        list for one direction serves both.
    activation_alpha, activation_beta : list of float, optional
        The activations' alpha and beta, as ONNX's attributes.
    clip : float, optional
        Bounds every activation's input to ``[-clip, clip]`` (ONNX's cell
        clip); positive. None: no clipping.
    dtype : dtype, default float32
        The weights' and computation's dtype: float32 or float64 (float16
        computes in float32).
    seed : int, optional
        Seed of the initialization (PyTorch's: every weight and bias drawn
        from ``U(-k, k)``, ``k = 1/sqrt(hidden_size)``).

    Raises
    ------
    StepNetError
        An option out of range (a size that is not a positive integer, an
        unknown direction, a wrong number of activations, ...).

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> lstm = sn.nn.LSTM(4, 8, num_layers=2, seed=0)
    >>> X = sn.LoDTensor.from_lengths(np.ones((5, 4), np.float32), [[2, 3]])
    >>> Y, (h_n, c_n) = lstm(X, backend="interpreter")
    >>> Y.data.shape, h_n.shape, c_n.shape
    ((5, 8), (2, 2, 8), (2, 2, 8))
    """

    cell = "lstm"

    def __init__(self, input_size, hidden_size, num_layers=1, peephole=False, proj_size=0,
                 input_forget=False, *, direction="forward", combine="per_layer", activations=None,
                 activation_alpha=None, activation_beta=None, clip=None, dtype=np.float32, seed=None):
        super().__init__(input_size, hidden_size, num_layers, peephole=peephole,
                         proj_size=proj_size, input_forget=input_forget,
                         direction=direction, combine=combine,
                         activations=activations, activation_alpha=activation_alpha,
                         activation_beta=activation_beta, clip=clip, dtype=dtype, seed=seed)

    def _repr_options(self):
        return [f"{key}={getattr(self, key)!r}" for key in self.kind.options if getattr(self, key)]

    @classmethod
    def _torch_options(cls, module):
        return {"proj_size": module.proj_size}

    def _torch_unsupported(self):
        reasons = []
        if self.peephole:
            reasons.append("peephole")
        if self.input_forget:
            reasons.append("input_forget")
        return reasons

    def _torch_kwargs(self):
        return {"proj_size": self.proj_size}

    def __call__(self, X, initial=None, backend=None, keep_workspace=False):
        """``Y, (h_n, c_n) = layer(X, (h0, c0)=None)``; see docs/design.md §5.

        Parameters
        ----------
        X : LoDTensor or tuple
            A LoDTensor ``[N, input_size]`` with at least one level (the
            layer runs over the sequences of its finest level), or
            ``(padded, lengths)`` with ``padded`` ``[B, T, input_size]`` and
            ``lengths`` ``[B]``. Floating point; float16 is computed in the
            layer's dtype and given back as float16.
        initial : tuple, optional
            ``(h0, c0)``, either of which may be None (zeros): ``h0``
            ``[num_layers * num_directions, B, output_size]`` (``proj_size``
            or ``hidden_size``), ``c0`` ``[num_layers * num_directions, B,
            hidden_size]``, indexed ``layer * num_directions + direction``.
            None: both zeros.
        backend : str, optional
            ``"interpreter"``, ``"numba"`` or ``"cuda"``; None:
            ``default_backend()``.
        keep_workspace : bool, default False
            Keep this run's workspace, so that ``sn.gradients(layer, ...)``
            without inputs runs only the backward.

        Returns
        -------
        Y : LoDTensor or ndarray
            Every step's ``h``, ``num_directions * output_size`` wide for
            ``bidirectional_concat``, else ``output_size``: a LoDTensor with
            X's LoD, or ``[B, T, width]`` padded with zeros when X was padded.
        (h_n, c_n) : tuple of ndarray
            Each sequence's last states, shaped and indexed as ``h0`` and
            ``c0``.

        Raises
        ------
        ShapeError
            ``X`` does not fit, ``initial`` is not a pair, or ``h0`` or ``c0``
            has another shape.
        BackendError
            The backend is unknown or not available.
        """
        if initial is None:
            h0 = c0 = None
        elif isinstance(initial, (tuple, list)) and len(initial) == 2:
            h0, c0 = initial
        else:
            raise ShapeError("LSTM: the initial state must be a pair (h0, c0) (either may be "
                             f"None), got {type(initial).__name__}")
        Y, (h_n, c_n) = self._forward(X, None, [h0, c0], backend, keep_workspace)
        return Y, (h_n, c_n)


class MGU(_RecurrentLayer):
    """The minimal gated unit (Zhou et al., 2016): a GRU whose one gate
    ``f`` serves as both update and reset gate, ``f = sigmoid(x Wf + h_prev
    Rf + b)``, ``h~ = tanh(x Wh + (f * h_prev) Rh + b)``, ``h = (1 - f) *
    h_prev + f * h~``: two gates' weights where a GRU has three.

    ONNX and PyTorch have no MGU: ``to_onnx``, ``from_torch`` and
    ``to_torch`` raise UnsupportedError; ``sn.onnx.export`` writes it as a
    Scan of its step.

    Parameters
    ----------
    input_size : int
        Width of each token of the input.
    hidden_size : int
        Width of the recurrent state.
    num_layers : int, default 1
        Layers stacked, each reading the previous one's output.
    direction : {"forward", "reverse", "bidirectional_concat", "bidirectional_sum"}, default "forward"
        Which way each layer runs; the bidirectional ones run both ways and
        concatenate or add the two directions' outputs.
    combine : {"per_layer", "final"}, default "per_layer"
        How a bidirectional stack is combined: after every layer, or at the
        end (each direction's whole stack runs on its own).
    activations : list of str, optional
        ONNX activation names (2 per direction: the gate's and the
        candidate's, ``["Sigmoid", "Tanh"]`` by default); a list for one
        direction serves both.
    activation_alpha, activation_beta : list of float, optional
        The activations' alpha and beta, as ONNX's attributes.
    clip : float, optional
        Bounds every activation's input to ``[-clip, clip]``; positive.
        None: no clipping.
    dtype : dtype, default float32
        The weights' and computation's dtype: float32 or float64 (float16
        computes in float32).
    seed : int, optional
        Seed of the initialization (every weight and bias drawn from
        ``U(-k, k)``, ``k = 1/sqrt(hidden_size)``).

    Raises
    ------
    StepNetError
        An option out of range (a size that is not a positive integer, an
        unknown direction, a wrong number of activations, ...).

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> mgu = sn.nn.MGU(4, 8, seed=0)
    >>> X = sn.LoDTensor.from_lengths(np.ones((5, 4), np.float32), [[2, 3]])
    >>> Y, h_n = mgu(X, backend="interpreter")
    >>> Y.data.shape, h_n.shape
    ((5, 8), (1, 2, 8))
    """

    cell = "mgu"

    def __init__(self, input_size, hidden_size, num_layers=1, *, direction="forward",
                 combine="per_layer", activations=None, activation_alpha=None,
                 activation_beta=None, clip=None, dtype=np.float32, seed=None):
        super().__init__(input_size, hidden_size, num_layers, direction=direction, combine=combine,
                         activations=activations, activation_alpha=activation_alpha,
                         activation_beta=activation_beta, clip=clip, dtype=dtype, seed=seed)


# ----------------------------------------------------------------------------
# one step of a layer, as a cell inside another step-net's block


class _Cell:
    """A one-layer, one-direction layer called as one step of its recurrence:
    ``cell(x, state)`` is ``cell.step(x, state)`` (see
    :meth:`_RecurrentLayer.step`). ``from_torch``/``to_torch`` convert
    ``torch.nn.RNNCell``/``GRUCell``/``LSTMCell``; ``onnx_weights`` and
    ``set_onnx_weights`` are the layer's."""

    _one_step = True

    def __init__(self, input_size, hidden_size, **kwargs):
        for key in ("num_layers", "direction", "combine"):
            if kwargs.pop(key, None) not in (None, 1, "forward", "per_layer"):
                raise StepNetError(f"{type(self).__name__}: a cell has one layer and one direction")
        super().__init__(input_size, hidden_size, **kwargs)

    def __call__(self, x, state):
        """One step: ``cell.step(x, state)``.

        Parameters
        ----------
        x : Value or ndarray
            The step's input ``[B, input_size]``.
        state : MemoryHandle, Value or ndarray, or a pair of them
            The previous state ``[B, output_size]`` (LSTMCell: a pair
            ``(h, c)``, ``c`` ``[B, hidden_size]``). A memory handle is updated, as ``h.update`` would; a
            step value or array is only read.

        Returns
        -------
        Value, MemoryHandle or ndarray, or a pair of them
            The new state (LSTMCell: ``(h, c)``). Outside a step block, on
            arrays, computed eagerly.
        """
        return self.step(x, state)

    @classmethod
    def from_torch(cls, module):
        """A cell with the weights (and dtype) of a ``torch.nn.RNNCell``,
        ``GRUCell`` or ``LSTMCell``.

        Parameters
        ----------
        module : torch.nn.RNNCell, torch.nn.GRUCell or torch.nn.LSTMCell
            Exactly the class that matches this cell's; float32 or float64.

        Returns
        -------
        cell
            An instance of this class (a ``GRUCell`` with
            ``linear_before_reset=True``, PyTorch's GRU).

        Raises
        ------
        StepNetError
            ``module`` is of another class or dtype.
        UnsupportedError
            PyTorch is not installed.
        """
        torch = _torch_of(cls, "from_torch")
        expected = getattr(torch.nn, cls.kind.torch + "Cell")
        if type(module) is not expected:
            raise StepNetError(f"{cls.__name__}.from_torch expects a {expected.__name__}, "
                               f"got {type(module).__name__}")
        # (a torch.nn.RNNCell's nonlinearity is its only option beyond the sizes)
        options = {"nonlinearity": module.nonlinearity} if hasattr(module, "nonlinearity") else {}
        layer = getattr(torch.nn, cls.kind.torch)(module.input_size, module.hidden_size,
                                                  bias=module.bias, **options)
        with torch.no_grad():
            for name, value in module.named_parameters():
                getattr(layer, name + "_l0").copy_(value)
        return super().from_torch(layer.to(module.weight_ih.dtype))

    def to_torch(self):
        """The same weights in a ``torch.nn.RNNCell``, ``GRUCell`` or ``LSTMCell``.

        Returns
        -------
        torch.nn.Module
            In the cell's dtype.

        Raises
        ------
        UnsupportedError
            PyTorch is not installed, or the cell uses what PyTorch lacks (as
            for the layers' ``to_torch``).
        """
        torch = _torch_of(self, "to_torch")
        if self.proj_size:
            raise UnsupportedError(f"{type(self).__name__}.to_torch: PyTorch's "
                                   f"{self.kind.torch}Cell has no proj_size")
        layer = super().to_torch()
        options = {k: v for k, v in self._torch_kwargs().items() if k == "nonlinearity"}
        module = getattr(torch.nn, self.kind.torch + "Cell")(
            self.input_size, self.hidden_size, **options).to(layer.weight_ih_l0.dtype)
        with torch.no_grad():
            for name, value in module.named_parameters():
                value.copy_(getattr(layer, name + "_l0"))
        return module


def _refuse_cell(net, where):
    """Raise a StepNetError if ``net`` is a cell: ``where`` (a wrapper that
    runs a layer over sequences) cannot take one step of a recurrence."""
    if isinstance(net, _Cell):
        layer = next(c for c in type(net).__mro__
                     if issubclass(c, _RecurrentLayer) and not issubclass(c, _Cell))
        raise StepNetError(
            f"{where}: {type(net).__name__} is a cell, one step of a recurrence called "
            f"inside a step block (h = cell(x, h)), not a layer over sequences; pass the "
            f"layer sn.nn.{layer.__name__}(...) instead, or a step-net (sn.create_rnn_op) "
            f"whose step calls the cell")


class RNNCell(_Cell, RNN):
    """One step of an Elman RNN inside a step block: ``h = cell(x, h)``.

    Parameters
    ----------
    input_size : int
        Width of the step's input ``x``.
    hidden_size : int
        Width of the state.
    **kwargs
        The keyword options of :class:`RNN` (``nonlinearity``, ``activations``,
        ``activation_alpha``, ``activation_beta``, ``clip``, ``dtype``,
        ``seed``); ``num_layers``, ``direction`` and ``combine`` only at their
        defaults (1, ``"forward"``, ``"per_layer"``).

    Raises
    ------
    StepNetError
        Another number of layers, direction or combination, or an option out
        of range.

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> cell = sn.nn.RNNCell(4, 8, seed=0)
    >>> cell(np.ones((2, 4), np.float32), np.zeros((2, 8), np.float32)).shape
    (2, 8)
    """


class GRUCell(_Cell, GRU):
    """One step of a GRU inside a step block: ``h = cell(x, h)``
    (``linear_before_reset=True`` is PyTorch's ``GRUCell``).

    Parameters
    ----------
    input_size : int
        Width of the step's input ``x``.
    hidden_size : int
        Width of the state.
    **kwargs
        The keyword options of :class:`GRU` (``linear_before_reset``, ``activations``,
        ``activation_alpha``, ``activation_beta``, ``clip``, ``dtype``,
        ``seed``); ``num_layers``, ``direction`` and ``combine`` only at their
        defaults (1, ``"forward"``, ``"per_layer"``).

    Raises
    ------
    StepNetError
        Another number of layers, direction or combination, or an option out
        of range.
    """


class LSTMCell(_Cell, LSTM):
    """One step of an LSTM inside a step block: ``h, c = cell(x, (h, c))``.

    Parameters
    ----------
    input_size : int
        Width of the step's input ``x``.
    hidden_size : int
        Width of the state.
    **kwargs
        The keyword options of :class:`LSTM` (``peephole``, ``proj_size``, ``input_forget``, ``activations``,
        ``activation_alpha``, ``activation_beta``, ``clip``, ``dtype``,
        ``seed``); ``num_layers``, ``direction`` and ``combine`` only at their
        defaults (1, ``"forward"``, ``"per_layer"``).

    Raises
    ------
    StepNetError
        Another number of layers, direction or combination, or an option out
        of range.
    """


class AUGRUCell(_Cell, AUGRU):
    """One step of an AUGRU inside a step block: ``h = cell(x, h, attention)``,
    ``attention`` the step's score per sequence (``[B, 1]``: computed in the
    step, e.g. from the previous state and a target, or a step input), which
    scales the update gate, ``z' = (1 - a) * z``. PyTorch has no AUGRU: no
    ``from_torch``/``to_torch``.

    Parameters
    ----------
    input_size : int
        Width of the step's input ``x``.
    hidden_size : int
        Width of the state.
    **kwargs
        The keyword options of :class:`AUGRU` (``linear_before_reset``, ``activations``,
        ``activation_alpha``, ``activation_beta``, ``clip``, ``dtype``,
        ``seed``); ``num_layers``, ``direction`` and ``combine`` only at their
        defaults (1, ``"forward"``, ``"per_layer"``).

    Raises
    ------
    StepNetError
        Another number of layers, direction or combination, or an option out
        of range.
    """

    def __call__(self, x, state, attention):
        """One step: ``cell.step(x, state, attention=attention)``.

        Parameters
        ----------
        x : Value or ndarray
            The step's input ``[B, input_size]``.
        state : MemoryHandle, Value or ndarray
            The previous state ``[B, hidden_size]``. A memory handle is
            updated, as ``h.update`` would; a step value or array is only
            read.
        attention : Value or ndarray
            The step's score per sequence, ``[B, 1]``.

        Returns
        -------
        Value, MemoryHandle or ndarray
            The new state.

        Raises
        ------
        ShapeError
            ``attention`` is not ``[B, 1]``.
        """
        return self.step(x, state, attention=attention)


class MGUCell(_Cell, MGU):
    """One step of a minimal gated unit inside a step block: ``h = cell(x, h)``.
    PyTorch has no MGU: no ``from_torch``/``to_torch``.

    Parameters
    ----------
    input_size : int
        Width of the step's input ``x``.
    hidden_size : int
        Width of the state.
    **kwargs
        The keyword options of :class:`MGU` (``activations``,
        ``activation_alpha``, ``activation_beta``, ``clip``, ``dtype``,
        ``seed``); ``num_layers``, ``direction`` and ``combine`` only at their
        defaults (1, ``"forward"``, ``"per_layer"``).

    Raises
    ------
    StepNetError
        Another number of layers, direction or combination, or an option out
        of range.
    """
