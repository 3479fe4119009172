"""Memory per device for a plan: weights, gradients, optimizer state.

`layout_map.explain(model, optimizer=..., device_memory=...)` adds a
`DeviceMemory` to its report. The optimizer's state is found by building a
copy of the optimizer on the model's trainable weights inside
`keras.StatelessScope(initialize_variables=False)`: every state variable it
makes (Adam's two slots a weight, AMSGrad's third, Adafactor's factored
ones, the step count) is counted with its own shape and dtype, and no
memory is allocated. A slot shaped like its weight takes the weight's
layout, as `klm` places it (or the split layout of
`klm.shard_optimizer_states`); any other state variable takes the map's
layout for its path (replicated when no rule names it). A gradient has its
weight's shape, dtype and layout; only trainable weights have one.

A layout that fits its tensor (explain checks they all do) splits it
evenly, so every device of the mesh holds the same bytes: the figures are
those of each device (`"per_device"`: the largest device, which is every
device).

This module imports no Keras at import time (the command line parses
`--device-memory` with `parse_bytes` before loading Keras).
"""

import dataclasses
import re

import keras

from keras_layoutmap import backends
from keras_layoutmap.layout import Layout, layout_bytes_per_device
from keras_layoutmap.paths import reference_of

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6,
          "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text):
    """`"16GiB"` -> 17179869184: a number of bytes with an optional unit
    (B, KB/MB/GB/TB: powers of 1000; KiB/MiB/GiB/TiB: powers of 1024);
    an int is taken as it is. Raises `ValueError` naming what it received."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"cannot parse the device memory {text!r}: expected a positive "
            "number of bytes with an optional unit, e.g. 16GiB, 80GB, 512MiB "
            "or 1000000 (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def human(n):
    """`17179869184` -> `"16.00 GiB"`."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20),
                       ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class StateRow:
    """One optimizer state variable: its path, the weight it was made for
    (None: not a slot), shape, dtype, layout and bytes per device; `split`
    says whether `klm.shard_optimizer_states` split it over its axis, and
    `why_not` why a slot it could have split was left with its weight's
    layout."""

    path: str
    weight: object
    shape: tuple
    dtype: str
    layout: object
    bytes_per_device: int
    split: bool = False
    why_not: object = None


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What each device holds for a plan, in bytes: `weights`, `gradients`
    (trainable weights, laid out like them), `optimizer` (its state, as it
    lays it out), `total`; `budget` the device memory given (None: none)
    and `devices` the mesh's device names. `state` holds a `StateRow` per
    optimizer variable."""

    weights: int
    gradients: int
    optimizer: int
    optimizer_name: object = None
    budget: object = None
    devices: tuple = ()
    state: tuple = ()

    @property
    def total(self):
        return self.weights + self.gradients + self.optimizer

    @property
    def over_budget(self):
        """The devices whose total exceeds the budget (every device or
        none: they hold the same bytes)."""
        if self.budget is None or self.total <= self.budget:
            return []
        return list(self.devices)

    def to_dict(self):
        return {"weights": self.weights, "gradients": self.gradients,
                "optimizer": self.optimizer, "total": self.total}

    def render(self, console):
        """Print the memory table on a rich `console`."""
        from rich.table import Table

        what = (f"optimizer {self.optimizer_name}" if self.optimizer_name
                else "no optimizer: inference, weights only")
        table = Table(title=f"memory per device ({what})")
        columns = ["devices", "weights", "gradients", "optimizer state",
                   "total"]
        if self.budget is not None:
            columns.append(f"budget {human(self.budget)}")
        for col in columns:
            table.add_column(col, justify="left" if col == "devices" else "right",
                             overflow="fold")
        cells = [_device_range(self.devices)] + [
            human(n) for n in (self.weights, self.gradients, self.optimizer,
                               self.total)]
        if self.budget is not None:
            cells.append(f"OVER by {human(self.total - self.budget)}"
                         if self.over_budget else "fits")
        table.add_row(*cells)
        console.print(table)
        split = [r for r in self.state if r.split]
        kept = [r for r in self.state if r.why_not]
        if split:
            console.print(f"optimizer state split over the data axis: "
                          f"{len(split)} slot(s)")
        for r in kept:
            console.print(f"slot {r.path} keeps its weight's layout: {r.why_not}")


def _device_range(devices):
    if len(devices) <= 2:
        return ", ".join(devices)
    return f"each of {len(devices)} ({devices[0]} ... {devices[-1]})"


def over_budget_finding(memory):
    """The strict-mode message for a plan over its device memory (None
    when it fits or has no budget)."""
    if not memory.over_budget:
        return None
    return (
        f"each of the {len(memory.devices)} devices needs {memory.total:,} "
        f"bytes ({human(memory.total)}: weights {human(memory.weights)}, "
        f"gradients {human(memory.gradients)}, optimizer state "
        f"{human(memory.optimizer)}), more than the device memory "
        f"{memory.budget:,} bytes ({human(memory.budget)})"
    )


def optimizer_instance(optimizer):
    """A fresh, unbuilt optimizer like `optimizer` (a name such as
    `"adam"`, a config dict or a `keras.optimizers.Optimizer`)."""
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        return type(optimizer).from_config(optimizer.get_config())
    if isinstance(optimizer, (str, dict)):
        try:
            return keras.optimizers.get(optimizer)
        except ValueError as e:
            raise ValueError(
                f"unknown optimizer {optimizer!r}: expected a name of "
                f"keras.optimizers (adam, adamw, sgd, rmsprop, adafactor, "
                f"...), a config dict or an Optimizer ({e})") from None
    raise TypeError(
        "`optimizer` must be a keras.optimizers.Optimizer, its name (e.g. "
        f"'adam') or a config dict. Received: {optimizer!r} of type "
        f"{type(optimizer).__name__}"
    )


def optimizer_state(model, optimizer):
    """`[(state_variable, weight_or_None)]` that `optimizer` makes for the
    model's trainable weights, with shapes only (no memory)."""
    copy = optimizer_instance(optimizer)
    # TensorFlow's optimizer keys weights by their tf.Variable, which a
    # weight made with shapes only does not have; this copy is thrown away.
    copy._var_key = id
    try:
        with keras.StatelessScope(initialize_variables=False):
            copy.build(model.trainable_weights)
    except ValueError as e:
        if "stateless scope" not in str(e):
            raise
        raise ValueError(
            f"cannot count the state of optimizer {type(copy).__name__} from "
            "shapes: its build() makes a variable from a value, which "
            "keras.StatelessScope refuses (only optimizers that make their "
            "state with add_variable, as Adam, AdamW, SGD, RMSprop, Lion "
            "do, can be counted without allocating it)") from None
    return [(v, reference_of(v)) for v in copy.variables], type(copy).__name__


