"""`fit` / `evaluate` / `predict` (and the `*_on_batch` methods) on a mesh.

Each batch becomes DTensors by the distribution's data layout for that
batch's shape, Keras' own step runs on them (DTensor inserts the
collectives; a model whose weights are all replicated runs its layers on
each process's rows instead: `local_pieces`, and where its loss is a mean
over rows and its metrics sums, all of Keras' training step does, with one
all-reduce: `local_step`), gradients are laid out like
their weights before the optimizer applies them (`gradients`), and what a
step returns (metrics, predictions) comes back whole to every process.

Across processes, `auto_shard_dataset=True` means every process passes the
same global data (each keeps its own rows); with `False` each passes its
own slice and the slices are gathered into the global batch first.
"""

import functools
import weakref

from keras import distribution as keras_distribution
from keras import tree
from torch.distributed.tensor import DTensor

from keras_layoutmap.backends.torch import (
    local_pieces,
    local_step,
    local_step_conditions,
    processes,
)
from keras_layoutmap.backends.torch.keras_internals import convert_to_tensor
from keras_layoutmap.backends.torch.placement import (
    describe_mesh,
    local_slices,
    placements,
    sums_taken,
    to_device_mesh,
    to_host,
    to_layout,
)
from keras_layoutmap.layout import as_layout


def check_mesh(x, device_mesh, whose):
    """A DTensor input must be on `device_mesh`."""
    if x.device_mesh != device_mesh:
        raise ValueError(
            f"An input is a DTensor on another mesh {describe_mesh(x.device_mesh)} "
            f"than {whose}, {describe_mesh(device_mesh)}. Place inputs with a "
            "layout on that mesh (klm.distribute(x, klm.Layout.batch_sharded("
            "mesh, 'batch', rank))), or pass host data and let the "
            "distribution place it."
        )


_IN_STEP = [False]  # set while a step made by wrap_make_function runs


def _reduced(x):
    """A model's output with its pending sums taken (a row-sharded last
    layer leaves `Partial` placements): a value, as on JAX and TF."""
    return sums_taken(x) if isinstance(x, DTensor) else x


def wrap_model_call(original):
    """A model on a mesh called on a DTensor from another mesh: a clear
    error, not DTensor's cross-mesh failure deep inside a layer."""

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        # Inside fit & co. the batches were placed (and checked) already.
        inputs = [] if _IN_STEP[0] else [
            x for x in tree.flatten((args, kwargs)) if isinstance(x, DTensor)]
        if inputs:
            mesh = next((v._value.device_mesh for v in self.variables
                         if isinstance(getattr(v, "_value", None), DTensor)), None)
            if mesh is not None:
                for x in inputs:
                    check_mesh(x, mesh, f"model {self.name!r}'s variables")
        outputs = local_pieces.run_model_call(self, original, args, kwargs)
        if outputs is not local_pieces.NOT_LOCAL:
            return outputs
        return tree.map_structure(_reduced, original(self, *args, **kwargs))

    return __call__


def _mesh_distribution():
    dist = keras_distribution.distribution()
    if dist is None or dist.device_mesh is None or dist.device_mesh.size <= 1:
        return None
    return dist


def distribute_batch(data, dist):
    """Every tensor of a batch as a DTensor with the distribution's data
    layout for its shape."""
    gather = (processes.process_count() > 1
              and not getattr(dist, "auto_shard_dataset", True))

    def place(x):
        if x is None:
            return x
        if isinstance(x, DTensor):
            check_mesh(x, to_device_mesh(dist.device_mesh), "the distribution's")
            return x
        x = convert_to_tensor(x)
        if gather:
            x = processes.all_gather_rows(x)
        layout = dist.get_data_layout(tuple(x.shape))
        return to_layout(x, as_layout(layout))

    return tree.map_structure(place, data)


_DATA_PLACEMENTS = weakref.WeakKeyDictionary()  # distribution -> {shape: ...}


