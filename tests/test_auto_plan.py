"""`klm.auto_layout_map`: a tensor-parallel plan from a model's layers and
shapes. From shapes alone (fake meshes): the roles each weight gets and
why, every layout dividing its weight, the memory per device against
keras-hub's recipes and at Llama-70B scale, `device_memory`, bad inputs and
`klm explain --auto`. On devices: a Llama placed by the plan trains as on
one device (a CNN with a Dense pair does in every cell of the workflow
matrix: its auto-plan row)."""

import math
import re
import time

import keras
import numpy as np
import pytest
from helpers import (
    BACKEND,
    assert_same_history,
    assert_same_weights,
    compile_classifier,
    fake_mesh,
    mp_mesh,
)

import keras_layoutmap as klm
from keras_layoutmap import weight_roles
from keras_layoutmap.layout import fit_problem
from keras_layoutmap.rules import auto

TF = BACKEND == "tensorflow"


def mlp():
    """64 -> Dense(32) d1 -> Dense(16) d2 -> Dense(10) d3, seed 0 (not
    compiled: a builder runs with shapes only, no optimizer)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    x = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
    x = keras.layers.Dense(16, activation="relu", name="d2")(x)
    outputs = keras.layers.Dense(10, name="d3")(x)
    return keras.Model(inputs, outputs, name="mlp")


def shapes_only(build):
    with keras.StatelessScope(initialize_variables=False):
        return build()


def rows_of(report):
    return {r.object_path: r for r in report.rows}


def assert_every_layout_fits(report):
    for r in report.rows:
        assert fit_problem(r.layout, r.shape) is None, r.object_path
        assert r.rule == re.escape(r.object_path), r.object_path  # exact
        assert r.reason, r.object_path
    assert report.unused_rules == [] and report.shadowed_rules == []


def share_of_device_0(report):
    total = sum(math.prod(r.shape) * np.dtype(r.dtype).itemsize
                for r in report.rows)
    return report.bytes_per_device / total


# -- roles and reasons (shapes only) -------------------------------------------


def test_mlp_column_then_row_and_the_reasons():
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    plan = klm.auto_layout_map(mlp, mesh)
    assert isinstance(plan, klm.LayoutMap)
    report = plan.explain(shapes_only(mlp))
    rows = rows_of(report)
    assert_every_layout_fits(report)
    # d1 column-parallel (its 32 outputs over model, its inputs over batch),
    # d2 row-parallel: one reduction for the pair; d3 starts a new pair.
    assert rows["d1.kernel"].layout.sharding_specs == ["batch", "model"]
    assert rows["d1.bias"].layout.sharding_specs == ["model"]
    assert rows["d2.kernel"].layout.sharding_specs == ["model", "batch"]
    assert rows["d2.bias"].layout.sharding_specs == ["unsharded"]
    assert rows["d3.kernel"].layout.sharding_specs[1] == "model"
    assert rows["d1.kernel"].reason.startswith("column-parallel: feeds d2")
    assert rows["d2.kernel"].reason.startswith("row-parallel: reads d1")
    assert "FSDP" in rows["d1.kernel"].reason
    assert rows["d1.bias"].reason == "follows d1.kernel: its outputs over 'model'"
    assert "why" in report.render(width=250)
    assert report.to_dict()["weights"][0]["reason"] == rows["d1.kernel"].reason
    # Rules as data: the layouts and the reasons survive JSON.
    again = klm.LayoutMap.from_json(plan.to_json(), mesh=mesh)
    assert again.get_config() == plan.get_config()
    assert again.reason(r"d1\.kernel") == plan.reason(r"d1\.kernel")
    del again[r"d1\.kernel"]  # edited: the reason goes with the rule
    assert again.reason(r"d1\.kernel") is None


def test_a_builder_is_planned_without_memory_and_keeps_auto_names():
    def build():  # auto-named layers: dense, dense_1, ...
        inputs = keras.Input((4,), dtype="int32")
        x = keras.layers.Embedding(1 << 20, 1024)(inputs)  # 4 GiB
        return keras.Model(inputs, keras.layers.Dense(8)(x))

    mesh = fake_mesh([("batch", 4), ("model", 2)])
    start = time.perf_counter()
    plan = klm.auto_layout_map(build, mesh)
    assert time.perf_counter() - start < 10  # nothing allocated
    report = plan.explain(shapes_only(build))  # the next build: same names
    assert_every_layout_fits(report)
    assert report.bytes_per_device < (1 << 32) // 7


def test_a_builder_may_compile():
    """keras-hub's task models compile as they are made: the optimizer's
    counter is made outside the shapes-only scope."""
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    plan = klm.auto_layout_map(lambda: compile_classifier(mlp()), mesh)
    assert plan.get_config() == klm.auto_layout_map(mlp, mesh).get_config()


def test_moe_over_experts_and_gqa_heads_another_way():
    keras_hub = pytest.importorskip("keras_hub", reason="the `nlp` extra")

    def build():
        return keras_hub.models.MixtralBackbone(
            vocabulary_size=64, num_layers=1, num_query_heads=8,
            num_key_value_heads=2, hidden_dim=32, intermediate_dim=32,
            num_experts=4)

    mesh = fake_mesh([("batch", 2), ("model", 4)])
    report = klm.auto_layout_map(build, mesh).explain(shapes_only(build))
    assert_every_layout_fits(report)
    experts = [r for r in report.rows if r.reason.startswith("experts:")]
    assert len(experts) == 3
    for r in experts:
        if BACKEND == "tensorflow":  # DTensor routes to whole experts only
            assert r.layout.sharding_specs[0] == "unsharded", r.path
            assert "model" in r.layout.sharding_specs, r.path
            assert "TensorFlow" in r.reason
        else:
            assert r.shape[0] == 4 and r.layout.sharding_specs[0] == "model"
    (router,) = [r for r in report.rows if "router" in r.reason]
    assert router.layout.is_fully_replicated()
    keys = [r for r in report.rows if r.path.endswith("key/kernel")]
    (key,) = keys  # (32 features, 2 heads, head_dim 4)
    assert key.layout.sharding_specs == ["model", "unsharded", "batch"]
    assert ("2 key/value heads, model axis 'model' of 4: split inputs "
            "instead") in key.reason


def test_functional_graph_branches_and_merges():
    """Pairs follow the graph, not the order of the layers: two branches
    from the input are both column-parallel, a merge starts a new pair,
    and activations and dropout between two Dense layers keep the pair."""
    inputs = keras.Input((16,))
    a = keras.layers.Dense(32, name="a")(inputs)
    b = keras.layers.Dense(32, name="b")(inputs)
    x = keras.layers.Dense(16, name="c")(keras.layers.Concatenate()([a, b]))
    x = keras.layers.Dropout(0.1)(keras.layers.Activation("relu")(x))
    model = keras.Model(inputs, keras.layers.Dense(16, name="d")(x))
    roles = {w.path: w.role for w in weight_roles.describe(model)}
    assert [roles[f"{n}.kernel"] for n in "abcd"] == [
        auto.COLUMN, auto.COLUMN, auto.COLUMN, auto.ROW]


class Block(keras.layers.Layer):
    """x + down(relu(up(x))): a residual MLP block."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up = keras.layers.Dense(64, activation="relu")
        self.down = keras.layers.Dense(16)

    def call(self, x):
        return x + self.down(self.up(x))


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.blocks = [Block(), Block()]
        self.head = keras.layers.Dense(10)

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_subclassed_model_pairs_inside_each_block():
    def build():
        model = Net()
        model(keras.Input((16,)))
        return model

    mesh = fake_mesh([("batch", 4), ("model", 2)])
    report = klm.auto_layout_map(build, mesh).explain(shapes_only(build))
    assert_every_layout_fits(report)
    rows = rows_of(report)
    for i in (0, 1):
        up, down = rows[f"blocks.{i}.up.kernel"], rows[f"blocks.{i}.down.kernel"]
        assert up.layout.sharding_specs == ["batch", "model"]
        assert down.layout.sharding_specs == ["model", "batch"]
        down_name = down.path.split("/")[-2]  # the layer's (auto) name
        assert up.reason.startswith(f"column-parallel: feeds {down_name}")
    assert rows["head.kernel"].layout.sharding_specs[1] == "model"


