"""Built-in recurrent layers, each written as step-nets in the public DSL.

``RNN``, ``LSTM`` (peephole, projection, coupled input-forget gate), ``GRU``
(``linear_before_reset``), ``AUGRU`` and ``MGU`` (the minimal gated unit);
forward, reverse and bidirectional (concat or sum), stacked per layer or per
direction; PyTorch's and ONNX's weight layouts. See docs/design.md §5.
``RNNCell``, ``GRUCell``, ``LSTMCell``, ``AUGRUCell`` and ``MGUCell`` (and
``layer.step``) are one step of a layer inside another step-net's block. Each
cell is one record of ``stepnet.nn.cells.CELLS`` (docs/adding-a-layer.md).

>>> import numpy as np, stepnet as sn
>>> gru = sn.nn.GRU(4, 8, seed=0)
>>> X = sn.LoDTensor.from_lengths(np.ones((5, 4), np.float32), [[2, 3]])
>>> Y, h_n = gru(X, backend="interpreter")
>>> Y.data.shape, Y.lod, h_n.shape
((5, 8), [[0, 2, 5]], (1, 2, 8))
"""

from .layers import AUGRU, DIRECTIONS, GRU, LSTM, MGU, RNN
from .step_cells import AUGRUCell, GRUCell, LSTMCell, MGUCell, RNNCell

__all__ = ["AUGRU", "AUGRUCell", "DIRECTIONS", "GRU", "GRUCell", "LSTM", "LSTMCell", "MGU",
           "MGUCell", "RNN", "RNNCell"]
