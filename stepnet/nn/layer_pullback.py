"""The backward of one call of a built-in layer (``layer.vjp``, or a call
with ``keep_workspace=True``)."""

from __future__ import annotations

import numpy as np

from ..pullback import _deliver, wrt_list
from ..errors import ShapeError, StepNetError
from ..lod import LoDTensor
from ..tracing import Parameter


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

    def _state_grads(self, grad_outputs):
        """The gradients of the final states (``dh_n``, LSTM also ``dc_n``)
        from ``grad_outputs``, their count and shapes checked."""
        layer = self.layer
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
        return d_states

    def _split(self, dy):
        """A layer's output gradient ``dy`` as one gradient per direction."""
        layer = self.layer
        if layer.num_directions == 1:
            return [dy]
        if layer.direction == "bidirectional_sum":
            return [dy, dy]
        H = layer.output_size
        return [np.ascontiguousarray(dy[:, :H]), np.ascontiguousarray(dy[:, H:])]

    def __call__(self, grad_outputs, wrt=None, accumulate=False, out=None):
        layer = self.layer
        wrt = layer.parameters() if wrt is None else wrt_list(wrt)
        widths = layer.state_widths()
        names = ("h", "c")[:len(widths)]
        d_states = self._state_grads(grad_outputs)
        L, D = layer.num_layers, layer.num_directions
        B = self.flat.num_sequences
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

        # the directions at the same time, as the forward ran them (layer.stack)
        work = layer._direction_work(self.flat.data.shape[0],
                                     [pb.backend for pb in self.tape.values()])

        def directions(fn):
            from ..jit import threads  # (at the first run: importing stepnet starts no engine)

            return threads.run_apart(fn, range(D), work)

        dy = self._rows(grad_outputs[0])
        if layer.combine == "per_layer" or D == 1:
            for i in reversed(range(L)):
                parts = self._split(dy)
                dy = sum(directions(lambda d, i=i, parts=parts: pull(i, d, parts[d])))
            dX = dy
        else:
            parts = self._split(dy)

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