class GatedBlock(keras.layers.Layer):
    """x + down(gelu(gate(x)) * up(x)) with square kernels: the shapes
    cannot tell the down projection from the gate."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = keras.layers.Dense(16, name="gate")
        self.up = keras.layers.Dense(16, name="up")
        self.down = keras.layers.Dense(16, name="down")

    def call(self, x):
        return x + self.down(keras.ops.gelu(self.gate(x)) * self.up(x))


class GatedNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.block = GatedBlock(name="block")

    def call(self, x):
        return self.block(x)


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_square_gated_mlp_pairs_by_the_tensors_each_projection_reads(kind):
    """The gate and up read one tensor, so both are column-parallel and the
    down projection is their row (the order of the weights alone made `up`
    the row and `down` a column: correct numbers, extra collectives)."""
    def build():
        inputs = keras.Input((16,))
        if kind == "functional":
            return keras.Model(inputs, GatedBlock(name="block")(inputs))
        model = GatedNet()
        model(inputs)
        return model

    model = shapes_only(build)
    roles = {w.path: w.role for w in weight_roles.describe(model)}
    assert [roles[f"block.{n}.kernel"] for n in ("gate", "up", "down")] == [
        auto.COLUMN, auto.COLUMN, auto.ROW]
    # The trace put every layer's own `call` back.
    assert not any("call" in vars(layer) for layer in model._flatten_layers())


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_convolutions_on_tensorflow_keep_whole_kernels(backend):
    def build():
        inputs = keras.Input((8, 8, 1))
        x = keras.layers.Conv2D(8, 3, name="c1")(inputs)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))

    weights = {w.path: w for w in weight_roles.describe(shapes_only(build),
                                                     backend=backend)}
    placed = {p.path: p for p in auto.plan(
        list(weights.values()), {"batch": 4, "model": 2}, model_axis="model",
        data_axis="batch")}
    if backend == "tensorflow":
        assert placed["c1.kernel"].specs == (None,) * 4
        assert placed["c1.bias"].specs == (None,)
        assert "TensorFlow" in placed["c1.kernel"].reason
    else:
        assert placed["c1.kernel"].specs[3] == "model"  # output channels
        assert placed["c1.bias"].specs == ("model",)


# -- keras-hub architectures without a recipe, and against the recipes --------

ARCHS = {
    "Mistral": ("MistralBackbone", dict(num_query_heads=4,
                                        num_key_value_heads=2)),
    "GPT2": ("GPT2Backbone", dict(num_heads=2, max_sequence_length=16)),
    "Phi3": ("Phi3Backbone", dict(num_query_heads=4, num_key_value_heads=2)),
    "Qwen3": ("Qwen3Backbone", dict(num_query_heads=4, num_key_value_heads=2,
                                    head_dim=4)),
    "Falcon": ("FalconBackbone", dict(num_attention_heads=2)),
    "Bert": ("BertBackbone", dict(num_heads=2, max_sequence_length=16)),
    "OPT": ("OPTBackbone", dict(num_heads=2, max_sequence_length=16)),
    "Mixtral": ("MixtralBackbone", dict(num_query_heads=4,
                                        num_key_value_heads=2, num_experts=4)),
    # With a recipe: key/value heads the recipe's batch axis (4) divides.
    "Llama": ("LlamaBackbone", dict(num_query_heads=4, num_key_value_heads=4)),
    "Gemma": ("GemmaBackbone", dict(num_query_heads=4, num_key_value_heads=4,
                                    head_dim=8)),
}
TINY = dict(vocabulary_size=64, num_layers=1, hidden_dim=16,
            intermediate_dim=32)


def backbone_builder(arch):
    keras_hub = pytest.importorskip("keras_hub", reason="the `nlp` extra")
    name, config = ARCHS[arch]
    return lambda: getattr(keras_hub.models, name)(**TINY, **config)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_keras_hub_architecture(arch):
    build = backbone_builder(arch)
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    plan = klm.auto_layout_map(build, mesh)
    model = shapes_only(build)
    report = plan.explain(model)
    assert_every_layout_fits(report)
    assert share_of_device_0(report) <= 0.6
    # Every projection is one side of a pair (Falcon's attention output, a
    # square Dense after the heads, was column-parallel and alone), but a
    # pooler's; a mixture of experts' router is whole.
    alone = [r.path for r in report.rows
             if r.reason.startswith(("column-parallel", "row-parallel",
                                     "attention heads"))
             and not re.search(r"\b(feeds|reads) ", r.reason)]
    assert all("pooled_dense" in p for p in alone), alone
    for r in report.rows:
        if "router" in r.reason:
            assert r.layout.is_fully_replicated(), r.path
    if hasattr(type(model), "get_layout_map"):
        recipe = klm.LayoutMap.from_keras(type(model).get_layout_map(mesh),
                                          mesh)
        assert report.bytes_per_device <= recipe.explain(model).bytes_per_device


TASKS = {"Mistral": "MistralCausalLM", "GPT2": "GPT2CausalLM",
         "Phi3": "Phi3CausalLM", "Qwen3": "Qwen3CausalLM",
         "Falcon": "FalconCausalLM", "Bert": "BertTextClassifier",
         "OPT": "OPTCausalLM", "Mixtral": "MixtralCausalLM"}


def hub_task(arch):
    """The keras-hub task model of `arch`'s tiny backbone, compiled."""
    keras_hub = pytest.importorskip("keras_hub", reason="the `nlp` extra")
    keras.utils.set_random_seed(0)
    task = getattr(keras_hub.models, TASKS[arch])
    kwargs = {"num_classes": 2} if arch == "Bert" else {}
    model = task(backbone=backbone_builder(arch)(), preprocessor=None,
                 **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    if arch != "Bert":
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(
                          from_logits=True), sampler="greedy")
    return model