def _data_placement(dist, shape):
    """(DeviceMesh, placements, this process's slice) of a batch tensor of
    `shape` by the distribution's data layout (kept per shape)."""
    found = _DATA_PLACEMENTS.setdefault(dist, {})
    if shape not in found:
        layout = as_layout(dist.get_data_layout(shape))
        device_mesh = to_device_mesh(layout.mesh)
        places = placements(layout)
        found[shape] = (device_mesh, places,
                        local_slices(shape, device_mesh, places))
    return found[shape]


def batch_pieces(data, dist):
    """A batch as `local_step.Piece`s: each tensor's rows for this process
    by the distribution's data layout, with no DTensor made (a DTensor
    input gives its local piece); None where the slices must be gathered
    first (`auto_shard_dataset=False` across processes)."""
    if processes.process_count() > 1 and not getattr(
            dist, "auto_shard_dataset", True):
        return own_rows_pieces(data, dist)

    def piece(x):
        if x is None:
            return x
        if isinstance(x, DTensor):
            check_mesh(x, to_device_mesh(dist.device_mesh), "the distribution's")
            return local_step.Piece.of(x)
        x = convert_to_tensor(x)
        shape = tuple(x.shape)
        device_mesh, places, slices = _data_placement(dist, shape)
        return local_step.Piece(x[slices], shape, x.dtype, places, device_mesh)

    if type(data) is tuple and not any(
            isinstance(x, (tuple, list, dict)) for x in data):
        return tuple(piece(x) for x in data)  # as tree.map_structure, faster
    return tree.map_structure(piece, data)


def own_rows_pieces(data, dist):
    """A batch each process passed its own rows of (`auto_shard_dataset=
    False`) as `local_step.Piece`s, none gathered, when its rows are
    already where the data layout puts them: the processes' rows side by
    side in rank order are the global batch, and each process's devices
    hold exactly its own rows (a batch axis over the processes, in rank
    order, that splits the batch as the processes did). One all-gather of
    the row counts decides, alike on every process; None where the rows
    must be gathered first (a model axis across processes, uneven shares,
    a DTensor input, a short last batch the batch axis does not divide)."""
    leaves = [x for x in tree.flatten(data) if x is not None]
    rows = int(leaves[0].shape[0]) if leaves and len(leaves[0].shape) else -1
    if any(isinstance(x, DTensor) or not len(x.shape)
           or int(x.shape[0]) != rows for x in leaves):
        rows = -1
    counts = tuple(c for (c,) in processes.all_gather_ints((rows,)))
    if min(counts) < 0:
        return None
    placed = {}

    def piece(x):
        if x is None:
            return x
        x = convert_to_tensor(x)
        shape = (sum(counts), *x.shape[1:])
        device_mesh, places, _ = _data_placement(dist, shape)
        if not _rows_are_own(dist, shape, device_mesh, places, counts):
            placed["gather"] = True
            return None
        return local_step.Piece(x, shape, x.dtype, places, device_mesh)

    pieces = tree.map_structure(piece, data)
    return None if placed else pieces


def _rows_are_own(dist, shape, device_mesh, places, counts):
    """Whether, under `places`, the device of each rank r holds rows
    `sum(counts[:r])` to `sum(counts[:r + 1])` of a batch of `shape`, every
    other dimension whole: the same answer on every process. Kept with the
    distribution's data placements (which hold `device_mesh`, so its id
    names it while the answer is kept)."""
    found = _DATA_PLACEMENTS.setdefault(dist, {})
    key = ("own rows", shape, tuple(places), id(device_mesh), counts)
    if key not in found:
        offsets = [sum(counts[:r]) for r in range(len(counts))]
        ranks = device_mesh.mesh
        own = ranks.numel() == len(counts)
        for r in range(len(counts)) if own else ():
            coordinate = [int(i) for i in (ranks == r).nonzero()[0]]
            got = local_slices(shape, device_mesh, places, coordinate)
            want = (slice(offsets[r], offsets[r] + counts[r]),
                    *(slice(0, n) for n in shape[1:]))
            own = own and got == want
        found[key] = own
    return found[key]


def _host_outputs(outputs):
    return tree.map_structure(
        lambda x: to_host(x) if isinstance(x, DTensor) else x, outputs)


