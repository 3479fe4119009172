"""The JAX backend's Keras internals (see `keras_layoutmap.keras_internals`).

3.15 -> 3.16: `keras.src.backend.jax.core` became `...jax.ops.core`;
`JaxVariable` became `Variable` (an NNX subclass `Variable` on top of it
when NNX is on, with `JaxVariable` kept for the base); `JAXTrainer` became
`Trainer`; `JAXEpochIterator._get_distributed_iterator` is gone: 3.16's
`_get_iterator` computes a data layout per batch (the short last batch
works) through the module function `_distribute_data`, which gained
`is_super_batch`.
"""

from keras_layoutmap.keras_internals import modules_holding, optional, private

core = private("keras.src.backend.jax.ops.core", "keras.src.backend.jax.core")
# The class every JAX variable is (the NNX one when NNX is on).
Variable = core.Variable
# The base class that makes and initializes a variable's value.
JaxVariable = getattr(core, "JaxVariable", core.Variable)
convert_to_numpy = core.convert_to_numpy
# Where Keras looks `convert_to_numpy` up: a wrapper goes on each.
CONVERT_TO_NUMPY_MODULES = modules_holding(
    "convert_to_numpy",
    "keras.src.backend",  # 3.15
    "keras.src.backend.jax",  # 3.15
    "keras.src.backend.jax.ops",  # 3.16
    core.__name__,
)

trainer = private("keras.src.backend.jax.trainer")
Trainer = private("keras.src.backend.jax.trainer:Trainer",
                  "keras.src.backend.jax.trainer:JAXTrainer")
EpochIterator = private("keras.src.backend.jax.trainer:JAXEpochIterator")
# `_distribute_data(data, layouts=None[, is_super_batch=False])`.
distribute_data = private("keras.src.backend.jax.trainer:_distribute_data")
# 3.15 only: the per-distribution iterator we replace. On 3.16 the hook is
# `EpochIterator._get_iterator` (None here).
get_distributed_iterator = optional(
    "keras.src.backend.jax.trainer:JAXEpochIterator._get_distributed_iterator")

# `conv`, `depthwise_conv` (and `separable_conv`, which calls both).
nn = private("keras.src.backend.jax.ops.nn", "keras.src.backend.jax.nn")
random = private("keras.src.backend.jax.random")
jax_draw_seed = private("keras.src.backend.jax.random:jax_draw_seed")
distribution_lib = private("keras.src.backend.jax.distribution_lib")