def estimate(model, rows, layout_map, optimizer=None, device_memory=None):
    """The `DeviceMemory` of `model` placed as `rows` (explain's) say."""
    mesh = layout_map.device_mesh
    budget = None if device_memory is None else parse_bytes(device_memory)
    trainable = {id(v) for v in model.trainable_weights}
    by_path = {r.path: r for r in rows}
    weights = sum(r.bytes_per_device for r in rows)
    state, name, gradients = [], None, 0
    if optimizer is not None:
        gradients = sum(by_path[v.path].bytes_per_device
                        for v in model.weights if id(v) in trainable)
        variables, name = optimizer_state(model, optimizer)
        slot_layout = getattr(layout_map, "slot_layout", None)
        for variable, weight in variables:
            shape = tuple(int(d) for d in variable.shape)
            row = by_path.get(getattr(weight, "path", None))
            split, why_not = False, None
            if row is not None and shape == row.shape:
                layout = row.layout
                if slot_layout is not None:
                    layout, why_not = slot_layout(row.layout, shape,
                                                  variable.dtype)
                    split = layout != row.layout
            else:
                try:
                    layout = layout_map.choose(shape, variable.path,
                                               dtype=variable.dtype).layout
                except ValueError:
                    layout = None
                if layout is None:
                    layout = Layout.replicated(mesh, len(shape))
            state.append(StateRow(
                variable.path, None if weight is None else weight.path, shape,
                str(variable.dtype), layout,
                layout_bytes_per_device(layout, shape, variable.dtype),
                split, why_not))
    devices = () if mesh is None else tuple(
        str(d) for d in mesh.devices.ravel())
    return DeviceMemory(
        weights=weights, gradients=gradients,
        optimizer=sum(r.bytes_per_device for r in state),
        optimizer_name=name, budget=budget, devices=devices,
        state=tuple(state))


def measured(variables):
    """`{device: bytes}` this process's devices hold of `variables`, read
    from the backend (`device_bytes`), for checking an estimate."""
    held = {}
    for variable in variables:
        for device, n in backends.get().device_bytes(variable).items():
            held[device] = held.get(device, 0) + n
    return held

