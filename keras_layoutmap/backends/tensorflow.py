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
"""

import contextlib
import contextvars
import functools
import os

import keras.src.backend as keras_backend
import numpy as np
import tensorflow as tf
from keras.src.backend import tensorflow as keras_tf
from keras.src.backend.tensorflow import core as keras_tf_core
from keras.src.backend.tensorflow import distribution_lib as keras_tf_distribution_lib
from keras.src.backend.tensorflow import random as keras_tf_random
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.models import model as keras_model
from tensorflow.experimental import dtensor

from keras_layoutmap.backends.tensorflow_processes import (  # noqa: F401
    MULTI_PROCESS,
    barrier,
    device_spec,
    gather_process_batches,
    global_device_count,
    join,
    local_ids,
    process_count,
    process_index,
    set_cpu_devices,
)

SHARDING = True
TRAINING = True
NOT_BUILT = None


def configure_virtual_devices(n):
    set_cpu_devices(n)


def list_devices():
    return [f"cpu:{i}" for i in range(global_device_count())]


def _device_id(name):
    return int(str(name).rpartition(":")[2])


def num_local_devices(mesh):
    local = set(local_ids())
    return sum(_device_id(d) in local for d in np.ravel(mesh.devices))


_DMESHES = {}


def _tf_device(name):
    kind, index = str(name).split(":")
    return f"{kind.upper()}:{index}"


def _dmesh(mesh):
    """The one `dtensor.Mesh` for meshes equal to `mesh` (same axes, sizes
    and devices), with a name of its own: DTensor keys compiled functions
    by mesh name, so meshes of other shapes must not share one."""
    from keras_layoutmap.mesh import _mesh_key

    key = _mesh_key(mesh)
    if key not in _DMESHES:
        dims = list(zip(mesh.axis_names, mesh.shape))
        name = f"klm_{len(_DMESHES)}"
        if process_count() == 1:
            _DMESHES[key] = dtensor.create_mesh(
                dims, devices=[_tf_device(d) for d in np.ravel(mesh.devices)],
                mesh_name=name)
        else:  # global ids; this client's devices among them
            ids = np.asarray([_device_id(d) for d in np.ravel(mesh.devices)])
            local = local_ids()
            mine = [i for i in ids if i in local]
            _DMESHES[key] = dtensor.Mesh(
                list(mesh.axis_names), ids.reshape(mesh.shape), mine,
                [device_spec(i - local[0]) for i in mine], mesh_name=name)
    return _DMESHES[key]


def _local_positions(mesh):
    """Positions (in mesh order) of the mesh devices this process holds."""
    if process_count() == 1:
        return list(range(mesh.size))
    local = set(local_ids())
    return [i for i, d in enumerate(np.ravel(mesh.devices))
            if _device_id(d) in local]


def _dlayout(layout):
    specs = [dtensor.UNSHARDED if a is None else a for a in layout.axes]
    return dtensor.Layout(specs, _dmesh(layout.mesh))


def _value(x):
    """A tensor for `x`: a Keras or tf variable's current value."""
    if isinstance(x, keras_tf_core.Variable):
        x = x.value
    if isinstance(x, tf.Variable):
        x = x.read_value()
    return x


def _is_dtensor(x):
    try:
        dtensor.fetch_layout(x)
        return True
    except Exception:
        return False


def fetch_layout(x):
    from keras_layoutmap.mesh import Mesh

    value = _value(x)
    if not tf.is_tensor(value):
        raise TypeError(
            "Expected a tf.Tensor, DTensor or keras.Variable. Received: "
            f"{type(x).__name__}"
        )
    if not _is_dtensor(value):
        device = tf.convert_to_tensor(value).device.split("device:")[-1].lower()
        rank = len(value.shape)
        return [None] * rank, Mesh((1,), ["device"], [device or "cpu:0"])
    layout = dtensor.fetch_layout(value)
    dmesh = layout.mesh
    if process_count() == 1:
        devices = [d.split("device:")[-1].lower() for d in dmesh.local_devices()]
    else:
        devices = [f"cpu:{i}" for i in np.ravel(dmesh.global_device_ids())]
    mesh = Mesh(dmesh.shape(), dmesh.dim_names, devices)
    axes = [None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs]
    return axes, mesh


