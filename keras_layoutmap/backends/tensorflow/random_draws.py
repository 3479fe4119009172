"""Random draws inside Keras' steps on a mesh, made whole: DTensor draws a
sharded random tensor shard by shard, from per-device seeds (other numbers
than one device); drawn replicated, later ops shard it like any tensor."""

import contextlib
import contextvars
import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.keras_internals import (
    random as keras_tf_random,
)
from keras_layoutmap.backends.tensorflow.placement import (
    mesh_distribution,
    to_dmesh,
)

_IN_MESH_STEP = contextvars.ContextVar("klm_in_mesh_step", default=False)


@contextlib.contextmanager
def mesh_step():
    token = _IN_MESH_STEP.set(True)
    try:
        yield
    finally:
        _IN_MESH_STEP.reset(token)


def _traced_mesh():
    """The `dtensor.Mesh` random numbers are drawn for: the distribution's,
    while a step on it is being traced; None otherwise."""
    if not _IN_MESH_STEP.get() or tf.executing_eagerly():
        return None
    dist = mesh_distribution()
    return None if dist is None else to_dmesh(dist.device_mesh)


def _replicated(tensor, dmesh):
    return dtensor.relayout(tensor, dtensor.Layout.replicated(dmesh, tensor.shape.rank))


def wrap_random(original):
    """DTensor draws a sharded random tensor shard by shard from per-device
    seeds: other numbers than one device draws. Draw it whole (replicated)
    instead; later ops shard it like any other tensor."""

    @functools.wraps(original)
    def draw(*args, **kwargs):
        dmesh = _traced_mesh()
        result = original(*args, **kwargs)
        return result if dmesh is None else _replicated(result, dmesh)

    return draw


def wrap_dropout(original):
    @functools.wraps(original)
    def dropout(inputs, rate, noise_shape=None, seed=None):
        dmesh = _traced_mesh()
        if dmesh is None or rate in (0.0, 1.0):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        # tf.nn.experimental.stateless_dropout, op for op, with the noise
        # drawn whole.
        seed = keras_tf_random._cast_seed(keras_tf_random.draw_seed(seed))
        shape = keras_tf_random._get_concrete_noise_shape(inputs, noise_shape)
        noise = _replicated(
            tf.random.stateless_uniform(shape, seed=seed, dtype=inputs.dtype), dmesh)
        scaled = inputs * tf.convert_to_tensor(1 / (1 - rate), dtype=inputs.dtype)
        return tf.where(noise >= rate, scaled, tf.constant(0, dtype=inputs.dtype))

    return dropout


def wrap_categorical(original):
    """`keras.random.categorical` is `tf.random.stateless_categorical`, whose
    op DTensor has no layout rule for, replicated or not: inside a function
    on a mesh it would fail at run time with DTensor's message naming
    neither the Keras call nor a way around. Say both, at trace time."""

    @functools.wraps(original)
    def categorical(logits, num_samples, dtype="int64", seed=None):
        if tf.executing_eagerly() or mesh_distribution() is None:
            return original(logits, num_samples, dtype=dtype, seed=seed)
        raise ValueError(
            "keras.random.categorical cannot run on a TensorFlow DTensor mesh: "
            "DTensor has no layout rule for its op 'tf.StatelessMultinomial'. "
            "keras-hub's TopKSampler, TopPSampler and RandomSampler draw with "
            "it; on TensorFlow generate() under a distribution with the "
            "'greedy', 'beam' or 'contrastive' sampler, or sample on JAX or "
            "torch, where seeded samplers run on the mesh.")

    return categorical
