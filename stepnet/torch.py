"""stepnet inside PyTorch: a step-net or a ``stepnet.nn`` layer as a
``torch.nn.Module``, trained by ``torch.optim``.

``Module(layer)`` is called like the matching torch module and returns what
it returns::

    import torch, stepnet as sn, stepnet.torch
    g = torch.nn.GRU(8, 16, batch_first=True)
    m = stepnet.torch.Module(sn.nn.GRU.from_torch(g))      # batch_first=True
    y, h_n = m(torch.randn(4, 10, 8))                        # as g(x) gives

``Module(rnn)`` takes a step-net's inputs by name as torch tensors: a LoD input
(a step input, or a ragged static input: a decoder's memory) as a
``PackedSequence``, as ``(padded, lengths)`` or as ``(rows, lod)``, initial
memories and other static inputs as tensors; all-steps outputs come back in the
layout their input came in, last-step outputs as ``[num_seq, ...]``.

The module's parameters are ``torch.nn.Parameter``s sharing memory with the
stepnet ``Parameter``s, so ``torch.optim`` updates what stepnet computes with.
The forward runs on stepnet's backend (Numba by default); when autograd
records, it keeps the workspace and the backward is ``sn.vjp``'s pullback;
under ``torch.no_grad()`` nothing is kept. See docs/torch.md.
"""

from __future__ import annotations

import numpy as np

from .errors import ShapeError, StepNetError, UnsupportedError, optional_import

torch = optional_import("torch", "stepnet.torch", "pip install torch==2.13.0")

from torch.nn.utils.rnn import PackedSequence  # noqa: E402

from . import dsl  # noqa: E402
from .backends import get_backend  # noqa: E402
from .nn.layers import LAYERS  # noqa: E402
from .nn.step_cells import _refuse_in_bridge  # noqa: E402
from .torch_autograd import Bridge, LayerCall, StepNetCall, autograd_records  # noqa: E402
from .torch_layouts import (  # noqa: E402
    NUMPY_DTYPES,
    TORCH_DTYPES,
    as_array,
    check_tensor,
    data_pointer,
    is_lod_levels,
    packed_layout,
    padded_layout,
    rows_layout,
)

__all__ = ["LayerModule", "Module", "StepNetModule"]

_LAYERS = tuple(LAYERS.values())


# ----------------------------------------------------------------------------
# the module


