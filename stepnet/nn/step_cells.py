"""The built-in cells: ``RNNCell``, ``GRUCell``, ``LSTMCell``, ``AUGRUCell``
and ``MGUCell``, one step of a layer (:mod:`stepnet.nn.layers`) called inside
another step-net's block (``h = cell(x, h)``), each reading its cell's
record (``cells.CELLS``) as its layer does."""

from __future__ import annotations

from ..errors import StepNetError, UnsupportedError
from .base import _RecurrentLayer
from .layouts import _torch_of
from .layers import AUGRU, GRU, LSTM, MGU, RNN


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
            self.input_size, self.hidden_size, bias=self.bias, **options).to(layer.weight_ih_l0.dtype)
        with torch.no_grad():
            for name, value in module.named_parameters():
                value.copy_(getattr(layer, name + "_l0"))
        return module


def _refuse_in_bridge(net, where):
    """Raise a StepNetError if ``net`` is a cell: ``where`` (a wrapper that
    runs a layer over sequences) cannot take one step of a recurrence; an
    UnsupportedError if it is quantized: its weights were fixed when it was
    quantized, so the Parameters ``where`` would hand out could not reach
    it, and it has no gradient."""
    if getattr(net, "quantized", None):
        raise UnsupportedError(
            f"{where}: the {type(net).__name__} is quantized ({net.quantized}): its weights are "
            "fixed and it has no gradient; call it directly, or wrap the float model")
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
        ``seed``, ``bias``); ``num_layers``, ``direction`` and ``combine`` only at their
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
        ``seed``, ``bias``); ``num_layers``, ``direction`` and ``combine`` only at their
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
        ``seed``, ``bias``); ``num_layers``, ``direction`` and ``combine`` only at their
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
        ``seed``, ``bias``); ``num_layers``, ``direction`` and ``combine`` only at their
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
        ``seed``, ``bias``); ``num_layers``, ``direction`` and ``combine`` only at their
        defaults (1, ``"forward"``, ``"per_layer"``).

    Raises
    ------
    StepNetError
        Another number of layers, direction or combination, or an option out
        of range.
    """
