"""Backends: where a step-net runs. Each backend is one module that turns a
program into a callable ``run(args, consts) -> outputs``; this module binds
inputs, calls it, and shapes the results (the same for every backend).
"""

from __future__ import annotations

import importlib
import math
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import ir, schedule as _schedule, sizes
from .autodiff import backward_program, forward_program
from .errors import BackendError
from .lod import LoDTensor



@dataclass(frozen=True)
class Backend:
    """One backend: the module that compiles for it and what it can do.

    Front ends ask these, never a backend's name. ``module`` implements
    ``compile_program(program) -> run`` with ``run(args, consts) -> outputs``
    (``available()`` and ``why_unavailable()`` where it may be missing, and
    ``tiered()`` where it tiers); a ``run`` may have ``source``,
    ``schedule``, ``ready`` and ``wait``, which :class:`CompiledStepNet`
    reads, and a ``host_code`` backend's run has ``prepared_call(consts)``
    (:meth:`CompiledStepNet.prepared`).
    """
    name: str
    module: str
    compiles: bool  # runs code generated for the step-net (a first call may compile it)
    tiers: bool  # a new kernel may answer on the first tier while it compiles (``tiered()``)
    releases_gil: bool  # two calls run at once on two threads (a layer's directions)
    host_code: bool  # machine code in this process, called directly by front ends (ONNX
    # streaming nodes and fused elementwise runs) and beside stepnet's host products
    device_memory: bool  # computes in a device's memory (inputs and outputs are copied)
    keeps_scopes: bool = False  # a call may keep each step's scope (``keep_scopes=True``)


BACKENDS = {
    "interpreter": Backend("interpreter", "stepnet.interpreter", compiles=False, tiers=False,
                           releases_gil=False, host_code=False, device_memory=False,
                           keeps_scopes=True),
    "numba": Backend("numba", "stepnet.jit.numba_cpu", compiles=True, tiers=True,
                     releases_gil=True, host_code=True, device_memory=False),
    "cuda": Backend("cuda", "stepnet.jit.numba_cuda", compiles=True, tiers=False,
                    releases_gil=False, host_code=False, device_memory=True),
}
_default = None  # the first call picks "numba" when it is available (docs/design.md §4)


def backends() -> list:
    """The backends available on this machine.

    Importing each backend's module (Numba's, and Numba's CUDA support) is how
    it is checked.

    Returns
    -------
    list of str
        In ``["interpreter", "numba", "cuda"]``, the ones that work here.
    """
    out = []
    for name in BACKENDS:
        try:
            _module(name)
        except BackendError:
            continue
        out.append(name)
    return out


def set_default_backend(name) -> None:
    """Make ``name`` the backend used when a call passes no ``backend=``.

    Parameters
    ----------
    name : str
        ``"interpreter"``, ``"numba"`` or ``"cuda"``.

    Raises
    ------
    BackendError
        ``name`` is unknown or not available on this machine.
    """
    global _default
    _module(name)
    _default = name


def default_backend() -> str:
    """The backend used when a call passes no ``backend=``.

    Returns
    -------
    str
        The name given to :func:`set_default_backend`; else, chosen at the
        first call and kept, ``"numba"`` where Numba's backend imports, or
        ``"interpreter"``. The CUDA backend is never chosen by default.
    """
    global _default
    if _default is None:
        try:  # (numba alone: the others are not imported for it, numba.cuda least of all)
            _module("numba")
            _default = "numba"
        except BackendError:
            _default = "interpreter"
    return _default


def backend(name=None) -> Backend:
    """What backend ``name`` can do.

    Parameters
    ----------
    name : str or None
        A backend's name; None: :func:`default_backend`.

    Returns
    -------
    Backend
        Its record (its module is not imported for it).

    Raises
    ------
    BackendError
        ``name`` is not a backend's.
    """
    name = name or default_backend()
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name]


def answers_while_compiling(name=None) -> bool:
    """Whether a new kernel of backend ``name`` (None: the default) answers
    its first calls on its first tier (``sn.config.first_tier``: the schedule
    executor or the interpreter) while it compiles (``sn.config.tiered`` and
    the backend's tiers)."""
    info = backend(name)
    return info.tiers and _module(info.name).tiered()


def _module(name):
    info = backend(name)
    try:
        module = importlib.import_module(info.module)
    except ImportError as exc:
        raise BackendError(f"backend {name!r} is not available here: {exc}") from exc
    available = getattr(module, "available", None)
    if available is not None and not available():
        why = getattr(module, "why_unavailable", lambda: "")()
        raise BackendError(f"backend {name!r} is not available on this machine"
                           + (f": {why}" if why else ""))
    return module


