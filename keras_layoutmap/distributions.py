"""`DataParallel` and `ModelParallel`: Keras 3 distributions that apply a
`LayoutMap` by object path, honour layer `<weight>_layout=` kwargs and handle
a final short batch."""

import contextlib

import numpy as np
from keras import distribution as keras_distribution

from keras_layoutmap import backends, strict
from keras_layoutmap.keras_internals import KerasDistribution as _KerasDistribution
from keras_layoutmap.layout import Layout
from keras_layoutmap.mesh import as_mesh, list_devices
from keras_layoutmap.rules.config import synced_from_keras
from keras_layoutmap.rules.resolve import creating_layer, resolve_weight, weight_keys
from keras_layoutmap.rules.rule_map import RuleMap


def distribution():
    """The current distribution (`keras.distribution.distribution()`)."""
    return keras_distribution.distribution()


def set_distribution(value):
    """Make `value` the global distribution (None to clear it)."""
    keras_distribution.set_distribution(value)


class _Resolving:
    """What `klm` distributions share: layouts from kwargs, then rules, then
    replicated; and a data layout that survives a short final batch."""

    layout_map = None

    def scope(self):
        """Make this distribution current (a context manager).

        On a backend that cannot place tensors yet, only a one-device mesh
        (where there is nothing to place) is accepted.
        """
        backend = backends.get()
        if not backend.SHARDING and self.device_mesh.size > 1:
            raise NotImplementedError(backend.NOT_BUILT)
        # A strict map checks the models made inside as the scope exits.
        return strict.checked_scope(self.layout_map, super().scope())

    def check_mesh(self):
        """Refuse, on every process alike (so none waits for another), a
        mesh that leaves out devices when the run spans processes: each
        process feeds its own devices' rows of every batch and takes part
        in every step, so the mesh must hold every device of every process.
        In one process a mesh over some devices, in any order, is fine."""
        backend = backends.get()
        if not backend.SHARDING or backend.process_count() < 2:
            return
        everywhere = list_devices()
        used = {str(d) for d in np.ravel(self.device_mesh.devices)}
        missing = [d for d in everywhere if d not in used]
        if missing:
            raise ValueError(
                f"{type(self).__name__} on a mesh of {self.device_mesh.size} "
                f"devices, but this run spans {backend.process_count()} "
                f"processes with {len(everywhere)} devices: across processes "
                "a distribution's mesh must use every device of every process"
                f" (it leaves out {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                "). Build the mesh over all of `klm.list_devices()` (the "
                "default of `klm.create_mesh`)."
            )

    # Keras' own multi-process data handling (tf.data only, sharded per
    # process by Keras) is replaced by the backend's: with
    # `auto_shard_dataset=True` every process passes the same global data
    # and feeds its own devices' rows of each batch; with False, each passes
    # its own slice.
    @property
    def _is_multi_process(self):
        return False

    @_is_multi_process.setter
    def _is_multi_process(self, value):
        pass

    def distribute_dataset(self, dataset):
        return dataset

    # Keras 3.16's data adapters deal whole batches out to the processes
    # (batch i to process i mod n) when `auto_shard_dataset` is set; here
    # every process reads every batch, as above, and the backend splits the
    # rows: one shard.
    @property
    def num_data_shards(self):
        return 1

    @property
    def data_shard_id(self):
        return 0

    def resolve_variable(self, variable):
        """`(source, layout)` for a variable about to be created."""
        object_path, path = weight_keys(variable)
        return resolve_weight(
            owner=creating_layer(),
            name=variable.name,
            shape=tuple(variable.shape),
            object_path=object_path,
            path=path,
            layout_map=self.layout_map,
            mesh=self.device_mesh,
            dtype=variable.dtype,
        )

    def get_variable_layout(self, variable):
        if getattr(variable, "_layout", None) is not None:
            return variable._layout
        source, layout = self.resolve_variable(variable)
        if source is None and creating_layer() is not None:
            # A layer is creating it: no memory is allocated yet.
            strict.refuse_at_creation(self.layout_map, variable, layout,
                                      weight_keys(variable)[0])
        variable._klm_rule = source
        if source is not None and self.layout_map is not None:
            self.layout_map.note_placed(source)
        return layout

    def get_data_layout(self, data_shape):
        """Shard dimension 0 over the batch axis; a batch the axis does not
        divide (the short last batch) is replicated instead, so it trains on
        every device exactly as on one."""
        specs = [None] * len(data_shape)
        if data_shape:
            n = self.device_mesh.dim_size(self.batch_dim_name)
            if data_shape[0] is None or int(data_shape[0]) % n == 0:
                specs[0] = self.batch_dim_name
        return Layout(specs, self.device_mesh)


