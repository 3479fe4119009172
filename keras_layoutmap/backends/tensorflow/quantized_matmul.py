"""int8 x int8 products on DTensors: one op DTensor lays out, same numbers.

Keras' int8 `Dense` and `EinsumDense` multiply int8 inputs by the int8
kernel and keep int32 sums: TensorFlow's `matmul(..., output_type=int32)`,
which is the op `BatchMatMulV3`, and `einsum` through the same op. DTensor
has no SPMD rule for `BatchMatMulV3` ("has no layout rule for the op
'tf.BatchMatMulV3'"), so a quantized model could not run on a mesh.

On a mesh the operands are widened to int32 first and multiplied by
`MatMul` (`tf.matmul`, `tf.tensordot`) or `Einsum`, ops DTensor lays out.
The products and their sums are integers well inside int32 (|127 x 127| x
the contracted size), so the result is exactly Keras' one-device int32
result: nothing rounds. An int8 einsum's operands are first made whole on
every device (`_replicated`: DTensor's Einsum rule refuses a label split
over two mesh axes, which int8 activations and kernels can meet). Off the
mesh Keras' own path runs.
"""

import functools

import tensorflow as tf
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow.placement import mesh_of, runs_on_mesh


def _int8_pair(operands):
    return len(operands) == 2 and all(
        tf.is_tensor(x) and x.dtype == tf.int8
        and not isinstance(x, tf.SparseTensor) for x in operands)


def wrap_matmul(original):
    """Keras' TensorFlow `numpy.matmul`: int8 x int8 on a mesh in int32."""

    @functools.wraps(original)
    def matmul(x1, x2):
        x1, x2 = tf.convert_to_tensor(x1), tf.convert_to_tensor(x2)
        if not (_int8_pair((x1, x2)) and runs_on_mesh(x1, x2)):
            return original(x1, x2)
        a, b = tf.cast(x1, tf.int32), tf.cast(x2, tf.int32)
        if a.shape.rank == 2 and b.shape.rank == 2:
            return tf.matmul(a, b)
        if b.shape.rank == 2 and a.shape.rank is not None and a.shape.rank > 2:
            return tf.tensordot(a, b, axes=[[-1], [0]])
        return tf.matmul(a, b)

    return matmul


def _replicated(x):
    """`x` whole on every device of the active mesh. DTensor's Einsum rule
    needs each label split over one mesh axis in both operands; an int8
    activation and its kernel may split a label over two (Llama's attention
    output, `bquh,uhm->bqm`: the heads over "model" in the activation, over
    "batch" in the kernel under its recipe), which the float path never
    meets (its activations are laid out from the kernels). Quantized
    inference keeps its exact int32 sums; the sharding resumes after."""
    mesh = mesh_of(x)
    if mesh is None:
        return x
    return dtensor.relayout(x, dtensor.Layout.replicated(mesh, x.shape.rank))


def wrap_einsum(original):
    """Keras' TensorFlow `numpy.einsum`: int8 x int8 on a mesh in int32."""

    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        if kwargs or len(operands) != 2:
            return original(subscripts, *operands, **kwargs)
        operands = [tf.convert_to_tensor(x) for x in operands]
        if not (_int8_pair(operands) and runs_on_mesh(*operands)):
            return original(subscripts, *operands, **kwargs)
        return tf.einsum(subscripts, *(
            tf.cast(_replicated(x), tf.int32) for x in operands))

    return einsum
