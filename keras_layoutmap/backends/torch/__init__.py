"""The PyTorch backend: `torch.distributed` places tensors and variables.

A mesh spans processes, one CPU device each (gloo): `processes` joins them,
`placement` turns meshes and layouts into `DeviceMesh` and DTensor
placements, `variables` makes Keras variables DTensor parameters (born
sharded by `initialization`), and `training` feeds DTensor batches to
Keras' own steps. This module is the backend interface (see
`keras_layoutmap/backends/__init__.py`) and `install()`.
"""

import logging

import keras

from keras_layoutmap.backends.torch import (
    attention,
    cache_updates,
    convolution,
    decoding,
    dtensor_rules,
    einsums,
    gradients,
    keras_distribution,
    local_step,
    lookups,
    mixed_inplace,
    placement,
    random_draws,
    reshapes,
    scalar_reads,
    training,
    variables,
    whole_batch,
    whole_fallbacks,
)
from keras_layoutmap.backends.torch import keras_internals as keras_torch
from keras_layoutmap.backends.torch.placement import (  # noqa: F401
    device_bytes,
    distribute,
    fetch_layout,
    is_on_mesh,
    pack,
    unpack,
)
from keras_layoutmap.backends.torch.processes import (  # noqa: F401
    MULTI_PROCESS,
    barrier,
    configure_virtual_devices,
    enter_together,
    gather_process_batches,
    join,
    list_devices,
    local_devices,
    num_local_devices,
    process_count,
    process_index,
)
from keras_layoutmap.backends.torch.variables import (  # noqa: F401
    relayout_variable,
    unplace_variable,
)
from keras_layoutmap.keras_internals import Model, distribution_module

SHARDING = True
TRAINING = True
NOT_BUILT = None


def after_place(model):
    """A model's variables moved: torch's list of its parameters follows."""
    training.retrack_parameters(model)


