"""`ops.einsum` on DTensors: TensorFlow's one `Einsum` op.

Keras' TensorFlow `einsum` rewrites about twenty equations into
`tf.transpose` + `tf.reshape` + `tf.matmul` (for the GPU's matmul kernels),
among them the two of keras-hub's attention (Gemma's
`btkgh,bskh->bkgts` and `bkgts,bskh->btkgh`: the key and the value
transposed before a batched matmul). DTensor lays out each of those ops on
its own, and its Transpose has no SPMD rule for an output laid out other
than as its operand permuted ("TransposeOp SPMD needs communication is not
supported yet"): in `generate()` the KV cache (made by `ops.zeros`,
replicated, and carried through the decoding loop) is transposed into a
matmul whose other operand, the query, is split over the batch axis
(`DataParallel`) or its heads over the model axis (Gemma's
`get_layout_map`), and generation failed. TensorFlow's `tf.einsum` is one
`Einsum` op, whose SPMD rule lays its operands out itself.

So on a mesh (a DTensor operand eagerly; inside a `tf.function`, under a
mesh distribution) a floating-point einsum is `tf.einsum`, with Keras' dtype
rule (operands cast to their result type). Integer operands (int8
quantized kernels, whose int8 x int8 -> int32 Keras computes with
`matmul(output_type=...)`) and extra arguments keep Keras' own path.
"""

import functools

import keras
import tensorflow as tf

from keras_layoutmap.backends.tensorflow.placement import runs_on_mesh


def wrap_einsum(original):
    """Keras' TensorFlow `numpy.einsum`, as one `tf.einsum` on a mesh."""

    @functools.wraps(original)
    def einsum(subscripts, *operands, **kwargs):
        if kwargs or not runs_on_mesh(*operands):
            return original(subscripts, *operands, **kwargs)
        operands = [tf.convert_to_tensor(x) for x in operands]
        dtype = keras.backend.result_type(*(x.dtype.name for x in operands))
        if "float" not in dtype:
            return original(subscripts, *operands, **kwargs)
        return tf.einsum(subscripts, *(tf.cast(x, dtype) for x in operands))

    return einsum
