"""Slices whose bounds a step computes: read with `tf.slice` on a mesh.

Inside a `tf.function` DTensor (TensorFlow 2.21) expands a strided slice
whose begin or end is a tensor (`images[:, h:h + 6, w:w + 6, :]`, `h` drawn
in the step) to an empty slice on every device, whatever the operand's
layout, replicated included: `RandomCrop` under data parallel or
`klm.fsdp` cropped empty images, and its resize failed ("input image must
be of non-zero size"). Eagerly it slices right; so does `tf.slice` with a
tensor begin and static sizes, inside a step too, keeping the rows'
split.

So while a step on a mesh is traced, `RandomCrop`'s training crop is that
`tf.slice`: the same offsets (Keras' own `get_random_transformation`), the
same values. Only where the crop lies inside the image by construction
(the image larger than the crop in both dimensions, as Keras draws it
then); else Keras' own path, which resizes.
"""

import functools

import keras
import tensorflow as tf


def _mesh():
    from keras_layoutmap.backends.tensorflow.training import traced_mesh
    return traced_mesh()


def crop(images, starts, sizes):
    """`images` cropped to `sizes` from `starts`, each a `{dimension:
    value}` (a start may be a scalar tensor), with `tf.slice`: static
    sizes, the other dimensions whole."""
    rank = images.shape.rank
    begin = [starts.get(d, 0) for d in range(rank)]
    size = [sizes.get(d, -1 if images.shape[d] is None else images.shape[d])
            for d in range(rank)]
    begin = tf.stack([tf.cast(b, tf.int32) for b in begin])
    return tf.slice(images, begin, size)


def wrap_random_crop_transform_images(original):
    """`RandomCrop.transform_images`, its training crop a `tf.slice` on a
    mesh."""

    @functools.wraps(original)
    def transform_images(self, images, transformation, training=True):
        rank = getattr(getattr(images, "shape", None), "rank", None)
        if (not training or rank not in (3, 4) or _mesh() is None
                or not tf.is_tensor(images)):
            return original(self, images, transformation, training=training)
        height_axis, width_axis = self.height_axis % rank, self.width_axis % rank
        height, width = images.shape[height_axis], images.shape[width_axis]
        if height is None or width is None or not (
                height > self.height and width > self.width):
            return original(self, images, transformation, training=training)
        images = keras.ops.cast(images, self.compute_dtype)
        h_start, w_start = transformation
        return crop(images, {height_axis: h_start, width_axis: w_start},
                    {height_axis: self.height, width_axis: self.width})

    return transform_images


def install():
    layer = keras.layers.RandomCrop
    layer.transform_images = wrap_random_crop_transform_images(
        layer.transform_images)
