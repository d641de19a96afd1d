"""stepnet.distributed on a LocalCluster of two worker processes: the same
outputs as one process, in the caller's order, even when a worker dies."""

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from nets import nested_encoder

import stepnet as sn

distributed = pytest.importorskip("distributed")
from stepnet import distributed as sd  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def client():
    with sd.local_client(2) as c:
        yield c


# ----------------------------------------------------------------------------
# connect: which specs start a local cluster (nothing is started here)


@pytest.fixture
def started(monkeypatch):
    """What ``connect`` starts, recorded instead: ("local", n) or ("address", spec)."""
    calls = []
    monkeypatch.setattr(sd, "local_client", lambda n_workers=None: calls.append(("local", n_workers)))
    monkeypatch.setattr(distributed, "Client", lambda address: calls.append(("address", address)))
    return calls


@pytest.mark.parametrize("spec, expected", [
    ("local", ("local", None)),
    ("local:3", ("local", 3)),
    ("localhost:8786", ("address", "localhost:8786")),
    ("localhost", ("address", "localhost")),
    ("tcp://localhost:8786", ("address", "tcp://localhost:8786")),
    ("tcp://10.0.0.1:8786", ("address", "tcp://10.0.0.1:8786")),
])
def test_connect_starts_a_local_cluster_only_for_local_or_local_n(started, spec, expected):
    sd.connect(spec)
    assert started == [expected]


@pytest.mark.parametrize("spec", ["local:", "local:x", "local:0", "local:-2", "local:2.5"])
def test_connect_refuses_a_malformed_local_spec_before_starting_anything(started, spec):
    with pytest.raises(sn.StepNetError, match=rf"cluster '{spec}': expected local:N with N a "
                                              r"positive number of workers"):
        sd.connect(spec)
    assert started == []


def test_connect_refuses_a_spec_that_is_not_a_string(started):
    with pytest.raises(sn.StepNetError, match=r"cluster spec must be a string \('local', "
                                              r"'local:N' or a scheduler address\), got int"):
        sd.connect(8786)
    assert started == []


# ----------------------------------------------------------------------------
# partitions


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=0, max_size=40), st.integers(1, 8))
def test_partitions_are_contiguous_whole_and_balanced(tokens, parts):
    bounds = sd.partition_bounds(tokens, parts)
    if not tokens:
        assert bounds == []
        return
    assert bounds[0][0] == 0 and bounds[-1][1] == len(tokens)
    assert all(a < b for a, b in bounds)
    assert all(b == c for (_, b), (c, _) in zip(bounds[:-1], bounds[1:]))
    assert len(bounds) <= min(parts, len(tokens))
    # no partition holds more than its share plus one sequence
    share = sum(tokens) / len(bounds)
    biggest = max(tokens)
    for a, b in bounds:
        assert sum(tokens[a:b]) <= share + biggest + 1e-9


def test_partitions_balance_tokens_not_sequences():
    tokens = [100] + [1] * 99  # one long sequence, many short ones
    (a0, b0), (a1, b1) = sd.partition_bounds(tokens, 2)
    assert (a0, b0) == (0, 1) and (a1, b1) == (1, 100)


def test_tokens_per_sequence_counts_nested_rows():
    X = sn.LoDTensor.from_lengths(np.zeros((9, 1)), [[2, 0, 1], [3, 1, 5]])
    assert sd.tokens_per_sequence(X).tolist() == [4, 0, 5]


# ----------------------------------------------------------------------------
# inference


def _nested_net(lengths, seed):
    """nets.nested_encoder with a per-sequence initial memory and static
    input (both split by partition) and its memory as both output forms."""
    return nested_encoder(np.random.default_rng(seed), lengths, static=True, init=True,
                          outputs=("h", "h")).rnn


@st.composite
def nested_lengths(draw):
    outer = draw(st.lists(st.integers(0, 4), min_size=1, max_size=12))
    inner = draw(st.lists(st.integers(0, 5), min_size=sum(outer), max_size=sum(outer)))
    return [outer, inner]


@settings(max_examples=6, deadline=None)
@given(nested_lengths(), st.integers(1, 5), st.integers(0, 100))
def test_nested_batches_match_one_process(client, lengths, parts, seed):
    rnn = _nested_net(lengths, seed)
    for flags in (True, (True, False)):
        expected = rnn(output_all_steps=flags)
        got = sd.run(rnn, client=client, partitions=parts, output_all_steps=flags)
        assert_close(got, expected, what="distributed vs one process")