class CompiledStepNet:
    """A step-net bound to one backend: ``f(**inputs, output_all_steps=True)``.

    It holds every program compiled for that pair: one per set of output flags,
    and for gradients the forward that keeps its workspace and the backward.
    ``source`` holds the generated code for code-generating backends.
    """

    def __init__(self, rnn, backend):
        self.rnn = rnn
        self.backend = backend
        self.capabilities = BACKENDS[backend]  # (what it can do: Backend)
        self._module = _module(backend)
        self._runs = {}  # output flags (kernel_flags) -> run
        self._kernel_flags = {}  # a call's output flags -> the run's (kernel_flags)
        self._gradient_runs = {}  # ("forward", flags) / ("backward", flags, present) -> runs
        self._outputs = {}  # (output flags, with the workspace) -> _Outputs

    def __reduce__(self):
        # (pickled and copied as its step-net and backend: another process,
        # or the copy, compiles its own runs)
        return compiled, (self.rnn, self.backend)

    def _runner(self, all_steps):
        flags = self.kernel_flags(all_steps)
        if flags not in self._runs:
            self._runs[flags] = self._module.compile_program(self.rnn.program(flags))
        return self._runs[flags]

    def kernel_flags(self, all_steps) -> tuple:
        """The output flags the backend's run computes for a call's
        ``all_steps``: on the compiled backends a ragged last-step output
        that is not a ragged memory's (attention weights over a ragged static
        input) is computed for every step, and :meth:`__call__` takes each
        sequence's last step of it (:func:`_last_steps`); the interpreter
        keeps last steps itself."""
        flags = self.rnn.all_steps_flags(all_steps)
        if not self.capabilities.compiles or all(flags):
            return flags
        if flags not in self._kernel_flags:
            eqn = self.rnn.program(flags).eqn
            ragged_memories = eqn.attrs.get("ragged_memories", {})
            self._kernel_flags[flags] = tuple(
                flag or (res.lod_depth > 0 and mi not in ragged_memories)
                for flag, res, mi in zip(flags, eqn.attrs["body"].outputs, eqn.attrs["output_memory"]))
        return self._kernel_flags[flags]

    def last_steps(self, outputs, all_steps) -> list:
        """A run's ``outputs`` (of :meth:`kernel_flags`) as a call with output
        flags ``all_steps`` gives them: each sequence's last step of those
        computed for every step in their place (:func:`_last_steps`)."""
        computed = self.kernel_flags(all_steps)
        if computed == all_steps:
            return list(outputs)
        reverse = bool(self.rnn.program(all_steps).eqn.attrs["reverse"])
        return [_last_steps(o, reverse) if every and not asked else o
                for o, every, asked in zip(outputs, computed, all_steps)]

    def has_run(self, all_steps=None) -> bool:
        """Whether a run with these output flags (any, if None) is compiled."""
        if all_steps is None:
            return bool(self._runs)
        return self.kernel_flags(all_steps) in self._runs

    def check_sizes(self, flags, args, workspace=False):
        """Refuse a call (bound ``args``) whose outputs, and with ``workspace``
        the values a training call keeps for its backward, would not fit
        (``_Outputs``), before the backend makes them."""
        self._check_device_inputs(args)
        key = (flags, workspace)
        if key not in self._outputs:
            program = self.rnn.program(flags)
            self._outputs[key] = _Outputs.of(forward_program(program) if workspace else program,
                                             "outputs and workspace" if workspace else "outputs")
        self._outputs[key].check(args)

    def _check_device_inputs(self, args):
        """Refuse step inputs whose data lies on a GPU where this backend reads
        host arrays."""
        if self.capabilities.device_memory or not any(
                type(value) is LoDTensor and value.on_device for value in args):
            return
        for name, value in zip(self.rnn.bindings, args):
            if type(value) is LoDTensor and value.on_device:
                raise BackendError(
                    f"input {name}: its data is on the GPU, and backend {self.backend!r} reads "
                    f"host arrays; run with backend='cuda' or pass {name}.to_host()")

    def forward_with_workspace(self, flags):
        """The forward program that also returns its workspace, compiled
        (``flags``: :meth:`kernel_flags`'s)."""
        key = ("forward", flags)
        if key not in self._gradient_runs:
            program = forward_program(self.rnn.program(flags))
            self._gradient_runs[key] = self._module.compile_program(program)
        return self._gradient_runs[key]

    def backward(self, flags, present):
        """``([(run, program), ...], layout)``: the backward programs for output
        flags ``flags`` (:meth:`kernel_flags`'s) and the outputs that get a
        cotangent (``present``)."""
        key = ("backward", flags, present)
        if key not in self._gradient_runs:
            programs, layout = backward_program(self.rnn.program(flags), present)
            runs = [(self._module.compile_program(p), p) for p in programs]
            self._gradient_runs[key] = (runs, layout)
        return self._gradient_runs[key]

    def _all_runs(self):
        yield from self._runs.values()
        for entry in self._gradient_runs.values():
            if isinstance(entry, tuple):  # a backward: ([(run, program), ...], layout)
                yield from (run for run, _ in entry[0])
            else:
                yield entry

    def ready(self) -> bool:
        """Whether every program compiled so far runs its compiled kernel (on
        the Numba backend a new kernel answers on the first tier, the
        executor or the interpreter, while it compiles; ``STEPNET_TIERED=0``
        turns that off)."""
        return all(getattr(run, "ready", True) for run in self._all_runs())

    def wait(self, timeout=None) -> bool:
        """Block until every program compiled so far runs its compiled kernel
        (``timeout`` seconds at most for each); whether they all do."""
        for run in list(self._all_runs()):
            if hasattr(run, "wait"):
                run.wait(timeout)
        return self.ready()

    def prepared(self, output_all_steps=True):
        """The compiled kernel with the step-net's constants (its weights, as
        they are now) laid out once, for a front end that calls it chunk
        after chunk: ``call(data, offsets, states)`` for a step-net of one
        sequence input of one LoD level and dense inputs (``states``, None:
        zeros), whose first output is all-steps and the others last-step,
        giving ``[Y data, last, ...]`` (:class:`stepnet.jit.prepared.PreparedCall`).

        Returns None where the backend runs no machine code here (not
        ``capabilities.host_code``), where the kernel does not answer yet (a
        new one on its first tier: ask again after :meth:`wait`),
        or where the step-net is not of that form. Ask again after a weight
        changes."""
        run = self._runner(self.rnn.all_steps_flags(output_all_steps))
        if not self.capabilities.host_code or not getattr(run, "ready", True):
            return None
        return getattr(run, "numba_program", run).prepared_call(self.rnn.const_values())

    @property
    def source(self) -> str:
        return getattr(self._runner(True), "source", "")

    def last_call(self, output_all_steps=True):
        """What the last call with these output flags did, counted as it ran,
        where the backend counts it (the CUDA backend's
        :class:`stepnet.jit.cuda_run.CallCounts`: the loop's plan, launches,
        copies to the device, syncs a step, weight bytes read from global
        memory a step); None before a call and on the other backends."""
        run = self._runs.get(self.kernel_flags(output_all_steps))
        return getattr(run, "last_call", None)

    @property
    def schedule(self):
        """The :class:`stepnet.schedule.Schedule` of the all-steps program:
        what runs once, what runs per step, in which stages (``print`` it).
        The compiled backends render it; the interpreter runs the IR as it
        is, so for it this is the schedule the others would use."""
        run = self._runner(True)
        return getattr(run, "schedule", None) or _schedule.schedule(self.rnn.program(True))

    def explain(self, output_all_steps=True, **inputs):
        """Print, and return, the parallel plan of a call on ``inputs``: which
        top-level sequences run on which thread, and what the helper thread
        may take (:mod:`stepnet.jit.plan`); then the kernel's plan, what its
        code does beyond the schedule (:mod:`stepnet.jit.kernel_plan`).
        Nothing runs.

        Parameters
        ----------
        output_all_steps : bool or sequence of bool
            As for a call: which program's plan.
        **inputs
            The step-net's inputs by name, as for a call; those not given
            keep the values bound when it was defined.

        Returns
        -------
        stepnet.jit.plan.RunPlan or None
            The plan (``print`` shows it), or None on a backend without one
            (the interpreter runs the sequences on the calling thread, the
            CUDA backend in its launches).
        """
        rnn = self.rnn
        args = rnn.bind(**inputs)
        run = self._runner(rnn.all_steps_flags(output_all_steps))
        kernel = getattr(run, "numba_program", run)  # (a tiered run's kernel)
        if not hasattr(kernel, "plan"):
            print(f"{self.backend}: every sequence in one call of the calling thread"
                  if not self.capabilities.device_memory else
                  f"{self.backend}: every sequence in the device's launches")
            return None
        from .jit import threads

        found = kernel.plan(args, threads.count()).check()
        print(found)
        print(kernel.kernel_plan)
        return found

    def __call__(self, output_all_steps=True, scopes=None, **inputs):
        rnn = self.rnn
        all_steps = rnn.all_steps_flags(output_all_steps)
        args = rnn.bind(**inputs)
        self.check_sizes(all_steps, args)
        run = self._runner(all_steps)
        if scopes is not None:
            outputs = run(args, rnn.const_values(), scopes=scopes)
        else:
            outputs = run(args, rnn.const_values())
        outputs = self.last_steps(outputs, all_steps)
        if rnn.float16_input(inputs):
            outputs = [o.astype(np.float16) for o in outputs]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _last_steps(every, reverse):
    """Each top-level sequence's last step processed (its first position
    where ``reverse``) of the all-steps ragged output ``every`` (levels:
    sequence -> steps -> the rows of a step), as the interpreter gives a
    ragged last-step output: a LoDTensor of a sequence's rows per sequence,
    none for a sequence of no steps; on the device where ``every`` is."""
    if every.on_device:  # (picked on the host: a call's attention weights, not its hot path)
        return _last_steps(every.to_host(), reverse).to_device()
    steps = np.asarray(every.levels[0], np.int64)
    lengths = np.diff(steps)
    picked = (steps[:-1] if reverse else steps[1:] - 1)[lengths > 0]
    taken = LoDTensor._trusted(every.data, every.levels[1:]).select(picked)
    counts = np.zeros(lengths.size, np.int64)
    counts[lengths > 0] = np.diff(np.asarray(taken.levels[0]))
    return LoDTensor(taken.data, [np.concatenate([[0], np.cumsum(counts)]), *taken.levels[1:]])


