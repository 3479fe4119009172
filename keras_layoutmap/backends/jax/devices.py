"""Which devices JAX meshes use: the accelerators JAX starts on (its
default backend: GPUs or TPUs where it sees them), unless
`klm.configure_virtual_devices` asked for CPU devices (the CPU demo path).

`choose` is the whole decision, pure; `platform` asks JAX.
"""

import jax

# Set by `configure_virtual_devices` / a CPU `join`: meshes stay on CPUs.
VIRTUAL_CPUS = [False]


def choose(default_backend, virtual_cpus):
    """The JAX platform meshes use, given JAX's default backend (`"cpu"`,
    `"gpu"`, `"tpu"`) and whether virtual CPU devices were asked for.

    >>> choose("gpu", False), choose("gpu", True), choose("cpu", False)
    ('gpu', 'cpu', 'cpu')
    """
    return "cpu" if virtual_cpus else str(default_backend)


def platform():
    return choose(jax.default_backend(), VIRTUAL_CPUS[0])


def global_devices():
    """Every device of the chosen platform, across processes."""
    return jax.devices(platform())


def local_devices():
    """This process's devices of the chosen platform."""
    return jax.local_devices(backend=platform())
