"""`fit` / `evaluate` / `predict` on a mesh: a data layout per batch shape
(the short last batch), global batches across processes, predictions
gathered to every process."""

import functools

import jax
from keras import distribution as keras_distribution
from keras import tree

from keras_layoutmap.backends.jax import keras_internals as keras_jax
from keras_layoutmap.backends.jax.processes import (
    gather_process_batches,
    global_array,
    to_host,
)


def distributed_iterator(self, distribution):
    """Keras computes the data layouts from the first batch and reuses them;
    the last, short batch then fails with `IndivisibleError`. Ask the
    distribution for every new batch shape instead (cached). Across
    processes, each batch becomes one global array (see `processes`)."""
    cache = {}
    several = jax.process_count() > 1
    gather = several and not distribution.auto_shard_dataset

    def layout_for(d):
        if d is None:
            return None
        key = tuple(d.shape)
        if key not in cache:
            cache[key] = distribution.get_data_layout(d.shape).backend_layout
        return cache[key]

    def place(d):
        if d is None:
            return None
        if gather:
            d = gather_process_batches(d)
        return global_array(d, layout_for(d))

    for data in self.data_adapter.get_jax_iterator():
        if several:
            yield tree.map_structure(place, data)
        else:
            yield keras_jax.distribute_data(
                data, tree.map_structure(layout_for, data))


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
