"""Data-parallel, then model-parallel training of an MLP with plain `fit`.

The data are scikit-learn's 1,797 real 8x8 handwritten digits (no download).
Eight virtual CPU devices stand in for eight accelerators; the same code runs
unchanged on a machine that has them.

1. Data parallel: a 1-D mesh `batch=8`; every weight replicated, every batch
   split over the eight devices (`klm.DataParallel`).
2. Model parallel: a 2-D mesh `batch=4 x model=2`; a `klm.LayoutMap` splits
   the hidden layers' kernels and biases over `model`, batches over `batch`.

Both runs use `batch_size=128` and `validation_split=0.2`: Keras trains on
the first 1,437 samples, so the last training batch of every epoch has 29
samples, which do not divide over the batch axis. Stock
`keras.distribution.DataParallel` fails on such a batch (pass
`--show-keras-failure` to see it); the `klm` distributions compute it whole
on every device instead.

Run: `KERAS_BACKEND=jax python examples/train_digits.py [--epochs N]` (or
`KERAS_BACKEND=tensorflow`).
The script exits non-zero if either run ends below 90% validation accuracy.

Both runs print the same losses and accuracies, to the last digit: that is
the point. They start from the same seed, and sharding changes where the
numbers are computed, not the numbers (parity with one device).
"""

import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_layoutmap as klm  # noqa: E402

# The first call after the import, before anything touches a device.
klm.configure_virtual_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

BATCH_SIZE = 128
VALIDATION_SPLIT = 0.2
MIN_ACCURACY = 0.9


def load_data(seed=0):
    """Digits as (n, 64) float32 in [0, 1] and int32 labels, shuffled once
    (`validation_split` takes the last 20%, so the order must be random)."""
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype("float32")
    y = digits.target[order].astype("int32")
    return x, y


def build_mlp():
    """The model code knows nothing about devices; names are what rules use."""
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu", name="hidden_1"),
            keras.layers.Dense(128, activation="relu", name="hidden_2"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="mlp",
    )


def heading(title):
    print(f"\n=== {title} ===")


def train(model, x, y, epochs, title):
    """Compile and fit outside any scope: the model remembers the
    distribution it was built under."""
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    history = model.fit(
        x,
        y,
        batch_size=BATCH_SIZE,
        epochs=epochs,
        validation_split=VALIDATION_SPLIT,
        verbose=2,
    )
    seconds = time.perf_counter() - start
    accuracy = float(history.history["val_accuracy"][-1])
    print(f"{title}: final val_accuracy = {accuracy:.4f} ({seconds:.1f} s)")
    return accuracy


def last_batches(n):
    """Sizes of the last training and validation batches (Keras keeps the
    first floor(n * 0.8) samples for training)."""
    n_train = int(np.floor(n * (1 - VALIDATION_SPLIT)))
    return n_train % BATCH_SIZE or BATCH_SIZE, (n - n_train) % BATCH_SIZE or BATCH_SIZE


def data_parallel(x, y, epochs):
    title = "data parallel (batch=8)"
    heading(title)
    mesh = klm.create_mesh([("batch", 8)])
    dist = klm.DataParallel(mesh)
    keras.utils.set_random_seed(0)
    with dist.scope():
        model = build_mlp()
    layout = klm.fetch_layout(model.get_layer("hidden_1").kernel)
    print(f"data parallel on {mesh}: hidden_1.kernel is {layout.sharding_specs}")
    return train(model, x, y, epochs, title)


def model_parallel(x, y, epochs):
    title = "model parallel (batch=4 x model=2)"
    heading(title)
    mesh = klm.create_mesh([("batch", 4), ("model", 2)])
    layout_map = klm.LayoutMap(mesh)
    # Rules are regexes over object paths ("hidden_1.kernel"); the first one
    # that matches wins, and unmatched weights ("logits.*") are replicated.
    layout_map[r"hidden_\d+\.kernel"] = (klm.UNSHARDED, "model")
    layout_map[r"hidden_\d+\.bias"] = ("model",)
    keras.utils.set_random_seed(0)
    with layout_map.scope():
        model = build_mlp()
    print(layout_map.explain(model))
    kernel = model.get_layer("hidden_1").kernel
    shards = [tuple(s.shape) for s in klm.unpack(kernel)]
    print(f"hidden_1.kernel {tuple(kernel.shape)} -> per-device shards {shards}")
    return train(model, x, y, epochs, title)


def show_keras_failure(x, y):
    """Stock Keras' DataParallel on the same data: the 29-sample batch cannot
    be split over 8 devices."""
    dist = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:8]
    )
    with dist.scope():
        model = build_mlp()
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(True))
        try:
            model.fit(x, y, batch_size=BATCH_SIZE, epochs=1,
                      validation_split=VALIDATION_SPLIT, verbose=0)
        except Exception as e:  # show whatever it raises
            message = " ".join(str(e).split())
            print(f"\nkeras.distribution.DataParallel: {type(e).__name__}: "
                  f"{message[:220]}...")
        else:
            print("\nkeras.distribution.DataParallel handled the short batch.")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--show-keras-failure", action="store_true",
                        help="first run stock keras.distribution.DataParallel")
    args = parser.parse_args()

    x, y = load_data()
    last_train, last_val = last_batches(len(y))
    print(f"{len(y)} digits on {len(klm.list_devices())} devices; last "
          f"batches: {last_train} (train) and {last_val} (validation)")
    if args.show_keras_failure:
        show_keras_failure(x, y)

    results = {
        "data parallel": data_parallel(x, y, args.epochs),
        "model parallel": model_parallel(x, y, args.epochs),
    }
    print()
    for name, accuracy in results.items():
        print(f"{name:>14}: val_accuracy {accuracy:.4f}")
    if len(set(results.values())) == 1:
        print("The two runs match to the last digit, as they should: same "
              "seed, same numbers;\nsharding changes where they are computed, "
              "not what they are (parity).")
    failed = [n for n, a in results.items() if a < MIN_ACCURACY]
    if failed:
        raise SystemExit(
            f"FAILED: {', '.join(failed)} below {MIN_ACCURACY:.0%} accuracy"
        )


if __name__ == "__main__":
    main()
