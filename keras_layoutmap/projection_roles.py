"""Column, row and heads: the role of each Dense / EinsumDense kernel in a
model, and the projections each pairs with (the part of `weight_roles`
that reads projections).

A projection that reads the residual stream is column-parallel and one that
writes it row-parallel; where the shapes cannot tell, the tensors the
projections read decide (`projection_inputs`), then the Functional graph,
then the order in their layer. An `EinsumDense` kernel with several output
dimensions is attention's heads, one with several contracted dimensions
their output.
"""

import collections
import math

import keras

from keras_layoutmap.projection_inputs import projection_reads
from keras_layoutmap.rules import auto


class Projection:
    """A Dense or EinsumDense kernel: which of its dimensions are inputs
    (contracted) and which outputs."""

    def __init__(self, path, owner, parent, shape, ins, outs):
        self.path, self.owner, self.parent = path, owner, parent
        self.shape, self.ins, self.outs = shape, ins, outs
        self.role = None
        self.partners = []
        self.group = [self]  # the projections of the same parent layer

    @property
    def in_size(self):
        return math.prod(self.shape[d] for d in self.ins)

    @property
    def out_size(self):
        return math.prod(self.shape[d] for d in self.outs)


def einsum_dims(equation, kernel_rank):
    """`(ins, outs, letters)` of an EinsumDense kernel: its dimensions the
    equation contracts with the input, those it keeps in the output, and
    each dimension's letter."""
    equation = equation.replace("...", "")
    left, out = equation.split("->")
    inputs, kernel = left.split(",")
    kernel = kernel.strip()
    if len(kernel) != kernel_rank:
        return None
    ins = tuple(i for i, c in enumerate(kernel) if c in inputs and c not in out)
    outs = tuple(i for i, c in enumerate(kernel) if c in out)
    return ins, outs, kernel


def projections_of(rows):
    """`{object_path: Projection}` for every Dense / EinsumDense kernel."""
    found = {}
    for variable, object_path, owner, parent, shape in rows:
        if variable.name != "kernel" or owner is None:
            continue
        if isinstance(owner, keras.layers.EinsumDense):
            dims = einsum_dims(owner.equation, len(shape))
            if dims is None or not dims[0] or not dims[1]:
                continue
            ins, outs = dims[0], dims[1]
        elif isinstance(owner, keras.layers.Dense) and len(shape) == 2:
            ins, outs = (0,), (1,)
        else:
            continue
        found[object_path] = Projection(object_path, owner, parent, shape,
                                         ins, outs)
    return found


def assign_roles(projections, width, model):
    """Column or row for each projection (heads for attention's), and the
    projections each pairs with. A projection that reads the residual
    stream (`width`) is column-parallel, one that writes it row-parallel.
    Where the shape cannot tell: one that reads the tensor an earlier
    projection reads takes its side (a gated MLP's gate and up); one fed by
    a column-parallel projection (the tensor it wrote, the graph of a
    Functional model, else the previous projection in the same layer) is
    row-parallel; any other column-parallel."""
    previous = {}  # id(parent) -> the last projection seen there
    by_layer = {id(p.owner): p for p in projections.values()}
    traced = []  # projection_reads(model, ...), traced on first need

    def reads():
        if not traced:
            traced.append(projection_reads(
                model, [p.owner for p in projections.values()]))
        return traced[0]

    decided = []
    for proj in projections.values():
        if len(proj.outs) > 1 and len(proj.ins) == 1:
            proj.role = auto.HEADS
        elif len(proj.ins) > 1 and len(proj.outs) == 1:
            proj.role = auto.HEADS_OUT
        elif width is not None and proj.in_size == width != proj.out_size:
            proj.role = auto.COLUMN
        elif width is not None and proj.out_size == width != proj.in_size:
            proj.role = auto.ROW
        else:
            proj.role = _ambiguous_role(proj, decided, reads(), by_layer,
                                        previous.get(id(proj.parent)))
        previous[id(proj.parent)] = proj
        decided.append(proj)
    _pair(projections)


def _ambiguous_role(proj, decided, reads, by_layer, last):
    """The role of a projection whose shape does not say (see
    `assign_roles`)."""
    read = reads.get(id(proj.owner), (None, None))[0]
    if read is not None:
        for other in decided:
            if reads.get(id(other.owner), (None, None))[0] == read:
                return (auto.ROW if other.role in (auto.ROW, auto.HEADS_OUT)
                        else auto.COLUMN)
        upstream = [p for p in decided
                    if reads.get(id(p.owner), (None, None))[1] == read]
    else:
        upstream = []
    if not upstream:
        upstream = _upstream(proj, by_layer)
        if upstream is None:  # no graph: the previous one in its layer
            upstream = [] if last is None else [last]
            if last is not None and last.role == auto.HEADS:
                # Attention's heads merged into features (Falcon's output
                # Dense): the query's width, whichever head came last.
                upstream += [p for p in decided if p.role == auto.HEADS
                             and p.parent is last.parent]
    follows_column = any(
        up.role in (auto.COLUMN, auto.HEADS) and up.out_size == proj.in_size
        for up in upstream)
    return auto.ROW if follows_column else auto.COLUMN


def _upstream(proj, by_layer):
    """The projections whose outputs reach `proj`'s layer through layers of
    one input (activations, dropout, norms), read from a Functional or
    Sequential model's graph; a merge (`Add`, `Concatenate`) or an input
    ends the search. None when the layer has no graph (inside a layer)."""
    nodes = getattr(proj.owner, "_inbound_nodes", None)
    if not nodes or not isinstance(proj.parent, keras.Model):
        return None
    found, stack, seen = [], list(nodes[0].parent_nodes), set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        layer = node.operation
        if id(layer) in by_layer:
            found.append(by_layer[id(layer)])
        elif len(node.parent_nodes) == 1:
            stack.extend(node.parent_nodes)
    return found


def _pair(projections):
    """Record, in each parent layer, which row projection each column one
    feeds (the next row reading as many features as it writes), and which
    the heads feed (an attention output by heads, or a row projection
    reading the heads merged into features)."""
    by_parent = collections.defaultdict(list)
    for proj in projections.values():
        by_parent[id(proj.parent)].append(proj)
    for group in by_parent.values():
        for proj in group:
            proj.group = group
        merged = max((p.out_size for p in group if p.role == auto.HEADS),
                     default=None)  # the heads' width, merged into features
        for i, proj in enumerate(group):
            if proj.role not in (auto.COLUMN, auto.HEADS):
                continue
            for later in group[i + 1:]:
                if (later.role == auto.ROW and (
                        _feeds(proj, later) if proj.role == auto.COLUMN
                        else later.in_size == merged)) or (
                        later.role == auto.HEADS_OUT
                        and proj.role == auto.HEADS and _feeds(proj, later)):
                    proj.partners.append(later)
                    later.partners.append(proj)
                    break


def _feeds(first, second):
    if first.role == auto.HEADS:
        heads = tuple(first.shape[d] for d in first.outs)
        return heads == tuple(second.shape[d] for d in second.ins) or (
            heads[1:] == tuple(second.shape[d] for d in second.ins)[1:])
    return first.out_size == second.in_size
