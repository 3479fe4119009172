"""Keras' sharded checkpoints (`OrbaxCheckpoint`, `load_model(directory)`)
survive a run killed in the middle of a save: the last checkpoint whose save
completed restores exactly. (Saving and restoring across backends, meshes
and processes: the matrix's rows `orbax-checkpoint` and
`orbax-other-backends`.)"""

import os
import signal
import time

import keras
import numpy as np
import pytest
from helpers import DEVICES, PROCESSES, digits_data, run_script
from test_workflows import keras_model_parallel_plan, mlp

import keras_layoutmap as klm

# A user's script, run in a fresh process: the matrix's MLP trained model
# parallel where the backend makes 8 devices in one process (one device on
# torch), OrbaxCheckpoint saving after every batch in the background; at
# batch 5, once that save has begun (its temporary directory is there),
# the process is killed. Every batch's weights are kept beside it.
_SCRIPT = r'''
import os, signal, sys, time
import keras
import numpy as np
import keras_layoutmap as klm

devices = 1 if keras.backend.backend() == "torch" else 8
klm.configure_virtual_devices(devices)
from helpers import digits_data
from test_workflows import keras_model_parallel_plan, mlp

folder = sys.argv[1]
checkpoints = os.path.join(folder, "ckpt")
if devices > 1:
    keras.distribution.set_distribution(keras_model_parallel_plan())
model = mlp()
x, y = digits_data(300)
KILL_AT = 5


class Record(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        np.savez(os.path.join(folder, f"step{self.step}.npz"),
                 *[keras.ops.convert_to_numpy(w) for w in self.model.weights])


class KillMidSave(keras.callbacks.Callback):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def on_train_batch_end(self, batch, logs=None):
        if self.record.step == KILL_AT:
            tmp = os.path.join(checkpoints, f"{KILL_AT}.orbax-checkpoint-tmp")
            deadline = time.monotonic() + 60
            while not os.path.exists(tmp) and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGKILL)


record = Record()
model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
          callbacks=[record, keras.callbacks.OrbaxCheckpoint(
              checkpoints, save_freq=1, max_to_keep=3), KillMidSave(record)])
sys.exit("the training was not killed")
'''


@pytest.mark.processes
def test_a_run_killed_mid_save_restores_the_last_complete_checkpoint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    killed = run_script(script, tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = sorted(os.listdir(tmp_path / "ckpt"))
    # Killed while step 5 was being written: it never completed.
    assert "5.orbax-checkpoint-tmp" in saved and "5" not in saved, saved
    complete = max(int(name) for name in saved if name.isdigit())
    assert 1 <= complete < 5, saved
    # Read as it was written: model parallel where there are 8 devices.
    keras.distribution.set_distribution(
        keras_model_parallel_plan() if DEVICES > 1 else None)
    try:
        model = keras.models.load_model(str(tmp_path / "ckpt"))
    finally:
        keras.distribution.set_distribution(None)
    expected = np.load(tmp_path / f"step{complete}.npz")
    for i, weight in enumerate(model.weights):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(weight), expected[f"arr_{i}"],
            err_msg=weight.path)
    assert int(model.optimizer.iterations) == complete


@pytest.mark.skipif(PROCESSES == 1, reason="needs several processes (the "
                    "launcher's): one process always sees its directory")
@pytest.mark.sharding
def test_a_directory_some_processes_do_not_see_is_refused_on_every_process(
        tmp_path):
    # Each process names a folder of its own, as each host's own disk
    # would be (one machine here).
    own = tmp_path / f"process{klm.process_index()}" / "ckpt"
    start = time.monotonic()
    with pytest.raises(ValueError, match="is not shared.*process\\(es\\) "):
        keras.callbacks.OrbaxCheckpoint(str(own))
    assert time.monotonic() - start < 30


def _compiled(model):
    model.compile("sgd", "mse")  # Keras reads a state tree of compiled ones
    return model


def _saved_dense(folder, units):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        units, name="d1")], name="small")
    model.compile("sgd", "mse")
    x = np.ones((8, 4), "float32")
    model.fit(x, np.ones((8, units), "float32"), epochs=1, verbose=0,
              callbacks=[keras.callbacks.OrbaxCheckpoint(
                  str(folder), save_on_background=False)])
    return model


