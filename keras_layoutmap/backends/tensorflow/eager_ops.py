"""Keras ops called eagerly on DTensors: what DTensor refuses runs whole.

An eager TensorFlow op with a DTensor input runs on DTensor's device, which

- refuses every other input that is not a DTensor or a scalar ("got a
  regular tensor for input 1 ... but was expecting a DTensor"): so
  `keras.ops.add(y, labels)` with `y` a model's output on a mesh and
  `labels` a numpy array failed with that raw error, while JAX computes it
  and torch counts the plain tensor as replicated;
- has no rule for some ops on split tensors (`ops.split`, `ops.tile`,
  `ops.pad`, `ops.flip`, `ops.cumprod`, `ops.triu`, a strided slice, ...:
  "Spliting over sharded dimension is not supported", "Trying to copy a
  non-single-device and non-replicated DTensor").

Here a Keras op that DTensor refuses eagerly runs again: first with its
plain operands (numpy arrays, tensors of rank 1 or more) copied to its
DTensor operand's mesh, whole on every device (they must then hold the
same value on every process, as on torch: the global labels, a constant);
then, if DTensor still refuses, on plain tensors (each DTensor operand
gathered), its result copied to the mesh whole on every device: the
numbers are one device's. An op DTensor refuses has not run, and an op
that runs costs no check. Losses and mean metrics subtract with
TensorFlow's operators, which no Keras op wraps: their plain labels join
the mesh before they run.

Inside a `tf.function` DTensor's rule is that a function's inputs are all
DTensors or none (see docs/porting.md), and an op it has no rule for is an
error `fit` explains (`training`). A plain eager tensor that a Keras op
traced on a mesh reads (a layer's constant: `Normalization(mean=...,
variance=...)` holds its mean and variance so) would be captured as an
input of the function, and DTensor refused the step ("got a regular
tensor for input 2 ... but was expecting a DTensor"): traced inside a call
of a model whose variables are on a mesh, or in a `fit` / `evaluate` /
`predict` step on one, the op reads its copy whole on that mesh instead,
made once per tensor, outside the function (a `tf.data` map it is traced
in is left alone).
"""

import functools
import weakref

import numpy as np
import tensorflow as tf

from keras_layoutmap.backends.keras_ops import wrap_ops
from keras_layoutmap.backends.tensorflow.placement import (
    copy_whole_to_mesh,
    is_dtensor,
    mesh_of,
    to_host,
    value_of,
)
from keras_layoutmap.backends.tensorflow.training import traced_mesh

REFUSAL = "but was expecting a DTensor"  # DTensor's message, eagerly
# ... and the words of its refusals of an op's layouts.
REFUSALS = (REFUSAL, "DTensor", "SPMD", "sharded", "sharding")


def _mesh(value):
    """The `dtensor.Mesh` of `value` if it is a DTensor (or a variable
    holding one), else None. Eagerly only."""
    value = value_of(value)
    return mesh_of(value) if tf.is_tensor(value) else None