class _Outputs(NamedTuple):
    """What a call's outputs take, to refuse one that would not fit before any
    backend makes them (:mod:`stepnet.sizes`): an all-steps output has a row
    per step of the top-level sequences, a last-step output a row per
    sequence (a LoD may declare billions of steps over a few broadcast rows)."""

    name: str  # the step-net's
    what: str  # "outputs", or "outputs and workspace"
    first: int  # the index among the call's arguments of its first sequence input
    rows: tuple  # (what, all_steps, row shape, dtype, bytes a row) per output of rows

    @classmethod
    def of(cls, program, what):
        eqn = program.eqn
        rows = tuple((f"output {k} ({out.name})", all_steps, tuple(out.shape[1:]), out.dtype,
                      math.prod(out.shape[1:]) * np.dtype(out.dtype).itemsize)
                     for k, (out, all_steps) in enumerate(zip(eqn.attrs["body"].outputs,
                                                              eqn.attrs["all_steps"]))
                     if not out.lod_depth)
        return cls(eqn.attrs["name"], what, list(program.inputs).index(ir.rnn_parts(eqn)[0][0]),
                   rows)

    def check(self, args):
        first = args[self.first]
        if not isinstance(first, LoDTensor):
            return
        steps, num_seq = int(first.levels[0][-1]), first.num_sequences
        need = sum((steps if all_steps else num_seq) * size
                   for _, all_steps, _, _, size in self.rows)
        if need < sizes.CHECKED_FROM:
            return
        sizes.check_all(f"the {self.what} of step-net {self.name!r}", [
            (what, ((steps if all_steps else num_seq),) + shape, dtype)
            for what, all_steps, shape, dtype, _ in self.rows])


