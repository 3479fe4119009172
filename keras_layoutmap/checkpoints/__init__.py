"""Keras' sharded checkpoints on every backend: `keras.callbacks.OrbaxCheckpoint`,
`keras.models.load_model(directory)` and `model.load_weights(directory)`.

Keras writes them with Orbax, whose multi-process support is JAX's: on
TensorFlow and torch, Keras hands Orbax every value whole (gathered on
every process) and every process writes the same files. Here, on those
backends and across processes, Orbax is given each sharded value as a
`jax.Array` of the shards this process holds (`backends.orbax_arrays`):
each process writes its own, in the format JAX writes, so that a
checkpoint written under one backend, mesh or process count restores
under another. Reading, every backend (JAX too) asks Orbax for each value
laid out as the model's variable is, whatever layout wrote it; a value
whose shape differs from the variable's is refused, naming it.

>>> import keras
>>> import keras_layoutmap as klm
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
>>> model.compile("sgd", "mse")
>>> saving = keras.callbacks.OrbaxCheckpoint("/tmp/klm_doc_ckpt")  # doctest: +SKIP
>>> model.fit(x, y, callbacks=[saving])  # doctest: +SKIP
>>> restored = keras.models.load_model("/tmp/klm_doc_ckpt")  # doctest: +SKIP
"""

from keras_layoutmap.checkpoints.keras_hooks import install

__all__ = ["install"]
