"""keras-hub's distributed-tuning recipe on a tiny Gemma: `ModelParallel`
with `GemmaBackbone.get_layout_map`, `fit`, LoRA, greedy `generate()`.

The recipe's code is Keras' own (`keras.distribution.DeviceMesh`,
`ModelParallel(layout_map=..., batch_dim_name="batch")`, `scope()`); the
only line added is `import keras_layoutmap`. The model is built from a tiny
config (no download) and fed token ids (`preprocessor=None`, no tokenizer).
The same steps run on one device first: the script checks that training
gives the same weights and that the generated ids are identical, prints the
rules' table and the ids, and exits non-zero otherwise.

Run: `KERAS_BACKEND=jax python examples/gemma_model_parallel.py` (or
`tensorflow`: 8 virtual CPU devices, a (4, 2) mesh; on torch, 4 processes
under `python -m keras_layoutmap.launch -n 4`, a (2, 2) mesh).
"""

import importlib.util
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_layoutmap as klm  # noqa: E402

TORCH = os.environ["KERAS_BACKEND"] == "torch"
DEVICES = int(os.environ.get("WORLD_SIZE", "1")) if TORCH else 8
if DEVICES > 1:
    klm.configure_virtual_devices(DEVICES)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

TINY = dict(vocabulary_size=64, num_layers=1, num_query_heads=4,
            num_key_value_heads=2, hidden_dim=16, intermediate_dim=32, head_dim=8)


def build():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**TINY)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(rank=2)
    lm.compile(optimizer=keras.optimizers.Adam(1e-2),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
               sampler="greedy")
    return lm


def fit(lm):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, size=(16, 9)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, 8), "int32")}
    # keras-hub batches numpy with grain or tf.data; without either (a JAX
    # or torch install), Keras' own fit runs the same train step.
    loader = any(importlib.util.find_spec(m) for m in ("grain", "tensorflow"))
    run = lm.fit if loader else (lambda *a, **k: keras.Model.fit(lm, *a, **k))
    run(x, tokens[:, 1:], batch_size=8, epochs=2, shuffle=False, verbose=0)


def generate(lm):
    rng = np.random.default_rng(1)
    mask = np.zeros((8, 8), bool)
    mask[:, :3] = True
    tokens = np.where(mask, rng.integers(1, 64, (8, 8)), 0).astype("int32")
    prompt = {"token_ids": tokens, "padding_mask": mask}
    return np.asarray(lm.generate(prompt, stop_token_ids=None)["token_ids"])


def lora_weights(lm):
    return [keras.ops.convert_to_numpy(v) for v in lm.trainable_weights]


def main():
    reference = build()
    fit(reference)
    expected_ids = generate(reference)

    # keras-hub's recipe, unchanged.
    device_mesh = keras.distribution.DeviceMesh(
        shape=(DEVICES // 2, 2), axis_names=("batch", "model"),
        devices=keras.distribution.list_devices())
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(device_mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch")
    with distribution.scope():
        lm = build()
        fit(lm)
        ids = generate(lm)

    main_process = int(os.environ.get("RANK", "0")) == 0
    if main_process:
        print(klm.LayoutMap.from_keras(layout_map).explain(lm.backbone))
        print("generated ids (model parallel):")
        print(ids)
    for a, b in zip(lora_weights(lm), lora_weights(reference)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(ids, expected_ids)
    if main_process:
        print("OK: fit, LoRA and greedy generate equal the one-device run")


if __name__ == "__main__":
    main()
