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

What the layers share is ``base._RecurrentLayer``; their layouts are in
``layouts``, the backward of a call in ``layer_pullback``.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError, StepNetError
from ..lod import LoDTensor
# (the registries LAYERS and CELLS, and DIRECTIONS, are read from here too)
from .base import CELLS, DIRECTIONS, LAYERS, _RecurrentLayer  # noqa: F401


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
    bias : bool, default True
        False: no biases (PyTorch's ``bias=False``): they stay zeros and are
        none of ``parameters()``.

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
                 activation_beta=None, clip=None, dtype=np.float32, seed=None,
                 bias=True):
        names = {"tanh": "Tanh", "relu": "Relu", "sigmoid": "Sigmoid"}
        if nonlinearity not in names:
            raise StepNetError(f"RNN: nonlinearity {nonlinearity!r} is not tanh, relu or sigmoid")
        self.nonlinearity = nonlinearity
        self._nonlinearity_name = names[nonlinearity]
        super().__init__(input_size, hidden_size, num_layers, direction=direction, combine=combine,
                         activations=activations, activation_alpha=activation_alpha,
                         activation_beta=activation_beta, clip=clip, dtype=dtype, seed=seed,
                         bias=bias)

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
    bias : bool, default True
        False: no biases (PyTorch's ``bias=False``): they stay zeros and are
        none of ``parameters()``.

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
                 activation_beta=None, clip=None, dtype=np.float32, seed=None,
                 bias=True):
        super().__init__(input_size, hidden_size, num_layers,
                         linear_before_reset=linear_before_reset, direction=direction, combine=combine,
                         activations=activations, activation_alpha=activation_alpha,
                         activation_beta=activation_beta, clip=clip, dtype=dtype, seed=seed,
                         bias=bias)

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
    bias : bool, default True
        False: no biases (PyTorch's ``bias=False``): they stay zeros and are
        none of ``parameters()``.

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
            or ``padded`` alone (X's lengths), ``padded`` ``[B, T]`` or
            ``[B, T, 1]``.
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
        if back[0] == "padded":  # (padded, lengths), or the padded scores alone: X's lengths
            padded, lengths = attention if isinstance(attention, tuple) and len(attention) == 2 \
                else (attention, np.diff(flat.levels[0]))
            padded = np.asarray(padded)
            if padded.ndim not in (2, 3) or padded.shape[:2] != (len(lengths), back[1]) \
                    or padded.size != len(lengths) * back[1]:
                raise ShapeError(f"AUGRU: a padded attention must be [B, T] or [B, T, 1] = "
                                 f"{[len(lengths), back[1]]} as X is, got shape "
                                 f"{list(padded.shape)}")
            attention = LoDTensor.from_padded(padded.reshape(padded.shape[:2] + (1,)), lengths)
        if not isinstance(attention, LoDTensor):
            raise ShapeError(f"AUGRU: attention must be a LoDTensor, got {type(attention).__name__}")
        A = attention if attention.num_levels == 1 else LoDTensor(attention.data,
                                                                  [attention.levels[-1]])
        if A.num_levels != 1 or not np.array_equal(A.levels[0], flat.levels[0]):
            raise ShapeError(f"AUGRU: attention has LoD {attention.lod}, the input has "
                             f"{X.lod if isinstance(X, LoDTensor) else flat.lod}; they must match")
        data = A.data.reshape(len(A.data), int(np.prod(A.data.shape[1:], dtype=np.int64)))
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
    bias : bool, default True
        False: no biases (PyTorch's ``bias=False``): they stay zeros and are
        none of ``parameters()``.

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
                 activation_alpha=None, activation_beta=None, clip=None, dtype=np.float32, seed=None,
                 bias=True):
        super().__init__(input_size, hidden_size, num_layers, peephole=peephole,
                         proj_size=proj_size, input_forget=input_forget,
                         direction=direction, combine=combine,
                         activations=activations, activation_alpha=activation_alpha,
                         activation_beta=activation_beta, clip=clip, dtype=dtype, seed=seed,
                         bias=bias)

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
    bias : bool, default True
        False: no biases: they stay zeros and are none of ``parameters()``.

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
                 activation_beta=None, clip=None, dtype=np.float32, seed=None,
                 bias=True):
        super().__init__(input_size, hidden_size, num_layers, direction=direction, combine=combine,
                         activations=activations, activation_alpha=activation_alpha,
                         activation_beta=activation_beta, clip=clip, dtype=dtype, seed=seed,
                         bias=bias)
