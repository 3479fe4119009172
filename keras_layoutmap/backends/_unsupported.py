"""Shared by backends whose sharding is not built yet."""


def not_built(backend, issue):
    def fail(*args, **kwargs):
        raise NotImplementedError(
            f"Sharding tensors on the {backend} backend is not built yet "
            f"({issue}). Rules, layouts, paths, serialization and explain work "
            "on every backend; run with KERAS_BACKEND=jax for sharded "
            "training today."
        )

    return fail
