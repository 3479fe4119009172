"""Which devices TensorFlow meshes use: GPUs where TensorFlow sees them,
unless `klm.configure_virtual_devices` asked for logical CPUs (the CPU
demo path).

`choose` is the whole decision, pure; `kind` asks TensorFlow.
"""

import tensorflow as tf

# Set by `configure_virtual_devices` / a CPU `join`: meshes stay on CPUs.
VIRTUAL_CPUS = [False]


def choose(gpu_count, virtual_cpus):
    """`"GPU"` or `"CPU"`: the device type of meshes, given how many GPUs
    TensorFlow sees and whether virtual CPU devices were asked for.

    >>> choose(2, False), choose(2, True), choose(0, False)
    ('GPU', 'CPU', 'CPU')
    """
    return "GPU" if gpu_count > 0 and not virtual_cpus else "CPU"


def gpu_count():
    return len(tf.config.list_physical_devices("GPU"))


def kind():
    return choose(gpu_count(), VIRTUAL_CPUS[0])
