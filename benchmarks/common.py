"""What the timing scripts share: a per-step timer and the benchmark MLP.

Import it after `KERAS_BACKEND` is set (it imports keras).
"""

import time

import keras


class StepTimer(keras.callbacks.Callback):
    """Wall-clock time of every training step."""

    def __init__(self):
        super().__init__()
        self.times = []
        self._start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def build_mlp(seed, features, hidden, classes, metrics=("accuracy",)):
    """Dense `features -> hidden -> hidden -> classes` (layers `d0`, `d1`,
    `head`), compiled with Adam 1e-3, sparse cross-entropy from logits and
    `metrics` (accuracy unless told)."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(hidden, activation="relu", name="d0"),
            keras.layers.Dense(hidden, activation="relu", name="d1"),
            keras.layers.Dense(classes, name="head"),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=list(metrics),
    )
    return model