# step-net -> {backend name: CompiledStepNet}: compiled code lives here, not on
# the step-net, and goes when the step-net does
_COMPILED = weakref.WeakKeyDictionary()


def compiled(rnn, backend) -> CompiledStepNet:
    """``rnn`` bound to ``backend`` (made once per pair)."""
    per_backend = _COMPILED.setdefault(rnn, {})
    if backend not in per_backend:
        per_backend[backend] = CompiledStepNet(rnn, backend)
    return per_backend[backend]


def is_compiled(rnn, backend, all_steps=None) -> bool:
    """Whether ``rnn`` has a run compiled on ``backend`` in this process (for
    these output flags; any, if None)."""
    found = _COMPILED.get(rnn, {}).get(backend)
    return found is not None and found.has_run(all_steps)


def _every_compiled():
    """Every CompiledStepNet of this process (a snapshot)."""
    return [entry for per_backend in list(_COMPILED.values())
            for entry in list(per_backend.values())]


def kernels_ready() -> bool:
    """Whether every step-net compiled in this process runs its compiled
    kernels (none is still answering on the first tier)."""
    return all(entry.ready() for entry in _every_compiled())


def first_tiers() -> set:
    """The tiers that answered the last calls of the step-nets of this
    process whose kernels still compile: ``"executor"`` and/or
    ``"interpreter"`` (``sn.config.first_tier``; the interpreter for a
    step-net the executor does not run); empty where every kernel runs."""
    return {getattr(run, "answered_by", None) for entry in _every_compiled()
            for run in entry._all_runs()} & {"executor", "interpreter"}


