"""stepnet.torch's calls as autograd sees them: the autograd function that
runs stepnet forward once, keeping the workspace, and backward by the
pullback; one call of a layer and one of a step-net, each with its inputs
as stepnet values, its run and its pullback.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import UnsupportedError
from .lod import LoDTensor
from .pullback import vjp
from .torch_layouts import NUMPY_DTYPES, as_array, as_tensor, grad_array

# ----------------------------------------------------------------------------
# the autograd function: forward once keeping the workspace, backward by the pullback


class Bridge(torch.autograd.Function):
    """``apply(call, *tensors)``: ``call.forward()`` runs stepnet (``tensors``
    are the inputs and parameters it reads, passed so that autograd links
    them); ``call.backward(grads, needs)`` runs the pullback."""

    @staticmethod
    def forward(ctx, call, *tensors):
        ctx.set_materialize_grads(False)  # None stands for zeros: the pullback skips them
        ctx.call = call
        ctx.save_for_backward(*tensors)  # modified in place before backward: torch refuses
        return call.forward()

    @staticmethod
    def backward(ctx, *grads):
        # grad mode is on in a backward only under create_graph=True: a
        # gradient of these gradients may be asked for, which stepnet has not
        # (torch's once_differentiable says so only where the incoming
        # gradients need one, and drops the second-order terms otherwise)
        if torch.is_grad_enabled():
            raise UnsupportedError("stepnet.torch: backward with create_graph=True (a gradient of "
                                   "a gradient) is not done through stepnet's bridge")
        ctx.saved_tensors  # noqa: B018 - checks that no input changed in place since
        return (None,) + tuple(ctx.call.backward(grads, ctx.needs_input_grad[1:]))


def autograd_records(tensors):
    """Whether autograd records this call."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


# ----------------------------------------------------------------------------
# the calls: a layer's and a step-net's


class LayerCall:
    """One call of a layer: its inputs as arrays, the run, its pullback."""

    def __init__(self, module, layout, data, attention, states):
        self.module = module
        self.layout = layout
        self.data = data
        self.attention = attention
        self.states = states
        self.pullback = None

    def _arguments(self):
        layout = self.layout
        X = LoDTensor(layout.gather(as_array(self.data)), layout.levels)
        args = [X]
        if self.attention is not None:  # one score per token: [tokens, 1]
            a = as_array(self.attention)
            steps = a.shape[:2] if layout.kind == "padded" else a.shape[:1]
            args.append(LoDTensor(layout.gather(a.reshape(steps + (1,))), layout.levels))
        states = [None if s is None else as_array(s) for s in self.states]
        if len(states) > 1:
            args.append(tuple(states) if any(s is not None for s in states) else None)
        else:
            args.append(states[0])
        return args

    def forward(self, keep=True):
        layer = self.module.wrapped
        args = self._arguments()
        backend = self.module.backend
        if keep:
            outs, self.pullback = vjp(layer, *args, backend=backend)
            if getattr(layer, "_workspace", None) is self.pullback:
                layer._workspace = None  # held by this call's autograd node only
        else:
            outs = layer(*args, backend=backend)
        Y, finals = outs
        finals = finals if isinstance(finals, tuple) else (finals,)
        return (as_tensor(self.layout.scatter(Y.data)),) + tuple(as_tensor(f) for f in finals)

    def backward(self, grads, needs):
        layout = self.layout
        dY = grads[0]
        cts = [None if dY is None else layout.gather(as_array(dY))]
        cts += [grad_array(g) for g in grads[1:]]
        given = [("X", self.data)]
        if self.attention is not None:
            given.append(("attention", self.attention))
        given += [(n, s) for n, s in zip(("h0", "c0"), self.states) if s is not None]
        params = [p for _, p, _ in self.module._links]
        inputs_needed = [name for (name, _), need in zip(given, needs) if need]
        params_needed = needs[len(given):]
        wrt = inputs_needed + [p for p, need in zip(params, params_needed) if need]
        if not wrt:
            return [None] * len(needs)
        found = iter(self.pullback(cts, wrt=wrt))
        out = []
        for (name, t), need in zip(given, needs):
            if not need:
                out.append(None)
            elif name in ("X", "attention"):
                out.append(as_tensor(layout.scatter(next(found)).reshape(t.shape)))
            else:
                out.append(as_tensor(next(found)))
        out += [as_tensor(next(found)) if need else None for need in params_needed]
        return out


