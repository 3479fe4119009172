"""`klm.auto_layout_map` against keras-hub's recipe and `klm.fsdp`, side by
side in one run: the step time of training, the tokens per second of greedy
`generate()`, and the weight bytes device 0 holds (read from the backend),
on keras-hub's Gemma and Llama causal LMs.

Each plan places the same model (built from a small config: vocabulary 1024,
2 layers, hidden 64, 4 query heads and 2 key-value heads for Gemma, 4 for
Llama, whose recipe puts them on the batch axis; no download, token ids in,
`preprocessor=None`) on a (batch, model 2) mesh:

- `recipe`: `Backbone.get_layout_map(mesh)`, keras-hub's hand-written rules;
- `auto`: `klm.auto_layout_map(build, mesh)`, planned from the model's
  builder, shapes only;
- `fsdp`: `klm.fsdp(mesh, axis="batch")`, every large weight split over
  the batch axis and gathered at each use.

Training: `train_on_batch` on 8 sequences of 16 tokens, the median of 5
steps after 2 warm-up steps (the compile). Generation: 8 prompts of 4
tokens, 28 new tokens each, the median of 3 calls after a warm-up call.
Every plan's losses and generated ids are checked against the same model on
one device (ids identical, losses to 1e-4).

The goals (issue 33): the auto plan reaches at least 0.95 of the recipe's
speed, and generates faster than the FSDP plan. On virtual CPU devices the
collectives of a tiny model dominate: the ratios between plans are the
figures, not the absolute speeds.

Run: KERAS_BACKEND=jax python benchmarks/auto_plan.py
     KERAS_BACKEND=tensorflow python benchmarks/auto_plan.py
     KERAS_BACKEND=torch python benchmarks/auto_plan.py   # 4 processes
"""

import os
import statistics
import time

from bench_devices import mesh_devices

DEVICES = mesh_devices(__file__)  # on torch: 4 processes
BACKEND = os.environ["KERAS_BACKEND"]
TORCH = BACKEND == "torch"

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(DEVICES)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

VOCAB = 1024
CONFIGS = {
    "gemma": (keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM,
              dict(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                   num_key_value_heads=2, hidden_dim=64, intermediate_dim=128,
                   head_dim=16)),
    # 4 key/value heads: the recipe puts them on the batch axis, and with
    # 2 it is refused on a (4, 2) mesh (the auto plan is not).
    "llama": (keras_hub.models.LlamaBackbone, keras_hub.models.LlamaCausalLM,
              dict(vocabulary_size=VOCAB, num_layers=2, num_query_heads=4,
                   num_key_value_heads=4, hidden_dim=64,
                   intermediate_dim=128)),
}
BATCH, TOKENS = 8, 16  # training
LENGTH, PROMPT = 32, 4  # generation
WARM_STEPS, STEPS, CALLS = 2, 5, 3


def builder(arch):
    backbone_class, lm_class, config = CONFIGS[arch]

    def build():
        keras.utils.set_random_seed(0)
        backbone = backbone_class(**config)
        lm = lm_class(backbone=backbone, preprocessor=None)
        lm.compile(optimizer=keras.optimizers.Adam(1e-3),
                   loss=keras.losses.SparseCategoricalCrossentropy(
                       from_logits=True),
                   sampler="greedy")
        return lm

    return build


def batches():
    rng = np.random.default_rng(0)
    for _ in range(WARM_STEPS + STEPS):
        tokens = rng.integers(1, VOCAB, (BATCH, TOKENS + 1)).astype("int32")
        x = {"token_ids": tokens[:, :-1],
             "padding_mask": np.ones((BATCH, TOKENS), "int32")}
        yield x, tokens[:, 1:]


def prompts():
    rng = np.random.default_rng(1)
    mask = np.zeros((BATCH, LENGTH), bool)
    mask[:, :PROMPT] = True
    tokens = np.where(mask, rng.integers(1, VOCAB, (BATCH, LENGTH)), 0)
    return {"token_ids": tokens.astype("int32"), "padding_mask": mask}


def device_0_bytes(lm):
    """The bytes of `lm`'s weights on this process's first device, read
    from the backend (each weight's local piece)."""
    total = 0
    for weight in lm.weights:
        piece = klm.unpack(weight)[0]
        total += int(np.prod(piece.shape)) * np.dtype(
            keras.backend.standardize_dtype(weight.dtype)).itemsize
    return total


def measure(lm):
    """(step seconds, losses, tokens per second, ids, device-0 bytes)."""
    losses, seconds = [], []
    for step, (x, y) in enumerate(batches()):
        start = time.perf_counter()
        loss = lm.train_on_batch(x, y)
        loss = float(np.asarray(loss[0] if isinstance(loss, list) else loss))
        if step >= WARM_STEPS:
            seconds.append(time.perf_counter() - start)
        losses.append(loss)
    ids = np.asarray(lm.generate(prompts(), stop_token_ids=None)["token_ids"])
    calls = []
    for _ in range(CALLS):
        start = time.perf_counter()
        lm.generate(prompts(), stop_token_ids=None)
        calls.append(time.perf_counter() - start)
    rate = BATCH * (LENGTH - PROMPT) / statistics.median(calls)
    return statistics.median(seconds), losses, rate, ids, device_0_bytes(lm)


def plans(arch, mesh):
    backbone_class = CONFIGS[arch][0]
    return {
        "recipe": klm.LayoutMap.from_keras(backbone_class.get_layout_map(mesh)),
        "auto": klm.auto_layout_map(builder(arch), mesh),
        "fsdp": klm.fsdp(mesh, axis="batch"),
    }


def main():
    rank0 = int(os.environ.get("RANK", "0")) == 0
    mesh = klm.create_mesh([("batch", DEVICES // 2), ("model", 2)])
    ratios = {}
    for arch in CONFIGS:
        build = builder(arch)
        one = measure(build())
        rows = {}
        for name, plan in plans(arch, mesh).items():
            with plan.scope():
                lm = build()
            rows[name] = got = measure(lm)
            np.testing.assert_allclose(got[1], one[1], rtol=1e-4,
                                       err_msg=f"{arch} {name} losses")
            np.testing.assert_array_equal(got[3], one[3],
                                          err_msg=f"{arch} {name} ids")
            del lm
        if not rank0:
            continue
        total = device_0_bytes(build())
        print(f"{BACKEND} {arch}: {DEVICES} devices, a ({DEVICES // 2}, 2) "
              "mesh; losses and generated ids equal one device's")
        print(f"  {'plan':<10} {'step ms':>8} {'tokens/s':>9} "
              f"{'device 0 bytes':>15} {'of the model':>13}")
        print(f"  {'one device':<10} {one[0] * 1e3:8.1f} {one[2]:9.1f} "
              f"{total:15d} {1:13.2f}")
        for name, (step, _, rate, _, held) in rows.items():
            print(f"  {name:<10} {step * 1e3:8.1f} {rate:9.1f} {held:15d} "
                  f"{held / total:13.2f}")
        auto, recipe, fsdp = rows["auto"], rows["recipe"], rows["fsdp"]
        ratios[arch] = (recipe[0] / auto[0], auto[2] / recipe[2],
                        auto[2] / fsdp[2])
    if rank0:
        for arch, (fit, generate, over_fsdp) in ratios.items():
            print(f"{arch}: auto / recipe speed: fit {fit:.2f}, generate "
                  f"{generate:.2f} (goal >= 0.95); auto / fsdp generate "
                  f"{over_fsdp:.2f} (goal > 1)")


if __name__ == "__main__":
    main()