def host_shards(array, layout):
    """The piece of host `array` each device of `layout.mesh` holds, in mesh
    device order (row-major over the mesh axes)."""
    mesh = layout.mesh
    shards = []
    for index in range(mesh.size):
        coords = dict(zip(mesh.axis_names, np.unravel_index(index, mesh.shape)))
        region = []
        for axis, size in zip(layout.axes, array.shape):
            if axis is None:
                region.append(slice(None))
            else:
                step = size // mesh.dim_size(axis)
                region.append(slice(coords[axis] * step, (coords[axis] + 1) * step))
        shards.append(array[tuple(region)])
    return shards


def distribute(x, layout):
    value = _value(x)
    if tf.is_tensor(value) and not tf.executing_eagerly() and not isinstance(
            value, tf.Variable):
        # Inside a tf.function every tensor is on the function's mesh.
        return dtensor.relayout(value, _dlayout(layout))
    if tf.is_tensor(value) and _is_dtensor(value):
        source = dtensor.fetch_layout(value)
        if source.mesh == _dmesh(layout.mesh):
            return dtensor.relayout(value, _dlayout(layout))
        if not source.is_fully_replicated():
            raise ValueError(
                f"Cannot move a tensor sharded as {source.sharding_specs} on "
                f"another mesh ({source.mesh.dim_names}, "
                f"{source.mesh.shape()}) onto {layout.mesh!r}; relayout it to "
                "replicated on its own mesh first."
            )
        # Replicated on another mesh (TensorFlow even caches small constants
        # such as zeros on the last mesh used): any one copy is the value.
        value = dtensor.unpack(value)[0]
    array = value.numpy() if tf.is_tensor(value) else np.asarray(value)
    shards = host_shards(array, layout)
    return pack([shards[i] for i in _local_positions(layout.mesh)], layout)


def pack(components, layout):
    return dtensor.pack([tf.convert_to_tensor(c) for c in components],
                        _dlayout(layout))


def unpack(x):
    value = _value(x)
    if not (tf.is_tensor(value) and _is_dtensor(value)):
        raise TypeError(
            "klm.unpack expects a tensor placed on a mesh (a DTensor) or a "
            f"keras.Variable made on one. Received: a plain {type(x).__name__}"
            f" of shape {tuple(getattr(value, 'shape', ()))}. Place it with "
            "klm.distribute(x, layout) or klm.pack(components, layout) first."
        )
    return dtensor.unpack(value)


def _check_inputs_on_mesh(model, inputs):
    """Refuse, before DTensor does, a plain tensor passed eagerly to a model
    whose variables live on a mesh: say what to do instead."""
    from keras.src import tree

    variables = model.variables
    if not variables or not _is_dtensor(variables[0]._value):
        return
    mesh = dtensor.fetch_layout(variables[0]._value).mesh
    for index, x in enumerate(tree.flatten(inputs)):
        if not isinstance(x, (np.ndarray, tf.Tensor)) or len(x.shape) == 0:
            continue
        if tf.is_tensor(x) and _is_dtensor(x):
            other = dtensor.fetch_layout(x).mesh
            if other != mesh:
                raise ValueError(
                    f"Model '{model.name}' has its variables on a mesh "
                    f"{dict(zip(mesh.dim_names, mesh.shape()))}, but input "
                    f"{index} is on another mesh "
                    f"{dict(zip(other.dim_names, other.shape()))}. Pack it "
                    "with a layout on the model's mesh."
                )
        else:
            raise ValueError(
                f"Model '{model.name}' has its variables on a mesh "
                f"{dict(zip(mesh.dim_names, mesh.shape()))}, but input {index} "
                f"is a plain {type(x).__name__} of shape {tuple(x.shape)}, "
                "not a tensor on that mesh. Place it first with "
                "klm.distribute(x, klm.Layout.batch_sharded(mesh, 'batch', "
                f"{len(x.shape)})) (or klm.pack one piece per device), or call "
                "model.predict(x), which packs batches for you."
            )


