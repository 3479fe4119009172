"""A mesh across processes: where a process finds its cluster; in nox's run
of 2 processes (`python -m keras_layoutmap.launch -n 2 -m pytest`), each
process trains with the other on one mesh and equals one device; scripts
started in processes of their own (a join with no seed, a process that
fails, a backup every process reads)."""

import ast
import os

import keras
import numpy as np
import pytest
from helpers import (
    BACKEND,
    DEVICES,
    PROCESSES,
    as_launched_process,
    compile_classifier,
    digits_data,
    folder_every_rank_shares,
    launch,
    net_layout_map,
    sequential_mlp,
)

import keras_layoutmap as klm
from keras_layoutmap.processes import Cluster, cluster_from_environment

MULTI_PROCESS = BACKEND in ("jax", "tensorflow")  # several devices a process
pytestmark_mp = pytest.mark.skipif(
    not MULTI_PROCESS, reason="2 processes of several devices each: a torch "
    "process holds one device; tests/test_torch_processes.py and the "
    "4-process run of nox -s tests-torch check torch across processes")


# -- where a process finds its cluster (backend-neutral) --------------------

def test_cluster_from_the_launcher_environment():
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "WORLD_SIZE": "4",
           "RANK": "3"}
    assert cluster_from_environment(env) == Cluster("127.0.0.1:1234", 4, 3)


def test_cluster_from_keras_environment():
    env = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:1234",
           "KERAS_DISTRIBUTION_PROCESS_ID": "1"}
    assert cluster_from_environment(env) == Cluster("10.0.0.1:1234", 2, 1)


def test_no_cluster_outside_a_launcher():
    assert cluster_from_environment({}) is None
    assert cluster_from_environment({"WORLD_SIZE": "1"}) is None


@pytest.mark.parametrize("env, match", [
    ({"WORLD_SIZE": "2"}, "RANK or MASTER_PORT"),
    ({"WORLD_SIZE": "two", "RANK": "0", "MASTER_PORT": "1"}, "WORLD_SIZE must be"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_PORT": "1"},
     r"process_id must be in \[0, 2\)"),
    ({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "a:1,b:1"}, "PROCESS_ID"),
])
def test_bad_cluster_environment_says_what_is_wrong(env, match):
    with pytest.raises(ValueError, match=match):
        cluster_from_environment(env)


# -- several processes -----------------------------------------------------

# Checked in nox's run of the workflow matrix in 2 processes (`python -m
# keras_layoutmap.launch -n 2 -m pytest`, 4 devices each on JAX, 2 on
# TensorFlow), where each process runs these tests with the other: no
# process of their own to start (a TensorFlow process spends 10 s of CPU
# importing it).
ACROSS_TWO = pytest.mark.skipif(
    not (MULTI_PROCESS and PROCESSES == 2),
    reason="runs in nox's run of 2 processes (python -m keras_layoutmap."
    "launch -n 2 -m pytest tests/test_processes.py), each holding half of "
    "the mesh; on torch a process holds one device: "
    "tests/test_torch_processes.py and the 4-process run of nox -s "
    "tests-torch check torch across processes")
BATCH = 64  # 200 rows: the last global batch of an epoch holds 8


def _build():
    return compile_classifier(sequential_mlp(32, 10, name="net"))


def _train(model, x, y, batch):
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                        verbose=0).history
    return {
        "history": {k: [float(v) for v in vs] for k, vs in history.items()},
        "evaluate": model.evaluate(x, y, batch_size=batch, verbose=0),
        "predict": model.predict(x, batch_size=batch, verbose=0),
        "weights": model.get_weights(),
    }


