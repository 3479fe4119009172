"""keras-hub's `generate()` on TensorFlow: the kernels split over the
prompts' mesh axis are gathered once per call, before the decoding loop.

keras-hub decodes on TensorFlow in one `tf.function` (`generate_step`),
whose `tf.while_loop` calls the backbone's layers at every token. A Dense
or EinsumDense kernel split over the mesh axis that also splits the
prompts' rows (the `batch` axis of `klm.fsdp`'s plan, of a 2-D plan and of
keras-hub's recipes) is gathered over it at each call of its layer
(`gather.wrap_dense_call`): inside the loop, at every token. Here the step
reads each such kernel once, as it starts, gathered over that axis (still
split over the others: a 2-D plan's kernel keeps its tensor-parallel
piece), and the loop's layers read those values (`gather.reading`). The
variables keep their layouts. Other weights stay as DTensor reads them:
held gathered, some make steps DTensor refuses (the lookup of a position
table split over `model` alone).

The gathered kernels cost memory for the call: `extra_bytes` of them on
each device. They are gathered only where that fits in half of every
process's free memory (known on CPUs; on accelerators TensorFlow does not
say, and they are gathered), decided when the step is traced, by every
process alike. Where DTensor refuses the step as it compiles it (an
`UnknownError` from its MLIR passes, before anything runs: keras-hub's
Mixtral, a quantized Gemma in 2 processes), keras-hub's own step takes
over. `KLM_TF_DECODE_GATHERED=0` turns this off.
"""

import functools
import os

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from keras_layoutmap.backends.causal_lm import wrap_when_loaded
from keras_layoutmap.backends.tensorflow import processes
from keras_layoutmap.backends.tensorflow.gather import (
    marked,
    reading,
    relayout,
    stored_layout,
    whole_over,
)
from keras_layoutmap.backends.tensorflow.placement import (
    mesh_distribution,
    to_dlayout,
)
from keras_layoutmap.layout import as_layout

ENABLED = os.environ.get("KLM_TF_DECODE_GATHERED", "1") != "0"


def row_axes(dist, inputs):
    """The mesh axes `dist` splits the rows of `inputs` (the prompts)
    over: those of its data layout's first dimension (its batch axis where
    the rows' count is not known)."""
    leaves = [x for x in tree.flatten(inputs) if hasattr(x, "shape")]
    if not leaves or not leaves[0].shape.rank:
        return ()
    shape = tuple(leaves[0].shape)
    if None in shape:
        axis = getattr(dist, "batch_dim_name", None)
        return () if axis is None else (axis,)
    layout = to_dlayout(as_layout(dist.get_data_layout(shape)))
    first = layout.sharding_specs[0]
    return (first,) if first in layout.mesh.dim_names else ()


def gathered_layouts(model, axes):
    """`[(kernel, its layout with axes unsharded)]` for the kernel of each
    `Dense` and `EinsumDense` layer of `model` stored split over one of
    `axes`: the weights `gather.wrap_dense_call` gathers at each call.
    Other weights (embedding tables, a mixture's experts) stay as DTensor
    reads them: held gathered, a position table split over `model` alone
    made a lookup DTensor refuses (keras-hub's GPT-2 and OPT)."""
    found = []
    for layer in model._flatten_layers():
        if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
            continue
        kernel = getattr(layer, "_kernel", None)
        layout = stored_layout(kernel)
        if layout is not None and any(a in layout.sharding_specs for a in axes):
            found.append((kernel, whole_over(layout, axes)))
    return found


def _piece_bytes(variable, layout):
    """The bytes of a piece of `variable` laid out as `layout`, as an even
    split (the same figure on every process)."""
    count = int(np.prod(variable.shape))
    for spec in layout.sharding_specs:
        if spec in layout.mesh.dim_names:
            count //= layout.mesh.dim_size(spec)
    return count * tf.as_dtype(variable.dtype).size


def extra_bytes(pairs):
    """The bytes each device holds beyond its pieces when the variables of
    `pairs` are held as their layouts there say."""
    return sum(_piece_bytes(v, layout) - _piece_bytes(v, stored_layout(v))
               for v, layout in pairs)


def free_bytes():
    """This process's free memory where its devices are CPUs, else None
    (TensorFlow does not say what an accelerator has left)."""
    if tf.config.list_logical_devices("GPU") or tf.config.list_logical_devices("TPU"):
        return None
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def fits(extra):
    """Whether `extra` bytes fit in half of every process's free memory
    (every process gets the same answer)."""
    free = free_bytes()
    with tf.init_scope():  # eagerly, also while a step is traced
        return processes.every_process_agrees(free is None or 2 * extra <= free)


def gathered_step(model, step, inputs, stop_token_ids):
    """`step(inputs, stop_token_ids)` (keras-hub's `generate_step`), with
    `model`'s weights split over the prompts' mesh axis read gathered."""
    dist = mesh_distribution()
    if not ENABLED or dist is None:
        return step(inputs, stop_token_ids)
    axes = row_axes(dist, inputs)
    pairs = gathered_layouts(model, axes)
    if not pairs or not fits(extra_bytes(pairs)):
        return step(inputs, stop_token_ids)
    held = {id(variable): marked(relayout(variable.value, layout), layout)
            for variable, layout in pairs}
    with reading(held):
        outputs = step(inputs, stop_token_ids)
    return outputs


def wrap_make_generate_function(original):
    """keras-hub's generate function, its `generate_step` reading the
    model's weights gathered once over the prompts' axis (`gathered_step`).
    Where DTensor refuses that step as it compiles it (an `UnknownError`
    from its MLIR passes, before anything runs), keras-hub's own step
    takes over, once and for good."""

    @functools.wraps(original)
    def make_generate_function(self):
        if self.generate_function is not None:
            return self.generate_function
        # keras-hub wraps `self.generate_step` (a `tf.function` of it, or
        # the method itself when run eagerly): for that once, the step
        # gathers first.
        step = self.generate_step

        @functools.wraps(step)
        def generate_step(inputs, stop_token_ids=None):
            return gathered_step(self, step, inputs, stop_token_ids)

        object.__setattr__(self, "generate_step", generate_step)
        try:
            function = original(self)
        finally:
            object.__delattr__(self, "generate_step")
        plain = []

        def generate_function(inputs, stop_token_ids=None):
            if plain:
                return plain[0](inputs, stop_token_ids=stop_token_ids)
            try:
                return function(inputs, stop_token_ids=stop_token_ids)
            except tf.errors.UnknownError as error:
                if "dtensor" not in str(error):
                    raise
            self.generate_function = None
            plain.append(original(self))
            self.generate_function = generate_function
            generate_function.compiled = plain[0]
            return plain[0](inputs, stop_token_ids=stop_token_ids)

        generate_function.compiled = function  # the `tf.function` it calls
        self.generate_function = generate_function
        return generate_function

    return make_generate_function


def install_if_loaded():
    """Wrap keras-hub's `CausalLM.make_generate_function` once keras-hub is
    loaded (called where variables are placed: cheap until then)."""
    wrap_when_loaded(wrap_make_generate_function)