def hub_data(arch):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(8, 9)).astype("int32")  # 2 steps
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((8, 8), "int32")}
    if arch == "Bert":
        x["segment_ids"] = np.zeros((8, 8), "int32")
        return x, rng.integers(0, 2, size=(8,))
    return x, tokens[:, 1:]


def device_0_share(model):
    """The share of `model`'s weight bytes this process's first device
    holds, read from the backend (each weight's local piece)."""
    held = sum(math.prod(klm.unpack(w)[0].shape) for w in model.weights)
    return held / sum(math.prod(w.shape) for w in model.weights)


def train(model, x, y):
    """Two `train_on_batch` steps of 4 rows (keras-hub's `fit` would send
    numpy through its preprocessing loader): the losses."""
    losses = []
    for rows in (slice(0, 4), slice(4, 8)):
        loss = model.train_on_batch({k: v[rows] for k, v in x.items()}, y[rows])
        losses.append(float(np.asarray(loss[0] if isinstance(loss, list)
                                       else loss)))
    return losses


@pytest.mark.sharding
@pytest.mark.training
@pytest.mark.parametrize("arch", list(TASKS))
def test_keras_hub_architecture_trains_and_generates_as_one_device(arch):
    """The auto plan of each architecture with no recipe, from its task's
    builder: training equal to one device, greedy `generate()` ids
    identical (the causal LMs), every weight held as planned, and device 0
    holding at most 0.6 of the weight bytes, read from the backend."""
    x, y = hub_data(arch)
    reference = hub_task(arch)
    expected = train(reference, x, y)
    plan = klm.auto_layout_map(lambda: hub_task(arch), mp_mesh())
    with plan.scope():
        model = hub_task(arch)
    np.testing.assert_allclose(train(model, x, y), expected, rtol=1e-4)
    # Adam divides by sqrt(v): a near-zero gradient's rounding (sums taken
    # in another order) moves its step by a share of the learning rate
    # (Falcon: one element of 1,024 by 1.2e-5 at lr 1e-2).
    assert_same_weights(model.get_weights(), reference.get_weights(),
                        rtol=1e-4, atol=5e-5)
    assert_held_as_planned(model, plan)
    assert device_0_share(model) <= 0.6
    if arch == "Bert":
        return
    prompts = {"token_ids": np.where(np.arange(8) < 3, x["token_ids"][:4], 0),
               "padding_mask": np.arange(8)[None, :].repeat(4, 0) < 3}
    ids = model.generate(prompts, stop_token_ids=None)["token_ids"]
    want = reference.generate(prompts, stop_token_ids=None)["token_ids"]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(ids),
                                  keras.ops.convert_to_numpy(want))


