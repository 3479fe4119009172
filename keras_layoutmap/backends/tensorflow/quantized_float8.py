"""float8 on DTensors: the amax history's roll as a gather, and the
rounded kernel kept where the kernel is.

Keras' float8 `Dense` and `EinsumDense` keep, per tensor, a history of its
largest absolute values and update it each step with `ops.roll(history,
shift=-1)`: TensorFlow's `Roll` op, for which DTensor has no layout rule
("has no layout rule for the op 'tf.Roll'"), so a float8 model could not
train on a mesh.

On a mesh, a roll by a static shift of a tensor of static shape is a
`tf.gather` of the same elements in the rolled order: an op DTensor lays
out, and the same values (nothing is computed, only moved). Anything else
runs Keras' own roll.

Keras rounds a float8 layer's inputs and kernel to float8 and back
(`quantize_and_dequantize`). DTensor moves a tensor where its consumer needs
it at the earliest op it can, which there is the float8 cast, and it has no
kernels for float8 collectives ("No OpKernel was registered to support Op
'Fill' ... T=DT_FLOAT8_E4M3FN": keras-hub Llama's attention output under its
recipe). A kernel gathered for a layer's call (`gather.gathered`) carries
its layout, and on a mesh its rounded copy is laid out the same
(`dtensor.relayout`): a move that follows is one of float32 values.
"""

import functools

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import runs_on_mesh


def wrap_roll(original):
    """Keras' TensorFlow `numpy.roll`: a gather on a mesh."""

    @functools.wraps(original)
    def roll(x, shift, axis=None):
        x = tf.convert_to_tensor(x)
        if (not isinstance(shift, (int, np.integer))
                or not isinstance(axis, (int, np.integer, type(None)))
                or not x.shape.is_fully_defined() or not runs_on_mesh(x)):
            return original(x, shift, axis=axis)
        if axis is None:
            flat = tf.reshape(x, [-1])
            return tf.reshape(roll(flat, shift, 0), x.shape)
        n = int(x.shape[axis])
        if n == 0:
            return x
        order = (np.arange(n) - int(shift)) % n
        return tf.gather(x, tf.constant(order, tf.int32), axis=axis)

    return roll


def wrap_quantize_and_dequantize(original):
    """Keras' float8 `quantize_and_dequantize`: a gathered kernel's rounded
    copy laid out as the kernel (see above)."""

    @functools.wraps(original)
    def quantize_and_dequantize(inputs, scale, quantized_dtype, compute_dtype):
        out = original(inputs, scale, quantized_dtype, compute_dtype)
        layout = getattr(inputs, "_klm_layout", None)
        if layout is not None and tf.is_tensor(out):
            out = dtensor.relayout(out, layout)
        return out

    return quantize_and_dequantize