class Module(torch.nn.Module):
    """A stepnet layer or step-net as a ``torch.nn.Module``.

    ``Module(layer, batch_first=True, backend=None)`` (a ``stepnet.nn`` RNN,
    GRU, LSTM or AUGRU) is a :class:`LayerModule`; ``Module(rnn,
    output_all_steps=True, batch_first=True, backend=None)`` (a top-level
    step-net) is a :class:`StepNetModule`.

    The module's torch parameters share memory with the stepnet Parameters,
    so ``torch.optim`` updates what stepnet computes with; the module stays
    on the CPU (``.to("cuda")`` is refused) and changes dtype only where the
    wrapped object can (a layer: float32 or float64).

    Parameters
    ----------
    net : stepnet.nn layer or RNNOp
        A ``stepnet.nn`` RNN, GRU, LSTM, AUGRU or MGU, or a top-level step-net
        (defined). Not a cell (``GRUCell``...): a cell is one step, called
        inside a step-net's block.
    batch_first : bool, default True
        Padded tensors are ``[B, T, ...]``; False: ``[T, B, ...]``, as in
        torch.
    backend : str, optional
        The stepnet backend the forward runs on; None:
        ``default_backend()``.

    Raises
    ------
    StepNetError
        ``net`` is neither a layer nor a step-net, or is a cell.

    Examples
    --------
    >>> import torch, stepnet as sn, stepnet.torch
    >>> m = stepnet.torch.Module(sn.nn.GRU(3, 5, seed=0))
    >>> y, h_n = m(torch.zeros(2, 4, 3))
    >>> tuple(y.shape), tuple(h_n.shape)
    ((2, 4, 5), (1, 2, 5))
    """

    def __new__(cls, net=None, *args, **kwargs):
        if cls is Module:
            _refuse_in_bridge(net, "stepnet.torch.Module")
            if isinstance(net, _LAYERS):
                cls = LayerModule
            elif isinstance(net, dsl.RNNOp):
                cls = StepNetModule
            else:
                raise StepNetError(f"stepnet.torch.Module: expects a stepnet.nn layer or a "
                                   f"step-net (sn.create_rnn_op), got {type(net).__name__}")
        return super().__new__(cls)

    def __init__(self, net, *, batch_first=True, backend=None):
        super().__init__()
        self.wrapped = net
        self.batch_first = bool(batch_first)
        if backend is not None:
            get_backend(backend)  # an unknown or unavailable name: BackendError, now
        self.backend = backend
        self._register_stepnet_parameters()

    # -- parameters ----------------------------------------------------------

    def _stepnet_parameters(self):
        return self.wrapped.parameters()

    def _register_stepnet_parameters(self):
        """One torch Parameter per stepnet Parameter, on the same memory."""
        self._links = []  # (torch name, stepnet Parameter, dtype it must keep)
        taken = set()
        for i, p in enumerate(self._stepnet_parameters()):
            name = (p.name or f"param{i}").replace(".", "_")
            base, k = name, 1
            while name in taken or hasattr(self, name):
                name, k = f"{base}_{k}", k + 1
            taken.add(name)
            if not (p.value.flags.c_contiguous and p.value.flags.writeable):
                p.value = np.array(p.value, order="C")  # torch shares only plain memory
            self.register_parameter(name, torch.nn.Parameter(torch.from_numpy(p.value)))
            self._links.append((name, p, p.value.dtype))

    def stepnet_parameter(self, name):
        """The stepnet ``Parameter`` behind the torch parameter ``name``.

        Parameters
        ----------
        name : str
            A name of ``module.named_parameters()``: the stepnet
            Parameter's name with ``.`` replaced by ``_`` (``param<i>`` for
            an unnamed one), made unique with a suffix.

        Returns
        -------
        Parameter

        Raises
        ------
        StepNetError
            ``name`` is not a parameter of this module.
        """
        for torch_name, p, _ in self._links:
            if torch_name == name:
                return p
        raise StepNetError(f"{name!r} is not a parameter of this module; its parameters are "
                           f"{[n for n, _, _ in self._links]}")

    def _sync(self):
        """Point each stepnet Parameter at its torch parameter's memory (torch
        owns it: ``param.data = ...``, ``load_state_dict``, a deep copy or a
        pickle round trip may have moved it)."""
        for name, p, dtype in self._links:
            t = self._parameters.get(name)
            if t is None:
                raise StepNetError(f"parameter {name!r} was removed from the module")
            if t.device.type != "cpu":
                raise UnsupportedError(f"parameter {name!r} is on {t.device}; stepnet.torch "
                                       "runs on CPU tensors")
            if t.dtype != TORCH_DTYPES.get(np.dtype(dtype)):
                raise ShapeError(f"parameter {name!r} has dtype {t.dtype}; the stepnet net "
                                 f"computes in {np.dtype(dtype)} (change dtypes with module.to)")
            if tuple(t.shape) != p.value.shape:
                raise ShapeError(f"parameter {name!r} has shape {list(t.shape)}; the stepnet "
                                 f"net was built with {list(p.value.shape)}")
            if not t.is_contiguous():
                t.data = t.data.contiguous()
            if t.data_ptr() != data_pointer(p.value) or not p.value.flags.c_contiguous:
                p.value = as_array(t)

    def _apply(self, fn, recurse=True):
        """``module.to(...)``, ``.double()``, ``.cuda()`` ...: refused before
        anything changes unless the result stays on the CPU in a dtype stepnet
        computes in (see ``_retype``)."""
        for dtype in {d for _, _, d in self._links}:
            probe = fn(torch.empty(0, dtype=TORCH_DTYPES[np.dtype(dtype)]))
            if probe.device.type != "cpu":
                raise UnsupportedError(f"stepnet.torch.Module runs on the CPU; it cannot move "
                                       f"to {probe.device} (stepnet's CUDA backend takes arrays, "
                                       "see docs/cuda.md)")
            if probe.dtype != TORCH_DTYPES[np.dtype(dtype)]:
                self._check_retype(probe.dtype)
        out = super()._apply(fn, recurse)
        changed = [self._parameters[name].dtype for name, _, dtype in self._links
                   if self._parameters[name].dtype != TORCH_DTYPES[np.dtype(dtype)]]
        if changed:
            self._retype(changed[0])
        self._sync()
        return out

    def _check_retype(self, dtype):
        """Refuse (raise) a change of the parameters' dtype to ``dtype``."""
        raise NotImplementedError

    def _retype(self, dtype):
        """Follow the torch parameters, converted to ``dtype``."""
        raise NotImplementedError