def _wrap_model_call(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        if tf.executing_eagerly():
            _check_inputs_on_mesh(self, args)
        return original(self, *args, **kwargs)

    return __call__


def _make_dvariable(variable, value, layout):
    with tf.init_scope():
        value = distribute(value, layout)
        return dtensor.DVariable(
            value, trainable=variable.trainable, name=variable.name,
            aggregation=variable._map_aggregation(variable.aggregation),
            synchronization=variable._map_synchronization(
                variable.synchronization),
        )


def relayout_variable(variable, layout):
    value = variable.value.read_value()
    if _is_dtensor(value) and dtensor.fetch_layout(value).mesh != _dmesh(
            layout.mesh):
        value = _to_host(value)  # from another mesh: through the host
    variable._layout = layout
    variable._value = _make_dvariable(variable, value, layout)


def unplace_variable(variable):
    """Bring a variable back to one device: a plain `tf.Variable` holding the
    gathered value, as if made with no distribution."""
    value = _to_host(variable.value.read_value())
    with tf.init_scope():
        variable._value = tf.Variable(
            value, dtype=variable._dtype, trainable=variable.trainable,
            name=variable.name,
            aggregation=variable._map_aggregation(variable.aggregation),
            synchronization=variable._map_synchronization(
                variable.synchronization),
        )
    variable._layout = None


def _wrap_initialize(original):
    def _initialize(self, value):
        if self._shape is None and not callable(value):
            # Keras sets the shape of a variable made from a value only
            # after `_initialize`; the layout needs it now.
            self._shape = self._validate_shape(tf.convert_to_tensor(value).shape)
        if getattr(self, "_layout", None) is None:
            from keras import distribution as keras_distribution

            dist = keras_distribution.distribution()
            if dist is not None:
                self._layout = dist.get_variable_layout(self)
        if self._layout is None or isinstance(value, tf.Variable):
            return original(self, value)
        from keras_layoutmap.layout import as_layout

        layout = as_layout(self._layout)
        if layout.mesh.size == 1:
            return original(self, value)  # one device: nothing to place
        if callable(value):
            with tf.init_scope():
                value = value()
        self._value = _make_dvariable(self, value, layout)

    return _initialize


def _wrap_direct_assign(original):
    def _direct_assign(self, value):
        if getattr(self, "_layout", None) is None or not _is_dtensor(self._value):
            return original(self, value)
        from keras_layoutmap.layout import as_layout

        value = tf.cast(value, self._value.dtype)
        if not _is_dtensor(value):
            value = distribute(value, as_layout(self._layout))
        self._value.assign(value)

    return _direct_assign


def _wrap_numpy(original):
    def numpy(self):
        if getattr(self, "_layout", None) is None or not _is_dtensor(self._value):
            return original(self)
        # A sharded DVariable has no single value on the host: gather it.
        return _to_host(self._value.read_value()).numpy()

    return numpy


def _wrap_convert_to_numpy(original):
    @functools.wraps(original)
    def convert_to_numpy(x):
        if isinstance(x, tf.Tensor) and _is_dtensor(x):
            x = _to_host(x)  # a sharded DTensor has no single host value
        return original(x)

    return convert_to_numpy


def _array(self, dtype=None, copy=None):
    array = np.asarray(self.numpy())
    return array if dtype is None else array.astype(dtype)


# Set while Keras' train / test / predict step runs on a mesh: random draws
# traced then are made whole. Nothing else is touched (a tf.data pipeline
# traced under a distribution, say, is no DTensor function).
_IN_MESH_STEP = contextvars.ContextVar("klm_in_mesh_step", default=False)


@contextlib.contextmanager
def _mesh_step():
    token = _IN_MESH_STEP.set(True)
    try:
        yield
    finally:
        _IN_MESH_STEP.reset(token)


def _traced_mesh():
    """The `dtensor.Mesh` random numbers are drawn for: the distribution's,
    while a step on it is being traced; None otherwise."""
    if not _IN_MESH_STEP.get() or tf.executing_eagerly():
        return None
    dist = _mesh_distribution()
    return None if dist is None else _dmesh(dist.device_mesh)


def _replicated(tensor, dmesh):
    return dtensor.relayout(tensor, dtensor.Layout.replicated(dmesh, tensor.shape.rank))


def _wrap_random(original):
    """DTensor draws a sharded random tensor shard by shard from per-device
    seeds: other numbers than one device draws. Draw it whole (replicated)
    instead; later ops shard it like any other tensor."""

    @functools.wraps(original)
    def draw(*args, **kwargs):
        dmesh = _traced_mesh()
        result = original(*args, **kwargs)
        return result if dmesh is None else _replicated(result, dmesh)

    return draw


def _wrap_dropout(original):
    @functools.wraps(original)
    def dropout(inputs, rate, noise_shape=None, seed=None):
        dmesh = _traced_mesh()
        if dmesh is None or rate in (0.0, 1.0):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        # tf.nn.experimental.stateless_dropout, op for op, with the noise
        # drawn whole.
        seed = keras_tf_random._cast_seed(keras_tf_random.draw_seed(seed))
        shape = keras_tf_random._get_concrete_noise_shape(inputs, noise_shape)
        noise = _replicated(
            tf.random.stateless_uniform(shape, seed=seed, dtype=inputs.dtype), dmesh)
        scaled = inputs * tf.convert_to_tensor(1 / (1 - rate), dtype=inputs.dtype)
        return tf.where(noise >= rate, scaled, tf.constant(0, dtype=inputs.dtype))

    return dropout


def _distribute_tensor(tensor, layout):
    """Keras' hook to relayout a layer output (`<layer>/output` rules)."""
    from keras_layoutmap.layout import as_layout

    return distribute(tensor, as_layout(layout))


def _mesh_distribution():
    """The active distribution if it spans more than one device."""
    from keras import distribution as keras_distribution

    dist = keras_distribution.distribution()
    mesh = getattr(dist, "device_mesh", None)
    if mesh is None or int(np.prod(mesh.shape)) == 1:
        return None
    return dist


def _pack_batch(data, dist):
    """`data` (a nest of host arrays or tensors) placed on the mesh: each
    leaf by the distribution's data layout for its shape. Leaves already on
    the distribution's mesh are left as they are."""
    from keras.src import tree

    from keras_layoutmap.data import distribute as checked_distribute
    from keras_layoutmap.layout import as_layout

    dmesh = _dmesh(dist.device_mesh)
    gather = process_count() > 1 and not dist.auto_shard_dataset

    def place(x):
        if x is None:
            return None
        if tf.is_tensor(x) and _is_dtensor(x):
            mesh = dtensor.fetch_layout(x).mesh
            if mesh != dmesh:
                raise ValueError(
                    "An input is a DTensor on another mesh "
                    f"{dict(zip(mesh.dim_names, mesh.shape()))} than the "
                    f"model's, {dist.device_mesh!r}. Pack inputs with a layout on the "
                    "model's mesh (klm.Layout.batch_sharded(mesh, ...)), or "
                    "pass host arrays and let the distribution pack them."
                )
            return x
        if isinstance(x, tf.Tensor):
            x = x.numpy()
        array = np.asarray(x)
        if gather:
            array = gather_process_batches(array)
        layout = as_layout(dist.get_data_layout(array.shape))
        return checked_distribute(array, layout)

    return tree.map_structure(place, data)


def _to_host(x):
    """A DTensor output as one plain tensor on the host (an all-gather if it
    is sharded); anything else as it is."""
    if not (tf.is_tensor(x) and _is_dtensor(x)):
        return x
    layout = dtensor.fetch_layout(x)
    if not layout.is_fully_replicated():
        x = dtensor.relayout(x, dtensor.Layout.replicated(layout.mesh, layout.rank))
    return tf.identity(dtensor.unpack(x)[0])


class _PackedBatches:
    """The batches of `iterator` packed onto the mesh of `dist`."""

    def __init__(self, iterator, dist):
        self._iterator = iter(iterator)
        self._dist = dist

    def __iter__(self):
        return self

    def __next__(self):
        try:
            data = next(self._iterator)
        except tf.errors.OutOfRangeError:
            raise StopIteration from None
        return _pack_batch(data, self._dist)


def _run_step(model, step, data):
    """`step(data)` on the mesh, with DTensor's layout errors made plain."""
    try:
        with _mesh_step():
            return step(data)
    except tf.errors.OpError as error:
        message = str(error)
        if "SPMD expansion" not in message:
            raise
        reason = message.split("error: ", 1)[-1].split("\n", 1)[0]
        raise ValueError(
            f"DTensor cannot run a step of model '{model.name}' with the "
            f"layouts it was given: {reason} TensorFlow runs only the "
            "combinations its SPMD expansion supports (JAX reshards instead); "
            "for a matmul, shard the contracting dimension of both operands on "
            "the same mesh axis, or on none. See the layouts with "
            "klm.explain(model)."
        ) from error


def _build_for_no_data(model, iterator):
    """Plain Keras traces its step even for empty data, which builds the
    compiled metrics and loss; build them from the data's spec instead, so
    `fit` / `evaluate` on empty data end as they do without a mesh."""
    spec = getattr(iterator, "element_spec", None)
    if spec is not None:
        model._symbolic_build(data_batch=spec)


def _wrap_make_function(original):
    def _make_function(self, step_function):
        keras_function = original(self, step_function)
        compiled = {}

        def function(iterator):
            dist = _mesh_distribution()
            if dist is None:
                return keras_function(iterator)
            if "step" not in compiled:
                # No XLA: DTensor expands the function to every device itself.
                compiled["step"] = (
                    step_function if self.run_eagerly
                    else tf.function(step_function, reduce_retracing=True))
            batches = _PackedBatches(iterator, dist)
            outputs = None
            for _ in range(self.steps_per_execution):
                try:
                    data = next(batches)
                except StopIteration:
                    if outputs is None:
                        _build_for_no_data(self, iterator)
                        raise
                    break
                outputs = _run_step(self, compiled["step"], data)
            return outputs

        return function

    return _make_function


def _wrap_make_predict_function(original):
    def make_predict_function(self, force=False):
        if self.predict_function is not None and not force:
            return self.predict_function
        original(self, force=force)
        keras_function = self.predict_function

        def predict_function(data):
            from keras.src import tree

            dist = _mesh_distribution()
            if dist is None:
                return keras_function(data)
            outputs = _run_step(self, keras_function,
                                [_pack_batch(d, dist) for d in data])
            return tree.map_structure(_to_host, outputs)

        self.predict_function = predict_function
        return predict_function

    return make_predict_function


def _wrap_export(original):
    """`model.export` of a model on a mesh: a SavedModel of plain variables
    holding the gathered weights, traced with no distribution, so that it
    serves plain tensors on any machine (DTensor is not in the graph)."""

    @functools.wraps(original)
    def export(self, *args, **kwargs):
        from keras import distribution as keras_distribution

        placed = [v for v in self.variables if _is_dtensor(v._value)]
        dist = keras_distribution.distribution()
        if not placed:
            return original(self, *args, **kwargs)
        dvariables = {id(v): v._value for v in placed}
        try:
            keras_distribution.set_distribution(None)
            for v in placed:
                with tf.init_scope():
                    v._value = tf.Variable(
                        _to_host(v._value.read_value()), trainable=v.trainable,
                        name=v.name)
            return original(self, *args, **kwargs)
        finally:
            for v in placed:
                v._value = dvariables[id(v)]
            keras_distribution.set_distribution(dist)

    return export


def _wrap_takes_host_data(original):
    """`fit` / `evaluate` / `predict` pack host data themselves; Keras' data
    adapters cannot read a DTensor, so say what to pass instead."""

    @functools.wraps(original)
    def method(self, x=None, *args, **kwargs):
        from keras.src import tree

        if isinstance(x, (tf.Tensor, dict, list, tuple)):
            for leaf in tree.flatten(x):
                if isinstance(leaf, tf.Tensor) and _is_dtensor(leaf):
                    raise ValueError(
                        f"model.{original.__name__} takes host data (numpy "
                        "arrays, tf.data, generators, PyDataset) and packs each "
                        "batch onto the mesh itself. Received a DTensor of "
                        f"shape {tuple(leaf.shape)}. Pass the host array, or "
                        "call the model (or your tf.function step) on the "
                        "packed tensor."
                    )
        return original(self, x, *args, **kwargs)

    return method


def install():
    # DTensor's pass that combines all-reduces moves the reduction of a
    # gradient past reads of other variables, ignoring the control edges of
    # their assigns: Adam then reads its moments before this step's update
    # and the first step is lost. Off unless the user chose otherwise.
    os.environ.setdefault("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", "0")

    # Keras' TensorFlow distribution module leaves this out ("DO NOT USE").
    keras_tf_distribution_lib.distribute_tensor = _distribute_tensor

    # Variables: made as DVariables, assigned, read back to the host.
    Variable = keras_tf_core.Variable
    Variable._initialize = _wrap_initialize_keeps_value_layout(
        _wrap_initialize(Variable._initialize))
    Variable._direct_assign = _wrap_direct_assign(Variable._direct_assign)
    Variable.numpy = _wrap_numpy(Variable.numpy)
    Variable.__array__ = _array
    convert_to_numpy = _wrap_convert_to_numpy(keras_tf_core.convert_to_numpy)
    for module in (keras_backend, keras_tf, keras_tf_core):
        module.convert_to_numpy = convert_to_numpy

    # Training: steps on the mesh, random draws made whole inside them.
    Trainer = keras_tf_trainer.TensorFlowTrainer
    Trainer._make_function = _wrap_make_function(Trainer._make_function)
    Trainer.make_predict_function = _wrap_make_predict_function(
        Trainer.make_predict_function)
    for name in ("fit", "evaluate", "predict"):
        setattr(Trainer, name, _wrap_takes_host_data(getattr(Trainer, name)))
    for name in ("normal", "uniform", "truncated_normal", "randint"):
        setattr(keras_tf_random, name, _wrap_random(getattr(keras_tf_random, name)))
    keras_tf_random.dropout = _wrap_dropout(keras_tf_random.dropout)

    # Models: inputs checked when called eagerly, exported without DTensor.
    keras_model.Model.export = _wrap_export(keras_model.Model.export)
    keras_model.Model.__call__ = _wrap_model_call(keras_model.Model.__call__)


def local_devices():
    """This process's devices (`"cpu:3"`, global ids), for
    `Mesh.local_devices()`."""
    return [f"cpu:{i}" for i in local_ids()]


def _wrap_initialize_keeps_value_layout(original):
    """`keras.Variable(value)` with `value` already a DTensor on a mesh and
    no distribution active keeps `value`'s layout (as JAX keeps a sharded
    array's), instead of becoming a one-device variable that DTensor later
    refuses to update."""

    def _initialize(self, value):
        from keras import distribution as keras_distribution

        if (getattr(self, "_layout", None) is None
                and keras_distribution.distribution() is None
                and tf.is_tensor(value) and not isinstance(value, tf.Variable)
                and _is_dtensor(value)):
            from keras_layoutmap.layout import Layout

            axes, mesh = fetch_layout(value)
            self._layout = Layout(axes, mesh)
        return original(self, value)

    return _initialize

