"""What the test files share: the run's devices and its meshes, the digits
data, the small models the tests train and the rules that split them, the
keras-hub config, the checks that training on a mesh equals one device, and
starting Python in fresh processes.

A plain module, not a fixture file (those are in conftest.py): a test file
imports it as `from helpers import ...` (pytest puts tests/, which is no
package, on `sys.path`), and so does a script a test starts in a fresh
process (tests/workers/scheduled.py puts tests/ on its own path; a script
written at run time gets `TESTS` on its PYTHONPATH). Importing it touches no
device: conftest.py, or the script, configures the devices first.
"""

import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile

import keras
import numpy as np
from sklearn.datasets import load_digits

import keras_layoutmap as klm
from keras_layoutmap import backends

TESTS = os.path.dirname(os.path.abspath(__file__))

# -- the run's devices --------------------------------------------------------

# `sharding` tests need a backend that places tensors on a mesh; `training`
# tests need `model.fit` on a mesh. On JAX and TensorFlow the run makes 8
# devices in this process. On torch a mesh spans processes, one device each:
# the run has as many devices as the launcher started processes (`python -m
# keras_layoutmap.launch -n 4 -m pytest`, as `nox -s tests-torch` does),
# every rank running the same session and each test collectively.
# conftest.py makes the devices.
BACKEND = backends.name()
SHARDING = backends.get().SHARDING
TRAINING = backends.get().TRAINING
if BACKEND == "torch":
    DEVICES = int(os.environ.get("WORLD_SIZE", "1"))
else:
    # KLM_TEST_DEVICES (default 8) checks the suite at another count, e.g.
    # 4 as a torch run has.
    DEVICES = int(os.environ.get("KLM_TEST_DEVICES", "8"))

# The plan that a test of one fit feature (optimizer options, loss
# reductions, sample weights, mixed precision, the layer zoo) trains in:
# model parallel on a (batch, model) mesh, which splits the batch as well
# as some kernels and holds the other weights replicated, as data parallel
# holds them all. On JAX and TensorFlow a `DataParallel` fit runs the same
# SPMD step. torch's data-parallel step is its own (backends/torch/
# local_step.py): tests/test_torch_local_step.py checks it against one
# device on these features (sample weights, optimizers, loss scaling,
# reductions that are not row means, several outputs), and the workflow
# matrix's data-parallel rows on every backend.
FIT_PLANS = ("model_parallel",)

# The processes running this session together (the launcher's WORLD_SIZE):
# 4 in tests-torch's mesh run, 2 in the JAX and TensorFlow workflow-matrix
# runs, else 1. True where a mesh spans them.
PROCESSES = int(os.environ.get("WORLD_SIZE", "1"))
SPANS_PROCESSES = PROCESSES > 1


def folder_every_rank_shares(name):
    """A folder of this run that every rank of it gets under `name` (the
    ranks' common parent is the launcher; with its port it names the run),
    as a user's script saves and loads one path on every rank."""
    run = f"klm-pytest-{os.getppid()}-{os.environ.get('MASTER_PORT', '0')}"
    path = pathlib.Path(tempfile.gettempdir(), run, name)
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- meshes -------------------------------------------------------------------


def device_names(n):
    """The names of the run's first `n` devices (`"cpu:0"`, ...)."""
    return [f"cpu:{i}" for i in range(n)]


def dp_mesh():
    """A data-parallel mesh over every device of the run."""
    return klm.create_mesh([("batch", DEVICES)])