class LayerModule(Module):
    """A ``stepnet.nn`` layer called like the matching torch module:
    ``module(input, hx=None)`` (AUGRU: ``module(input, attention, hx=None)``).

    ``input`` is ``[B, T, I]`` (``batch_first=True``, the default), ``[T, B, I]``
    (``batch_first=False``), ``[T, I]`` (one sequence) or a ``PackedSequence``;
    ``hx`` is ``[num_layers * num_directions, B, H]`` (LSTM: a pair ``(h_0,
    c_0)``), ``[L*D, H]`` for one sequence. Returns ``output, h_n`` (LSTM:
    ``output, (h_n, c_n)``), ``output`` a ``PackedSequence`` when one came in.
    As in torch, a padded tensor is run over all its T steps.

    Parameters
    ----------
    layer : stepnet.nn.RNN, GRU, LSTM, AUGRU or MGU
        The layer; it is rebuilt (as ``module.layer``) when the module
        changes dtype.
    batch_first : bool, default True
        Input and output are ``[B, T, ...]``; False: ``[T, B, ...]``.
    backend : str, optional
        The stepnet backend the forward runs on; None:
        ``default_backend()``.

    Raises
    ------
    StepNetError
        ``layer`` is not a ``stepnet.nn`` layer, or is a cell.
    """

    def __init__(self, layer, *, batch_first=True, backend=None):
        _refuse_in_bridge(layer, "LayerModule")
        if not isinstance(layer, _LAYERS):
            raise StepNetError(f"LayerModule: expects a stepnet.nn layer, got {type(layer).__name__}")
        super().__init__(layer, batch_first=batch_first, backend=backend)

    @property
    def layer(self):
        """The ``stepnet.nn`` layer this module runs (a new one after a change
        of dtype)."""
        return self.wrapped

    def extra_repr(self):
        return f"{self.wrapped!r}, batch_first={self.batch_first}"

    # -- dtype changes: the layer is built again in the new dtype --------------

    def _check_retype(self, dtype):
        if dtype not in (torch.float32, torch.float64):
            raise UnsupportedError(f"{type(self.wrapped).__name__} computes in float32 or "
                                   f"float64, not {dtype}")

    def _retype(self, dtype):
        """The same layer in ``dtype``, its Parameters on the converted torch
        parameters' memory (the torch Parameters stay the same objects)."""
        old = self.wrapped
        new = type(old)(old.input_size, old.hidden_size, **_layer_options(old, NUMPY_DTYPES[dtype]))
        fresh = new.parameters()
        if len(fresh) != len(self._links):
            raise AssertionError("the rebuilt layer has other parameters")
        links = []
        for (name, _, _), p in zip(self._links, fresh):
            t = self._parameters[name]
            if tuple(t.shape) != p.value.shape:
                raise AssertionError(f"rebuilt parameter {name} has another shape")
            p.value = as_array(t)
            links.append((name, p, p.value.dtype))
        self.wrapped, self._links = new, links

    # -- forward -----------------------------------------------------------------

    @torch.compiler.disable  # a model under torch.compile runs the bridge as it is
    def forward(self, input, *args, **kwargs):
        """Run the layer, as the matching torch module's forward does.

        Parameters
        ----------
        input : torch.Tensor or PackedSequence
            ``[B, T, input_size]`` (``[T, B, input_size]`` without
            ``batch_first``), ``[T, input_size]`` for one sequence, or a
            ``PackedSequence``; a CPU tensor of the layer's dtype.
        *args
            ``hx`` (AUGRU: ``attention``, then ``hx``).
        **kwargs
            The same by name: ``hx=`` (AUGRU also ``attention=``). ``hx`` is
            ``[num_layers * num_directions, B, H]`` (LSTM: a pair ``(h_0,
            c_0)``), ``[L*D, H]`` for one sequence; None: zeros. An AUGRU's
            ``attention`` is one score per step, laid out as ``input``
            (``[B, T]`` or ``[B, T, 1]``, or a PackedSequence packed as it).

        Returns
        -------
        output : torch.Tensor or PackedSequence
            Every step's output, in ``input``'s layout (padded with zeros
            past each length).
        h_n : torch.Tensor or tuple of torch.Tensor
            The last states, shaped as ``hx`` (LSTM: ``(h_n, c_n)``).

        Raises
        ------
        StepNetError
            Other arguments than the call takes.
        ShapeError
            A tensor of another shape or dtype than the layer's.
        UnsupportedError
            A tensor that is not on the CPU.
        """
        layer = self.wrapped
        if layer.kind.attention:
            attention, hx = _augru_arguments(args, kwargs)
        else:
            if len(args) > 1 or set(kwargs) - {"hx"} or (args and "hx" in kwargs):
                raise StepNetError(f"{type(layer).__name__} module: called as module(input, "
                                   "hx=None)")
            attention, hx = None, (args[0] if args else kwargs.get("hx"))
        self._sync()
        dtype = TORCH_DTYPES[np.dtype(layer.dtype)]
        packed = isinstance(input, PackedSequence)
        data, layout, unbatched = self._check_input(input, dtype)
        B = len(layout.levels[0]) - 1
        states = self._check_hx(hx, B, unbatched, dtype)
        if attention is not None:
            attention = self._check_attention(attention, packed, unbatched, layout, dtype)
        tensors = [data] + ([attention] if attention is not None else []) + \
            [s for s in states if s is not None]
        call = LayerCall(self, layout, data, attention, states)
        params = [self._parameters[n] for n, _, _ in self._links]
        if autograd_records(tensors + params):
            outs = Bridge.apply(call, *tensors, *params)
        else:
            outs = call.forward(keep=False)
        output, finals = outs[0], list(outs[1:])
        if packed:
            output = layout.wrap(output)
        elif unbatched:
            output, finals = output.squeeze(0), [f.squeeze(1) for f in finals]
        elif not self.batch_first:
            output = output.transpose(0, 1).contiguous()
        return (output, tuple(finals)) if len(finals) > 1 else (output, finals[0])

    def _check_input(self, input, dtype):
        """The input's data (batch-first ``[B, T, I]`` unless packed), its
        layout, and whether it is one sequence without a batch axis."""
        layer = self.wrapped
        name = type(layer).__name__
        if isinstance(input, PackedSequence):
            data = check_tensor(input.data, f"{name}: input", dtype)
            if data.dim() != 2 or data.shape[1] != layer.input_size:
                raise ShapeError(f"{name}: the PackedSequence's data has shape "
                                 f"{list(data.shape)}, expected [tokens, {layer.input_size}]")
            return data, packed_layout(input, f"{name}: input"), False
        data = check_tensor(input, f"{name}: input", dtype)
        if data.dim() not in (2, 3) or data.shape[-1] != layer.input_size:
            raise ShapeError(
                f"{name}: input has shape {list(data.shape)}, expected "
                f"{'[B, T' if self.batch_first else '[T, B'}, {layer.input_size}] or "
                f"[T, {layer.input_size}] (input_size {layer.input_size})")
        unbatched = data.dim() == 2
        if unbatched:
            data = data.unsqueeze(0)
        elif not self.batch_first:
            data = data.transpose(0, 1)
        return data, padded_layout(data.shape, (None,), f"{name}: input"), unbatched

    def _check_hx(self, hx, B, unbatched, dtype):
        layer = self.wrapped
        name = type(layer).__name__
        widths = layer.state_widths()
        if hx is None:
            return [None] * len(widths)
        if len(widths) > 1:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise ShapeError(f"{name}: hx must be a pair (h_0, c_0), got {type(hx).__name__}")
            given = list(hx)
        else:
            given = [hx]
        states = []
        LD = layer.num_layers * layer.num_directions
        for what, t, w in zip(("h_0", "c_0"), given, widths):
            t = check_tensor(t, f"{name}: {what}", dtype)
            expected = (LD, w) if unbatched else (LD, B, w)
            if tuple(t.shape) != expected:
                width = "proj_size" if w != layer.hidden_size else "hidden_size"
                raise ShapeError(f"{name}: {what} has shape {list(t.shape)}, expected "
                                 f"{list(expected)} ([num_layers * num_directions, "
                                 f"{'' if unbatched else 'B, '}{width}])")
            states.append(t.unsqueeze(1) if unbatched else t)
        return states

    def _check_attention(self, attention, packed, unbatched, layout, dtype):
        name = type(self.wrapped).__name__
        if packed != isinstance(attention, PackedSequence):
            raise ShapeError(f"{name}: attention must be a PackedSequence exactly when the "
                             "input is one")
        if packed:
            if not torch.equal(attention.batch_sizes, layout.packed.batch_sizes) or (
                    (attention.unsorted_indices is None) != (layout.packed.unsorted_indices is None)
                    or (attention.unsorted_indices is not None and not torch.equal(
                        attention.unsorted_indices, layout.packed.unsorted_indices))):
                raise ShapeError(f"{name}: attention is packed with other lengths or order "
                                 "than the input")
            a = check_tensor(attention.data, f"{name}: attention", dtype)
            if a.shape[0] != layout.caller_rows or a.numel() != a.shape[0]:
                raise ShapeError(f"{name}: attention's data has shape {list(a.shape)}, expected "
                                 f"[{layout.caller_rows}] or [{layout.caller_rows}, 1]")
            return a
        a = check_tensor(attention, f"{name}: attention", dtype)
        if unbatched:
            a = a.unsqueeze(0)
        elif not self.batch_first:
            a = a.transpose(0, 1)
        B, T = layout.padded_shape
        if tuple(a.shape[:2]) != (B, T) or a.numel() != B * T:
            raise ShapeError(f"{name}: attention has shape {list(attention.shape)}, expected one "
                             f"score per input step ({'[B, T]' if self.batch_first else '[T, B]'}"
                             f" = {[B, T] if self.batch_first else [T, B]}, or with a last "
                             "dimension of 1)")
        return a