class StepNetCall:
    """One call of a step-net: its inputs as stepnet values, the run, its
    pullback."""

    def __init__(self, module, bindings, names, steps, memories):
        self.module = module
        self.bindings = bindings
        self.names = names  # the inputs given as tensors, in the order passed to autograd
        self.layouts = {**steps, **memories}  # of each LoD input given (by name)
        self.pullback = None
        self.out_layouts = []
        self.out_lods = []
        self._first = next(iter(steps.values()), None)  # (the all-steps outputs' layout)
        self._memories = tuple(memories.values())  # (outputs over a memory's rows)

    def _values(self):
        values = {}
        for name, v in self.bindings.items():
            if isinstance(v, tuple):
                t, lay = v
                values[name] = LoDTensor(lay.gather(as_array(t)), lay.levels)
            elif isinstance(v, torch.Tensor):
                values[name] = as_array(v)
            else:
                values[name] = v
        return values

    def forward(self, keep=True):
        module = self.module
        rnn = module.wrapped
        flags = module.flags
        values = self._values()
        if keep:
            outs, self.pullback = vjp(rnn, output_all_steps=flags, backend=module.backend, **values)
        else:
            outs = rnn(output_all_steps=flags, backend=module.backend, **values)
        outs = outs if isinstance(outs, tuple) else (outs,)
        tensors = []
        for out, flag in zip(outs, flags):
            if not flag:
                self.out_layouts.append(None)
                tensors.append(as_tensor(out))
                continue
            lay = self._layout_of(out)
            if lay is not None:
                self.out_layouts.append(lay)
                tensors.append(as_tensor(lay.scatter(out.data)))
            else:
                self.out_layouts.append(None)
                self.out_lods.append(out.lod)
                tensors.append(as_tensor(out.data))
        return tuple(tensors)

    def _layout_of(self, out):
        """The layout an all-steps output ``out`` is given in: the first step
        input's (or that of its first levels), or its steps over a ragged
        static input's rows; None for ``(rows, lod)``."""
        if self._first is None:
            return None
        lay = self._first.of_levels(out.levels)
        for memory in self._memories:
            lay = lay or self._first.over_rows(memory, out.levels)
        return lay

    def backward(self, grads, needs):
        module = self.module
        cts = []
        for g, lay in zip(grads, self.out_layouts):
            if g is None:
                cts.append(None)
            elif lay is not None:
                cts.append(lay.gather(as_array(g)))
            else:
                cts.append(as_array(g))
        n = len(self.names)
        params = [p for _, p, _ in module._links]
        wrt = [name for name, need in zip(self.names, needs[:n]) if need]
        wrt += [p for p, need in zip(params, needs[n:]) if need]
        if not wrt:
            return [None] * len(needs)
        found = iter(self.pullback(cts, wrt=wrt))
        out = []
        for name, need in zip(self.names, needs[:n]):
            if not need:
                out.append(None)
                continue
            g = next(found)
            lay = self.layouts.get(name)
            if lay is not None:
                g = lay.scatter(g)
            v = self.bindings[name]
            t = v[0] if isinstance(v, tuple) else v
            out.append(as_tensor(np.asarray(g, NUMPY_DTYPES[t.dtype]).reshape(tuple(t.shape))))
        for need in needs[n:]:
            out.append(as_tensor(next(found)) if need else None)
        return out