LLAMA_70B = dict(vocabulary_size=128256, num_layers=80, num_query_heads=64,
                 num_key_value_heads=8, hidden_dim=8192,
                 intermediate_dim=28672)


@pytest.fixture(scope="module")
def llama_70b():
    keras_hub = pytest.importorskip("keras_hub", reason="the `nlp` extra")
    start = time.perf_counter()
    model = shapes_only(lambda: keras_hub.models.LlamaBackbone(**LLAMA_70B))
    return model, time.perf_counter() - start


@pytest.mark.parametrize("dims", [(8, 32), (16, 16)])
def test_llama_70b_from_shapes(llama_70b, dims):
    model, built_in = llama_70b
    mesh = fake_mesh([("batch", dims[0]), ("model", dims[1])])
    start = time.perf_counter()
    report = klm.auto_layout_map(model, mesh).explain(model)
    assert built_in + time.perf_counter() - start < 20
    assert_every_layout_fits(report)
    total = sum(math.prod(r.shape) * 4 for r in report.rows)
    assert report.bytes_per_device <= 1.1 * total / mesh.size
    rows = rows_of(report)
    assert rows["token_embedding.reverse_embeddings"].layout.sharding_specs \
        == ["batch", "model"]


def test_device_memory_splits_over_data_only_as_needed(llama_70b):
    model, _ = llama_70b
    mesh = fake_mesh([("batch", 8), ("model", 32)])
    roomy = klm.auto_layout_map(model, mesh, device_memory="16GiB")
    report = roomy.explain(model)
    assert not any("batch" in r.layout.sharding_specs for r in report.rows)
    tight = klm.auto_layout_map(model, mesh, device_memory="6GiB")
    report = tight.explain(model)
    fsdp = [r for r in report.rows if "FSDP" in (r.reason or "")]
    assert fsdp and len(fsdp) < len([r for r in report.rows
                                     if len(r.shape) > 1])
    assert "over device_memory" in fsdp[0].reason
    assert report.bytes_per_device <= 6 * 2**30
    with pytest.raises(ValueError) as info:
        klm.auto_layout_map(model, mesh, device_memory="512MiB")
    message = str(info.value)
    assert "512.0 MiB" in message and "at least" in message
    assert "model axis 'model' (32)" in message


