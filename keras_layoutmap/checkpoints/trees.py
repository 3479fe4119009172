"""What the checkpoint modules share: which backends go through JAX's
mirror, and nested state trees (Keras' `get_state_tree` layout) walked,
flattened to `a/b/c` paths and nested again."""

from keras_layoutmap import backends


def orbax_arrays():
    """`backends.orbax_arrays`, imported when a checkpoint is written or
    read (it imports JAX)."""
    from keras_layoutmap.backends import orbax_arrays

    return orbax_arrays


def mirrors():
    """Whether values go through JAX's mirror (TensorFlow and torch)."""
    return backends.name() != "jax"


def map_leaves(tree, function):
    if isinstance(tree, dict):
        return {k: map_leaves(v, function) for k, v in tree.items()}
    return function(tree)


def flat(tree, prefix=""):
    """`{"a/b/c": leaf}` of a nested tree."""
    paths = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            paths.update(flat(value, f"{prefix}{key}/"))
        else:
            paths[f"{prefix}{key}"] = value
    return paths


def nested(paths):
    """The nested tree of `{"a/b/c": leaf}`."""
    tree = {}
    for path, value in paths.items():
        *parents, last = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree
