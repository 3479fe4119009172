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
same seed gives the same numbers on the same mesh and layout. An initializer
DTensor cannot run on a mesh (`Orthogonal`'s matrix ops have no layout
propagation) falls back to the old path: drawn whole, then split.

Example:

>>> import keras, keras_layoutmap as klm
>>> from keras_layoutmap.backends.tensorflow.initialization import born_sharded
>>> mesh = klm.create_mesh([("model", 2)], devices=klm.list_devices()[:2])
>>> layout = klm.Layout(["model", None], mesh)
>>> init = keras.initializers.GlorotUniform(seed=7)
>>> value = born_sharded(lambda: init((6, 3), "float32"), layout)
>>> klm.fetch_layout(value).sharding_specs
['model', 'unsharded']
"""

import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import to_dlayout


def born_sharded(make_value, layout):
    """`make_value()` (a function of no arguments: Keras' initializer call)
    made on `layout`'s mesh, each device computing its shard; None when
    DTensor cannot run it on the mesh (the caller then makes it whole)."""
    dlayout = to_dlayout(layout)

    def on_mesh():
        return dtensor.relayout(tf.convert_to_tensor(make_value()), dlayout)

    try:
        with tf.init_scope(), dtensor.default_mesh(dlayout.mesh):
            return tf.function(on_mesh, autograph=False)()
    except (tf.errors.OpError, ValueError, TypeError, NotImplementedError):
        return None