def wrap_make_function(original, attribute):
    """`make_train_function` & co.: the step they make takes DTensor
    batches on a mesh and returns host values."""

    @functools.wraps(original)
    def make_function(self, force=False):
        if getattr(self, attribute) is not None and not force:
            return getattr(self, attribute)
        original(self, force=force)
        step = getattr(self, attribute)
        if getattr(step, "_klm_wrapped", False):
            return step

        def function(data):
            dist = _mesh_distribution()
            if dist is None:
                return step(data)
            _IN_STEP[0] = True
            try:
                training = attribute == "train_function"
                if (attribute != "predict_function" and len(data) == 1
                        and local_step_conditions.may_run(self, training)):
                    pieces = batch_pieces(data[0], dist)
                    local = pieces and local_step.prepare(self, pieces, training)
                    if local:  # its logs are plain tensors already
                        return local_step.run(self, local, pieces)
                data = [distribute_batch(batch, dist) for batch in data]
                return _host_outputs(step(data))
            finally:
                _IN_STEP[0] = False

        function._klm_wrapped = True
        setattr(self, attribute, function)
        return function

    return make_function


def retrack_parameters(model):
    """Keras torch layers list their variables' parameters for torch
    (`zero_grad`, `parameters()`); a moved variable holds a new parameter."""
    for layer in model._flatten_layers(include_self=True):
        if hasattr(layer, "_torch_params"):
            layer._track_variables()
    local_pieces.forget(model)


# --- Keras 3.16's own multi-process paths, stood aside on a klm mesh ---------


def _holds_dtensors(model):
    return any(isinstance(getattr(v, "_value", None), DTensor)
               for v in model.variables)


def wrap_initialize_ddp(original):
    """Keras 3.16 wraps a model in `DistributedDataParallel` when processes
    run and the distribution is None or a `DataParallel`. On a klm mesh the
    step already is data parallel (each process's rows, gradients summed
    over the batch axis): DDP would sum them again, and cannot broadcast
    DTensor weights. No DDP there, nor for a model whose weights are
    DTensors (made on a mesh, trained after `set_distribution(None)`)."""

    @functools.wraps(original)
    def _initialize_ddp(self):
        if _mesh_distribution() is not None or _holds_dtensors(self):
            return
        original(self)

    return _initialize_ddp


def wrap_get_metrics_result(original, trainer_class):
    """Keras 3.16 sums every metric variable over the processes (each held
    its own rows' counts under DDP). A klm step's metric states already
    count the global batch: read as they are."""

    @functools.wraps(original)
    def get_metrics_result(self):
        if _mesh_distribution() is None:
            return original(self)
        return super(trainer_class, self).get_metrics_result()

    return get_metrics_result


def wrap_epoch_iterator(original):
    """Keras 3.16 places `ModelParallel` batches itself, by the layout of
    the first batch (a short last batch then fails). On a klm mesh the step
    places each batch (`distribute_batch`): host batches, as on 3.15."""

    @functools.wraps(original)
    def _get_iterator(self):
        if _mesh_distribution() is None:
            return original(self)
        return self.data_adapter.get_torch_dataloader()

    return _get_iterator


def wrap_distribute_data(original):
    """Keras 3.16's `train_on_batch`, `test_on_batch` and `predict_on_batch`
    take a `ModelParallel` batch as each process's own rows of a batch P
    times larger (every process's, gathered): a script that passes every
    process the same batch, as klm's data are (and as `fit` takes them),
    would train on P copies and predict P times its rows. On a klm mesh
    they take host tensors, as on 3.15; the step places them
    (`distribute_batch`)."""

    @functools.wraps(original)
    def _distribute_data(data, layouts=None):
        if _mesh_distribution() is None:
            return original(data, layouts)
        return tree.map_structure(
            lambda x: None if x is None else convert_to_tensor(x), data)

    return _distribute_data


def wrap_gather_non_batch_axes(original):
    """Keras 3.16 cuts a prediction to each process's rows; a klm
    prediction comes back whole to every process (`_host_outputs`)."""

    @functools.wraps(original)
    def _gather_non_batch_axes(data):
        if _mesh_distribution() is None:
            return original(data)
        return data

    return _gather_non_batch_axes
