"""`LayoutMap`: ordered regex rules from weight paths to layouts, put to use.

The rules themselves (matching, checks, rules as data, the FSDP policy)
live in `keras_layoutmap.rules`; this module adds what uses them: a scope
that creates weights with their layouts (a `ModelParallel`), `explain()` and
`check()`. `layout_map_scope` is TF-Keras 2's name for the scope.
"""

import contextlib

from keras import distribution as keras_distribution

from keras_layoutmap.distributions import ModelParallel
from keras_layoutmap.explain import explain
from keras_layoutmap.rules.config import DEFAULT_MAX_REPLICATED_BYTES
from keras_layoutmap.rules.fsdp_policy import FSDPRuleMap
from keras_layoutmap.rules.rule_map import RuleMap


class LayoutMap(RuleMap):
    """Ordered rules mapping weight paths (regexes) to layouts.

    A weight is looked up by its TF-Keras *object path* (`"feature.kernel"`,
    `"d1.kernel"`) and by its Keras 3 `variable.path`
    (`"sequential/d1/kernel"`). An exact key wins; otherwise the first rule,
    in insertion order, whose regex `fullmatch`es either key. A weight that
    matches nothing is replicated on the map's mesh.

    It is a `keras.distribution.LayoutMap`, so it can be handed to
    `keras.distribution.ModelParallel` as well.

    With `strict=True`, a model built under the map is checked before it
    first trains, evaluates or predicts: a rule that matches no weight, or a
    weight above `max_replicated_bytes` (default 1 MiB) that no rule places
    (so it is replicated on every device), is an error (see `check`).

    Example:

    >>> import keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", 1), ("model", 1)],
    ...     devices=klm.list_devices()[:1])
    >>> layout_map = klm.LayoutMap(mesh)
    >>> layout_map[r".*dense.*kernel"] = (None, "model")
    >>> layout_map[r".*dense.*bias"] = ("model",)
    >>> layout_map["dense_1.kernel"]
    Layout(['unsharded', 'model'], Mesh(batch=1, model=1))
    >>> layout_map["d1.gamma"] is None
    True
    """

    def __init__(self, mesh=None, strict=False,
                 max_replicated_bytes=DEFAULT_MAX_REPLICATED_BYTES):
        super().__init__(mesh, strict=strict,
                         max_replicated_bytes=max_replicated_bytes)
        self._distribution = None  # made by `distribution()`, once

    def _changed(self):
        super()._changed()
        self._distribution = None

    @classmethod
    def from_config(cls, config, mesh=None):
        if isinstance(config, dict) and "fsdp" in config and cls is LayoutMap:
            return FSDPLayoutMap.from_config(config, mesh=mesh)  # `klm.fsdp`'s
        return super().from_config(config, mesh=mesh)

    def distribution(self, batch_dim_name=None):
        """The `klm.ModelParallel` distribution that applies this map."""
        if self._distribution is None or batch_dim_name is not None:
            dist = ModelParallel(layout_map=self, batch_dim_name=batch_dim_name)
            if batch_dim_name is not None:
                return dist
            self._distribution = dist
        return self._distribution

    @contextlib.contextmanager
    def scope(self):
        """Create every weight built under (or by layers made under) this
        scope with its layout; see `klm.ModelParallel`.

        Example:

        >>> import keras, keras_layoutmap as klm
        >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
        >>> layout_map = klm.LayoutMap(mesh)
        >>> layout_map["d1.kernel"] = ("unsharded", "batch")
        >>> with layout_map.scope():
        ...     model = keras.Sequential([keras.Input((4,)),
        ...                               keras.layers.Dense(8, name="d1")])
        >>> klm.fetch_layout(model.layers[0].kernel).sharding_specs
        ['unsharded', 'batch']
        """
        if self._device_mesh is None:
            raise ValueError(
                "LayoutMap.scope() needs a mesh: pass `mesh=` to LayoutMap() "
                "or add a rule whose layout has one."
            )
        dist = self.distribution()
        with dist.scope():
            yield dist

    def explain(self, model, optimizer=None, device_memory=None):
        """A report of which rule gives each weight of `model` its layout,
        and the memory each device holds (`report.memory`): weights, and
        with `optimizer` (a `keras.optimizers.Optimizer` or its name, e.g.
        `"adam"`) gradients and optimizer state too; `device_memory` (bytes,
        or text such as `"16GiB"`) marks devices over budget, a strict-mode
        finding."""
        return explain(model, self, optimizer=optimizer,
                       device_memory=device_memory)

    def check(self, model):
        """Check this map's plan for the built `model` as strict mode does
        (whether or not the map is strict): raise `StrictModeError` (a
        `ValueError`) naming every rule that matches no weight and every
        weight above `max_replicated_bytes` that no rule places. Returns the
        explain report when the plan passes."""
        report = self.explain(model)
        report.raise_for_strict()
        return report


class FSDPLayoutMap(FSDPRuleMap, LayoutMap):
    """A `LayoutMap` whose unmatched large weights are sharded over
    `fsdp_axis` (see `klm.fsdp`, which makes one)."""

    def distribution(self, batch_dim_name=None):
        """The `klm.ModelParallel` that applies this map; batches are split
        over "batch" when the mesh has it, else over the FSDP axis."""
        if batch_dim_name is None and "batch" not in self.device_mesh.axis_names:
            if self._distribution is None:
                self._distribution = super().distribution(self.fsdp_axis)
            return self._distribution
        return super().distribution(batch_dim_name)


def layout_map_scope(layout_map):
    """`layout_map.scope()` under TF-Keras 2.9-2.12's name
    (`tf.keras.dtensor.experimental.layout_map_scope`), for ported code.

    Example:

    >>> import keras, keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
    >>> layout_map = klm.LayoutMap(mesh)
    >>> layout_map["d1.kernel"] = ("unsharded", "batch")
    >>> with klm.layout_map_scope(layout_map):
    ...     model = keras.Sequential([keras.Input((4,)),
    ...                               keras.layers.Dense(8, name="d1")])
    >>> klm.fetch_layout(model.layers[0].kernel).sharding_specs
    ['unsharded', 'batch']
    """
    return as_layout_map(layout_map, "layout_map_scope expects").scope()


def as_layout_map(value, what):
    """`value` as a `klm.LayoutMap`: itself, or the rules of a
    `keras.distribution.LayoutMap` (matching anywhere); anything else is
    a `TypeError` that begins with `what` ("f expects") and names the
    value received."""
    if isinstance(value, keras_distribution.LayoutMap) and not isinstance(
            value, LayoutMap):
        value = LayoutMap.from_keras(value)
    if not isinstance(value, LayoutMap):
        raise TypeError(
            f"{what} a `klm.LayoutMap` (or a "
            "`keras.distribution.LayoutMap`). Received: "
            f"{value!r} of type {type(value).__name__}"
        )
    return value
