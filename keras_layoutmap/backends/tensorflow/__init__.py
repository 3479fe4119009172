"""The TensorFlow backend: `tf.experimental.dtensor` places tensors and
variables on the mesh.

Meshes and layouts become `dtensor.Mesh` / `dtensor.Layout`; every Keras
variable created under a distribution (or with a layout) is a
`dtensor.DVariable` with its layout. `model.fit` / `evaluate` / `predict`
(and the `*_on_batch` methods) pack each batch onto the mesh by the
distribution's data layout for that batch's shape, run Keras' own step in a
`tf.function` that DTensor expands to every device, and bring predictions
back to the host. DTensor computes on global tensors, so a loss or a metric
is that of one device: nothing is divided by a replica count.

One concern a module: `placement` (meshes, layouts, tensors, host reads),
`variables` (DVariables), `training` (the trainer hooks), `random_draws`
(random numbers inside a step), `export`, `processes` (DTensor
multi-client), `keras_distribution` (what `keras.distribution` asks of
the backend: every process's devices), `slice_updates` / `einsum` /
`arg_reductions` (keras-hub's `generate()` on a mesh), `decoding` (its
weights gathered once per call), `quantized_matmul` /
`quantized_lookup` / `quantized_float8` (quantized layers on a mesh),
`eager_ops` (Keras ops DTensor refuses eagerly run whole), `relayouts`
(DTensor's relayouts kept off its all-to-all, which misplaces values),
`unsplit_axes` (ops DTensor computes wrongly along a split axis, a
`Concatenate`'s, that axis gathered first), `time_distributed` and
`dynamic_slices` (layers whose slices DTensor lays out or computes
wrongly: `TimeDistributed`, `RandomCrop`).
This module is the backend interface (see `keras_layoutmap/backends/__init__.py`)
and `install()`.
"""

import os

import keras

from keras_layoutmap.backends.tensorflow import (
    arg_reductions,
    decoding,
    dynamic_slices,
    eager_ops,
    einsum,
    export,
    gather,
    keras_distribution,
    placement,
    quantized_float8,
    quantized_lookup,
    quantized_matmul,
    random_draws,
    relayouts,
    slice_updates,
    sparse_updates,
    time_distributed,
    training,
    unsplit_axes,
)
from keras_layoutmap.backends.tensorflow import keras_internals as keras_tf
from keras_layoutmap.backends.tensorflow import variables as dvariables
from keras_layoutmap.backends.tensorflow.handshakes import (  # noqa: F401
    enter_together,
)
from keras_layoutmap.backends.tensorflow.placement import (  # noqa: F401
    configure_virtual_devices,
    device_bytes,
    distribute,
    fetch_layout,
    is_on_mesh,
    list_devices,
    local_devices,
    num_local_devices,
    pack,
    unpack,
)
from keras_layoutmap.backends.tensorflow.processes import (  # noqa: F401
    MULTI_PROCESS,
    barrier,
    gather_process_batches,
    join,
    process_count,
    process_index,
)
from keras_layoutmap.backends.tensorflow.variables import (  # noqa: F401
    relayout_variable,
    unplace_variable,
)
from keras_layoutmap.keras_internals import Model

SHARDING = True
TRAINING = True
NOT_BUILT = None


