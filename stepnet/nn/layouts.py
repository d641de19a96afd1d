"""A built-in layer's weights in ONNX's and PyTorch's layouts: ``onnx_weights``,
``set_onnx_weights``, ``from_onnx``, ``to_onnx``, ``from_torch`` and
``to_torch`` of every layer (a mixin of ``base._RecurrentLayer``), read from
its cell's record (gates and their orders, ``cells.CELLS``)."""

from __future__ import annotations

import warnings

import numpy as np

from ..errors import ShapeError, StepNetError, UnsupportedError, optional_import
from . import cells

_ONNX_DIRECTION = {"forward": "forward", "reverse": "reverse",
                   "bidirectional_concat": "bidirectional"}
_FROM_ONNX_DIRECTION = {"forward": "forward", "reverse": "reverse",
                        "bidirectional": "bidirectional_concat"}


class _Layouts:
    """The layout conversions of ``_RecurrentLayer``."""

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
            ``layer`` is not an int in ``[0, num_layers)``, or biases other
            than zeros for a layer made with ``bias=False``.
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
        if not self.bias and np.any(B != 0):
            raise StepNetError(f"{type(self).__name__} layer {layer}: the layer has no biases "
                               "(bias=False); B must be zeros or None")
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

    def _float_weights(self, what):
        """Refuse to give a quantized layer's float weights as its own."""
        if getattr(self, "quantized", None):
            raise UnsupportedError(f"{type(self).__name__}.{what}: the layer is quantized "
                                   f"({self.quantized}); convert the float layer it was made from")

    def to_onnx(self):
        """The ONNX node's inputs and attributes: a dict (W, R, B, P with
        peepholes, hidden_size, direction, activations, activation_alpha,
        activation_beta, clip, and linear_before_reset or input_forget), or a
        list of such dicts, one per layer, for a stack."""
        name = type(self).__name__
        self._float_weights("to_onnx")
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
        ``proj_size``; ``dropout`` is left out with a ``UserWarning`` (the
        layer computes what the module computes in eval mode).

        Parameters
        ----------
        module : torch.nn.RNN, torch.nn.GRU or torch.nn.LSTM
            Exactly the class that matches this layer's (not a subclass);
            float32 or float64; any number of layers, one or two directions,
            with or without biases. Or PyTorch's dynamically quantized
            ``torch.ao.nn.quantized.dynamic.LSTM`` or ``GRU`` (int8
            weights): the layer comes quantized (``sn.quantize(layer,
            "int8")`` of its weights dequantized).

        Returns
        -------
        layer
            An instance of this class.

        Raises
        ------
        StepNetError
            ``module`` is of another class, of another dtype, of parameters
            of two dtypes, or on the ``meta`` device (no data).
        UnsupportedError
            PyTorch is not installed.
        """
        torch = _torch_of(cls, "from_torch")
        dequantized = _dequantized_torch(torch, module, cls.kind.torch)
        if dequantized is not None:  # PyTorch's int8 layer: the float one, quantized again
            return _quantized(cls.from_torch(dequantized))
        expected = getattr(torch.nn, cls.kind.torch)
        if type(module) is not expected:
            raise StepNetError(f"{cls.__name__}.from_torch expects a {expected.__name__}, "
                               f"got {type(module).__name__}")
        dtype = _torch_dtype(torch, module, f"{cls.__name__}.from_torch")
        kwargs = {
            "num_layers": module.num_layers,
            "direction": "bidirectional_concat" if module.bidirectional else "forward",
            "dtype": dtype,
            "bias": bool(module.bias),
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
        self._float_weights("to_torch")
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
            self.input_size, self.hidden_size, self.num_layers, bias=self.bias,
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
                    values = {"weight_ih": reorder(onnx["W"][d]), "weight_hh": reorder(onnx["R"][d])}
                    if self.bias:
                        values.update(bias_ih=reorder(b[:G * H]), bias_hh=reorder(b[G * H:]))
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


def _quantized(layer):
    from ..quantize import quantize

    return quantize(layer, "int8")


def _torch_dtype(torch, module, where):
    """The NumPy dtype of a ``torch.nn`` recurrent ``module``'s parameters,
    checked: one float dtype, data on a device (not ``meta``). Warns that its
    dropout is left out."""
    first = module.weight_ih_l0.detach()
    dtype = {torch.float32: np.float32, torch.float64: np.float64}.get(first.dtype)
    if dtype is None:
        raise StepNetError(f"{where}: dtype {first.dtype} is not float32 or float64")
    for name, p in module.named_parameters():
        if p.dtype != first.dtype or p.device.type == "meta":
            raise StepNetError(f"{where}: parameter {name} is {p.dtype} on {p.device.type}; every "
                               f"parameter must hold data of one dtype ({first.dtype}, as weight_ih_l0)")
    if module.dropout:
        warnings.warn(f"stepnet: {where} leaves out the module's dropout={module.dropout}: "
                      "stepnet's layers run as PyTorch's do in eval mode", stacklevel=3)
    return dtype


def _dequantized_torch(torch, module, name):
    """A float ``torch.nn.<name>`` holding the dequantized weights of a
    ``torch.ao.nn.quantized.dynamic.<name>`` ``module``; None where
    ``module`` is not one."""
    dynamic = getattr(getattr(getattr(getattr(torch, "ao", None), "nn", None), "quantized", None),
                      "dynamic", None)
    if dynamic is None or type(module) is not getattr(dynamic, name, None):
        return None
    weights, biases = module.get_weight(), module.get_bias()
    if any(w.dtype != torch.qint8 for w in weights.values()):
        kinds = sorted({str(w.dtype) for w in weights.values()})
        raise StepNetError(f"from_torch: the quantized {name} holds {kinds} weights; stepnet takes "
                           "its int8 (qint8) form")
    out = getattr(torch.nn, name)(module.input_size, module.hidden_size, num_layers=module.num_layers,
                                  bias=module.bias, bidirectional=module.bidirectional)
    with torch.no_grad():
        for key, value in {**weights, **biases}.items():
            getattr(out, key).copy_(value.dequantize() if value.is_quantized else value)
    return out
