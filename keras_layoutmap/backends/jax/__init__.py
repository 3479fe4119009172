"""The JAX backend: `keras.distribution` on `jax.sharding` does the work.

One concern a module: `placement` (devices, meshes, layouts, tensors,
variables, host reads), `initialization` (weights born sharded),
`training` (the trainer hooks), `processes` (`jax.distributed`),
`handshakes` (saves called on some processes only) and `writer_transfers`
(one-file saves streamed to process 0). This
module is the backend interface (see `keras_layoutmap/backends/__init__.py`)
and `install()`.
"""

from keras_layoutmap.backends.jax import (
    convolution,
    initialization,
    placement,
    training,
)
from keras_layoutmap.backends.jax import keras_internals as keras_jax
from keras_layoutmap.backends.jax.handshakes import enter_together  # noqa: F401
from keras_layoutmap.backends.jax.placement import (  # noqa: F401
    configure_virtual_devices,
    device_bytes,
    distribute,
    fetch_layout,
    is_on_mesh,
    list_devices,
    local_devices,
    num_local_devices,
    pack,
    relayout_variable,
    unpack,
    unplace_variable,
)
from keras_layoutmap.backends.jax.processes import (  # noqa: F401
    MULTI_PROCESS,
    barrier,
    gather_process_batches,
    join,
    join_detected,
    process_count,
    process_index,
)

SHARDING = True  # tensors and variables on a mesh
TRAINING = True  # model.fit & co. on a mesh
NOT_BUILT = None


def install():
    Trainer = keras_jax.Trainer
    training.install_iterator(keras_jax.EpochIterator)
    keras_jax.trainer._distribute_data = training.wrap_distribute_data(
        keras_jax.distribute_data)
    Trainer.make_predict_function = training.wrap_make_predict_function(
        Trainer.make_predict_function)
    # Values read on the host (get_weights, save_weights, callbacks) are
    # gathered when the mesh spans processes.
    convert_to_numpy = placement.wrap_convert_to_numpy(keras_jax.convert_to_numpy)
    for module in keras_jax.CONVERT_TO_NUMPY_MODULES:
        module.convert_to_numpy = convert_to_numpy
    keras_jax.Variable.__array__ = placement.variable_array
    JaxVariable = keras_jax.JaxVariable
    JaxVariable._initialize = placement.wrap_initialize_keeps_value_layout(
        JaxVariable._initialize)
    # Values assigned on a mesh that spans processes: each process places
    # its own pieces (no gather of the whole value from every process).
    keras_jax.distribution_lib.distribute_tensor = (
        placement.wrap_distribute_tensor(
            keras_jax.distribution_lib.distribute_tensor))
    for cls in {JaxVariable, keras_jax.Variable}:
        if "_direct_assign" in vars(cls):
            cls._direct_assign = placement.wrap_direct_assign(
                cls._direct_assign)
    # Convolutions run device by device on a mesh (XLA partitions some of
    # them wrongly).
    convolution.install(keras_jax.nn)
    # Weights made under a distribution are born sharded.
    JaxVariable._initialize_with_initializer = (
        initialization.wrap_initialize_with_initializer(
            JaxVariable._initialize_with_initializer))