# -- bad inputs ---------------------------------------------------------------


def test_bad_inputs():
    mesh = fake_mesh([("data", 4), ("model", 2)])
    with pytest.raises(ValueError, match=r"data_axis='batch' is not an axis "
                       r"of the mesh .*\['data', 'model'\]"):
        klm.auto_layout_map(mlp, mesh)
    with pytest.raises(ValueError, match="model_axis='tp' is not an axis"):
        klm.auto_layout_map(mlp, mesh, model_axis="tp", data_axis="data")
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    empty = keras.Sequential([keras.Input((4,)), keras.layers.Activation("relu")],
                             name="empty")
    with pytest.raises(ValueError, match="'empty' has no weights"):
        klm.auto_layout_map(empty, mesh)

    def broken():
        raise KeyError("num_heads")

    with pytest.raises(RuntimeError, match=r"the builder .*broken failed .*"
                       r"KeyError: 'num_heads'"):
        klm.auto_layout_map(broken, mesh)

    with pytest.raises(TypeError, match="a keras.Model or a function"):
        klm.auto_layout_map("mlp", mesh)
    with pytest.raises(ValueError, match="cannot parse the device memory"):
        klm.auto_layout_map(mlp, mesh, device_memory="lots")


# -- on devices: equal to one device -------------------------------------------


def assert_held_as_planned(model, plan):
    report = plan.explain(model)
    rows = {r.path: r for r in report.rows}
    split = 0
    for variable in model.weights:
        layout = klm.fetch_layout(variable)
        assert layout == rows[variable.path].layout, variable.path
        split += not layout.is_fully_replicated()
    assert split >= 3