def mp_mesh(axis="model", width=2):
    """A (batch, `axis`) mesh over every device of the run, `axis` `width`
    wide: (4, 2) on 8 devices, (2, 2) on 4."""
    return klm.create_mesh([("batch", DEVICES // width), (axis, width)])


def keras_mesh(mesh):
    """`mesh` as Keras' own `keras.distribution.DeviceMesh`, as a user of
    the Keras distribution guide writes it."""
    return keras.distribution.DeviceMesh(
        mesh.shape, mesh.axis_names, devices=keras.distribution.list_devices())


def fake_mesh(dims):
    """A mesh over named (not real) devices: enough for rules, layouts and
    explain, which never place a tensor."""
    return klm.Mesh.for_planning(dims)


def local_shards(value, layout):
    """What `klm.unpack` of `value` laid out as `layout` gives in this
    process: the piece each of its devices holds, in mesh order, cut here
    from the whole numpy `value`."""
    mesh = layout.mesh
    names = list(mesh.axis_names)
    pieces = []
    for device in mesh.local_device_ids():
        position = np.unravel_index(device, tuple(mesh.shape))
        index = []
        for size, axis in zip(value.shape, layout.axes):
            if axis is None:
                index.append(slice(None))
                continue
            parts = mesh.dim_size(axis)
            step = size // parts
            start = step * int(position[names.index(axis)])
            index.append(slice(start, start + step))
        pieces.append(value[tuple(index)])
    return pieces


# -- data ---------------------------------------------------------------------


def digits_data(rows=None, labels="int32"):
    """scikit-learn's handwritten digits (1797 images of 8x8 pixels), the
    first `rows` of them (all by default): pixels scaled to [0, 1] as
    float32, one row of 64 per image, and the labels 0-9 as `labels`."""
    x, y = load_digits(return_X_y=True)
    return (x[:rows] / 16.0).astype("float32"), y[:rows].astype(labels)


# -- models -------------------------------------------------------------------


def compile_classifier(model, optimizer=None, loss=None, accuracy=True, **kwargs):
    """`model.compile` as the tests train a classifier of logits: Adam(0.01)
    unless `optimizer`, sparse categorical cross-entropy unless `loss`,
    accuracy as the metric unless not `accuracy` (or `metrics` given);
    `kwargs` go to compile."""
    kwargs.setdefault("metrics", ["accuracy"] if accuracy else None)
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(0.01),
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )
    return model


def quantized_mlp():
    """16 -> 32 -> 16 -> 8, Functional, the model the quantized tests
    quantize: d1 split by columns, d2 by rows, d3 unplaced."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="d2")(x)
    return keras.Model(inputs, keras.layers.Dense(8, name="d3")(x))


def sequential_mlp(*units, inputs=64, names=None, name=None, seed=0):
    """A `keras.Sequential` of Dense layers, not compiled: `inputs` features
    in, a layer of each of `units`, relu but the last, named d1, d2, ...
    unless `names`; the random seed set to `seed` first."""
    keras.utils.set_random_seed(seed)
    names = names or [f"d{i}" for i in range(1, len(units) + 1)]
    layers = [keras.Input((inputs,))]
    for width, layer in zip(units[:-1], names):
        layers.append(keras.layers.Dense(width, activation="relu", name=layer))
    layers.append(keras.layers.Dense(units[-1], name=names[len(units) - 1]))
    return keras.Sequential(layers, name=name)


def digits_net(optimizer=None, loss=None, *, before=None, middle=None, d1=None,
               d2=None, model_class=keras.Model, **compile_kwargs):
    """A Functional classifier of the digits, 64 pixels -> Dense(32, relu)
    `d1` -> Dense(10) `d2`, named "net", made from seed 0 and compiled by
    `compile_classifier(model, optimizer, loss, **compile_kwargs)`.

    `before` and `middle` make a layer to put before d1 and between d1 and d2
    (each made where it stands, in the order the layers are made); `d1` and
    `d2` are more arguments for those layers; `model_class` makes the model
    from (inputs, outputs, name=)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    x = before()(inputs) if before is not None else inputs
    x = keras.layers.Dense(32, activation="relu", name="d1", **(d1 or {}))(x)
    if middle is not None:
        x = middle()(x)
    outputs = keras.layers.Dense(10, name="d2", **(d2 or {}))(x)
    model = model_class(inputs, outputs, name="net")
    return compile_classifier(model, optimizer, loss, **compile_kwargs)


def small_classifier():
    """A compiled 64 -> 16 -> 10 classifier of `sequential_mlp`, seed 0:
    the tests' smallest model to train across processes."""
    return compile_classifier(sequential_mlp(16, 10), accuracy=False)


def small_fit(model, rows=96, batch=40):
    """`model` trained for 2 epochs on the first `rows` digits, the last
    batch of an epoch short; its losses and weights as lists (JSON)."""
    x, y = digits_data(rows)
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False,
                        verbose=0).history
    return {"loss": [float(v) for v in history["loss"]],
            "weights": [w.tolist() for w in model.get_weights()]}


def net_layout_map(mesh, bias=True):
    """Model-parallel rules for d1 -> d2 (a Megatron-style pair): d1's
    kernel split over `model` on its outputs, its bias with them (unless
    not `bias`), and d2's kernel on its inputs."""
    layout_map = klm.LayoutMap(mesh)
    layout_map[r"d1\.kernel"] = (None, "model")
    if bias:
        layout_map[r"d1\.bias"] = ("model",)
    layout_map[r"d2\.kernel"] = ("model", None)
    return layout_map


# -- keras-hub ----------------------------------------------------------------

TINY_GEMMA = dict(vocabulary_size=64, num_layers=2, num_query_heads=4,
                  num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
                  head_dim=8)


def gemma_lm():
    """A causal LM head on a TINY_GEMMA backbone, as a plain Functional
    model (the keras-hub task class would need a data loader for its
    preprocessing)."""
    import keras_hub  # the `nlp` extra; tests-jax installs it

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**TINY_GEMMA)
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask"),
    }
    hidden = backbone(inputs)
    logits = backbone.token_embedding(hidden, reverse=True)
    model = keras.Model(inputs, logits, name="gemma_lm")
    model.backbone = backbone
    return compile_classifier(model, keras.optimizers.Adam(1e-2))


