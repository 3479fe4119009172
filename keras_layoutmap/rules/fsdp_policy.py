"""The FSDP policy (ZeRO-3 style) of `klm.fsdp`, as rules.

Each weight that no rule places and that holds at least `min_bytes` is
sharded over the data axis along its largest dimension that the axis
divides; its optimizer slots follow it. Smaller weights (biases, norms) are
replicated. Explicit rules (and layer `<weight>_layout=` kwargs) win, so
model-parallel rules on a second mesh axis combine with it. Inside a step,
each sharded weight is gathered whole for compute (JAX: the compiler inserts
the all-gather; TensorFlow: the backend relayouts the weight as the model
reads it) and its gradient reduce-scattered back to the shards, so storage
stays sharded and numbers equal one device's.
"""

import keras
import numpy as np
from keras import distribution as keras_distribution

from keras_layoutmap.layout import Layout
from keras_layoutmap.mesh import as_mesh
from keras_layoutmap.rules.choice import Choice
from keras_layoutmap.rules.config import DEFAULT_MAX_REPLICATED_BYTES
from keras_layoutmap.rules.rule_map import RuleMap

DEFAULT_MIN_BYTES = 1 << 16  # 64 KiB: biases and norms stay replicated


class FSDPRuleMap(RuleMap):
    """Rules whose unmatched large weights are sharded over `fsdp_axis`
    (the FSDP policy of `klm.fsdp`, which makes one)."""

    def __init__(self, mesh=None, axis="batch", min_bytes=DEFAULT_MIN_BYTES,
                 strict=False, max_replicated_bytes=DEFAULT_MAX_REPLICATED_BYTES):
        super().__init__(mesh, strict=strict,
                         max_replicated_bytes=max_replicated_bytes)
        mesh = self.device_mesh
        if mesh is None:
            raise ValueError("klm.fsdp needs a mesh. Received: mesh=None")
        if not isinstance(axis, str) or axis not in mesh.axis_names:
            raise ValueError(
                f"klm.fsdp: `axis` must be an axis of the mesh, one of "
                f"{list(mesh.axis_names)}. Received: axis={axis!r}"
            )
        if isinstance(min_bytes, bool) or not isinstance(
                min_bytes, (int, np.integer)):
            raise TypeError(
                "klm.fsdp: `min_bytes` must be an int (a number of bytes, "
                f">= 0). Received: min_bytes={min_bytes!r} of type "
                f"{type(min_bytes).__name__}"
            )
        if min_bytes < 0:
            raise ValueError(
                "klm.fsdp: `min_bytes` must be >= 0 (a number of bytes). "
                f"Received: min_bytes={min_bytes!r}"
            )
        self.fsdp_axis = axis
        self.min_bytes = int(min_bytes)

    @classmethod
    def build(cls, mesh=None, axis="batch", min_bytes=DEFAULT_MIN_BYTES,
              rules=None, strict=False,
              max_replicated_bytes=DEFAULT_MAX_REPLICATED_BYTES):
        """A map of this class: `rules` (a map, or a
        `keras.distribution.LayoutMap`) copied first, then the policy (see
        `klm.fsdp` for the arguments)."""
        if rules is not None and not isinstance(rules, RuleMap):
            if not isinstance(rules, keras_distribution.LayoutMap):
                raise TypeError(
                    "`rules` must be a `klm.LayoutMap` (or a "
                    f"`keras.distribution.LayoutMap`). Received: {rules!r} of "
                    f"type {type(rules).__name__}"
                )
            rules = RuleMap.from_keras(rules, mesh=mesh)
        if mesh is None and rules is not None:
            mesh = rules.device_mesh
        if mesh is None:
            raise ValueError(
                "klm.fsdp needs a mesh: pass `mesh=` (or `rules=` a LayoutMap "
                "that has one). Received: mesh=None"
            )
        layout_map = cls(
            mesh, axis=axis, min_bytes=min_bytes, strict=strict,
            max_replicated_bytes=max_replicated_bytes,
        )
        if rules is not None:
            layout_map.search = rules.search
            if as_mesh(rules.device_mesh) != layout_map.device_mesh:
                raise ValueError(
                    f"`rules` are on {rules.device_mesh!r} but `mesh` is "
                    f"{layout_map.device_mesh!r}; FSDP and its rules share one "
                    "mesh."
                )
            for key, layouts in rules._alternatives.items():
                layout_map[key] = list(layouts) if len(layouts) > 1 else layouts[0]
        return layout_map

    @property
    def policy_name(self):
        """What `explain()` names as the rule of the weights FSDP places."""
        return f"fsdp({self.fsdp_axis})"

    def fsdp_layout(self, shape, dtype=None):
        """The FSDP layout of a weight of `shape` and `dtype` (None:
        float32), or None when it stays replicated (too small, or no
        dimension the axis divides)."""
        shape = tuple(int(d) for d in shape)
        itemsize = np.dtype(keras.backend.standardize_dtype(
            dtype or "float32")).itemsize
        if not shape or int(np.prod(shape)) * itemsize < self.min_bytes:
            return None
        n = self.device_mesh.dim_size(self.fsdp_axis)
        fits = [i for i, d in enumerate(shape) if d % n == 0 and d >= n]
        if not fits:
            return None
        # The largest dimension; the first of equals (kernels: the input one).
        dim = max(fits, key=lambda i: (shape[i], -i))
        specs = [None] * len(shape)
        specs[dim] = self.fsdp_axis
        return Layout(specs, self.device_mesh)

    def choose(self, shape, *keys, dtype=None):
        """A rule's choice when a rule matches; else the FSDP layout (rule
        `"fsdp(<axis>)"`) for a large weight; else replicated."""
        choice = super().choose(shape, *keys, dtype=dtype)
        if choice.rule is not None:
            return choice
        layout = self.fsdp_layout(shape, dtype)
        if layout is None:
            return choice
        return Choice(self.policy_name, layout)

    def get_config(self):
        config = super().get_config()
        config["fsdp"] = {"axis": self.fsdp_axis, "min_bytes": self.min_bytes}
        return config

    @classmethod
    def from_config(cls, config, mesh=None):
        config = dict(config)
        policy = config.pop("fsdp", None) or {}
        if not isinstance(policy, dict) or not set(policy) <= {
                "axis", "min_bytes"}:
            raise ValueError(
                "The 'fsdp' entry of a LayoutMap config is {'axis': name, "
                f"'min_bytes': int}}. Received: {policy!r}"
            )
        rules = RuleMap.from_config(config, mesh=mesh)
        return cls.build(rules.device_mesh, rules=rules, strict=rules.strict,
                         max_replicated_bytes=rules.max_replicated_bytes,
                         **policy)

    def __repr__(self):
        return (super().__repr__()[:-1]
                + f", fsdp(axis={self.fsdp_axis!r}, min_bytes={self.min_bytes}))")
