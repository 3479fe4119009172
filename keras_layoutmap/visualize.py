"""`klm.visualize(x)`: a picture of which devices hold each block of a
tensor or variable on a mesh (JAX's `jax.debug.visualize_array_sharding`,
on every backend and across processes).

Nothing is gathered: the map from blocks to devices follows from the layout
and the mesh, which every process knows (`fetch_layout` reads them from the
backend's own sharding), so each process could draw the whole picture;
process 0 prints it. The device at mesh position `p` holds, along each
dimension split over a mesh axis, the block numbered by `p`'s coordinate
on that axis (the convention of `jax.sharding.NamedSharding`, DTensor's
`Layout` and torch's `Shard` placements alike; blocks are cut as
`torch.chunk` does, which is an even split wherever the axis divides the
dimension). `Report.show(regex)` draws a plan's weights the same way from
their shapes alone.
"""

import io
import itertools
import math
import re
import shutil
import sys

import numpy as np

from keras_layoutmap import backends
from keras_layoutmap.data import fetch_layout
from keras_layoutmap.processes import process_index


def block_devices(layout, shape):
    """`{block_index: [device, ...]}` for a tensor of `shape` laid out by
    `layout`: one key per block (a tuple with one block number per
    dimension), its devices in mesh order (several for a replicated block)."""
    mesh = layout.mesh
    names = list(mesh.axis_names)
    blocks = {}
    for position, device in enumerate(np.ravel(mesh.devices)):
        coords = np.unravel_index(position, tuple(mesh.shape))
        index = tuple(0 if axis is None else int(coords[names.index(axis)])
                      for axis in layout.axes)
        blocks.setdefault(index, []).append(str(device))
    return blocks


def block_bounds(layout, shape):
    """For each dimension, `[(start, stop), ...]` of each of its blocks."""
    bounds = []
    for dim, size in enumerate(shape):
        parts = layout.num_shards(dim)
        chunk = max(1, math.ceil(size / parts))
        bounds.append([(min(i * chunk, size), min((i + 1) * chunk, size))
                       for i in range(parts)])
    return bounds


def shown_dims(layout):
    """The (at most two) dimensions a picture shows: the split ones first,
    then the last whole ones; and the split dimensions left over (one
    picture for each block of those)."""
    rank = layout.rank
    split = [d for d in range(rank) if layout.axes[d] is not None]
    shown = split[:2]
    for d in reversed(range(rank)):
        if len(shown) >= 2:
            break
        if d not in shown:
            shown.append(d)
    return sorted(shown), split[2:]


def _compact(devices):
    """`["cpu:0", "cpu:4"]` -> `"cpu 0,4"`."""
    kinds = {}
    for device in devices:
        kind, sep, index = device.rpartition(":")
        if not sep:
            kind, index = "", device
        kinds.setdefault(kind, []).append(index)
    return " ".join(f"{kind} {','.join(ids)}".strip()
                    for kind, ids in kinds.items())


def _dim(layout, shape, d):
    axis = layout.axes[d]
    how = "whole" if axis is None else (
        f"split over {axis!r} ({layout.mesh.dim_size(axis)})")
    return f"dimension {d} (size {shape[d]}, {how})"


def orientation(layout, shape, width=80):
    """`(rows_dim, cols_dim, extra)`: the dimension along the rows (None:
    one row), along the columns (None: one column) and the split ones left
    over. Columns run along the second shown dimension unless the grid is
    then wider than `width` and the other way round is narrower."""
    shown, extra = shown_dims(layout)
    if not shown:
        return None, None, extra
    if len(shown) == 1:
        shown = [None, shown[0]]
    rows, cols = shown
    blocks = {d: layout.num_shards(d) for d in shown if d is not None}
    cell = 4 + max(len(_compact([str(d) for d in np.ravel(
        layout.mesh.devices)])) // max(1, math.prod(blocks.values())),
        6 * len(shown))

    def wide(c):
        return (1 if c is None else blocks[c]) * cell

    if wide(cols) > width and wide(rows) < wide(cols):
        rows, cols = cols, rows
    return rows, cols, extra


def _dim(layout, shape, d):
    axis = layout.axes[d]
    how = "whole" if axis is None else (
        f"split over {axis!r} ({layout.mesh.dim_size(axis)})")
    return f"dimension {d} (size {shape[d]}, {how})"


def describe(layout, shape, rows, cols, extra):
    """One line saying which dimensions the picture shows (None for a
    scalar)."""
    rank = len(shape)
    if rank == 0:
        return None
    text = "; ".join(f"{where}: {_dim(layout, shape, d)}" for where, d in (
        ("rows", rows), ("columns", cols)) if d is not None)
    whole = [d for d in range(rank) if d not in (rows, cols) and d not in extra]
    if whole:
        text += f"; rank {rank}: " + ", ".join(
            f"dimension {d} (size {shape[d]})" for d in whole
        ) + " whole in every block"
    if extra:
        text += f"; rank {rank}: one grid per block of " + ", ".join(
            _dim(layout, shape, d) for d in extra)
    return text