def _augru_arguments(args, kwargs):
    kwargs = dict(kwargs)
    names = ["attention", "hx"]
    values = dict(zip(names, args))
    for k in list(kwargs):
        if k not in names or k in values:
            raise StepNetError("AUGRU module: called as module(input, attention, hx=None)")
        values[k] = kwargs.pop(k)
    if len(args) > 2 or "attention" not in values:
        raise StepNetError("AUGRU module: called as module(input, attention, hx=None)")
    return values["attention"], values.get("hx")


def _layer_options(layer, dtype):
    """The keyword arguments that build ``layer`` again (in ``dtype``)."""
    options = {
        "num_layers": layer.num_layers,
        "direction": layer.direction,
        "combine": layer.combine,
        "activations": list(layer.activations),
        "activation_alpha": layer.activation_alpha,
        "activation_beta": layer.activation_beta,
        "clip": layer.clip,
        "bias": layer.bias,
        "dtype": dtype,
    }
    options.update({key: getattr(layer, key) for key in layer.kind.options})
    return options


class StepNetModule(Module):
    """A top-level step-net as a torch module: ``module(**inputs)`` takes the
    step-net's inputs by name as torch tensors (a LoD input as a
    ``PackedSequence``, ``(padded, lengths)`` or ``(rows, lod)``) and returns
    its outputs: one, or a tuple in ``add_outputs`` order.

    An all-steps output comes back in the layout of the first LoD input: a
    ``PackedSequence``, a padded tensor (zeros past each length), or
    ``(rows, lod)``; a last-step output is ``[num_seq, ...]`` in the caller's
    sequence order. ``output_all_steps`` (one flag or one per output) is fixed
    when the module is made.

    Parameters
    ----------
    rnn : RNNOp
        A defined, top-level step-net.
    output_all_steps : bool or sequence of bool, default True
        As in ``rnn(output_all_steps=...)``, for every call of the module.
    batch_first : bool, default True
        Padded tensors are ``[B, T, ...]``; False: ``[T, B, ...]``.
    backend : str, optional
        The stepnet backend the forward runs on; None:
        ``default_backend()``.

    Raises
    ------
    StepNetError
        ``rnn`` is not a step-net, is not defined yet, is nested, or
        ``output_all_steps`` has another number of flags than it has
        outputs.
    """

    def __init__(self, rnn, output_all_steps=True, *, batch_first=True, backend=None):
        if not isinstance(rnn, dsl.RNNOp):
            raise StepNetError(f"StepNetModule: expects a step-net, got {type(rnn).__name__}")
        rnn._require_defined()
        if not rnn._top:
            raise StepNetError(f"{rnn.name} is a nested step-net; wrap its enclosing one")
        flags = rnn.all_steps_flags(output_all_steps)
        super().__init__(rnn, batch_first=batch_first, backend=backend)
        self.flags = flags

    @property
    def rnn(self):
        """The step-net this module runs."""
        return self.wrapped

    def _check_retype(self, dtype):
        traced = sorted({np.dtype(d).name for _, _, d in self._links})
        raise UnsupportedError(
            f"step-net {self.wrapped.name} computes in {', '.join(traced)}: a step-net's dtypes "
            f"are fixed when it is defined; define it again with {dtype} inputs and Parameters")

    def extra_repr(self):
        inputs = ", ".join(f"{n}: {b.kind}" for n, b in self.wrapped.bindings.items())
        return f"{self.wrapped.name}({inputs}), output_all_steps={self.flags}"

    @torch.compiler.disable  # a model under torch.compile runs the bridge as it is
    def forward(self, **inputs):
        """Run the step-net on torch tensors.

        Parameters
        ----------
        **inputs
            The step-net's inputs by name; those not given keep the values
            bound when it was defined. A LoD input is a ``PackedSequence``,
            ``(padded, lengths)`` (lengths None: every sequence ``T`` steps)
            or ``(rows, lod)``; one of ``d`` levels ``(padded, (lengths_1,
            ..., lengths_d))`` padded by each (``[B, T1, ..., Td, ...]``) or
            ``(rows, lod)``; a ragged static input as a one-level LoD input
            (a decoder's memory: rows per sequence);
            an initial memory or other static input is a tensor, or a number
            or ndarray taken as a constant (no gradient). CPU tensors of the
            dtype the step-net computes in.

        Returns
        -------
        torch.Tensor, PackedSequence, tuple
            One per output, a tuple of them for two or more. An all-steps
            output is in the layout of the first LoD input given (a
            PackedSequence, or a padded tensor with zeros past each length,
            padded by the output's own levels) where its LoD is that input's
            or its first levels, else ``(rows, lod)``; a last-step
            output is ``[num_seq, ...]`` in the caller's sequence order.

        Raises
        ------
        StepNetError
            An unknown input name.
        ShapeError
            An input of another form, LoD depth, feature shape or dtype than
            the step-net was defined with.
        UnsupportedError
            A tensor that is not on the CPU.
        """
        rnn = self.wrapped
        unknown = set(inputs) - set(rnn.bindings)
        if unknown:
            raise StepNetError(f"unknown input name(s) {sorted(unknown)}; {rnn.name} takes "
                               f"{sorted(rnn.bindings)}")
        self._sync()
        bindings, tensors, names, layouts, ragged = {}, [], [], {}, {}
        for name, value in inputs.items():
            b = rnn.bindings[name]
            dtype = TORCH_DTYPES[np.dtype(b.var.dtype)]
            what = f"input {name}"
            if b.kind == "sequence" or b.var.lod_depth:  # (a ragged static input: a decoder's memory)
                t, lay = self._sequence_input(value, b, what, dtype)
                (layouts if b.kind == "sequence" else ragged)[name] = lay
                bindings[name] = (t, lay)
            else:
                if isinstance(value, (int, float, np.ndarray)):
                    bindings[name] = value  # a constant: no gradient
                    continue
                t = check_tensor(value, what, dtype)
                bindings[name] = t
            tensors.append(t)
            names.append(name)
        call = StepNetCall(self, bindings, names, layouts, ragged)
        params = [self._parameters[n] for n, _, _ in self._links]
        if autograd_records(tensors + params):
            outs = Bridge.apply(call, *tensors, *params)
        else:
            outs = call.forward(keep=False)
        results = []
        for out, flag, lay in zip(outs, self.flags, call.out_layouts):
            if flag and lay is not None:
                out = lay.wrap(out)
                if lay.kind == "padded" and not self.batch_first:
                    out = out.transpose(0, 1).contiguous()
            elif flag:
                out = (out, call.out_lods.pop(0))
            results.append(out)
        return results[0] if len(results) == 1 else tuple(results)

    def _sequence_input(self, value, b, what, dtype):
        features = tuple(b.var.shape[1:])
        depth = b.var.lod_depth
        if isinstance(value, PackedSequence):
            if depth != 1:
                raise ShapeError(f"{what}: a PackedSequence has one LoD level; {what} was defined "
                                 f"with {depth} (pass (rows, lod))")
            t = check_tensor(value.data, what, dtype)
            lay = packed_layout(value, what)
            shape = tuple(t.shape[1:])
        elif isinstance(value, (tuple, list)) and len(value) == 2:
            t, second = value
            t = check_tensor(t, what, dtype)
            if depth > 1 and t.dim() == 1 + depth + len(features):  # padded by every level
                t, lay = self._padded(t, second, depth, what)
                shape = tuple(t.shape[depth + 1:])
            elif is_lod_levels(second):
                lay = rows_layout(t, second, what)
                if len(lay.levels) != depth:
                    raise ShapeError(f"{what}: lod has {len(lay.levels)} level(s); {what} was "
                                     f"defined with {depth}")
                shape = tuple(t.shape[1:])
            else:
                if depth != 1:
                    raise ShapeError(f"{what}: was defined with {depth} LoD levels: pass (padded "
                                     f"[B, T1, ..., T{depth}, ...], lengths of each level) or "
                                     "(rows, lod)")
                if t.dim() < 2:
                    raise ShapeError(f"{what}: the padded tensor has shape {list(t.shape)}, "
                                     f"expected {'[B, T' if self.batch_first else '[T, B'}, ...]")
                if not self.batch_first:
                    t = t.transpose(0, 1)
                lay = padded_layout(t.shape, (second,), what)
                shape = tuple(t.shape[2:])
        else:
            raise ShapeError(f"{what}: a LoD input is given as a PackedSequence, (padded, lengths) "
                             f"or (rows, lod); got {type(value).__name__}")
        if shape != features:
            raise ShapeError(f"{what}: has feature shape {list(shape)}; it was defined with "
                             f"{list(features)}")
        return t, lay

    def _padded(self, t, lengths, depth, what):
        """A LoD input of ``depth`` levels padded by each, ``[B, T1, ...,
        Td, ...]`` (``[T1, B, ...]`` where not batch_first), with
        ``lengths`` a sequence of one array per level (None: every entry
        full): the tensor batch-first and its layout."""
        if lengths is None:
            lengths = (None,) * depth
        if not isinstance(lengths, (tuple, list)) or len(lengths) != depth:
            raise ShapeError(f"{what}: a tensor padded by its {depth} LoD levels takes {depth} "
                             f"lengths ([B], [B, T1], ...), got {type(lengths).__name__}"
                             + (f" of {len(lengths)}" if isinstance(lengths, (tuple, list)) else ""))
        if not self.batch_first:
            t = t.transpose(0, 1)
        return t, padded_layout(t.shape, tuple(lengths), what)
