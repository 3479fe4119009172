"""A custom training loop on a mesh, as in the TF DTensor Keras tutorial.

The tutorial's loop, ported to Keras 3 on JAX:

- the model gives each Dense layer `kernel_layout=` / `bias_layout=`
  (replicated, i.e. data parallel on a 1-D `batch=8` mesh);
- `pack_inputs` splits each batch into one piece per local device and
  `klm.pack`s the pieces into one batch-sharded array, like the tutorial's
  `pack_dtensor_inputs`;
- `klm.optimizers.Adam(0.01, mesh=mesh)` and
  `keras.metrics.SparseCategoricalAccuracy(mesh=mesh)` keep their state on
  the mesh;
- `train_step` is a pure function, `jax.jit`-compiled: `model.stateless_call`
  for the forward pass, `jax.value_and_grad` for the gradients and
  `optimizer.stateless_apply` for the update (the approach of Keras' guide
  "Writing a training loop from scratch in JAX").

Three epochs on scikit-learn's digits; a `keras.utils.Progbar` per epoch.

Run: `KERAS_BACKEND=jax python examples/custom_training_loop.py`.
Exits non-zero if the test accuracy ends below 90%.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(8)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

BATCH_SIZE = 128
MIN_ACCURACY = 0.9


def load_data(seed=0, n_test=360):
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype("float32")
    y = digits.target[order].astype("int32")
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def batches(x, y, batch_size, rng=None, drop_remainder=True):
    """Yield (images, labels) batches, shuffled when `rng` is given.

    `klm.pack` needs a batch that divides into one equal piece per device, so
    training drops the last, short batch (drop_remainder): 1,437 training
    digits make 11 batches of 128, and the 29 left over change from epoch to
    epoch as the data are reshuffled. The 360 test digits end with a batch of
    104 = 8 x 13, which packs as it is.
    """
    order = rng.permutation(len(y)) if rng is not None else np.arange(len(y))
    stop = len(y) - batch_size + 1 if drop_remainder else len(y)
    for start in range(0, stop, batch_size):
        index = order[start:start + batch_size]
        yield x[index], y[index]


def pack_inputs(images, labels, image_layout, label_layout):
    """Split a host batch into one piece per local device and pack the pieces
    into batch-sharded arrays (for a mesh whose only axis is the batch)."""
    num_local_devices = image_layout.mesh.num_local_devices()
    images = np.split(images, num_local_devices)
    labels = np.split(labels, num_local_devices)
    return (klm.pack(images, image_layout), klm.pack(labels, label_layout))


def build_model(mesh):
    unsharded_layout_2d = klm.Layout.replicated(mesh, 2)
    unsharded_layout_1d = klm.Layout.replicated(mesh, 1)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu", name="d1",
                               kernel_layout=unsharded_layout_2d,
                               bias_layout=unsharded_layout_1d),
            keras.layers.Dense(10, name="d2",
                               kernel_layout=unsharded_layout_2d,
                               bias_layout=unsharded_layout_1d),
        ]
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    mesh = klm.create_mesh([("batch", 8)])
    keras.utils.set_random_seed(0)
    model = build_model(mesh)
    for weight in model.weights:
        print(f"{weight.path}: {klm.fetch_layout(weight)}")

    optimizer = klm.optimizers.Adam(0.01, mesh=mesh)
    optimizer.build(model.trainable_variables)
    train_accuracy = keras.metrics.SparseCategoricalAccuracy(mesh=mesh)
    test_accuracy = keras.metrics.SparseCategoricalAccuracy(mesh=mesh)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def compute_loss(trainable, non_trainable, x, y):
        logits, non_trainable = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        # The mean of the batch-sharded per-example losses is one replicated
        # scalar: XLA adds the cross-device sum for us.
        return loss_fn(y, logits), (logits, non_trainable)

    grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

    @jax.jit
    def train_step(state, x, y):
        trainable, non_trainable, optimizer_vars, metric_vars = state
        (loss, (logits, non_trainable)), grads = grad_fn(
            trainable, non_trainable, x, y
        )
        trainable, optimizer_vars = optimizer.stateless_apply(
            optimizer_vars, grads, trainable
        )
        metric_vars = train_accuracy.stateless_update_state(metric_vars, y, logits)
        return loss, (trainable, non_trainable, optimizer_vars, metric_vars)

    @jax.jit
    def eval_step(trainable, non_trainable, metric_vars, x, y):
        logits, _ = model.stateless_call(trainable, non_trainable, x)
        return test_accuracy.stateless_update_state(metric_vars, y, logits)

    # The state the loop threads through train_step: jax arrays that already
    # live on the mesh with their layouts.
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    optimizer_vars = [v.value for v in optimizer.variables]

    image_layout = klm.Layout.batch_sharded(mesh, "batch", rank=2)
    label_layout = klm.Layout.batch_sharded(mesh, "batch", rank=1)
    (x_train, y_train), (x_test, y_test) = load_data()
    steps = len(y_train) // BATCH_SIZE
    rng = np.random.default_rng(0)

    for epoch in range(args.epochs):
        print(f"============================\nEpoch: {epoch}")
        metric_vars = [v.value for v in train_accuracy.variables]  # reset
        state = (trainable, non_trainable, optimizer_vars, metric_vars)
        progbar = keras.utils.Progbar(target=steps, stateful_metrics=["accuracy"])
        for step, (images, labels) in enumerate(
            batches(x_train, y_train, BATCH_SIZE, rng), start=1
        ):
            images, labels = pack_inputs(images, labels, image_layout, label_layout)
            loss, state = train_step(state, images, labels)
            accuracy = train_accuracy.stateless_result(state[3])
            progbar.update(step, values=[("loss", float(loss)),
                                         ("accuracy", float(accuracy))])
        trainable, non_trainable, optimizer_vars, _ = state

        metric_vars = [v.value for v in test_accuracy.variables]  # reset
        for images, labels in batches(x_test, y_test, BATCH_SIZE,
                                      drop_remainder=False):
            images, labels = pack_inputs(images, labels, image_layout, label_layout)
            metric_vars = eval_step(trainable, non_trainable, metric_vars,
                                    images, labels)
        result = float(test_accuracy.stateless_result(metric_vars))
        print(f"eval_accuracy: {result:.4f}")

    # Write the trained state back into the Keras objects.
    for variable, value in zip(model.trainable_variables, trainable):
        variable.assign(value)
    for variable, value in zip(model.non_trainable_variables, non_trainable):
        variable.assign(value)
    for variable, value in zip(optimizer.variables, optimizer_vars):
        variable.assign(value)
    for variable, value in zip(test_accuracy.variables, metric_vars):
        variable.assign(value)

    kernel = model.get_layer("d1").kernel
    print(f"\nafter training d1.kernel is still {klm.fetch_layout(kernel)}")
    print(f"optimizer iterations: {int(optimizer.iterations.value)}")
    final = float(test_accuracy.result())
    print(f"final test accuracy: {final:.4f}")
    if final < MIN_ACCURACY:
        raise SystemExit(f"FAILED: test accuracy {final:.4f} < {MIN_ACCURACY}")


if __name__ == "__main__":
    main()
