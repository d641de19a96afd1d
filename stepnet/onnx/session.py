"""``stepnet.onnx.InferenceSession``: ONNX models on stepnet's kernels.

The session checks every node when it is made, against its operator's schema
(inputs, outputs, attributes) and against what runs it: an op outside the
default domain, one the model's opset does not have, or a malformed node
raises :class:`stepnet.errors.UnsupportedError` or :class:`~stepnet.errors.Error`
naming the node, before any data is seen (:mod:`stepnet.onnx.schema`). Nodes
that compute only from constants (initializers, ``Constant``) are computed
then, once.

``run`` evaluates the other nodes in order (:mod:`stepnet.onnx.graph`):

- GRU, LSTM, RNN and Scan nodes as step-nets on the chosen backend
  (:mod:`stepnet.onnx.recurrent`, :mod:`stepnet.onnx.scan`);
- ``If`` and ``Loop`` by the graph, their branches and bodies being graphs
  themselves (so recurrent nodes inside them are step-nets too);
- the ONNX Gradient operator with stepnet's reverse mode
  (:mod:`stepnet.onnx.gradient`);
- every other op with stepnet's NumPy version where it has one
  (:mod:`stepnet.onnx.ops`, :mod:`stepnet.onnx.conv`), else with the ONNX
  project's reference implementation (:mod:`stepnet.onnx.reference`); on
  the Numba backend, once a call with the same input shapes has run them
  node by node, runs of elementwise nodes as one compiled loop each
  (:mod:`stepnet.onnx.fusion`), or, where every node of that call's plan
  lowers, the whole plan as one compiled call (:mod:`stepnet.onnx.lowering`).

float16 is computed in float32 and given back as float16 (docs/design.md §4): per
node, the outputs typed like a float16 input are rounded to float16.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from ..backends import default_backend, get_backend
from ..errors import Error, ShapeError, StepNetError, UnsupportedError
from ..interpreter import numpy_blas_on_one_thread
from .graph import Graph, has_decided, no_widening
from .reading import load_model
from .schema import NodeArg, mentions_float16, tensor_type_name
from .static import SMALL, VALUE, analyse

__all__ = ["InferenceSession", "NodeArg"]


class InferenceSession:
    """Run an ONNX model with stepnet, shaped like ``onnxruntime.InferenceSession``.

    Every node is checked when the session is made, before any data is
    seen; nodes that compute only from constants are computed then, once.

    Parameters
    ----------
    model : str, os.PathLike, bytes or onnx.ModelProto
        The model: a file's path, its serialized bytes, or the proto. Local
        functions are inlined.
    backend : str, optional
        Where recurrent nodes run as step-nets: any of ``stepnet.backends()``.
        None: ``default_backend()`` at each run. Anything else in its place
        is taken for onnxruntime's second argument, ``sess_options``.
    sess_options, providers, provider_options : optional
        onnxruntime's, accepted so that a session is made as onnxruntime's
        is, and not used: ``backend`` says where stepnet runs.

    Raises
    ------
    BackendError
        ``backend`` is unknown or not available on this machine (checked
        first, before the model is read).
    UnsupportedError
        ONNX is not installed; the model imports no version of the default
        domain, or has an op outside it or one its opset lacks.
    StepNetError
        ``model`` is a path that does not exist, or of another type.
    Error
        A node is malformed (its inputs, outputs or attributes do not fit
        its operator's schema); the message names the node.

    Examples
    --------
    >>> import numpy as np, stepnet as sn
    >>> model = sn.onnx.export(sn.nn.GRU(3, 4, seed=0))
    >>> session = sn.onnx.InferenceSession(model, backend="interpreter")
    >>> [arg.name for arg in session.get_inputs()]
    ['X', 'lengths']
    >>> X, lengths = np.ones((2, 5, 3), np.float32), np.array([5, 2])
    >>> Y, h_n = session.run(None, {"X": X, "lengths": lengths})
    >>> Y.shape, h_n.shape
    ((2, 5, 4), (1, 2, 4))
    """

    def __init__(self, model, backend=None, *, sess_options=None, providers=None,
                 provider_options=None):
        if backend is not None and not isinstance(backend, str):
            backend = None  # (onnxruntime's sess_options, given in its place)
        if backend is not None:
            get_backend(backend)  # an unknown or unavailable name: BackendError, now
        self.backend = backend
        self._path = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
        model = load_model(model)
        with self._naming():
            opsets = {}
            for imp in model.opset_import:
                if not 1 <= imp.version < 2**31:
                    raise Error(f"ONNX model imports version {imp.version} of domain "
                                f"{imp.domain or 'ai.onnx'!r}, which is no opset version")
                opsets["" if imp.domain in ("", "ai.onnx") else imp.domain] = imp.version
            if "" not in opsets:
                raise UnsupportedError("ONNX model imports no version of the default (ai.onnx) "
                                       "domain")
            self.graph = Graph(model.graph, opsets)
        if not mentions_float16(model.graph):
            no_widening(self.graph)
        self._inputs = [a for a in self.graph.input_args if a.name not in self.graph.initializers]
        # (name, dtype, declared shape, its fixed axes [(axis, size)]) per tensor input
        self._checks = [(a.name, self.graph.input_dtypes[a.name], a.shape,
                         None if a.shape is None else
                         [(k, d) for k, d in enumerate(a.shape) if isinstance(d, int) and d > 0])
                        for a in self.graph.input_args if a.type.startswith("tensor(")]
        self._plan_memo()

    def _plan_memo(self):
        """Which inputs make the key of the memos (:mod:`stepnet.onnx.static`):
        the shapes of all, and the values of small integer inputs."""
        graph = self.graph
        self._by_value, self._memoized = [], False
        # a run's key also picks its plan with elementwise nodes fused, but
        # not where a Gradient node reads the values of the nodes it follows
        self._keyed = not any(n.kind == "gradient" for n in graph.nodes)
        if not self._keyed:
            return
        status = {}
        for arg in graph.input_args:
            dtype, shape = graph.input_dtypes[arg.name], arg.shape
            small = (dtype is not None and np.dtype(dtype).kind in "biu" and shape is not None
                     and all(isinstance(d, int) and d > 0 for d in shape)
                     and int(np.prod(shape)) <= SMALL)
            status[arg.name] = VALUE if small else 1
            if small:
                self._by_value.append(arg.name)
        _, decided = analyse(graph, status)
        self._memoized = has_decided(graph)

    def get_inputs(self) -> list:
        """The model's inputs, as onnxruntime lists them.

        Returns
        -------
        list of NodeArg
            The graph's inputs in order, without those that an initializer
            gives a value to.
        """
        return list(self._inputs)

    def get_outputs(self) -> list:
        """The model's outputs, as onnxruntime lists them.

        Returns
        -------
        list of NodeArg
            The graph's outputs in order.
        """
        return list(self.graph.output_args)

    def run(self, output_names, input_feed, run_options=None):
        """The outputs named (all when ``output_names`` is None or empty), in order.

        Parameters
        ----------
        output_names : sequence of str or None
            Names of graph outputs; None or empty: every output.
        input_feed : dict
            A value for every input of ``get_inputs()`` by name: arrays (or
            anything ``np.asarray`` takes) of the declared dtype and rank, and
            of the declared size on each fixed axis (a list or a number is
            taken in the declared dtype, an array of the declared dtype in
            the other byte order converted; ``None`` is a value not fed, as
            an input left out, which only an input with an initializer may
            be). float16 inputs are
            computed in float32 and the outputs typed like them given back as
            float16.
        run_options : object, optional
            Accepted for onnxruntime's signature; not read.

        Returns
        -------
        list
            One value per name, in order: ndarrays (the caller's own, never
            a view of the session's constants), or lists for sequence
            outputs.

        Raises
        ------
        StepNetError
            An unknown output or input name, an input without a value, or an
            ``input_feed`` that is not a dict.
        ShapeError
            An input of another dtype or shape than the model declares.
        """
        try:
            graph = self.graph
            names = list(output_names) if output_names else graph.output_names
            for name in names:
                if name not in graph.output_names:
                    raise StepNetError(f"InferenceSession.run: {name!r} is not an output of the "
                                       f"model (outputs: {graph.output_names})")
            env = self._check_feeds(input_feed)
            backend = self.backend or default_backend()
            key = self._key(env)
            if graph.one_compiled_call(key):  # (no NumPy product runs)
                graph.run(env, backend, key=key)
            else:
                with numpy_blas_on_one_thread():  # (small GEMMs: OpenBLAS's pool spinning
                    graph.run(env, backend, key=key)  # after them takes the cores Numba's need)
        except Error as exc:  # (as _naming: a block of it costs a call of a small model a microsecond)
            self._raise_named(exc)
        return [self._output(env[n]) for n in names]

    @contextlib.contextmanager
    def _naming(self):
        """A stepnet error of the model's own, raised with its file named."""
        try:
            yield
        except Error as exc:
            self._raise_named(exc)

    def _raise_named(self, exc):
        """Raise ``exc``, or where it does not name the model's file yet, the
        same error naming it."""
        if self._path is None or str(exc).startswith(self._path):
            raise exc
        raise type(exc)(f"{self._path}: {exc}") from None

    @staticmethod
    def _output(value):
        """An output as the caller gets it: a copy where it is (a view of) one
        of the session's constants or memoized values (read-only: the next
        run reuses them)."""
        if isinstance(value, np.ndarray):
            return value if value.flags.writeable else value.copy()
        return value if isinstance(value, list) or value is None else np.asarray(value)

    def _key(self, env):
        """A run's key (``Graph.run``): the fed shapes, and small integer
        values where they decide; None where runs are not keyed."""
        if not self._keyed:
            return None
        key = tuple((n, v.shape, v.dtype) if type(v) is np.ndarray else (n, id(v))
                    for n, v in env.items())
        if self._memoized:
            key += tuple(env[n].tobytes() for n in self._by_value if n in env)
        return key

    def _check_feeds(self, feeds) -> dict:
        graph = self.graph
        if not isinstance(feeds, dict):
            raise StepNetError(f"InferenceSession.run: input_feed must be a dict, got "
                               f"{type(feeds).__name__}")
        env = {}
        for name, value in feeds.items():
            if name not in graph.input_dtypes:
                raise StepNetError(f"InferenceSession.run: {name!r} is not an input of the model "
                                   f"(inputs: {[a.name for a in self._inputs]})")
            if value is not None:  # (None: not fed, as an input left out)
                env[name] = value
        for name, dtype, shape, fixed in self._checks:
            value = env.get(name)
            if value is None:
                continue
            if type(value) is not np.ndarray:  # (a list or a number: in the declared dtype)
                value = env[name] = np.asarray(value, dtype if isinstance(
                    value, (list, tuple, int, float)) and not isinstance(value, bool) else None)
            if dtype is not None and value.dtype != dtype and value.dtype.newbyteorder("=") == dtype:
                value = env[name] = value.astype(dtype)  # (another byte order)
            if dtype is not None and value.dtype != dtype and value.dtype != object:
                raise ShapeError(f"InferenceSession.run: input {name!r} has dtype {value.dtype}, "
                                 f"the model declares {tensor_type_name(dtype)}")
            if shape is not None:
                ok = value.ndim == len(shape)
                for k, d in fixed:
                    ok = ok and value.shape[k] == d
                if not ok:
                    raise ShapeError(f"InferenceSession.run: input {name!r} has shape "
                                     f"{list(value.shape)}, the model declares {shape}")
        missing = [a.name for a in self._inputs if a.name not in env]
        if missing:
            raise StepNetError(f"InferenceSession.run: no value fed for input(s) {missing}")
        return env