def test_layer_with_initial_state_and_yaml_model(client, rng, tmp_path):
    gru = sn.nn.GRU(3, 4, num_layers=2, seed=0)
    X = sn.LoDTensor.from_lengths(rng.standard_normal((20, 3)).astype(np.float32), [[3, 0, 5, 4, 8]])
    h0 = rng.standard_normal((2, 5, 4)).astype(np.float32)
    assert_close(sd.run(gru, {"X": X, "h0": h0}, client=client, partitions=3), gru(X, h0))
    lstm = sn.nn.LSTM(3, 4, seed=0)
    c0 = rng.standard_normal((1, 5, 4)).astype(np.float32)
    assert_close(sd.run(lstm, {"X": X, "h0": h0[:1], "c0": c0}, client=client, partitions=3),
                 lstm(X, (h0[:1], c0)))
    assert_close(sd.run(lstm, {"X": X, "c0": c0}, client=client, partitions=2), lstm(X, (None, c0)))
    model = sn.load_yaml(ROOT / "examples" / "hierarchical.yaml")
    feeds = model.random_feeds(seed=1, num_sequences=7, max_length=5)
    got, expected = sd.run(model, feeds, client=client, partitions=3), model(feeds)
    assert list(got) == list(expected)
    for name in expected:
        assert_close(got[name], expected[name], what=name)
    # a YAML model's layer.last: [num_layers * num_directions, B, H], joined along B
    path = tmp_path / "layer_last.yaml"
    path.write_text("inputs:\n  x: {shape: [3]}\n"
                    "layers:\n  g: {type: lstm, input: x, hidden_size: 2, num_layers: 2}\n"
                    "outputs:\n  y: g.all\n  h_n: g.last.h_n\n  c_n: g.last.c_n\n")
    model = sn.load_yaml(path)
    feeds = model.random_feeds(seed=2, num_sequences=5, max_length=4)
    got, expected = sd.run(model, feeds, client=client, partitions=2), model(feeds)
    assert got["h_n"].shape == expected["h_n"].shape == (2, 5, 2)
    for name in expected:
        assert_close(got[name], expected[name], what=name)


def test_bad_input_is_refused_before_anything_runs(client):
    with pytest.raises(sn.StepNetError, match="expects a step-net"):
        sd.run(object(), {}, client=client)
    gru = sn.nn.GRU(3, 4, seed=0)
    with pytest.raises(sn.StepNetError, match="must be a LoDTensor"):
        sd.run(gru, {"X": np.zeros((2, 3, 3))}, client=client)
    X = sn.LoDTensor.from_lengths(np.zeros((3, 3), np.float32), [[1, 2]])
    with pytest.raises(sn.StepNetError, match=r"feeds \['c0'\] are not inputs of the GRU layer"):
        sd.run(gru, {"X": X, "c0": np.zeros((1, 2, 4), np.float32)}, client=client)
    for partitions in (0, -1, 2.5, "2", True):
        with pytest.raises(sn.StepNetError, match="partitions must be a whole number >= 1"):
            sd.run(gru, {"X": X}, client=client, partitions=partitions)
    # what one process refuses, refused before splitting (split, it ran on part of it)
    with pytest.raises(sn.ShapeError, match=r"'h0' of shape \[1, 3, 4\] needs 2 rows along axis 1"):
        sd.run(gru, {"X": X, "h0": np.zeros((1, 3, 4), np.float32)}, client=client)
    rnn = _nested_net([[2, 1], [1, 2, 0]], 0)
    X4 = sn.LoDTensor.from_lengths(np.zeros((6, 3), np.float32), [[1, 1, 1, 1], [1, 2, 0, 3]])
    with pytest.raises(sn.ShapeError, match="has 2 rows but the step inputs have 4"):  # bound for 2
        sd.run(rnn, {"X": X4}, client=client)
    with pytest.raises(sn.StepNetError, match=r"unknown input name\(s\) \['Typo'\]"):
        sd.run(rnn, {"Typo": X4}, client=client)
    model = sn.load_yaml(ROOT / "examples" / "hierarchical.yaml")
    feeds = model.random_feeds(seed=1, num_sequences=4, max_length=3)
    name = next(k for k, v in feeds.items() if not isinstance(v, sn.LoDTensor))
    feeds[name] = np.concatenate([feeds[name], feeds[name][:1]])
    with pytest.raises(sn.ShapeError, match=f"'{name}' of shape .* needs 4 rows along axis 0"):
        sd.run(model, feeds, client=client)


