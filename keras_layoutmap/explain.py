"""`LayoutMap.explain(model)`: which rule places each weight, and the cost.

The report also says which layout of a rule with fallbacks placed each
weight (and why the earlier ones were refused), and what strict mode finds
wrong with the plan: rules that match no weight, and large weights that no
rule chose, replicated on every device.
"""

import dataclasses
import io

from keras_layoutmap import memory, paths
from keras_layoutmap.findings import (  # noqa: F401 - public here too
    Finding,
    StrictModeError,
    replicated_weight,
    unused_rule,
)
from keras_layoutmap.layout import layout_bytes_per_device
from keras_layoutmap.rules.resolve import resolve_weight
from keras_layoutmap.visualize import show_rows


@dataclasses.dataclass(frozen=True)
class WeightRow:
    """One weight: its names, shape, the rule (or `<weight>_layout=` kwarg)
    that placed it (None: no rule, replicated; `"fsdp(<axis>)"`: the
    `klm.fsdp` policy), the layout and its cost.

    For a rule with fallbacks, `alternative` is the index (0-based) of the
    layout that placed the weight among the rule's `alternatives`, and
    `refused` holds `(sharding_specs, reason)` for each earlier one;
    `alternative` is None for a rule with one layout. For a variable that
    `model.quantize()` added (a scale, a zero point, an amax history),
    `follows` is the object path of the kernel whose layout it follows
    (`rule` is that kernel's rule); None for any other weight.
    """

    path: str
    object_path: str
    shape: tuple
    dtype: str
    rule: object  # the key that matched, or None
    layout: object
    bytes_per_device: int
    alternative: object = None
    alternatives: int = 1
    refused: tuple = ()
    follows: object = None
    reason: object = None