def _operands(args, kwargs):
    """The arguments and the items of argument lists (`concatenate`'s)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _plain(value):
    """Whether DTensor refuses `value` next to a DTensor: a numpy array or
    an eager tensor of rank 1 or more that is not a DTensor."""
    if isinstance(value, np.ndarray):
        return value.ndim > 0
    return (isinstance(value, tf.Tensor) and value.shape.rank not in (0, None)
            and not is_dtensor(value))


def _on_mesh(value, mesh):
    if isinstance(value, (list, tuple)) and any(_plain(v) for v in value):
        return type(value)(_on_mesh(v, mesh) for v in value)
    return copy_whole_to_mesh(value, mesh) if _plain(value) else value


def _host(value):
    """`value` (a DTensor, a Keras variable holding one) as one plain
    tensor (every process takes part in a split one's gather); anything
    else as it is."""
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return to_host(value_of(value))


def _replicated(value, mesh):
    if isinstance(value, (list, tuple)):
        return type(value)(_replicated(v, mesh) for v in value)
    return copy_whole_to_mesh(value, mesh) if tf.is_tensor(value) else value


def _refused(error):
    """Whether `error` is DTensor's refusal of an op's operands or layouts."""
    return isinstance(error, (tf.errors.UnimplementedError,
                              tf.errors.UnknownError,
                              tf.errors.InvalidArgumentError)) and any(
        word in str(error) for word in REFUSALS)


# id(a plain eager tensor) -> (a weak reference to it, {mesh: its copy}).
_COPIES = {}


def _captured(value):
    """Whether a `tf.function` being traced would capture `value` as a plain
    (not DTensor) input: an eager tensor of rank 1 or more."""
    return (isinstance(value, tf.Tensor) and not tf.is_symbolic_tensor(value)
            and value.shape.rank not in (0, None) and not is_dtensor(value))


def _copy_on_mesh(value, mesh):
    """`value` (a plain eager tensor) whole on every device of `mesh`, made
    eagerly once and kept while `value` lives."""
    key = id(value)
    entry = _COPIES.get(key)
    if entry is None or entry[0]() is not value:
        entry = (weakref.ref(value, lambda _: _COPIES.pop(key, None)), {})
        _COPIES[key] = entry
    copies = entry[1]
    if mesh not in copies:
        with tf.init_scope():
            copies[mesh] = copy_whole_to_mesh(value, mesh)
    return copies[mesh]


def _captured_on_mesh(value, mesh):
    if isinstance(value, (list, tuple)) and any(map(_captured, value)):
        return type(value)(_captured_on_mesh(v, mesh) for v in value)
    return _copy_on_mesh(value, mesh) if _captured(value) else value


def _in_traced_step(args, kwargs):
    """The mesh of the model (or the step) a `tf.function` is tracing on a
    mesh, where an operand is a plain eager tensor it would capture; else
    None."""
    if tf.executing_eagerly() or not any(map(_captured,
                                             _operands(args, kwargs))):
        return None
    return traced_mesh()


def wrap_op(original):
    """`original` (a Keras backend op) which, when DTensor refuses it
    eagerly, runs again with its plain operands on the mesh of its DTensor
    operand, then on plain tensors (its result whole on that mesh); traced
    on a mesh, reads the copies on the mesh of the plain eager tensors it
    would capture."""

    @functools.wraps(original)
    def op(*args, **kwargs):
        mesh = _in_traced_step(args, kwargs)
        if mesh is not None:
            args = tuple(_captured_on_mesh(a, mesh) for a in args)
            kwargs = {k: _captured_on_mesh(v, mesh) for k, v in kwargs.items()}
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        except tf.errors.OpError as e:
            if not (tf.executing_eagerly() and _refused(e)):
                raise
            mesh = next((m for m in map(_mesh, _operands(args, kwargs))
                         if m is not None), None)
            if mesh is None:
                raise
            plain_only = REFUSAL in str(e)
        if plain_only:
            try:
                return original(*(_on_mesh(a, mesh) for a in args),
                                **{k: _on_mesh(v, mesh)
                                   for k, v in kwargs.items()})
            except tf.errors.OpError as e:
                if not _refused(e):
                    raise
        out = original(*(_host(a) for a in args),
                       **{k: _host(v) for k, v in kwargs.items()})
        return _replicated(out, mesh)

    return op


def wrap_targets(original):
    """`original` (a loss's `__call__`, a metric's `update_state`) with
    plain operands copied to the mesh of a DTensor operand before it runs,
    eagerly: a loss subtracts with TensorFlow's operators, which no Keras
    op wraps."""

    @functools.wraps(original)
    def call(*args, **kwargs):
        if tf.executing_eagerly():
            operands = list(_operands(args, kwargs))
            mesh = next((m for m in map(_mesh, operands) if m is not None),
                        None)
            if mesh is not None:
                args = tuple(_on_mesh(a, mesh) for a in args)
                kwargs = {k: _on_mesh(v, mesh) for k, v in kwargs.items()}
        return original(*args, **kwargs)

    return call


def install(modules, core):
    """Wrap every public function defined in each of `modules` (Keras'
    TensorFlow `numpy`, `math`, `nn`, `linalg` ops) and core's `scatter`
    ops; and the losses' `__call__` and the mean metrics' `update_state`
    (labels against predictions)."""
    import keras

    keras.losses.Loss.__call__ = wrap_targets(keras.losses.Loss.__call__)
    MeanMetricWrapper = keras.metrics.MeanMetricWrapper
    MeanMetricWrapper.update_state = wrap_targets(
        MeanMetricWrapper.update_state)
    wrap_ops(wrap_op, modules, core)