def _grid(blocks, bounds, rows_dim, cols_dim, fixed):
    """A rich Table of the blocks whose extra split dimensions have the
    block numbers `fixed` (`{dim: block}`)."""
    from rich import box
    from rich.table import Table

    n_rows = 1 if rows_dim is None else len(bounds[rows_dim])
    n_cols = 1 if cols_dim is None else len(bounds[cols_dim])
    table = Table(show_header=False, show_lines=True, box=box.SQUARE,
                  padding=(0, 1))
    for _ in range(n_cols):
        table.add_column(justify="center", overflow="fold")
    shown = sorted(d for d in (rows_dim, cols_dim) if d is not None)
    for r in range(n_rows):
        cells = []
        for c in range(n_cols):
            at = dict(fixed)
            if rows_dim is not None:
                at[rows_dim] = r
            if cols_dim is not None:
                at[cols_dim] = c
            devices = [device for index, held in blocks.items()
                       if all(index[d] == b for d, b in at.items())
                       for device in held]
            where = ", ".join("{}:{}".format(*bounds[d][at[d]]) for d in shown)
            cells.append(_compact(devices) + (f"\n[{where}]" if where else ""))
        table.add_row(*cells)
    return table


def render(layout, shape, *, title=None, width=None):
    """The picture as text (what `draw` prints), on every process; as wide
    as the terminal (or `COLUMNS`), 80 columns when there is none."""
    from rich.console import Console

    out = io.StringIO()
    shape = tuple(int(d) for d in shape)
    blocks = block_devices(layout, shape)
    bounds = block_bounds(layout, shape)
    console = Console(file=out, color_system=None, highlight=False,
                      width=width)
    rows, cols, extra = orientation(layout, shape, console.width)
    if title:
        console.print(title)
    note = describe(layout, shape, rows, cols, extra)
    if note:
        console.print(note)
    for numbers in itertools.product(*(range(len(bounds[d])) for d in extra)):
        fixed = dict(zip(extra, numbers))
        if fixed:
            console.print(", ".join(
                f"dimension {d} block {b + 1} of {len(bounds[d])} "
                f"[{bounds[d][b][0]}:{bounds[d][b][1]}]"
                for d, b in fixed.items()))
        console.print(_grid(blocks, bounds, rows, cols, fixed))
    return out.getvalue()


def draw(layout, shape, *, title=None, file=None):
    """Print the picture of a tensor of `shape` under `layout` on process 0
    (other processes print nothing). `file`: a text stream (None: standard
    output)."""
    if process_index() != 0:
        return
    width = shutil.get_terminal_size().columns if file is None else None
    (file if file is not None else sys.stdout).write(
        render(layout, shape, title=title, width=width))


def _not_on_mesh(x, where):
    shape = getattr(x, "shape", None)
    shape = "" if shape is None else f" of shape {tuple(shape)}"
    kind = type(x)
    return TypeError(
        "klm.visualize expects a tensor or keras.Variable placed on a mesh "
        "(made under a distribution or a LayoutMap scope, or by "
        f"klm.distribute / klm.pack). Received: a {kind.__module__}."
        f"{kind.__name__}{shape}, {where}. Place it with "
        "klm.distribute(x, layout) first."
    )


def visualize(x, *, file=None):
    """Print which devices hold each block of `x`, a tensor or a
    `keras.Variable` on a mesh.

    Each cell of the grid is a block, with the devices holding it (all of
    them for a replicated block) and its index range. Two dimensions are
    shown: for a tensor of rank above 2 a line says which (the split ones
    first), and a tensor split along three or more gets one grid per block
    of the others. The layout and the mesh are read from the backend
    (`klm.fetch_layout`); no data moves, and in a run of several processes
    process 0 prints the whole picture. `file` is a text stream (None:
    standard output).

    Example:

    >>> import io, numpy as np, keras_layoutmap as klm
    >>> mesh = klm.create_mesh([("batch", len(klm.list_devices()))])
    >>> x = klm.distribute(np.zeros((8, 4)), klm.Layout(["batch", None], mesh))
    >>> out = io.StringIO()
    >>> klm.visualize(x, file=out)  # process 0 prints
    >>> klm.process_index() > 0 or "cpu 1" in out.getvalue()
    True
    """
    if isinstance(x, (np.ndarray, np.generic, list, tuple, int, float)):
        raise _not_on_mesh(x, "a host value on no mesh")
    backend = backends.get()
    try:
        on_mesh = backend.is_on_mesh(x)
    except (TypeError, ValueError, AttributeError):
        on_mesh = False
    if not on_mesh:
        raise _not_on_mesh(x, "which lives on one device, on no mesh")
    layout = fetch_layout(x)
    shape = tuple(int(d) for d in x.shape)
    name = getattr(x, "path", None) or "tensor"
    title = (f"{name} {shape} {getattr(x, 'dtype', '')}: "
             f"{layout.sharding_specs} on {layout.mesh!r}")
    draw(layout, shape, title=title, file=file)


def show_rows(rows, pattern, *, file=None):
    """`Report.show`: draw the explain rows matching `pattern`."""
    try:
        regex = re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(
            f"{pattern!r} is not a valid regex: {e}") from None
    chosen = [r for r in rows if regex.fullmatch(r.object_path)
              or regex.fullmatch(r.path)]
    if not chosen:
        raise ValueError(
            f"the regex {pattern!r} matches no weight (it must match a "
            "whole object path or variable path, as a rule does; e.g. "
            f"{rows[0].object_path!r})" if rows else
            f"the regex {pattern!r} matches no weight: the model has "
            "none")
    for r in chosen:
        rule = "no rule" if r.rule is None else f"rule {r.rule!r}"
        draw(r.layout, r.shape, file=file, title=(
            f"{r.object_path} ({r.path}) {r.shape} {r.dtype}: "
            f"{r.layout.sharding_specs} by {rule} on {r.layout.mesh!r}"))
    return chosen