def install():
    # DTensor warns on every (Partial, Partial) -> Replicate gradient of a
    # 2-D mesh that it takes two all-reduces; each process takes them in the
    # same order, and the warning repeats every step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(
        logging.ERROR)
    # A number read from a DTensor is the whole value's (not the piece's).
    scalar_reads.install()
    # DTensor's rules that would run an op on pieces it cannot (a scan
    # along a split dim given as negative), read with their dims put right.
    dtensor_rules.install()
    # `plain += dtensor` (Keras' L1L2 regularizer) computed out of place.
    mixed_inplace.install()
    Variable = keras_torch.Variable
    Variable._initialize = variables.wrap_initialize(Variable._initialize)
    Variable._initialize_with_initializer = (
        variables.wrap_initialize_with_initializer(
            Variable._initialize_with_initializer))
    Variable._direct_assign = variables.wrap_direct_assign(Variable._direct_assign)
    if keras_torch.initialize_distributed is not None:  # Keras 3.16
        Variable._initialize_distributed = variables.keras_placement_off
    convert_to_numpy = placement.wrap_convert_to_numpy(
        keras_torch.convert_to_numpy)
    for module in keras_torch.CONVERT_TO_NUMPY_MODULES:
        module.convert_to_numpy = convert_to_numpy

    Trainer = keras_torch.Trainer
    for name, attribute in (("make_train_function", "train_function"),
                            ("make_test_function", "test_function"),
                            ("make_predict_function", "predict_function")):
        setattr(Trainer, name, training.wrap_make_function(
            getattr(Trainer, name), attribute))
    if keras_torch.initialize_ddp is not None:  # Keras 3.16
        Trainer._initialize_ddp = training.wrap_initialize_ddp(
            keras_torch.initialize_ddp)
    if keras_torch.reduces_metrics:  # Keras 3.16
        Trainer.get_metrics_result = training.wrap_get_metrics_result(
            Trainer.get_metrics_result, Trainer)
    Trainer.get_metrics_result = local_step.wrap_get_metrics_result(
        Trainer.get_metrics_result)
    Trainer.compute_loss = local_step.wrap_compute_loss(Trainer.compute_loss)
    Trainer.compute_metrics = local_step.wrap_compute_metrics(
        Trainer.compute_metrics)
    # 3.15's iterator already gives host batches; 3.16's places ModelParallel
    # ones itself.
    if keras_torch.TorchEpochIterator is not None:
        keras_torch.TorchEpochIterator._get_iterator = (
            training.wrap_epoch_iterator(
                keras_torch.TorchEpochIterator._get_iterator))
    if keras_torch.gather_non_batch_axes is not None:  # Keras 3.16
        keras_torch.trainer._gather_non_batch_axes = (
            training.wrap_gather_non_batch_axes(
                keras_torch.gather_non_batch_axes))
    if keras_torch.distribute_data is not None:  # Keras 3.16
        keras_torch.trainer._distribute_data = training.wrap_distribute_data(
            keras_torch.distribute_data)
    Model.__call__ = training.wrap_model_call(Model.__call__)
    keras_torch.random.dropout = random_draws.wrap_dropout(
        keras_torch.random.dropout)
    keras_torch.random.categorical = random_draws.wrap_categorical(
        keras_torch.random.categorical)
    distribution_module.distribution_lib = keras_distribution
    decoding.install_if_loaded()  # else when a variable is placed
    keras_torch.core.slice_update = cache_updates.wrap_slice_update(
        keras_torch.core.slice_update)
    keras_torch.numpy.take = lookups.wrap_take(keras_torch.numpy.take)
    keras_torch.numpy.einsum = einsums.wrap_einsum(keras_torch.numpy.einsum)
    keras_torch.numpy.matmul = reshapes.wrap_matmul(
        keras_torch.numpy.matmul, keras_torch.numpy.einsum)
    keras_torch.numpy.reshape = reshapes.wrap_reshape(keras_torch.numpy.reshape)
    keras_torch.nn.dot_product_attention = (
        attention.wrap_dot_product_attention(
            keras_torch.nn.dot_product_attention))
    # name: (kernel arguments, output channels may stay split, where
    # data_format stands after the kernels)
    for name, kernels, split, data_format in (
            ("conv", 1, True, 2), ("depthwise_conv", 1, False, 2),
            ("separable_conv", 2, False, 2), ("conv_transpose", 1, False, 3)):
        setattr(keras_torch.nn, name, convolution.wrap_convolution(
            getattr(keras_torch.nn, name), kernels, split, data_format))
    # name: where data_format stands after the input
    for name, data_format in (("max_pool", 3), ("average_pool", 3),
                              ("adaptive_max_pool", 1),
                              ("adaptive_average_pool", 1)):
        if hasattr(keras_torch.nn, name):
            setattr(keras_torch.nn, name, convolution.wrap_pooling(
                getattr(keras_torch.nn, name), data_format))
    Optimizer = keras_torch.TorchOptimizer
    Optimizer.apply = gradients.wrap_apply(Optimizer.apply)
    Optimizer.scale_loss = local_step.wrap_scale_loss(Optimizer.scale_loss)
    for outer in keras_torch.OUTER_OPTIMIZERS:
        outer.apply = gradients.wrap_outer_apply(outer.apply)
    # A batch the batch axis does not divide, through kernels split over it.
    Variable.value = whole_batch.wrap_value(Variable.value)
    for layer in (keras.layers.Dense, keras.layers.EinsumDense):
        layer.call = whole_batch.wrap_layer_call(layer.call)
    # Keras ops DTensor refuses (no rule, an in-place placement change) run
    # on whole tensors.
    whole_fallbacks.install(
        (keras_torch.numpy, keras_torch.math, keras_torch.nn,
         keras_torch.linalg), keras_torch.core)
    keras_torch.ops_nn._rms_normalization = whole_fallbacks.wrap_op(
        keras_torch.ops_nn._rms_normalization)
