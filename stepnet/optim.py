"""Optimizers over ``stepnet.Parameter``s, gradient clipping and a training loop.

The update equations are PyTorch's (``torch.optim.SGD``, ``torch.optim.Adam``,
``torch.nn.utils.clip_grad_norm_``) and are tested against them step by step.
Gradients come from ``sn.gradients`` / ``sn.vjp`` (docs/gradients.md) or from
anywhere else: an optimizer only sees one ndarray per parameter.

Parameters are updated **in place** (``p.value[...] = ...``): a step-net that
reads a Parameter sees the new values on its next call, with no re-tracing and
no recompiling.

>>> import numpy as np, stepnet as sn
>>> from stepnet.optim import SGD
>>> W = sn.Parameter(np.ones((2, 2), np.float32), name="W")
>>> opt = SGD([W], lr=0.5)
>>> opt.step([np.ones((2, 2), np.float32)])
>>> W.value
array([[0.5, 0.5],
       [0.5, 0.5]], dtype=float32)
"""

import math
from collections.abc import Iterator

import numpy as np

from .errors import ShapeError, StepNetError
from .tracing import Parameter

__all__ = ["SGD", "Adam", "Optimizer", "clip_grad_norm", "train"]


def _describe(p, i):
    """How an error message names parameter ``i``."""
    return f"parameter {i} ({p.name!r})" if p.name else f"parameter {i}"


def _number(value, what):
    try:
        return float(value)
    except (TypeError, ValueError):
        raise StepNetError(f"{what} must be a number, got {value!r}") from None


