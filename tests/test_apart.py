"""Calls apart (stepnet.jit.apart): a generated kernel calls its rnn functions
and stepnet's helpers by the address of their machine code, their code not
compiled again into its own; a call apart returns and raises as a call."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit

import stepnet as sn
from conftest import assert_close, cache_with_helpers
from test_helper import _fails_on_negative
from stepnet.jit import apart, blas, loading, threads


@njit(nogil=True)
def _scaled(x, by):
    if x[0] < 0:
        raise ValueError("negative")
    return x * by


@njit(nogil=True)
def _scaled_apart(x, by):
    return apart.call_apart(_scaled, (x, by))


@njit(nogil=True)
def _two_jobs_apart(board, a, b, out_a, out_b):
    return threads.run_jobs(board, apart.job_apart(_fails_on_negative, (a, out_a)),
                            apart.job_apart(_fails_on_negative, (b, out_b)), True)


def _defines(dispatcher, function):
    """Whether the machine code of ``dispatcher`` (its one compiled
    signature) carries that of ``function`` (each of its compiled signatures)."""
    (caller,) = dispatcher.overloads.values()
    text = caller.library.get_llvm_str()
    defined = [line for line in text.splitlines() if line.startswith("define")]
    return any(callee.fndesc.mangled_name in line
               for callee in function.overloads.values() for line in defined)


def test_a_call_apart_returns_and_raises_as_a_call():
    x = np.arange(1.0, 5.0)
    np.testing.assert_array_equal(_scaled_apart(x, 3.0), x * 3.0)
    with pytest.raises(ValueError, match="negative"):
        _scaled_apart(-x, 3.0)
    assert _scaled.overloads and not _defines(_scaled_apart, _scaled)


def test_a_job_apart_runs_and_says_when_it_raised():
    out_a, out_b = np.zeros(1), np.zeros(1)
    assert _two_jobs_apart(threads.ALONE, 1.0, 2.0, out_a, out_b) == -1
    assert out_a[0] == 1.0 and out_b[0] == 2.0
    assert _two_jobs_apart(threads.ALONE, 3.0, -1.0, out_a, out_b) == threads.RAISED
    assert out_a[0] == 3.0
    assert not _defines(_two_jobs_apart, _fails_on_negative)


def test_a_kernel_compiles_its_own_code_only(rng, monkeypatch, tmp_path):
    """program() carries neither its rnn functions' code nor the helpers'
    (blas.pack, gemm_packed ...): each is compiled once, apart."""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(cache_with_helpers(tmp_path / "cache")))
    monkeypatch.setenv("STEPNET_TIERED", "0")
    layer = sn.nn.GRU(16, 48, seed=0)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((30, 16)).astype(np.float32),
                                  [[9, 1, 12, 8]])
    Y, _ = layer(X)
    assert_close(Y, layer(X, backend="interpreter")[0])
    # (a kernel module of an earlier test may be gone with its cache directory,
    # or be the CUDA backend's)
    (program,) = [p for p in loading._MODULES.values() if hasattr(p, "program")
                  and p.program.overloads
                  and os.path.isfile(p.__file__) and "job_apart(" in open(p.__file__).read()][-1:]
    rnn_functions = [f for name, f in vars(program).items() if name.startswith("rnn_")]
    assert rnn_functions and all(f.overloads for f in rnn_functions)
    for function in rnn_functions + [blas.pack, blas.gemm_packed]:
        assert function.overloads, function
        assert not _defines(program.program, function), function


_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np, stepnet as sn
    sys.path.insert(0, {tests!r})
    from nets import nested_encoder
    from stepnet.jit import loading
    rng = np.random.default_rng(0)
    net = nested_encoder(rng, hidden=40, inner_reads_outer=True, outputs=("h", "last"))
    for got, want in zip(net.rnn(backend="numba"), net.rnn(backend="interpreter")):
        assert np.allclose(got.data, want.data, rtol=1e-4, atol=1e-5), abs(got.data - want.data).max()
    source = "".join(open(m.__file__).read() for m in loading._MODULES.values())
    assert "job_apart(rnn_" in source and "call_apart(rnn_" in source
    hits = sum(sum(m.program.stats.cache_hits.values()) for m in loading._MODULES.values())
    print("kernels loaded from the cache:", hits)
    """
)


def test_a_kernel_cached_by_one_process_loads_its_callees_in_another(tmp_path):
    """The second process loads the kernel from the disk cache; its hooks
    give LLVM the addresses of the rnn functions and helpers it calls (else
    its machine code could not be linked)."""
    env = dict(os.environ, STEPNET_CACHE_DIR=str(cache_with_helpers(tmp_path / "cache")),
               STEPNET_TIERED="0")
    script = _SCRIPT.format(tests=os.path.dirname(__file__))
    said = []
    for _ in range(2):
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        said.append(result.stdout.strip().splitlines()[-1])
    assert said == ["kernels loaded from the cache: 0", "kernels loaded from the cache: 1"]


def test_weights_a_kernel_computes_share_the_helpers_compiled_for_given_ones(rng, monkeypatch,
                                                                            tmp_path):
    """A backward transposes the weights in its program(); typed read-only
    (``atomics.as_read_only``) they take the ``pack`` compiled for the
    forward's read-only weights, not one of their own (and its
    ``gemm_packed``)."""
    monkeypatch.setenv("STEPNET_CACHE_DIR", str(cache_with_helpers(tmp_path / "cache")))
    monkeypatch.setenv("STEPNET_TIERED", "0")
    before = set(blas.pack.signatures) | set(blas.gemm_hoisted.signatures)
    layer = sn.nn.GRU(8, 40, seed=1)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((17, 8)).astype(np.float32), [[9, 8]])
    Y, _ = layer(X)
    _, pullback = sn.vjp(layer, X)
    pullback([np.ones_like(Y.data), None])
    new = (set(blas.pack.signatures) | set(blas.gemm_hoisted.signatures)) - before

    def weights(function, args):
        return args[1 if function is blas.gemm_hoisted else 0]

    # the read-only weights' helpers exist (this process compiled them, here
    # or before), and none compiled here takes writable weights
    for function in (blas.pack, blas.gemm_hoisted):
        assert any(not weights(function, args).mutable for args in function.signatures)
        assert all(not weights(function, args).mutable
                   for args in function.signatures if args in new), new