def assert_trains_as_one_device(build, plan_of, x, y, batch_size):
    """`build()` trained one epoch on one device, then placed by the plan
    `plan_of(reference)` makes and trained again: the same losses and
    weights, every weight held as the plan says. Returns the plan and the
    reference model."""
    reference = build()
    ref = reference.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                        verbose=0).history
    plan = plan_of(reference)
    with plan.scope():
        model = build()
    history = model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                        verbose=0).history
    assert_same_history(history, ref, rtol=1e-4)
    assert_same_weights(model.get_weights(), reference.get_weights(),
                        rtol=1e-4, atol=1e-5)
    assert_held_as_planned(model, plan)
    return plan, reference


def llama_lm():
    """A causal LM on a one-layer Llama backbone, as a Functional model."""
    keras_hub = pytest.importorskip("keras_hub", reason="the `nlp` extra")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)
    inputs = {
        "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
        "padding_mask": keras.Input((None,), dtype="int32",
                                    name="padding_mask"),
    }
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    return keras.Model(inputs, logits, name="llama_lm")


def test_a_builder_of_a_model_around_a_backbone():
    """A Functional model that calls a keras-hub backbone, planned from its
    builder with nothing allocated (on TensorFlow the backbone's eager call
    on shapes-only variables raised an AttributeError)."""
    mesh = fake_mesh([("batch", 4), ("model", 2)])
    report = klm.auto_layout_map(llama_lm, mesh).explain(shapes_only(llama_lm))
    assert_every_layout_fits(report)
    assert sum(not r.layout.is_fully_replicated() for r in report.rows) >= 8


def compile_lm(model):
    return compile_classifier(model, keras.optimizers.Adam(1e-2),
                              accuracy=False)


@pytest.mark.sharding
@pytest.mark.training
def test_keras_hub_llama_parity():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(16, 9)).astype("int32")  # 2 steps
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), "int32")}
    plan, reference = assert_trains_as_one_device(
        lambda: compile_lm(llama_lm()),
        lambda model: klm.auto_layout_map(model, mp_mesh(width=4)),
        x, tokens[:, 1:], batch_size=8)
    # A model axis of 4 and 2 key/value heads: their input features split.
    (key,) = [r for r in plan.explain(reference).rows
              if r.path == "transformer_layer_0/self_attention/key/kernel"]
    assert "split inputs instead" in plan.reason(key.rule)


@pytest.mark.sharding
def test_attention_outputs_keep_the_batch_split_on_jax():
    """On JAX the plan lays out the query, key and value projections'
    outputs (batch over `batch`, heads over `model`), so that a decoding
    cache stays split over both axes; `explain` lists those rules, and the
    key's output has that layout, read from the backend. On TensorFlow and
    torch the plan has no output rule."""
    plan = klm.auto_layout_map(llama_lm, mp_mesh())
    with plan.scope():
        model = llama_lm()
    report = plan.explain(model)
    assert report.unused_rules == []
    attention = "transformer_layer_0/self_attention"
    if BACKEND != "jax":
        assert report.output_rules == {}
        return
    assert sorted(report.output_rules) == [
        f"{attention}/{role}/output" for role in ("key", "query", "value")]
    layer = model.get_layer("llama_backbone").transformer_layers[0]
    key_dense = layer._self_attention_layer._key_dense
    seen = []

    class Spy(type(key_dense)):
        def __call__(self, *args, **kwargs):
            out = super().__call__(*args, **kwargs)
            seen.append(klm.fetch_layout(out))
            return out

    key_dense.__class__ = Spy
    tokens = np.ones((8, 4), "int32")
    with plan.scope():
        model({"token_ids": tokens, "padding_mask": tokens})
    assert seen[-1].axes == ("batch", None, "model", None)


@pytest.mark.parametrize("name", ["auto_plan", "rules.auto", "weight_roles",
                                  "projection_inputs"])
def test_docstring_examples(name):
    import doctest
    import importlib

    module = importlib.import_module(f"keras_layoutmap.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