def _count(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StepNetError(f"{what} must be a whole number, got {value!r}")
    if value < 0:
        raise StepNetError(f"{what} must be >= 0, got {value}")
    return int(value)


def _nonnegative(value, what):
    value = _number(value, what)
    if not value >= 0.0:  # also refuses NaN
        raise StepNetError(f"{what} must be >= 0, got {value}")
    return value


class Optimizer:
    """What every optimizer shares: the parameter list, validation of the
    gradients handed to :meth:`step`, and per-parameter state.

    Subclasses implement ``_update(i, p, g)``, which changes ``p.value`` in place
    from the gradient ``g`` (an ndarray of ``p``'s shape and dtype).

    Parameters
    ----------
    params : iterable of Parameter
        The parameters to train, each once (e.g. ``layer.parameters()`` or
        ``rnn.parameters()``); floating-point and writable, since they are
        updated in place. Not a single Parameter: pass ``[p]``.
    lr : float
        The learning rate, ``>= 0``.

    Raises
    ------
    StepNetError
        ``params`` is a single Parameter, is empty, holds something other
        than a Parameter or one Parameter twice, or holds one that is not a
        writable float array; ``lr`` is negative or NaN.
    """

    def __init__(self, params, lr):
        if isinstance(params, Parameter):
            raise StepNetError(f"{type(self).__name__}: params must be a list of Parameters, "
                               "not a single Parameter; pass [p]")
        self.params = list(params)
        if not self.params:
            raise StepNetError(f"{type(self).__name__}: got an empty parameter list")
        seen = {}
        for i, p in enumerate(self.params):
            if not isinstance(p, Parameter):
                raise StepNetError(f"{type(self).__name__}: params[{i}] is a "
                                   f"{type(p).__name__}, not a stepnet.Parameter")
            if id(p) in seen:
                raise StepNetError(f"{type(self).__name__}: {_describe(p, i)} is the same "
                                   f"Parameter as parameter {seen[id(p)]}; it would be "
                                   "updated twice per step")
            seen[id(p)] = i
            if p.value.dtype.kind != "f":
                raise StepNetError(f"{type(self).__name__}: {_describe(p, i)} has dtype "
                                   f"{p.value.dtype}; only floating-point parameters are trained")
            if not p.value.flags.writeable:
                raise StepNetError(f"{type(self).__name__}: {_describe(p, i)}'s value is "
                                   "read-only; it is updated in place")
        self.lr = _nonnegative(lr, f"{type(self).__name__}: lr")
        self.state = [{} for _ in self.params]  # one dict per parameter
        self.steps = 0  # number of calls to step()

    def _check(self, grads):
        """The gradients as arrays of each parameter's dtype (``None`` kept)."""
        name = type(self).__name__
        if isinstance(grads, np.ndarray):
            raise StepNetError(f"{name}.step: grads must be a list with one array per "
                               "parameter, not a single array")
        grads = list(grads)
        if len(grads) != len(self.params):
            raise StepNetError(f"{name}.step: got {len(grads)} gradients for "
                               f"{len(self.params)} parameters (one per parameter, in order)")
        out = []
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                out.append(None)
                continue
            g = np.asarray(g)
            if g.shape != p.value.shape:
                raise ShapeError(f"{name}.step: the gradient of {_describe(p, i)} has shape "
                                 f"{g.shape}; the parameter has shape {p.value.shape}")
            if g.dtype.kind not in "fiu":
                raise ShapeError(f"{name}.step: the gradient of {_describe(p, i)} has dtype "
                                 f"{g.dtype}, not a real number type")
            out.append(g.astype(p.value.dtype, copy=False))
        return out

    def step(self, grads):
        """Update every parameter from its gradient.

        Parameters
        ----------
        grads : sequence of array_like or None
            One gradient per parameter, in the order the parameters were
            given, each shaped like ``Parameter.value`` (cast to its dtype);
            ``None`` leaves that parameter (and its state) unchanged, as a
            missing ``.grad`` does in PyTorch. The arrays are not modified.

        Raises
        ------
        StepNetError
            ``grads`` is a single array, or does not hold one entry per
            parameter.
        ShapeError
            A gradient's shape is not its parameter's, or its dtype is not a
            real number type.
        """
        grads = self._check(grads)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is not None:
                self._update(i, p, g)
        self.steps += 1

    def _update(self, i, p, g):
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}({len(self.params)} parameters, lr={self.lr})"


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, as ``torch.optim.SGD``::

        g = grad + weight_decay * p
        buf = g                                   (first step)
        buf = momentum * buf + (1 - dampening) * g   (later steps)
        g = g + momentum * buf if nesterov else buf  (when momentum != 0)
        p = p - lr * g

    Parameters
    ----------
    params : iterable of Parameter
        The parameters to train, each once; floating-point and writable.
    lr : float
        The learning rate, ``>= 0``.
    momentum : float, default 0.0
        The momentum factor, ``>= 0``; 0: plain gradient descent, no state.
    nesterov : bool, default False
        Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.
    weight_decay : float, default 0.0
        L2 penalty added to the gradient, ``>= 0``.
    dampening : float, default 0.0
        Dampening of the momentum's later steps.

    Raises
    ------
    StepNetError
        A parameter list that ``Optimizer`` refuses, a negative ``lr``,
        ``momentum`` or ``weight_decay``, or ``nesterov`` without momentum
        or with dampening.
    """

    def __init__(self, params, lr, momentum=0.0, nesterov=False, weight_decay=0.0, dampening=0.0):
        super().__init__(params, lr)
        self.momentum = _nonnegative(momentum, "SGD: momentum")
        self.dampening = _number(dampening, "SGD: dampening")
        self.weight_decay = _nonnegative(weight_decay, "SGD: weight_decay")
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise StepNetError("SGD: nesterov=True needs momentum > 0 and dampening 0")

    def _update(self, i, p, g):
        if self.weight_decay:
            g = g + self.weight_decay * p.value
        if self.momentum:
            state = self.state[i]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = np.array(g, copy=True)  # an array even when 0-d
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        p.value[...] = p.value - self.lr * g


class Adam(Optimizer):
    """Adam with bias correction, as ``torch.optim.Adam`` (``amsgrad=False``)::

        g = grad + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    with ``t`` counting that parameter's updates from 1. ``weight_decay`` is
    L2 added to the gradient (PyTorch's Adam, not AdamW).

    Parameters
    ----------
    params : iterable of Parameter
        The parameters to train, each once; floating-point and writable.
    lr : float, default 1e-3
        The learning rate, ``>= 0``.
    betas : tuple of float, default (0.9, 0.999)
        ``(beta1, beta2)``, the decay rates of the moment estimates ``m`` and
        ``v``, each in ``[0, 1)``.
    eps : float, default 1e-8
        Added to the denominator, ``>= 0``.
    weight_decay : float, default 0.0
        L2 penalty added to the gradient, ``>= 0``.

    Raises
    ------
    StepNetError
        A parameter list that ``Optimizer`` refuses, ``betas`` that are not
        two numbers in ``[0, 1)``, or a negative ``lr``, ``eps`` or
        ``weight_decay``.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, lr)
        if not isinstance(betas, (tuple, list)):
            raise StepNetError(f"Adam: betas must be two numbers in [0, 1), got {betas!r}")
        betas = tuple(_number(b, "Adam: betas") for b in betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise StepNetError(f"Adam: betas must be two numbers in [0, 1), got {betas}")
        self.betas = betas
        self.eps = _nonnegative(eps, "Adam: eps")
        self.weight_decay = _nonnegative(weight_decay, "Adam: weight_decay")

    def _update(self, i, p, g):
        beta1, beta2 = self.betas
        if self.weight_decay:
            g = g + self.weight_decay * p.value
        state = self.state[i]
        if not state:
            state["step"] = 0
            state["exp_avg"] = np.zeros_like(p.value)
            state["exp_avg_sq"] = np.zeros_like(p.value)
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        m += (1.0 - beta1) * (g - m)  # PyTorch's lerp
        v *= beta2
        v += (1.0 - beta2) * (g * g)
        step_size = self.lr / (1.0 - beta1 ** t)
        denom = np.sqrt(v) / math.sqrt(1.0 - beta2 ** t) + self.eps
        p.value[...] = p.value - step_size * (m / denom)


def clip_grad_norm(grads, max_norm, norm_type=2.0):
    """Scale ``grads`` in place so that their joint norm is at most ``max_norm``;
    returns the norm before clipping, as ``torch.nn.utils.clip_grad_norm_``.

    The joint norm is the ``norm_type`` norm of all gradients taken together
    (``float("inf")``: the largest absolute value). When it exceeds
    ``max_norm`` every gradient is multiplied by ``max_norm / (norm + 1e-6)``.
    ``None`` entries are skipped. The arrays must be writable float arrays.
    A NaN norm leaves the gradients as they are (PyTorch's would turn them all
    into NaN); the returned norm says so.

    Parameters
    ----------
    grads : ndarray or sequence of ndarray or None
        The gradients, scaled in place: writable float arrays; ``None``
        entries are skipped.
    max_norm : float
        The largest joint norm kept, ``>= 0``.
    norm_type : float, default 2.0
        The norm's order ``p`` (``(sum |g|**p) ** (1/p)``), positive, or
        ``float("inf")``.

    Returns
    -------
    float
        The joint norm before clipping (0.0 when there is no gradient).

    Raises
    ------
    StepNetError
        ``max_norm`` is negative, ``norm_type`` is not positive, or a
        gradient is not a writable float ndarray (checked before any is
        scaled).
    """
    max_norm = _nonnegative(max_norm, "clip_grad_norm: max_norm")
    norm_type = _number(norm_type, "clip_grad_norm: norm_type")
    if not norm_type > 0:
        raise StepNetError(f"clip_grad_norm: norm_type must be positive or inf, got {norm_type}")
    if isinstance(grads, np.ndarray):
        grads = [grads]
    grads = [g for g in grads if g is not None]
    for i, g in enumerate(grads):
        if not isinstance(g, np.ndarray) or g.dtype.kind != "f":
            raise StepNetError(f"clip_grad_norm: gradient {i} is not a float ndarray "
                               f"(got {type(g).__name__}); it is scaled in place")
        if not g.flags.writeable:
            raise StepNetError(f"clip_grad_norm: gradient {i} is read-only; it is scaled in place")
    if not grads:
        return 0.0
    flat = [np.abs(g.astype(np.float64, copy=False)).ravel() for g in grads]
    if math.isinf(norm_type):
        total = max((float(a.max()) if a.size else 0.0) for a in flat)
    else:
        total = float(sum(np.sum(a ** norm_type) for a in flat) ** (1.0 / norm_type))
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g *= g.dtype.type(coef)
    return total


def _epoch_batches(batches, epoch, epochs):
    if callable(batches):
        return batches(epoch)
    if epochs > 1 and isinstance(batches, Iterator):
        raise StepNetError("train: batches is an iterator, which runs out after one epoch; "
                           "pass a list or a function epoch -> batches")
    return batches


def _stops(answer, step):
    """Whether a callback's answer stops training: its truth value."""
    try:
        return bool(answer)
    except (TypeError, ValueError) as exc:  # an array of several elements, say
        raise StepNetError(f"train: callback returned {type(answer).__name__} at step {step}, "
                           f"which has no truth value ({exc}); return True to stop, "
                           f"False or None to go on") from None


def train(step_fn, optimizer, batches, epochs=1, log_every=0, callback=None, log=print):
    """Run a training loop; returns the list of every step's loss.

    Each batch: ``loss, grads = step_fn(batch)``, then
    ``optimizer.step(grads)``; ``step_fn`` may clip the gradients
    (:func:`clip_grad_norm`) before returning them.

    Parameters
    ----------
    step_fn : callable
        ``step_fn(batch) -> (loss, grads)``: the loss of one batch (anything
        ``float()`` takes) and the gradients of the optimizer's parameters,
        one array each in the optimizer's order, e.g. from ``sn.gradients``
        or ``sn.vjp``.
    optimizer : Optimizer
        Its ``step(grads)`` runs after each batch.
    batches : iterable or callable
        A list (or other re-iterable) run through once per epoch, or a
        function ``batches(epoch)`` (epoch counting from 0) giving that
        epoch's batches (fresh random batches each epoch, say). A one-shot
        iterator is accepted only with ``epochs=1``.
    epochs : int, default 1
        How many times to run through the batches, ``>= 0``.
    log_every : int, default 0
        Every that many steps, ``log`` gets a line ``step N  epoch E  loss L``
        with the mean loss over those steps; 0 logs nothing.
    callback : callable, optional
        ``callback(step, loss)``, called after every step (``step`` counts
        from 1 over all epochs); a truthy return (``True``, ``np.True_``, a
        nonzero number...) stops training there, and ``None`` (no
        ``return``) or any falsy value goes on.
    log : callable, default print
        Takes each log line, a str.

    Returns
    -------
    list of float
        Every step's loss, in order.

    Raises
    ------
    StepNetError
        ``epochs`` or ``log_every`` is negative, ``batches`` is an iterator
        with ``epochs > 1``, ``step_fn`` does not return a pair, or
        ``callback`` returns something without a truth value (an array of
        several elements).

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> W = sn.Parameter(np.array([4.0], np.float32))
    >>> opt = sn.optim.SGD([W], lr=0.25)
    >>> def step_fn(batch):  # loss = W**2, gradient 2 W
    ...     return float(W.value[0] ** 2), [2 * W.value]
    >>> sn.optim.train(step_fn, opt, [None, None])
    [16.0, 4.0]
    """
    epochs = _count(epochs, "train: epochs")
    log_every = _count(log_every, "train: log_every")
    losses = []
    for epoch in range(epochs):
        for batch in _epoch_batches(batches, epoch, epochs):
            result = step_fn(batch)
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                raise StepNetError("train: step_fn(batch) must return (loss, grads), got "
                                   f"{type(result).__name__}")
            loss, grads = result
            loss = _number(loss, "train: the loss step_fn(batch) returns")
            optimizer.step(grads)
            losses.append(loss)
            step = len(losses)
            if log_every and step % log_every == 0:
                mean = sum(losses[-log_every:]) / log_every
                log(f"step {step:6d}  epoch {epoch + 1}  loss {mean:.6f}")
            if callback is not None and _stops(callback(step, loss), step):
                return losses
    return losses