def wait_for_kernels(timeout=None) -> bool:
    """Block until every step-net compiled in this process runs its compiled
    kernels (see :meth:`CompiledStepNet.wait`); whether they all do."""
    results = [entry.wait(timeout) for entry in _every_compiled()]  # every one waited for
    return all(results)


def compile_ahead(model, *args, timeout=None, **kwargs) -> int:
    """Compile the Numba kernels of ``model`` into the disk cache ahead of
    use (for a deployment's image, or a CI step before the tests), so that
    a later process, given inputs of the same dtypes and nesting, loads them
    at its first call instead of compiling them.

    ``model(*args, **kwargs)`` is called once on the Numba backend, then
    this waits until every kernel it met is compiled. A kernel depends on
    the step-net, the dtypes and LoD levels of its inputs and the weights'
    shapes, not on the number or lengths of the sequences: random inputs of
    the right kind build the same kernels as real ones. For a backward's
    kernels, pass a function that runs a training step.

    Parameters
    ----------
    model : callable
        A step-net (:class:`~stepnet.RNNOp`), a layer of :mod:`stepnet.nn`,
        a :class:`stepnet.yaml.Model` (with no ``args``: on its
        ``random_feeds()``), an ONNX :class:`~stepnet.onnx.InferenceSession`'s
        ``run``, or any function that runs stepnet's step-nets.
    *args, **kwargs
        What to call it with (a ``backend=`` keyword other than ``"numba"``
        is refused).
    timeout : float, optional
        Seconds to wait for the kernels at most; None: until they are
        compiled.

    Returns
    -------
    int
        How many kernels this compiled into the cache (those found there
        already are not counted).

    Raises
    ------
    BackendError
        ``backend=`` names another backend, or Numba's is not available.
    TimeoutError
        The kernels were not compiled within ``timeout`` seconds.

    Examples
    --------
    >>> import stepnet as sn
    >>> model = sn.load_yaml("examples/custom_cell.yaml")
    >>> sn.compile_ahead(model) >= 0
    True
    """
    from .jit.cache import cache_dir
    from .yaml import Model

    if kwargs.get("backend", "numba") != "numba":
        raise BackendError(f"compile_ahead compiles Numba kernels, not backend="
                           f"{kwargs['backend']!r}")
    _module("numba")
    if isinstance(model, Model):
        if not args and "feeds" not in kwargs:
            args = (model.random_feeds(),)
        kwargs["backend"] = "numba"
    elif hasattr(model, "all_steps_flags") or hasattr(model, "step_net"):  # a step-net, a layer
        kwargs["backend"] = "numba"
    before = set(cache_dir().glob("stepnet_kernel_*.ready"))
    model(*args, **kwargs)
    if not wait_for_kernels(timeout):
        raise TimeoutError(f"compile_ahead: the kernels were not compiled in {timeout} s")
    return len(set(cache_dir().glob("stepnet_kernel_*.ready")) - before)


def get_backend(name=None):
    return _Runner(name or default_backend())


class _Runner:
    def __init__(self, name):
        self.name = name
        _module(name)

    def compile_rnn_op(self, rnn):
        return compiled(rnn, self.name)

    def run_rnn_op(self, rnn, bindings, output_all_steps, keep_scopes=False):
        compiled = self.compile_rnn_op(rnn)
        if keep_scopes:
            scopes = {}
            result = compiled(output_all_steps, scopes=scopes, **bindings)
            rnn.step_scopes = scopes[rnn.name]
            return result
        return compiled(output_all_steps, **bindings)


__all__ = ["CompiledStepNet", "backends", "compile_ahead", "default_backend",
           "set_default_backend", "kernels_ready", "wait_for_kernels"]
