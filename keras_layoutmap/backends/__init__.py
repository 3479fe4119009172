"""The one place that knows which Keras backend is running.

Each backend module (`jax`, `tensorflow`, `torch`) implements the same small
interface; the rest of the package calls it through `get()` and never imports
a backend itself:

- `configure_virtual_devices(n)`, `list_devices()`, `local_devices()`,
  `num_local_devices(mesh)`
- `fetch_layout(x) -> (axes, mesh_or_None)`: the sharding a value really has
- `is_on_mesh(x)`: whether a value is laid out on a mesh (not one device)
- `device_bytes(x) -> {device: bytes}`: what this process's devices hold of
  a value, read from the backend
- `distribute(x, layout)`, `pack(components, layout)`, `unpack(x)`
- `relayout_variable(variable, layout)`: move an existing variable onto a layout
- `unplace_variable(variable)`: bring a variable on a mesh back to one device
- `after_place(model)` (optional): called once a model's variables moved
- `process_count()`, `process_index()`, `barrier(name)`,
  `gather_process_batches(local)`: a run of several processes
- `enter_together(name)`: whether every process enters `name` (a save)
  with this one, told outside any collective (`save_handshake`)
- `install()`: backend-specific hooks into Keras (e.g. the data iterator)
- `SHARDING`: whether this backend can place tensors on a multi-device mesh
- `TRAINING`: whether `model.fit` / `evaluate` / `predict` run on one
- `NOT_BUILT`: the message for what is missing (None when nothing is)
"""

import importlib

import keras


def name():
    """The Keras backend in use: `"jax"`, `"tensorflow"` or `"torch"`."""
    return keras.backend.backend()


def get():
    """The backend module for the running Keras backend."""
    backend = name()
    if backend not in ("jax", "tensorflow", "torch"):
        raise RuntimeError(
            f"keras-layoutmap supports the jax, tensorflow and torch Keras "
            f"backends. Received: KERAS_BACKEND={backend!r}."
        )
    return importlib.import_module(f"keras_layoutmap.backends.{backend}")