def install():
    # DTensor's pass that combines all-reduces moves the reduction of a
    # gradient past reads of other variables, ignoring the control edges of
    # their assigns: Adam then reads its moments before this step's update
    # and the first step is lost. Off unless the user chose otherwise.
    os.environ.setdefault("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", "0")
    # ... and its relayouts without all-to-all (see `relayouts`).
    relayouts.install()

    # Keras' TensorFlow distribution module leaves this out ("DO NOT USE").
    keras_tf.distribution_lib.distribute_tensor = placement.distribute_tensor_hook
    # ... and lists each process's devices under the same names: the run's
    # devices, every process's once, as `klm.list_devices()`.
    keras_distribution.install(keras_tf.distribution_lib)

    # Variables: made as DVariables, assigned, read back to the host.
    Variable = keras_tf.Variable
    Variable._initialize = dvariables.wrap_initialize_keeps_value_layout(
        dvariables.wrap_initialize(Variable._initialize))
    Variable._direct_assign = dvariables.wrap_direct_assign(Variable._direct_assign)
    Variable.numpy = dvariables.wrap_numpy(Variable.numpy)
    Variable.__array__ = dvariables.variable_array
    convert_to_numpy = dvariables.wrap_convert_to_numpy(keras_tf.convert_to_numpy)
    for module in keras_tf.CONVERT_TO_NUMPY_MODULES:
        module.convert_to_numpy = convert_to_numpy

    # Training: steps on the mesh, random draws made whole inside them.
    Trainer = keras_tf.Trainer
    Trainer._make_function = training.wrap_make_function(Trainer._make_function)
    Trainer.make_predict_function = training.wrap_make_predict_function(
        Trainer.make_predict_function)
    for name in ("fit", "evaluate", "predict"):
        setattr(Trainer, name, training.wrap_takes_host_data(getattr(Trainer, name)))
    for name in ("normal", "uniform", "truncated_normal", "randint"):
        setattr(keras_tf.random, name,
                random_draws.wrap_random(getattr(keras_tf.random, name)))
    keras_tf.random.dropout = random_draws.wrap_dropout(keras_tf.random.dropout)
    keras_tf.random.categorical = random_draws.wrap_categorical(
        keras_tf.random.categorical)
    Optimizer = keras_tf.TFOptimizer
    for name in ("assign_add", "assign_sub"):  # an embedding's sparse update
        setattr(Optimizer, name, sparse_updates.wrap_sparse_update(
            getattr(Optimizer, name)))

    # Models: inputs checked when called eagerly, exported without DTensor.
    Model.export = export.wrap_export(Model.export)
    # keras-hub's generate(): the KV cache and token updates on a mesh.
    keras_tf.core.slice_update = slice_updates.wrap_slice_update(
        keras_tf.core.slice_update)
    # ... its weights split over the prompts' axis gathered once per call.
    decoding.install_if_loaded()  # else when a variable is placed
    # ... the greedy sampler's argmax of logits laid out unlike its output.
    keras_tf.numpy.argmax = arg_reductions.wrap_argmax(keras_tf.numpy.argmax)
    keras_tf.numpy.argmin = arg_reductions.wrap_argmin(keras_tf.numpy.argmin)
    # ... and a mixture of experts' router's top_k.
    keras_tf.math.top_k = arg_reductions.wrap_top_k(keras_tf.math.top_k)
    # ... and attention's einsums, which Keras rewrites into transposes
    # DTensor cannot lay out (the KV cache against a split query).
    keras_tf.numpy.einsum = einsum.wrap_einsum(keras_tf.numpy.einsum)
    # Quantized int8 layers: int8 x int8 -> int32 as ops DTensor lays out.
    keras_tf.numpy.matmul = quantized_matmul.wrap_matmul(keras_tf.numpy.matmul)
    keras_tf.numpy.einsum = quantized_matmul.wrap_einsum(keras_tf.numpy.einsum)
    # ... and int4 tables' packed rows, looked up before they are unpacked.
    keras_tf.numpy.take = quantized_lookup.wrap_take(keras_tf.numpy.take)
    # ... and float8's amax histories, rolled each step.
    keras_tf.numpy.roll = quantized_float8.wrap_roll(keras_tf.numpy.roll)
    for module in keras_tf.FLOAT8_QDQ_MODULES:
        module.quantize_and_dequantize = (
            quantized_float8.wrap_quantize_and_dequantize(
                module.quantize_and_dequantize))
    # Ops DTensor computes wrongly along a split axis (a Concatenate read
    # by a head split over its rows): that axis gathered first.
    unsplit_axes.install(keras_tf.numpy)
    # ... and TimeDistributed's steps, read without moving the batch's rows.
    time_distributed.install()
    # ... and RandomCrop's crop, whose offsets the step draws.
    dynamic_slices.install()
    Model.__call__ = training.wrap_model_call(Model.__call__)
    # Eager ops DTensor refuses: again with plain operands on the mesh, then
    # on the gathered values.
    eager_ops.install(
        (keras_tf.numpy, keras_tf.math, keras_tf.nn, keras_tf.linalg),
        keras_tf.core)

    # FSDP: weights sharded over the data axis gathered while a model computes.
    Variable.value = gather.wrap_value(Variable.value)
    Variable.handle = property(gather.handle)
    Model.__call__ = gather.wrap_model_call(Model.__call__)
    # ... and while a Dense or EinsumDense whose kernel is sharded over the
    # batch axis computes (keras-hub's recipes store kernels so).
    # A quantized layer runs `quantized_call` in place of `call`.
    for layer in (keras.layers.Dense, keras.layers.EinsumDense):
        layer.call = gather.wrap_dense_call(layer.call)
        layer.quantized_call = gather.wrap_dense_call(layer.quantized_call)


