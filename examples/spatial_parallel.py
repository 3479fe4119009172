"""Spatial parallelism: split the *feature* dimension of the input.

The DTensor ML tutorial's third scheme, on Keras 3. On a mesh
`batch=4 x feature=2`, each device holds a quarter of the examples and half
of each example's 64 pixels. The first Dense kernel is split the same way
along its input dimension (`("feature", None)`), so each device multiplies
its half of the pixels by its half of the kernel rows and the partial sums
are added across the `feature` axis.

The script runs one forward pass on the sharded input and checks it against
the same model, with the same weights, on a single device.

Run: `KERAS_BACKEND=jax python examples/spatial_parallel.py` (or
`KERAS_BACKEND=tensorflow`).
Exits non-zero if the two forward passes differ (rtol 1e-5).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

BATCH = 64


def build():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32, activation="relu", name="d1"),
            keras.layers.Dense(10, name="d2"),
        ],
        name="mlp",
    )


def shard_shapes(x):
    return [tuple(s.shape) for s in klm.unpack(x)]


def to_host(x, mesh):
    """A sharded tensor, whole, as a numpy array. JAX's arrays convert
    directly, but TensorFlow's DTensor refuses to copy a sharded tensor to
    the host; on both, relayout it to replicated and take one device's copy."""
    replicated = klm.distribute(x, klm.Layout.replicated(mesh, len(x.shape)))
    return np.asarray(klm.unpack(replicated)[0])


def main():
    x = (load_digits().data[:BATCH] / 16.0).astype("float32")

    # The reference: one device, no distribution.
    keras.utils.set_random_seed(0)
    single = build()
    expected = keras.ops.convert_to_numpy(single(x))

    mesh = klm.create_mesh([("batch", 4), ("feature", 2)])
    layout_map = klm.LayoutMap(mesh)
    layout_map["d1.kernel"] = ("feature", klm.UNSHARDED)  # rows follow pixels
    with layout_map.scope():
        model = build()
    model.set_weights(single.get_weights())  # same numbers, new placement
    print(layout_map.explain(model))

    image_layout = klm.Layout(["batch", "feature"], mesh)
    sharded_x = klm.distribute(x, image_layout)
    print(f"input   {x.shape} {klm.fetch_layout(sharded_x).sharding_specs}: "
          f"per-device shards {shard_shapes(sharded_x)}")
    kernel = model.get_layer("d1").kernel
    print(f"d1.kernel {tuple(kernel.shape)} "
          f"{klm.fetch_layout(kernel).sharding_specs}: "
          f"per-device shards {shard_shapes(kernel)}")
    first = klm.unpack(sharded_x)[1]
    np.testing.assert_array_equal(np.asarray(first), x[:16, 32:])
    print("device 1 holds examples 0-15, pixels 32-63")

    outputs = model(sharded_x)
    print(f"output  {tuple(outputs.shape)} "
          f"{klm.fetch_layout(outputs).sharding_specs}: per-device shards "
          f"{shard_shapes(outputs)}")

    outputs = to_host(outputs, mesh)
    try:
        np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        raise SystemExit(
            f"FAILED: spatial-parallel forward pass differs:\n{e}"
        ) from None
    error = np.max(np.abs(outputs - expected))
    print(f"spatial-parallel forward pass matches the single-device one "
          f"(max abs difference {error:.2e})")


if __name__ == "__main__":
    main()