@dataclasses.dataclass(frozen=True)
class Report:
    """What `layout_map.explain(model)` returns: how a plan places a model.

    `rows` holds a `WeightRow` per weight; `unused_rules` the rules that
    match no weight and no layer output, `output_rules` those that match
    only layer outputs (`"<layer path>/output"`: `{rule: [output keys]}`),
    `shadowed_rules` those that match only weights an earlier rule won;
    `findings` the strict-mode `Finding`s; `strict` whether the map was
    strict. `str(report)` (or `render()`) is the table,
    `to_dict()` the same as JSON-ready data, `bytes_per_device` the total.
    `memory` (a `keras_layoutmap.memory.DeviceMemory`) is what each device
    holds: weights, and with `explain(model, optimizer=...)` gradients and
    optimizer state; `show(regex)` draws weights as `klm.visualize` does.
    """

    rows: list
    unused_rules: list  # rules that match no weight
    shadowed_rules: list  # rules that match only weights an earlier rule won
    findings: list = dataclasses.field(default_factory=list)  # strict mode
    strict: bool = False  # whether the map was strict
    mesh: object = None
    memory: object = None  # a `klm.memory.DeviceMemory`: bytes per device
    output_rules: dict = dataclasses.field(default_factory=dict)
    layout_map: object = dataclasses.field(default=None, repr=False)

    @property
    def bytes_per_device(self):
        return sum(r.bytes_per_device for r in self.rows)

    @property
    def fallbacks_used(self):
        """Rows placed by a later layout of a rule with fallbacks."""
        return [r for r in self.rows if r.alternative]

    def raise_for_strict(self):
        """Raise `StrictModeError` (a `ValueError`) naming every rule that
        matches no weight and every large weight no rule placed."""
        if not self.findings:
            return
        raise StrictModeError(
            f"Strict mode: {len(self.findings)} problem(s) with the layout "
            "plan:\n" + "\n".join(f"  - {f.message}" for f in self.findings),
            self.findings,
        )

    def to_dict(self):
        """The report as JSON-ready data."""
        mesh = self.mesh
        return {
            "mesh": None if mesh is None else dict(zip(mesh.axis_names, mesh.shape)),
            "weights": [
                {
                    "path": r.path,
                    "object_path": r.object_path,
                    "shape": list(r.shape),
                    "dtype": r.dtype,
                    "rule": r.rule,
                    "layout": r.layout.sharding_specs,
                    "bytes_per_device": r.bytes_per_device,
                    "alternative": r.alternative,
                    "alternatives": r.alternatives,
                    "refused": [{"layout": specs, "reason": why}
                                for specs, why in r.refused],
                    "follows": r.follows,
                    "reason": r.reason,
                }
                for r in self.rows
            ],
            "bytes_per_device": self.bytes_per_device,
            "unused_rules": list(self.unused_rules),
            "output_rules": [
                {"rule": rule, "layout": self._output_specs(rule),
                 "outputs": list(keys),
                 "reason": _reason_of(self.layout_map, rule)}
                for rule, keys in self.output_rules.items()],
            "shadowed_rules": list(self.shadowed_rules),
            "strict": self.strict,
            "strict_findings": [dataclasses.asdict(f) for f in self.findings],
            **({} if self.memory is None else {
                "per_device": self.memory.to_dict(),
                "optimizer": self.memory.optimizer_name,
                "device_memory": self.memory.budget,
                "over_budget": bool(self.memory.over_budget)}),
        }

    def render(self, width=None):
        """The report as text, `width` columns wide (None: the terminal's
        width, as rich finds it; columns fold to fit)."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title="LayoutMap.explain", show_lines=False)
        reasons = any(r.reason is not None for r in self.rows)
        for col in ("object path", "variable path", "shape", "rule",
                    "layout", "bytes/device") + (("why",) if reasons else ()):
            table.add_column(
                col, overflow="fold",
                justify="right" if col == "bytes/device" else "left",
            )
        for r in self.rows:
            layout = str(r.layout.sharding_specs)
            if r.alternative is not None:
                layout += f" (alt {r.alternative + 1}/{r.alternatives})"
            rule = "-" if r.rule is None else str(r.rule)
            if r.follows is not None:
                rule += f" (follows {r.follows})"
            table.add_row(
                r.object_path, r.path, str(r.shape), rule,
                layout, f"{r.bytes_per_device:,}",
                *((r.reason or "-",) if reasons else ()),
            )
        out = io.StringIO()
        console = Console(file=out, width=width, color_system=None,
                          highlight=False, soft_wrap=False)
        console.print(table)
        devices = "" if self.mesh is None else f" ({self.mesh.size} devices)"
        console.print(f"total bytes per device: {self.bytes_per_device:,}{devices}")
        if self.memory is not None:
            self.memory.render(console)
        for rule, keys in self.output_rules.items():
            why = _reason_of(self.layout_map, rule)
            console.print(
                f"layer output rule {rule!r}: {self._output_specs(rule)} for "
                f"{len(keys)} output(s)" + (f": {why}" if why else ""))
        if self.unused_rules:
            console.print(f"rules matching no weight: {self.unused_rules}")
        if self.shadowed_rules:
            console.print(
                f"rules shadowed by earlier rules: {self.shadowed_rules}"
            )
        for r in self.fallbacks_used:
            refused = "; ".join(f"{specs}: {why}" for specs, why in r.refused)
            console.print(
                f"fallback: {r.object_path} took layout {r.alternative + 1} of "
                f"{r.alternatives} of rule {r.rule!r}; refused {refused}"
            )
        if self.findings:
            head = "strict mode" if self.strict else "strict mode would find"
            console.print(f"{head}: {len(self.findings)} problem(s)")
            for f in self.findings:
                console.print(f"  - {f.message}")
        return out.getvalue()

    def __str__(self):
        return self.render()

    def _output_specs(self, rule):
        layout = None if self.layout_map is None else self.layout_map[rule]
        return getattr(layout, "sharding_specs", layout)

    def show(self, pattern, *, file=None):
        """Draw the weights whose object path or variable path
        `re.fullmatch`es `pattern` as `klm.visualize` does, from their
        shapes and layouts alone (process 0 prints). Returns the rows drawn;
        a pattern that matches no weight is a `ValueError`."""
        return show_rows(self.rows, pattern, file=file)


def _findings(rows, unused, layout_map):
    """Strict mode's findings, worded as at a weight's creation."""
    limit = layout_map.max_replicated_bytes
    found = [unused_rule(rule) for rule in unused]
    found += [
        replicated_weight(layout_map, r.object_path, r.path, r.shape,
                          r.bytes_per_device)
        for r in rows if r.rule is None and r.bytes_per_device > limit
    ]
    return found


def _reason_of(layout_map, rule):
    """Why `rule` gives its layout, where the map records it."""
    reason = getattr(layout_map, "reason", None)
    return None if reason is None or rule is None else reason(rule)


def explain(model, layout_map, optimizer=None, device_memory=None):
    """Resolve every weight of `model` against `layout_map`; with the
    memory each device holds (see `keras_layoutmap.memory`)."""
    owners = paths.object_paths(model, with_owner=True)
    rows, won, matched = [], set(), set()
    for variable in model.weights:
        object_path, owner = owners.get(id(variable), (variable.path, None))
        shape = tuple(int(d) for d in variable.shape)
        matched.update(layout_map.matching_rules(object_path, variable.path))
        rule, layout, choice = resolve_weight(
            owner, variable.name, shape, object_path, variable.path,
            layout_map, layout_map.device_mesh, detail=True,
            dtype=variable.dtype,
        )
        won.add(rule)
        rows.append(
            WeightRow(
                path=variable.path,
                object_path=object_path,
                shape=shape,
                dtype=str(variable.dtype),
                rule=rule,
                layout=layout,
                bytes_per_device=layout_bytes_per_device(
                    layout, shape, variable.dtype
                ),
                alternative=None if choice is None else choice.index,
                alternatives=1 if choice is None else choice.count,
                refused=() if choice is None else tuple(
                    (lt.sharding_specs, why) for lt, why in choice.refused
                ),
                follows=None if choice is None else choice.follows,
                reason=_reason_of(layout_map, rule),
            )
        )
    keys = list(layout_map)
    outputs = _output_rules(model, layout_map, matched)
    unused = [k for k in keys if k not in matched and k not in outputs]
    shadowed = [k for k in keys if k in matched and k not in won]
    usage = memory.estimate(model, rows, layout_map, optimizer, device_memory)
    over = memory.over_budget_finding(usage)
    return Report(
        rows=rows, unused_rules=unused, shadowed_rules=shadowed,
        findings=_findings(rows, unused, layout_map) + (
            [Finding("device_memory", "per_device", over)] if over else []),
        strict=layout_map.strict, mesh=layout_map.device_mesh, memory=usage,
        output_rules=outputs, layout_map=layout_map,
    )


def _output_rules(model, layout_map, weight_rules):
    """`{rule: [output keys]}` for the rules of `layout_map` that match no
    weight (`weight_rules` holds those that do) but the key Keras asks the
    distribution for a layer's output, `"<layer path>/output"` (matched as
    `ModelParallel.get_tensor_layout` matches it)."""
    found = {}
    for layer in model._flatten_layers(include_self=False):
        key = f"{layer.path}/output"
        parts = key.split("/")
        under = "/".join(parts[1:]) if len(parts) >= 3 else None
        for rule in layout_map.matching_rules(key, under):
            if rule not in weight_rules:
                found.setdefault(rule, []).append(key)
    return {rule: found[rule] for rule in layout_map if rule in found}
