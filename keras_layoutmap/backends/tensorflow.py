"""The TensorFlow backend. Devices only, for now: DTensor placement of
tensors and variables is tracked in the TensorFlow DTensor issue."""

import tensorflow as tf

from keras_layoutmap.backends._unsupported import not_built, not_built_message

SHARDING = False

NOT_BUILT = not_built_message("tensorflow", "the TensorFlow DTensor backend issue")
_unbuilt = not_built(NOT_BUILT)
fetch_layout = distribute = pack = unpack = relayout_variable = _unbuilt


def configure_virtual_devices(n):
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * n
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise RuntimeError(
                f"configure_virtual_devices({n}) must run before TensorFlow "
                f"initialises its devices; it already has {have} logical CPU "
                "device(s). Call it right after `import keras_layoutmap`."
            ) from None


def list_devices():
    return [
        f"{d.device_type.lower()}:{i}"
        for i, d in enumerate(tf.config.list_logical_devices("CPU"))
    ]


def num_local_devices(mesh):
    return mesh.size


def install():
    pass