@pytest.fixture(scope="module")
def parity():
    """Trained here, in each of the 2 processes: one device (the
    reference), then on the mesh of every process's devices model parallel
    with the model axis across the processes, and data parallel with each
    process passing its own rows; saved, loaded, and the rest of the
    contract. Returns the folder the processes share and what this process
    saw."""
    out = folder_every_rank_shares("parity")
    rank, count = klm.process_index(), klm.process_count()
    x, y = digits_data(200)
    reference = _train(_build(), x, y, BATCH)
    # The model axis spans the processes: each "model" pair joins a device
    # of process 0 with one of process 1. (Data parallel across processes,
    # global data: the matrix's keras-data-parallel row, in its 2-process
    # cells.)
    mesh_mp = klm.create_mesh([("model", 2), ("batch", DEVICES // 2)])
    layout_map = net_layout_map(mesh_mp, bias=False)
    runs = {}
    with layout_map.scope():
        model_parallel = _build()
    runs["model_parallel"] = _train(model_parallel, x, y, BATCH)
    kernel = klm.fetch_layout(model_parallel.layers[0].kernel)
    runs["model_parallel"]["kernel_layout"] = kernel.sharding_specs
    runs["model_parallel"]["local_devices"] = kernel.mesh.num_local_devices()

    # Each process passes its own slice, with a per-process batch size.
    local = klm.DataParallel(klm.create_mesh([("batch", DEVICES)]),
                             auto_shard_dataset=False)
    klm.set_distribution(local)
    rows = slice(rank * len(x) // count, (rank + 1) * len(x) // count)
    own = _train(_build(), x[rows], y[rows], BATCH // count)
    klm.set_distribution(None)
    # The global batches are the processes' local batches side by side:
    # the same global batches, in one process, are the reference.
    per = len(x) // count
    order = np.concatenate([
        np.arange(p * per + start, p * per + min(start + BATCH // count, per))
        for start in range(0, per, BATCH // count) for p in range(count)])
    runs["own_slices"] = {**own, "reference": _train(_build(), x[order],
                                                     y[order], BATCH)}
    np.save(out / f"own_slices{rank}.npy",
            np.concatenate([w.ravel() for w in own["weights"]]))

    # One file written once, loadable on another mesh and on one device.
    model_parallel.save_weights(out / "weights.weights.h5")
    runs["files"] = sorted(os.listdir(out))
    dp = klm.DataParallel(klm.create_mesh([("batch", DEVICES)]))
    klm.set_distribution(dp)
    restored = _build()
    restored.load_weights(out / "weights.weights.h5")
    runs["restored_data_parallel"] = restored.get_weights()
    klm.set_distribution(None)

    # The rest of the contract, unchanged across processes.
    contract = {}
    mesh = dp.device_mesh
    layout = klm.Layout(["batch", None], mesh)
    whole = np.arange(4 * DEVICES, dtype="float32").reshape(2 * DEVICES, 2)
    pieces = klm.unpack(klm.distribute(whole, layout))  # this process's
    contract["unpack"] = [np.asarray(p) for p in pieces]
    repacked = klm.pack([np.asarray(p) for p in pieces], layout)
    contract["repacked_layout"] = klm.fetch_layout(repacked).sharding_specs
    contract["repacked_host"] = keras.ops.convert_to_numpy(repacked)
    contract["explain_rules"] = sorted(
        str(r.rule) for r in layout_map.explain(model_parallel).rows if r.rule)
    metric = keras.metrics.Mean(mesh=mesh)
    metric.update_state(np.arange(8, dtype="float32"))
    contract["metric"] = float(metric.result())
    contract["metric_mesh"] = klm.fetch_layout(metric.variables[0]).mesh.size
    model_parallel.save(out / "model.keras")
    loaded = keras.models.load_model(out / "model.keras")  # one device
    contract["loaded_weights"] = loaded.get_weights()
    contract["loaded_mesh"] = klm.fetch_layout(loaded.layers[0].kernel).mesh.size
    if BACKEND == "tensorflow":  # DTensor's own checkpoints
        import tensorflow as tf

        prefix = str(out / "ckpt" / "model")
        tf.train.Checkpoint(model=model_parallel).write(prefix)
        with layout_map.scope():
            fresh = _build()
        tf.train.Checkpoint(model=fresh).read(prefix).expect_partial()
        contract["checkpoint_weights"] = fresh.get_weights()
    return out, {"reference": reference, "runs": runs, "contract": contract}


def max_difference(a, b):
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max())
               for x, y in zip(a, b))


def assert_run_matches(run, weights, history):
    assert max_difference(run["weights"], weights) < 2e-6
    for key in history:
        np.testing.assert_allclose(run["history"][key], history[key], rtol=1e-5,
                                   atol=1e-6, err_msg=key)


@pytest.mark.sharding
@pytest.mark.training
@ACROSS_TWO
def test_model_parallel_with_global_data_trains_as_one_device(parity):
    """Model parallel, the model axis across the processes (data parallel
    with global data across processes: the matrix's keras-data-parallel
    row in its 2-process cells)."""
    _, seen = parity
    assert klm.process_count() == 2 and len(klm.list_devices()) == DEVICES
    run, reference = seen["runs"]["model_parallel"], seen["reference"]
    assert_run_matches(run, reference["weights"], reference["history"])
    np.testing.assert_allclose(run["evaluate"], reference["evaluate"], rtol=1e-5)
    # predict returns every row to every process
    assert np.shape(run["predict"]) == np.shape(reference["predict"])
    np.testing.assert_allclose(run["predict"], reference["predict"],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.sharding
@pytest.mark.training
@ACROSS_TWO
def test_model_axis_spans_processes(parity):
    run = parity[1]["runs"]["model_parallel"]
    assert run["kernel_layout"] == ["unsharded", "model"]
    assert run["local_devices"] == DEVICES // 2


@pytest.mark.sharding
@pytest.mark.training
@ACROSS_TWO
def test_own_slices_with_short_batches_train_as_one_device(parity):
    # Fault: a short last local batch silently desynchronised the processes.
    out, seen = parity
    run = seen["runs"]["own_slices"]
    reference = run["reference"]
    assert_run_matches(run, reference["weights"], reference["history"])
    # Both processes wrote theirs before the save every process takes part in.
    first, second = (np.load(out / f"own_slices{r}.npy") for r in (0, 1))
    np.testing.assert_array_equal(first, second)


@pytest.mark.sharding
@pytest.mark.training
@ACROSS_TWO
def test_save_weights_writes_one_file_that_loads_on_another_mesh(parity):
    out, seen = parity
    runs = seen["runs"]
    assert [f for f in runs["files"] if f.endswith(".h5")] == [
        "weights.weights.h5"]
    weights = runs["model_parallel"]["weights"]
    assert max_difference(runs["restored_data_parallel"], weights) == 0
    # ... and with no distribution, on one device
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, name="d1"),
                              keras.layers.Dense(10, name="d2")])
    model.load_weights(out / "weights.weights.h5")
    assert max_difference(model.get_weights(), weights) == 0


@pytest.mark.processes
def test_unseeded_processes_join_and_make_the_same_replicated_weights(tmp_path):
    """No seed anywhere: every process still makes the same value for a
    weight they all hold replicated (read from each process's own piece),
    and draws the same Python and NumPy numbers, as process 0 would alone.
    Before, each process drew its own weights and the replicas disagreed
    with no error. On JAX and TensorFlow the script joins with
    `klm.initialize()`, as a cluster script does (here on one machine,
    `launch --devices-per-process 4`), and sees the whole cluster; a torch
    process holds one device (`configure_virtual_devices(2)`)."""
    if MULTI_PROCESS:
        join, options = "klm.initialize()", ["--devices-per-process", 4]
    else:
        join, options = "klm.configure_virtual_devices(2)", []
    script = tmp_path / "unseeded.py"
    script.write_text(
        "import pathlib, random, sys\n"
        "import numpy as np\n"
        "import keras_layoutmap as klm\n"
        f"{join}\n"
        "import keras\n"
        "mesh = klm.create_mesh([('batch', len(klm.list_devices()))])\n"
        "with klm.DataParallel(mesh).scope():\n"
        "    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])\n"
        "piece = klm.unpack(model.layers[0].kernel)[0]\n"
        "mine = keras.ops.convert_to_numpy(piece).round(6).tolist()\n"
        "seen = (klm.process_count(), len(klm.list_devices()),\n"
        "        mesh.num_local_devices())\n"
        "pathlib.Path(sys.argv[1], str(klm.process_index())).write_text(\n"
        "    repr((seen, mine, random.random(), float(np.random.rand()))))\n")
    result = launch(2, *options, script, tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    first, second = [ast.literal_eval((tmp_path / r).read_text()) for r in "01"]
    assert first[0] == ((2, 8, 4) if MULTI_PROCESS else (2, 2, 1))
    assert first == second


@pytestmark_mp
def test_devices_that_do_not_spread_evenly_say_how_to_launch(monkeypatch):
    # Process 1 of 3, as `launch -n 3` starts it: refused before joining.
    # (The launcher passes a failing process's error on: below,
    # test_a_process_that_raises_ends_the_run.)
    as_launched_process(monkeypatch, 3, 1)
    with pytest.raises(ValueError, match="cannot be spread evenly over the 3 "
                       r"processes.*keras_layoutmap\.launch -n 4"):
        klm.configure_virtual_devices(8)


@pytest.mark.skipif(BACKEND != "torch",
                    reason="JAX and TensorFlow put several devices in a process")
def test_torch_needs_one_process_per_device(monkeypatch):
    as_launched_process(monkeypatch, 2, 0)  # `launch -n 2`, 8 devices asked
    with pytest.raises(RuntimeError, match=r"keras_layoutmap\.launch -n 8"):
        klm.configure_virtual_devices(8)


@pytest.mark.sharding
@pytest.mark.training
@ACROSS_TWO
def test_rest_of_the_contract_runs_unchanged(parity):
    out, seen = parity
    contract, index = seen["contract"], klm.process_index()
    whole = np.arange(4 * DEVICES, dtype="float32").reshape(2 * DEVICES, 2)
    # unpack gives this process's devices' pieces, pack takes them back
    local = DEVICES // 2
    mine = [whole[2 * d: 2 * d + 2]
            for d in range(local * index, local * index + local)]
    np.testing.assert_array_equal(contract["unpack"], mine)
    assert contract["repacked_layout"] == ["batch", "unsharded"]
    np.testing.assert_array_equal(contract["repacked_host"], whole)
    assert contract["explain_rules"] == ["d1\\.kernel", "d2\\.kernel"]
    assert contract["metric"] == 3.5 and contract["metric_mesh"] == DEVICES
    # model.save on every process: one file, loads with no distribution
    weights = seen["runs"]["model_parallel"]["weights"]
    assert max_difference(contract["loaded_weights"], weights) == 0
    assert contract["loaded_mesh"] == 1
    if BACKEND == "tensorflow":  # tf.train.Checkpoint
        assert max_difference(contract["checkpoint_weights"], weights) == 0
    assert (out / "model.keras").is_file()


@pytest.mark.processes
@pytestmark_mp
def test_a_process_that_raises_ends_the_run(tmp_path):
    # Rank 1 raises while rank 0 waits for it in fit's first collective: the
    # launcher must end rank 0 and report rank 1's failure, not hang.
    script = tmp_path / "raises.py"
    script.write_text(
        "import time, keras_layoutmap as klm\n"
        "klm.configure_virtual_devices(8)\n"
        "import keras, numpy as np\n"
        "if klm.process_index() == 1:\n"
        "    raise ValueError('rank 1 fails on purpose')\n"
        "klm.set_distribution(klm.DataParallel(klm.create_mesh([('batch', 8)])))\n"
        "model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])\n"
        "model.compile('sgd', 'mse')\n"
        "print('rank 0 fits', flush=True)\n"
        "model.fit(np.ones((16, 4)), np.ones((16, 2)), batch_size=8, verbose=0)\n"
        "time.sleep(600)\n")
    result = launch(2, script, timeout=240)
    assert result.returncode == 1
    assert "rank 1 fails on purpose" in result.stderr


@pytest.mark.processes
def test_backup_is_read_by_every_process_before_it_is_written_again(tmp_path):
    """A model on one device per process (no distribution) resumes from
    BackupAndRestore: process 1 reads the backup late, and process 0, which
    takes no collective while it trains, must not write the next backup
    before then. Before, process 1 read a backup of a later epoch (or HDF5
    could not lock the file) and resumed elsewhere than process 0."""
    devices = 2
    script = tmp_path / "resume.py"
    script.write_text(
        "import pathlib, sys, time\n"
        "import keras_layoutmap as klm\n"
        f"klm.configure_virtual_devices({devices})\n"
        "import keras, numpy as np\n"
        "folder = pathlib.Path(sys.argv[1])\n"
        "x = np.random.default_rng(0).normal(size=(64, 4)).astype('float32')\n"
        "y = x.sum(axis=1, keepdims=True)\n"
        "class Stop(keras.callbacks.Callback):\n"
        "    def on_epoch_end(self, epoch, logs=None):\n"
        "        raise KeyboardInterrupt\n"
        "class Late(keras.callbacks.Callback):\n"
        "    def on_train_begin(self, logs=None):\n"
        "        if klm.process_index() == 1:\n"
        "            time.sleep(3)\n"
        "def run(before=(), after=()):\n"
        "    keras.utils.set_random_seed(0)\n"
        "    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])\n"
        "    model.compile(keras.optimizers.SGD(0.01), 'mse')\n"
        "    backup = keras.callbacks.BackupAndRestore(str(folder / 'backup'))\n"
        "    return model, model.fit(x, y, batch_size=16, epochs=4, verbose=0,\n"
        "                            shuffle=False,\n"
        "                            callbacks=[*before, backup, *after])\n"
        "try:\n"
        "    run(after=[Stop()])\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "model, history = run(before=[Late()])\n"
        "weights = model.get_weights()[0].round(6).tolist()\n"
        "(folder / str(klm.process_index())).write_text(\n"
        "    repr((len(history.history['loss']), weights)))\n")
    result = launch(2, script, tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = [(tmp_path / r).read_text() for r in "01"]
    assert first == second
    assert first.startswith("(3,")  # resumed after the first epoch
