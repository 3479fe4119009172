"""The DTensor Keras tutorial's training loop on the TensorFlow backend:
`tf.function` step, `tf.GradientTape`, inputs packed onto the mesh, an
optimizer and a metric with `mesh=`. (The JAX loop is in test_training.)"""

import keras
import numpy as np
import pytest
from helpers import digits_data, sequential_mlp

import keras_layoutmap as klm
from keras_layoutmap import backends

pytestmark = [
    pytest.mark.sharding,
    pytest.mark.skipif(backends.name() != "tensorflow",
                       reason="a tf.GradientTape loop runs on the TensorFlow "
                       "backend only"),
]


def build():
    return sequential_mlp(64, 10)


def train(model, optimizer, metric, mesh=None):
    import tensorflow as tf

    x_all, y_all = digits_data(512)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        metric.update_state(y, logits)
        return loss

    losses = []
    for start in range(0, 512, 128):
        x, y = x_all[start:start + 128], y_all[start:start + 128]
        if mesh is not None:  # the tutorial's pack_dtensor_inputs
            n = mesh.num_local_devices()
            x = klm.pack(np.split(x, n), klm.Layout.batch_sharded(mesh, "batch", 2))
            y = klm.pack(np.split(y, n), klm.Layout.batch_sharded(mesh, "batch", 1))
        loss = train_step(x, y)
        losses.append(float(klm.unpack(loss)[0]) if mesh is not None else float(loss))
    result = metric.result()
    accuracy = float(klm.unpack(result)[0]) if mesh is not None else float(result)
    return losses, accuracy, [v.numpy() if mesh is None else
                              klm.unpack(v)[0].numpy() for v in model.weights]


@pytest.mark.parametrize("name, learning_rate", [("SGD", 0.1), ("Adam", 0.01)])
def test_tutorial_loop_matches_single_device(name, learning_rate):
    # Adam reads its moments after updating them: with DTensor's all-reduce
    # combining pass on, the first update was lost (backends/tensorflow/__init__.py).
    ref_losses, ref_accuracy, ref_weights = train(
        build(), getattr(keras.optimizers, name)(learning_rate),
        keras.metrics.SparseCategoricalAccuracy())
    mesh = klm.create_mesh([("batch", 8)])
    with klm.DataParallel(mesh).scope():
        model = build()
    losses, accuracy, weights = train(
        model, getattr(klm.optimizers, name)(learning_rate, mesh=mesh),
        keras.metrics.SparseCategoricalAccuracy(mesh=mesh), mesh=mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert accuracy == pytest.approx(ref_accuracy, abs=1e-7)
    for a, b in zip(weights, ref_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert klm.fetch_layout(model.weights[0]) == klm.Layout.replicated(mesh, 2)
