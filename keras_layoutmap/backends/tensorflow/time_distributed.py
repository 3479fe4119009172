"""`TimeDistributed` on a mesh: each time step read as `inputs[:, t]`.

Keras' `TimeDistributed.call` swaps the batch and time dimensions
(`ops.transpose`) and reads step `t` as `inputs[t]`, a strided slice that
drops the first dimension. TensorFlow 2.21's DTensor lays that slice's
output out with the input's *leading* specs (`[unsharded, batch]` for a
`(time, batch, features)` tensor split over `batch` on its rows, where the
rows are now the first dimension of the step): a step of 3 features on 8
devices is refused ("'tf.DTensorLayout' op requires dimension 1 to be
divisible by sharding ... size=3"), eagerly and inside `fit`, under every
plan whose batch is split; where the features divide, the rows and
features trade their splits at every step. Reading `inputs[:, t]` (the
slice drops a dimension that is not the batch's) keeps the rows' layout,
and the steps are stacked on the time axis (`axis=1`): the same layer
calls on the same values as Keras', in the same order, without either
transpose.

On a mesh only (`runs_on_mesh`), with a static number of time steps (else
Keras' own `vectorized_map`), and with a mask Keras accepts (Keras' own
call raises for one it does not).
"""

import functools

import keras

from keras_layoutmap.backends.tensorflow import unsplit_axes
from keras_layoutmap.backends.tensorflow.placement import runs_on_mesh


def _mask_fits(inputs, mask):
    shape, mask_shape = inputs.shape, mask.shape
    if len(mask_shape) < 2:
        return False
    return all(a is None or b is None or a == b
               for a, b in zip(shape[:2], mask_shape[:2]))


def wrap_call(original):
    """`TimeDistributed.call`, stepping over `inputs[:, t]` on a mesh."""

    @functools.wraps(original)
    def call(self, inputs, training=None, mask=None):
        steps = getattr(inputs, "shape", (None, None))[1] if len(
            getattr(inputs, "shape", ())) >= 2 else None
        if (steps is None or not runs_on_mesh(inputs)
                or (mask is not None and not _mask_fits(inputs, mask))):
            return original(self, inputs, training=training, mask=mask)

        def step(t):
            kwargs = {}
            if self.layer._call_has_mask_arg and mask is not None:
                kwargs["mask"] = mask[:, t]
            if self.layer._call_has_training_arg:
                kwargs["training"] = training
            return self.layer.call(inputs[:, t], **kwargs)

        outputs = [step(t) for t in range(steps)]
        with unsplit_axes.relayouted():
            return keras.ops.stack(outputs, axis=1)

    return call


def install():
    layer = keras.layers.TimeDistributed
    layer.call = wrap_call(layer.call)
