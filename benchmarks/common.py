"""What the timing scripts share: a per-step timer, the benchmark MLP and
the keras-hub Gemma language model of `fsdp.py` and `zero.py`.

Import it after `KERAS_BACKEND` is set (it imports keras).
"""

import time

import keras
import numpy as np


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


# A GemmaBackbone of 4.98 M parameters (vocabulary 4096, 4 layers, hidden
# 256, 4 query / 2 key-value heads of 64, gated MLP of 1024), from a config:
# no preset, no download.
GEMMA_CONFIG = dict(vocabulary_size=4096, num_layers=4, num_query_heads=4,
                    num_key_value_heads=2, hidden_dim=256,
                    intermediate_dim=2048, head_dim=64)


def build_gemma_lm():
    """`GemmaBackbone(**GEMMA_CONFIG)` with its tied-embedding causal-LM
    head, as a Functional model compiled with Adam 1e-3 and sparse
    cross-entropy from logits (seed 0)."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**GEMMA_CONFIG)
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask"),
    }
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    model = keras.Model(inputs, logits, name="gemma_lm")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def gemma_data(rows, sequence):
    """`rows` random token sequences for `build_gemma_lm` (seed 0): inputs
    and next-token labels."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, GEMMA_CONFIG["vocabulary_size"],
                          size=(rows, sequence + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1],
         "padding_mask": np.ones((rows, sequence), "int32")}
    return x, tokens[:, 1:]
