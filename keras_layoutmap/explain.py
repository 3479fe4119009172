"""`LayoutMap.explain(model)`: which rule places each weight, and the cost."""

import dataclasses
import io

from keras_layoutmap import paths
from keras_layoutmap.layout import layout_bytes_per_device


@dataclasses.dataclass(frozen=True)
class WeightRow:
    path: str
    object_path: str
    shape: tuple
    dtype: str
    rule: object  # the key that matched, or None
    layout: object
    bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class Report:
    rows: list
    unused_rules: list  # rules that match no weight
    shadowed_rules: list  # rules that match only weights an earlier rule won

    @property
    def bytes_per_device(self):
        return sum(r.bytes_per_device for r in self.rows)

    def __str__(self):
        from rich.console import Console
        from rich.table import Table

        table = Table(title="LayoutMap.explain", show_lines=False)
        for col in ("object path", "variable path", "shape", "rule",
                    "layout", "bytes/device"):
            table.add_column(col, justify="right" if col == "bytes/device"
                             else "left")
        for r in self.rows:
            table.add_row(
                r.object_path, r.path, str(r.shape),
                "-" if r.rule is None else str(r.rule),
                str(r.layout.sharding_specs), f"{r.bytes_per_device:,}",
            )
        out = io.StringIO()
        console = Console(file=out, width=160, color_system=None)
        console.print(table)
        console.print(f"total bytes per device: {self.bytes_per_device:,}")
        if self.unused_rules:
            console.print(f"rules matching no weight: {self.unused_rules}")
        if self.shadowed_rules:
            console.print(
                f"rules shadowed by earlier rules: {self.shadowed_rules}"
            )
        return out.getvalue()


def explain(model, layout_map):
    """Resolve every weight of `model` against `layout_map`."""
    from keras_layoutmap.distributions import resolve_weight

    owners = paths.object_paths(model, with_owner=True)
    rows, won, matched = [], set(), set()
    for variable in model.weights:
        object_path, owner = owners.get(id(variable), (variable.path, None))
        shape = tuple(int(d) for d in variable.shape)
        matched.update(layout_map.matching_rules(object_path, variable.path))
        rule, layout = resolve_weight(
            owner, variable.name, shape, object_path, variable.path,
            layout_map, layout_map.device_mesh,
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
            )
        )
    keys = list(layout_map)
    unused = [k for k in keys if k not in matched]
    shadowed = [k for k in keys if k in matched and k not in won]
    return Report(rows=rows, unused_rules=unused, shadowed_rules=shadowed)

