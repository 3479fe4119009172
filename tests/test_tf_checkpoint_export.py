"""TensorFlow only: `tf.train.Checkpoint` across layouts (as in the DTensor
ML tutorial), `model.export` of a sharded model, and the errors a DTensor
user meets first."""

import os

import keras
import numpy as np
import pytest
from helpers import compile_classifier, device_names, sequential_mlp

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [
    pytest.mark.sharding,
    pytest.mark.training,
    pytest.mark.skipif(backends.name() != "tensorflow",
                       reason="tf.train.Checkpoint, SavedModel export and DTensor "
                       "errors belong to the TensorFlow backend"),
]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    return (rng.random((200, 16), dtype="float32"),
            rng.integers(0, 4, 200).astype("int32"))


def build():
    return compile_classifier(sequential_mlp(32, 4, inputs=16, name="mlp"),
                              accuracy=False)


def model_parallel(mesh):
    lm = klm.LayoutMap(mesh)
    lm[r"d1\.kernel"] = (None, "model")
    lm[r"d1\.bias"] = ("model",)
    with lm.scope():
        return build()


def state(model):
    return [np.asarray(v) for v in model.weights + model.optimizer.variables]


def test_tf_checkpoint_restores_across_layouts_and_resumes(tmp_path, data):
    import tensorflow as tf

    x, y = data
    reference = build()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    with klm.DataParallel(klm.create_mesh([("batch", 8)])).scope():
        first = build()
    first.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(root=first), str(tmp_path), max_to_keep=1)
    manager.save()

    # Restore into a model-parallel model: another mesh, other layouts.
    mesh = klm.create_mesh([("batch", 4), ("model", 2)])
    second = model_parallel(mesh)
    second.build((None, 16))
    second.optimizer.build(second.trainable_variables)
    tf.train.Checkpoint(root=second).restore(
        manager.latest_checkpoint).assert_existing_objects_matched()
    for a, b in zip(state(second), state(first)):
        np.testing.assert_array_equal(a, b)
    assert klm.fetch_layout(second.get_layer("d1").kernel) == klm.Layout(
        [None, "model"], mesh)
    # ... and training goes on as if it had never stopped.
    second.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(state(second), state(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)

    plain = build()  # and with no distribution at all
    plain.build((None, 16))
    tf.train.Checkpoint(root=plain).restore(manager.latest_checkpoint).expect_partial()
    for a, b in zip(plain.get_weights(), first.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_export_serves_plain_tensors(tmp_path, data):
    import tensorflow as tf

    x, y = data
    mesh = klm.create_mesh([("batch", 4), ("model", 2)])
    model = model_parallel(mesh)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "served")
    model.export(path, verbose=0)
    served = tf.saved_model.load(path)
    out = served.serve(tf.constant(x[:10]))
    assert "CPU:0" in out.device  # a plain tensor, not a DTensor
    np.testing.assert_allclose(out.numpy(), model.predict(x[:10], verbose=0),
                               rtol=1e-5, atol=1e-6)
    # The model stays on its mesh and keeps training.
    assert klm.fetch_layout(model.get_layer("d1").kernel) == klm.Layout(
        [None, "model"], mesh)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_plain_tensor_where_a_dtensor_is_needed(data):
    import tensorflow as tf

    x, _ = data
    mesh = klm.create_mesh([("batch", 8)])
    with klm.DataParallel(mesh).scope():
        model = build()
    with pytest.raises(ValueError, match=r"Model 'mlp' has its variables on a mesh "
                       r"\{'batch': 8\}, but input 0 is a plain ndarray of shape "
                       r"\(200, 16\).*klm.distribute"):
        model(x)
    with pytest.raises(TypeError, match="klm.unpack expects a tensor placed on a mesh"):
        klm.unpack(tf.constant(x))
    placed = klm.distribute(x[:64], klm.Layout.batch_sharded(mesh, "batch", 2))
    np.testing.assert_allclose(klm.unpack(model(placed))[0].shape, (8, 4))


def test_batch_on_another_mesh_is_refused(data):
    x, y = data
    with klm.DataParallel(klm.create_mesh([("batch", 8)])).scope():
        model = build()
    other = klm.create_mesh([("batch", 4)], devices=device_names(4))
    packed = klm.distribute(x[:32], klm.Layout.batch_sharded(other, "batch", 2))
    with pytest.raises(ValueError, match=r"Model 'mlp' has its variables on a "
                       r"mesh \{'batch': 8\}, but input 0 is on another mesh "
                       r"\{'batch': 4\}"):
        model(packed)
    with pytest.raises(ValueError, match=r"model.predict takes host data.*"
                       r"Received a DTensor of shape \(32, 16\)"):
        model.predict(packed, verbose=0)
    with pytest.raises(ValueError, match=r"An input is a DTensor on another mesh "
                       r"\{'batch': 4\} than the model's"):
        model.train_on_batch(packed, y[:32])
    with pytest.raises(ValueError, match="one component per local device"):
        klm.pack(np.split(x[:32], 4), klm.Layout.batch_sharded(
            klm.create_mesh([("batch", 8)]), "batch", 2))


def test_random_preprocessing_in_tf_data_under_a_mesh_distribution():
    """Random draws are made whole only inside Keras' steps on the mesh; a
    tf.data pipeline traced under the distribution is left alone."""
    import tensorflow as tf

    images = np.arange(2 * 4 * 4, dtype="float32").reshape(2, 4, 4, 1)
    flip = keras.layers.RandomFlip("horizontal", seed=1)
    with klm.DataParallel(klm.create_mesh([("batch", 8)])).scope():
        ds = tf.data.Dataset.from_tensor_slices(images).batch(2).map(
            lambda x: flip(x, training=True))
        (batch,) = list(ds)
    for out, image in zip(batch.numpy(), images):
        assert np.array_equal(out, image) or np.array_equal(out, image[:, ::-1])


def test_layouts_dtensor_cannot_run_get_a_clear_error(data):
    x, y = data
    mesh = klm.create_mesh([("batch", 4), ("model", 2)])
    lm = klm.LayoutMap(mesh)
    lm["d1/output"] = (None, "batch")  # d1's output columns on `batch` ...
    lm[r"d2\.kernel"] = ("model", None)  # ... d2's rows on `model`
    with lm.scope():
        model = build()
    with pytest.raises(ValueError, match=r"DTensor cannot run a step of model 'mlp'"
                       r".*Contracting dimension for matmul.*klm.explain"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