@pytest.mark.training  # every process of a run, together
def test_a_checkpoint_that_does_not_fit_the_model_is_refused_by_name(tmp_path):
    keras.distribution.set_distribution(None)
    saved = _saved_dense(tmp_path / "ckpt", 3)
    wider = _compiled(keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        5, name="d1")], name="small"))
    with pytest.raises(ValueError, match=(
            r"holds 'small/d1/\w+' with shape \((4, )?3,?\), "
            r"but the model's variable has shape \((4, )?5,?\)")):
        wider.load_weights(str(tmp_path / "ckpt"))
    renamed = _compiled(keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, name="other")], name="small"))
    with pytest.raises(ValueError, match=r"no value for 2 .*other/kernel"):
        renamed.load_weights(str(tmp_path / "ckpt"))
    # Keras' own leave-as-is, when asked for.
    renamed.load_weights(str(tmp_path / "ckpt"), skip_mismatch=True)
    # Outside a read, a partial tree is Keras' to assign, as before.
    same = _compiled(keras.Sequential([keras.Input((4,)), keras.layers.Dense(
        3, name="d1")], name="small"))
    same.load_weights(str(tmp_path / "ckpt"))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(same.weights[0]),
                                  keras.ops.convert_to_numpy(saved.weights[0]))
    same.set_state_tree({"trainable_variables": {"small": {"d1": {
        "bias": np.zeros(3, "float32")}}}})
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(same.weights[1]),
                                  np.zeros(3, "float32"))


def _split_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(8, name="a"),
        keras.layers.Dense(4, name="b", dtype="bfloat16"),
    ])


@pytest.mark.skipif(PROCESSES == 1, reason="needs several processes (the "
                    "launcher's): in one process every value is whole here")
@pytest.mark.training  # every process of a run, together
def test_one_file_save_brings_each_value_to_process_0_alone(tmp_path,
                                                          monkeypatch):
    """`save_weights` across processes streams: each kernel, split over
    both mesh axes (so over the processes), comes to process 0 alone,
    which gets it whole; every other process sends its pieces and gets a
    placeholder, never the whole value. The file holds every value bit
    for bit (bfloat16 included)."""
    from keras_layoutmap import one_writer

    mesh = klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])
    rules = klm.LayoutMap(mesh)
    rules[r".*kernel"] = ("batch", "model")
    with rules.scope():
        model = _split_model()
    assert klm.fetch_layout(model.get_layer("b").kernel).axes == (
        "batch", "model")
    received, results = one_writer.received, []

    def spy(whole, shape, dtype):
        result = received(whole, shape, dtype)
        results.append(one_writer.is_placeholder(result))
        return result

    monkeypatch.setattr(one_writer, "received", spy)
    if keras.backend.backend() == "tensorflow":
        from keras_layoutmap.backends.tensorflow import writer_transfers

        # each piece in several sums, the last one short (pieces of 4 and
        # 32 words here; sums of 2 MiB in use)
        monkeypatch.setattr(writer_transfers, "CHUNK_WORDS", 3)
    path = str(tmp_path / "split.weights.h5")
    model.save_weights(path)
    monkeypatch.undo()
    # the two kernels (on JAX the biases too: held whole by every process,
    # they are still arrays over every process's devices)
    assert len(results) == (4 if keras.backend.backend() == "jax" else 2)
    assert all(results) if klm.process_index() else not any(results)
    plain = _split_model()  # no plan: one device, other weights
    plain.load_weights(path)
    for got, want in zip(plain.weights, model.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got),
                                      keras.ops.convert_to_numpy(want))


@pytest.mark.skipif(PROCESSES == 1, reason="needs several processes (the "
                    "launcher's): in one process every value is whole here")
@pytest.mark.training  # every process of a run, together
def test_one_file_weights_across_processes_and_a_value_that_differs(tmp_path):
    """`save_weights` / `load_weights` of one file on a mesh that spans
    processes: every process reads the file and places its own pieces of
    each value (JAX: no gather of the whole value from every process to
    compare it), exact. A value assigned from a host is the same on every
    process (JAX's contract for a host value, kept on torch and
    TensorFlow): one that differs is refused on every process, naming the
    variable."""
    keras.distribution.set_distribution(keras_model_parallel_plan())
    try:
        saved = mlp()
        x, y = digits_data(64)
        saved.fit(x, y, batch_size=32, epochs=1, verbose=0)
        path = str(tmp_path / "model.weights.h5")
        saved.save_weights(path)
        loaded = mlp()  # as first built: other weights than the trained ones
        assert not np.array_equal(keras.ops.convert_to_numpy(loaded.weights[0]),
                                  keras.ops.convert_to_numpy(saved.weights[0]))
        loaded.load_weights(path)
        for got, want in zip(loaded.weights, saved.weights):
            assert klm.fetch_layout(got) == klm.fetch_layout(want), got.path
            np.testing.assert_array_equal(keras.ops.convert_to_numpy(got),
                                          keras.ops.convert_to_numpy(want))
        kernel = loaded.get_layer("d1").kernel
        mine = np.full(kernel.shape, klm.process_index(), "float32")
        with pytest.raises(ValueError, match=(
                r"d1/kernel'.*not the same on every process")):
            kernel.assign(mine)
    finally:
        keras.distribution.set_distribution(None)
