"""Shared by backends whose sharding is not built yet."""


def not_built_message(backend, issue):
    return (
        f"Placing tensors on a mesh is not built yet for the {backend} "
        f"backend ({issue}). Rules, layouts, object paths, serialization and "
        "explain work on every backend; use KERAS_BACKEND=jax for sharded "
        "training today."
    )


def not_built(message):
    def fail(*args, **kwargs):
        raise NotImplementedError(message)

    return fail