def test_a_layer_over_nested_sequences_splits_h0_by_its_sequences(client, rng):
    """A layer's h0 has a row per sequence of X's finest level."""
    gru = sn.nn.GRU(3, 4, seed=0)
    X = sn.LoDTensor(rng.standard_normal((14, 3)).astype(np.float32),
                     [[0, 2, 3, 6], [0, 3, 5, 6, 10, 10, 14]])
    h0 = rng.standard_normal((1, 6, 4)).astype(np.float32)
    for partitions in (1, 2, 3):
        assert_close(sd.run(gru, {"X": X, "h0": h0}, client=client, partitions=partitions), gru(X, h0))


def test_bit_for_bit_in_deterministic_mode():
    """STEPNET_DETERMINISTIC=1 (workers inherit it): every row a sequential
    sum, so partitions of a different size give the same bits."""
    code = f"""
import numpy as np, sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
from test_distributed import _nested_net
from stepnet import distributed as sd
from stepnet.jit import blas
assert blas.DETERMINISTIC
rnn = _nested_net([[3, 0, 2, 4, 1, 5, 2], [2, 1, 3, 2, 1, 1, 4, 2, 1, 3, 2, 1, 1, 2, 3, 1, 2]], 7)
expected = rnn()
with sd.local_client(2) as client:
    for parts in (2, 3, 5):
        got = sd.run(rnn, client=client, partitions=parts)
        for a, b in zip(got, expected):
            assert a.lod == b.lod and np.array_equal(a.data, b.data), parts
print("bit for bit")
"""
    env = dict(os.environ, STEPNET_DETERMINISTIC="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bit for bit" in out.stdout


def test_a_run_whose_tasks_were_cancelled_is_sent_again_once(monkeypatch):
    """A worker that dies before the scattered model reached the other
    workers takes it with it (Dask: "lost scattered data"), and the tasks
    that read it are cancelled, not rerun: ``run`` sends the run again, once
    (a second cancellation is raised)."""
    from concurrent.futures import CancelledError

    lengths = [[5] * 4, [3] * 20]
    rnn = _nested_net(lengths, 3)
    expected = rnn(backend="interpreter")
    with sd.local_client(1) as c:
        gather = c.gather
        calls = []

        def cancelled_first(futures, **kwargs):
            calls.append(len(futures))
            if len(calls) == 1:
                raise CancelledError("lost scattered data")
            return gather(futures, **kwargs)

        monkeypatch.setattr(c, "gather", cancelled_first)
        assert_close(sd.run(rnn, client=c, partitions=2, backend="interpreter"), expected)
        assert calls == [2, 2]
        def cancelled(futures, **kwargs):
            raise CancelledError("again")

        monkeypatch.setattr(c, "gather", cancelled)
        with pytest.raises(CancelledError):
            sd.run(rnn, client=c, partitions=2, backend="interpreter")


def test_a_worker_killed_mid_run_is_retried():
    """Dask reruns the tasks of a worker that dies; the result is complete and
    in order (no lost or duplicated sequence)."""
    lengths = [[40] * 12, [6] * 480]
    rnn = _nested_net(lengths, 3)
    expected = rnn(backend="interpreter")
    with sd.local_client(2) as c:
        workers = list(c.scheduler_info()["workers"])
        result = {}

        def run():
            result["out"] = sd.run(rnn, client=c, partitions=6, backend="interpreter")

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.time() + 60
        while time.time() < deadline:  # kill a worker once it is computing
            if any(c.processing().get(w) for w in workers):
                break
            time.sleep(0.05)
        victim = next(w for w in workers if c.processing().get(w)) if any(
            c.processing().get(w) for w in workers) else workers[0]
        try:
            c.run(os._exit, 1, workers=[victim])
        except Exception:  # noqa: BLE001 - the worker dies answering
            pass
        thread.join(timeout=600)
        assert not thread.is_alive()
        assert victim not in c.scheduler_info()["workers"]  # it really died (its nanny restarts it anew)
    assert_close(result["out"], expected, what="after a worker died")


# ----------------------------------------------------------------------------
# data-parallel training and the command line


def _example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adding_problem_trains_the_same_on_two_workers(client):
    ex = _example("train_adding_problem")
    curves = []
    for workers in (0, 2):
        model = ex.AddingModel(8, seed=3, backend=None)
        optimizer = sn.optim.Adam(model.parameters(), lr=0.01)
        rng = np.random.default_rng(3)
        batches = [ex.adding_batch(rng, 16, 12) for _ in range(6)]
        if workers:
            step = sd.data_parallel(model, ex.error_sums, client)
            curves.append(sn.optim.train(lambda b, step=step: ex.mean_and_clip(*step(b)),
                                         optimizer, batches))
        else:
            curves.append(sn.optim.train(model.loss_and_grads, optimizer, batches))
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-5)
    assert curves[0][-1] < curves[0][0]


class InlineClient:
    """A client of two workers that runs each task at once, in this process."""

    def __init__(self):
        self.submitted = 0

    def scatter(self, value, **kwargs):
        return value

    def scheduler_info(self):
        return {"workers": {"a": {}, "b": {}}}

    def submit(self, fn, *args, **kwargs):
        self.submitted += 1
        return fn(*args)

    def gather(self, futures):
        return list(futures)


class Linear:
    """A model as data_parallel takes one: something with parameters()."""

    def __init__(self, W):
        self.W = W

    def parameters(self):
        return [self.W]


def _squared_error_sums(model, shard):
    """Sum over the shard of (x @ W - y)^2, its gradient, and the count."""
    (W,) = model.parameters()
    x, y = shard
    r = x @ W.value - y
    return float((r ** 2).sum()), [2 * x.T @ r], len(x)


def test_data_parallel_mean_and_a_batch_without_examples():
    W = sn.Parameter(np.array([[2.0], [-1.0]]), name="W")
    model = Linear(W)
    c = InlineClient()
    step = sd.data_parallel(model, _squared_error_sums, c)
    x, y = np.arange(10.0).reshape(5, 2), np.ones((5, 1))
    loss, (grad,) = step((x, y))
    r = x @ W.value - y
    np.testing.assert_allclose(loss, (r ** 2).mean())
    np.testing.assert_allclose(grad, 2 * x.T @ r / 5)
    assert c.submitted == 2
    with pytest.raises(sn.StepNetError, match=r"data_parallel step: the batch has no examples "
                                              r"\(0 rows\); the mean loss and gradients over "
                                              r"no examples are undefined"):
        step((x[:0], y[:0]))
    with pytest.raises(sn.StepNetError, match=r"one row per example each, got rows \[5, 4\]"):
        step((x, y[:4]))
    with pytest.raises(sn.StepNetError, match=r"one row per example each, got rows \[\]"):
        step(())
    assert c.submitted == 2  # nothing was sent for those
    uncounted = sd.data_parallel(model, lambda m, s: (0.0, [np.zeros((2, 1))], 0), c)
    with pytest.raises(sn.StepNetError, match=r"shard_fn counted 0 examples in a batch of 5 rows"):
        uncounted((x, y))


def test_cli_run_on_a_local_cluster_and_shards(tmp_path):
    from stepnet.cli import save_npz

    model = sn.load_yaml(ROOT / "examples" / "hierarchical.yaml")
    shards = tmp_path / "shards"
    shards.mkdir()
    expected = {}
    for k in range(3):
        feeds = model.random_feeds(seed=k, num_sequences=3, max_length=4)
        save_npz(shards / f"part{k}.npz", feeds)
        expected[f"part{k}.npz"] = model(feeds)
    out_dir = tmp_path / "out"
    cmd = [sys.executable, "-m", "stepnet", "run", str(ROOT / "examples" / "hierarchical.yaml"),
           "--input", str(shards), "--output", str(out_dir), "--cluster", "local:2", "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rows/s" in done.stdout and "on 2 Dask worker(s) (local:2)" in done.stdout
    for name, outputs in expected.items():
        with np.load(out_dir / name) as npz:
            for key, value in outputs.items():
                data = value.data if isinstance(value, sn.LoDTensor) else value
                assert_close(npz[key], data, what=f"{name} {key}")
    # (random inputs on a cluster: test_cli_run_on_a_scheduler_address)


def test_cli_run_on_a_scheduler_address(client):
    """--cluster tcp://HOST:PORT connects to a running scheduler."""
    address = client.scheduler.address
    cmd = [sys.executable, "-m", "stepnet", "run", str(ROOT / "examples" / "custom_cell.yaml"),
           "--cluster", address, "--sequences", "5", "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"on 2 Dask worker(s) ({address})" in done.stdout
