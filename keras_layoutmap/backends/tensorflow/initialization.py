"""Weights born sharded on TensorFlow: an initializer run by DTensor with
the weight's layout, each device making only its shard.

A variable made under a distribution used to be drawn whole on one device
and then split onto the mesh. Here its initializer runs in a `tf.function`
on the mesh whose result is relaid to the weight's layout: DTensor
propagates that layout back to the ops that make the value (a random draw,
`zeros`, a fill), so each device computes its own shard, as TF-Keras 2's
`dtensor.call_with_layout` did. Random draws then come out other than on
one device: DTensor's stateless random ops mix each device's position on
the mesh into the seed. The numbers follow the same distribution, and the
same seed gives the same numbers on the same mesh and layout. So that a
model's small weights keep one device's values (parity with a model built
on one device), only a weight of at least `MIN_BYTES` is made this way;
smaller ones are drawn whole and split, as before. An initializer
DTensor cannot run on a mesh (`Orthogonal`'s matrix ops have no layout
propagation) falls back to the old path: drawn whole, then split.

Example:

>>> import keras, keras_layoutmap as klm
>>> from keras_layoutmap.backends.tensorflow.initialization import born_sharded
>>> mesh = klm.create_mesh([("model", 2)], devices=klm.list_devices()[:2])
>>> layout = klm.Layout(["model", None], mesh)
>>> init = keras.initializers.GlorotUniform(seed=7)
>>> value = born_sharded(lambda: init((6, 3), "float32"), layout, nbytes=72,
...                      min_bytes=0)
>>> klm.fetch_layout(value).sharding_specs
['model', 'unsharded']
"""

import threading

import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.keras_internals import (
    random as keras_tf_random,
)
from keras_layoutmap.backends.tensorflow.placement import to_dlayout

# Weights smaller than this are drawn whole (one device's values).
MIN_BYTES = 64 << 20
_DRAWING = threading.Lock()


def _draw_seed_once(original):
    """Keras' `draw_seed`, run eagerly outside the function on the mesh: a
    `SeedGenerator` advanced inside it would be advanced once per device."""

    def draw_seed(seed):
        with tf.init_scope():
            return original(seed)

    return draw_seed


def born_sharded(make_value, layout, nbytes, min_bytes=None):
    """`make_value()` (a function of no arguments: Keras' initializer call)
    made on `layout`'s mesh, each device computing its shard; None when the
    weight (`nbytes`) is under `min_bytes` (default `MIN_BYTES`) or DTensor
    cannot run it on the mesh: the caller then makes it whole."""
    if nbytes < (MIN_BYTES if min_bytes is None else min_bytes):
        return None
    dlayout = to_dlayout(layout)

    def on_mesh():
        return dtensor.relayout(tf.convert_to_tensor(make_value()), dlayout)

    original = keras_tf_random.draw_seed
    with _DRAWING:
        keras_tf_random.draw_seed = _draw_seed_once(original)
        try:
            with tf.init_scope(), dtensor.default_mesh(dlayout.mesh):
                return tf.function(on_mesh, autograph=False)()
        except (tf.errors.OpError, ValueError, TypeError, NotImplementedError):
            return None
        finally:
            keras_tf_random.draw_seed = original
