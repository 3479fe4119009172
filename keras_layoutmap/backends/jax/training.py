"""`fit` / `evaluate` / `predict` on a mesh: a data layout per batch shape
(the short last batch), global batches across processes, predictions
gathered to every process."""

import functools

import jax
import numpy as np
from keras import distribution as keras_distribution
from keras import tree

from keras_layoutmap.backends.jax import keras_internals as keras_jax
from keras_layoutmap.backends.jax.processes import (
    gather_process_batches,
    global_array,
    to_host,
)


def _batch_placer(distribution, stacked=False):
    """`(layout_for, place)`: a leaf's data layout (asked of the
    distribution once per shape: the short last batch has its own), and
    the leaf placed as one global array across processes: the same global
    batch on every process (`auto_shard_dataset=True`), each process placing
    its own devices' rows, or each process's own rows, gathered first.
    `stacked`: a super batch (Keras 3.16's `steps_per_execution`: the
    batches of several steps stacked on a new first axis), whose second
    axis is the batch."""
    cache = {}
    gather = not distribution.auto_shard_dataset

    def layout_for(d):
        if d is None:
            return None
        key = tuple(d.shape)
        if key not in cache:
            layout = distribution.get_data_layout(d.shape[1:] if stacked
                                                  else d.shape)
            if stacked:
                layout = keras_distribution.TensorLayout(
                    (None, *layout.axes), layout.device_mesh)
            cache[key] = layout.backend_layout
        return cache[key]

    def place(d):
        if d is None or (isinstance(d, jax.Array)
                         and not d.is_fully_addressable):
            return d  # none, or a global array already
        if gather:
            d = np.asarray(d)
            d = (np.swapaxes(gather_process_batches(np.swapaxes(d, 0, 1)), 0, 1)
                 if stacked else gather_process_batches(d))
        return global_array(d, layout_for(d))

    return layout_for, place


def distributed_iterator(self, distribution):
    """Keras computes the data layouts from the first batch and reuses them;
    the last, short batch then fails with `IndivisibleError`. Ask the
    distribution for every new batch shape instead (cached). Across
    processes, each batch becomes one global array (see `processes`)."""
    several = jax.process_count() > 1
    layout_for, place = _batch_placer(distribution)
    for data in self.data_adapter.get_jax_iterator():
        if several:
            yield tree.map_structure(place, data)
        else:
            yield keras_jax.distribute_data(
                data, tree.map_structure(layout_for, data))


def wrap_distribute_data(original):
    """Keras' `_distribute_data` across processes, for `train_on_batch`,
    `test_on_batch` and Keras 3.16's `steps_per_execution` iterator:
    Keras hands it the batch the user passed, and JAX takes that as this
    process's rows (`make_array_from_process_local_data`),
    so the global batch was every process's copy side by side: twice the
    rows on 2 processes, other dropout masks and other numbers from any op
    that reads a row's position, with no error (a mean loss of duplicated
    rows hid it). Here the batch is placed as `fit` places it: the same
    global batch on every process, or each process's own rows
    (`auto_shard_dataset=False`); a super batch (the batches of
    `steps_per_execution` steps, stacked) likewise along its second axis."""

    @functools.wraps(original)
    def _distribute_data(data, layouts=None, **kwargs):
        distribution = keras_distribution.distribution()
        if distribution is None or jax.process_count() == 1:
            return original(data, layouts, **kwargs)
        place = _batch_placer(distribution,
                              stacked=bool(kwargs.get("is_super_batch")))[1]
        return tree.map_structure(place, data)

    return _distribute_data


def install_iterator(EpochIterator):
    """Feed `fit` & co. through `distributed_iterator` whenever a
    distribution is active: Keras 3.15 asks `_get_distributed_iterator`
    for one; 3.16 makes every iterator in `_get_iterator` (which computes a
    layout per batch but makes no global batch across processes), so it is
    wrapped there, for one batch per step."""
    if keras_jax.get_distributed_iterator is not None:  # Keras 3.15
        EpochIterator._get_distributed_iterator = distributed_iterator
        return
    original = EpochIterator._get_iterator

    @functools.wraps(original)
    def _get_iterator(self):
        distribution = keras_distribution.distribution()
        if distribution is None or self.steps_per_execution > 1:
            return original(self)
        return distributed_iterator(self, distribution)

    EpochIterator._get_iterator = _get_iterator


def wrap_make_predict_function(original):
    """Predictions sharded over several processes come back whole, to every
    process."""

    @functools.wraps(original)
    def make_predict_function(self, force=False):
        if self.predict_function is not None and not force:
            return self.predict_function
        original(self, force=force)
        step = self.predict_function

        def predict_function(state, iterator):
            outputs, state = step(state, iterator)
            return tree.map_structure(to_host, outputs), state

        self.predict_function = predict_function
        return predict_function

    return make_predict_function