def gemma_data():
    """36 sequences of 8 tokens for gemma_lm, each next token the label."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(36, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((36, 8), "int32")}
    return x, tokens[:, 1:]


def assert_held_as_rules_say(distribution, model, at_least):
    """Every weight of `model` holds, read from the backend, the layout
    `distribution` gives it, and at least `at_least` of them are split."""
    sharded = 0
    for variable in model.weights:
        expected = distribution.get_variable_layout(variable)
        actual = klm.fetch_layout(variable)
        assert tuple(actual.axes) == tuple(expected.axes), variable.path
        sharded += not actual.is_fully_replicated()
    assert sharded >= at_least


# -- one device and a mesh give the same numbers --------------------------------


def assert_same_history(history, reference, rtol=1e-5, same_keys=True):
    """Each of `reference`'s logs (`History.history`, a dict of lists) in
    `history` to `rtol`; the same logs, no more, unless not `same_keys`."""
    if same_keys:
        assert history.keys() == reference.keys()
    for key in reference:
        np.testing.assert_allclose(history[key], reference[key], rtol=rtol,
                                   err_msg=key)


# How far apart two runs of the same training may end when only the order
# of a sum differs (a mesh reduces a batch's gradient in another order than
# one device): the digits MLP, 2 epochs of Adam(0.01), trained on one
# device with the rows of each batch permuted, ends up to 5.0e-6 from the
# unpermuted run (torch: 5.4e-7 to 5.0e-6 in 5 permutations; JAX: 1.9e-7
# to 4.9e-7; `python tests/tolerances.py reorder`). Adam divides each
# update by the gradient's size, so an element whose gradient nearly
# cancels moves by the rounding of that cancellation.
# `test_training.py::test_weight_tolerance_covers_a_reordered_sum` checks
# the bound where the tests run.
REORDER_ATOL = 1e-5


def assert_same_weights(weights, reference, rtol=1e-5, atol=REORDER_ATOL):
    """Two lists of weights (`model.get_weights()`) pairwise equal, to the
    rounding a sum taken in another order leaves (`REORDER_ATOL`)."""
    for a, b in zip(weights, reference):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


# -- fresh processes ----------------------------------------------------------


def run_script(script, *args, timeout=240):
    """`python script ARGS...` in a fresh process, as a user runs a script,
    importing the same keras_layoutmap as this process does, and helpers
    (both on its PYTHONPATH); its output captured as text."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(klm.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [root, TESTS, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(script), *map(str, args)],
                          env=env, capture_output=True, text=True,
                          timeout=timeout)


def launch(n, *args, timeout=300, **kwargs):
    """`python -m keras_layoutmap.launch -n n ARGS...`, its output captured
    as text; `kwargs` go to `subprocess.run`."""
    return subprocess.run(
        [sys.executable, "-m", "keras_layoutmap.launch", "-n", str(n),
         *map(str, args)],
        capture_output=True, text=True, timeout=timeout, **kwargs)


# What our launcher (or an enclosing run, or a scheduler's job) tells a
# process about the run it is in.
LAUNCHER_VARIABLES = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
    "MASTER_PORT", "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID",
    "KLM_DEVICES_PER_PROCESS", "DTENSOR_JOBS", "XLA_FLAGS")


def process_environment(monkeypatch, env):
    """This process's environment as that of a process whose run `env`
    describes (a launcher's or a scheduler's variables) and no other: the
    checks `initialize` and `configure_virtual_devices` make before joining
    a run, in this process."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))


def as_launched_process(monkeypatch, processes, rank, **more):
    """`process_environment` as the launcher gives process `rank` of
    `processes` (and `more` variables)."""
    process_environment(monkeypatch, {
        "WORLD_SIZE": processes, "RANK": rank, "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": 29999, **more})


def configure_script(path, devices=8):
    """Write a script to `path` that only configures `devices` devices, as
    the first call of a user's script (the launcher's checks need no more)."""
    path.write_text("import keras_layoutmap as klm\n"
                    f"klm.configure_virtual_devices({devices})\n")
    return path


@contextlib.contextmanager
def counted_collectives():
    """{name: calls} of torch's functional collectives inside the block."""
    import torch

    namespace = torch.ops._c10d_functional
    names = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce",
             "all_to_all_single")
    originals = {name: getattr(namespace, name) for name in names}
    counts = {}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)
        return call

    for name in names:
        setattr(namespace, name, counting(name))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(namespace, name, original)