class DataParallel(_Resolving, keras_distribution.DataParallel):
    """Replicate every weight, split every batch over the mesh's batch axis.

    Layer `<weight>_layout=` kwargs still apply. A final batch that the batch
    axis does not divide is computed whole on every device (no crash, nothing
    dropped or counted twice).

    Example:

    >>> import keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", 1)],
    ...     devices=klm.list_devices()[:1])
    >>> klm.DataParallel(mesh).batch_dim_name
    'batch'
    """

    def __init__(self, device_mesh=None, devices=None, auto_shard_dataset=True,
                 batch_dim_name=None):
        if device_mesh is None:
            super().__init__(devices=devices, auto_shard_dataset=auto_shard_dataset)
            self._device_mesh = as_mesh(self._device_mesh)
            return
        # On a mesh of several axes, shard data over `batch_dim_name`
        # ("batch" if the mesh has it, else its first axis) and replicate
        # the weights over all axes.
        mesh = as_mesh(device_mesh)
        names = list(mesh.axis_names)
        if batch_dim_name is None:
            batch_dim_name = "batch" if "batch" in names else names[0]
        if batch_dim_name not in names:
            raise ValueError(
                f"batch_dim_name {batch_dim_name!r} is not an axis of {mesh!r}."
            )
        _KerasDistribution.__init__(
            self, mesh, batch_dim_name, auto_shard_dataset
        )

    @property
    def num_model_replicas(self):
        return self.device_mesh.dim_size(self.batch_dim_name)


class ModelParallel(_Resolving, keras_distribution.ModelParallel):
    """Shard weights by a `klm.LayoutMap`, split batches over `batch_dim_name`.

    Rules match a weight's object path or its `variable.path`; the first rule
    in insertion order wins. Equivalent to `with layout_map.scope():`.

    Example:

    >>> import keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", 1), ("model", 1)],
    ...     devices=klm.list_devices()[:1])
    >>> layout_map = klm.LayoutMap(mesh)
    >>> layout_map[".*kernel"] = (None, "model")
    >>> klm.ModelParallel(layout_map=layout_map).batch_dim_name
    'batch'
    """

    def __init__(self, *, layout_map=None, batch_dim_name=None,
                 auto_shard_dataset=True, **kwargs):
        if layout_map is not None and not isinstance(layout_map, RuleMap):
            if isinstance(layout_map, keras_distribution.LayoutMap):
                # Read live: a rule added to the Keras map later applies.
                self.__dict__["_klm_keras_map"] = layout_map
                layout_map = synced_from_keras(RuleMap, self, layout_map)
            else:
                raise TypeError(
                    "`layout_map` must be a `klm.LayoutMap`. Received: "
                    f"{layout_map!r} of type {type(layout_map).__name__}"
                )
        if layout_map is not None and layout_map.device_mesh is None:
            raise ValueError("The LayoutMap has no mesh; pass `mesh=` to it.")
        mesh = layout_map.device_mesh if layout_map is not None else None
        if batch_dim_name is None and mesh is not None:
            names = list(mesh.axis_names)
            batch_dim_name = "batch" if "batch" in names else names[0]
        if mesh is not None and batch_dim_name not in mesh.axis_names:
            raise ValueError(
                f"batch_dim_name {batch_dim_name!r} is not an axis of "
                f"{mesh!r}."
            )
        super().__init__(
            layout_map=layout_map,
            batch_dim_name=batch_dim_name,
            auto_shard_dataset=auto_shard_dataset,
            **kwargs,
        )
        self.layout_map = layout_map

    @property
    def layout_map(self):
        """The rules: the `klm.LayoutMap` given, or those of the
        `keras.distribution.LayoutMap` given, as it stands now."""
        keras_map = self.__dict__.get("_klm_keras_map")
        if keras_map is not None:
            return synced_from_keras(RuleMap, self, keras_map)
        return self.__dict__.get("_klm_layout_map")

    @layout_map.setter
    def layout_map(self, value):
        if self.__dict__.get("_klm_keras_map") is None:
            self.__dict__["_klm_layout_map"] = value

    def get_tensor_layout(self, path):
        """The layout of the tensor Keras names `path`: a layer's output,
        `"<layer path>/output"` (e.g. `seq/d1/output`; a Functional model's
        layers have no model prefix: `d1/output`). A rule matches the path,
        or the path under the outermost model (`d1/output`, as weights are
        matched by their object path). The layout carries the path and the
        rule, for `keras_classes` to fit it to the output's shape."""
        keys = [path]
        parts = path.split("/")
        if len(parts) >= 3:
            keys.append("/".join(parts[1:]))
        rule, layout = self.layout_map.match(*keys)
        if layout is None:
            return None
        layout = Layout(layout.sharding_specs, layout.mesh)
        layout._klm_output = (path, rule, self.batch_dim_name)
        return layout


def replicated_on(mesh):
    """A `DataParallel` on `mesh`: what `mesh=` arguments create state with."""
    return DataParallel(device_mesh=mesh)


@contextlib.contextmanager
def mesh_scope(mesh):
    """Run under a replicated distribution on `mesh`, unless one is active."""
    if mesh is None or distribution() is not None:
        yield
        return
    with replicated_on(mesh).scope():
        yield
