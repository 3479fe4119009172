"""Tokens per second of greedy `CausalLM.generate()` under keras-hub's
recipe (`keras.distribution.ModelParallel` with
`GemmaBackbone.get_layout_map`) against the same model on one device, in
one run; on JAX also against plain Keras without the plugin (a subprocess
that never imports keras_layoutmap, the same mesh and rules).

The model: a `GemmaCausalLM` from a small config (vocabulary 1024, 2 layers,
hidden 64, 4 query / 2 key-value heads), no download, fed token ids
(`preprocessor=None`): 8 prompts of 4 tokens, 28 new tokens each (224 per
call). Time: the median of 3 calls after one warm-up call (the compile).
The generated ids are checked equal to one device's.

Measured (2-core machine shared with other jobs' tests, one run each):
JAX one device 12534 tokens/s, ModelParallel 781 (0.06), plain Keras on
the same mesh 1265 (klm / plain 0.62, ids identical); TensorFlow one device
765, ModelParallel 72 (0.09). Tiny model on virtual CPU devices: the mesh's
collectives dominate; the figures say what the plugin costs, not what a
sharded model gains on accelerators. torch (4 processes, a (2, 2) mesh,
one run on a quiet machine, 2026-11-24): one device 254.7 tokens/s,
ModelParallel 40.7 (0.16), ids identical.

Run: KERAS_BACKEND=jax python benchmarks/generate.py
     KERAS_BACKEND=tensorflow python benchmarks/generate.py
     KERAS_BACKEND=torch python benchmarks/generate.py   # 4 processes
"""

import os
import statistics
import subprocess
import sys
import time

from bench_devices import mesh_devices

DEVICES = mesh_devices(__file__)  # on torch: 4 processes
BACKEND = os.environ["KERAS_BACKEND"]
TORCH = BACKEND == "torch"
PLAIN = "--plain" in sys.argv  # the subprocess: Keras alone
if PLAIN:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}")
else:
    import keras_layoutmap as klm

    klm.configure_virtual_devices(DEVICES)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

CONFIG = dict(vocabulary_size=1024, num_layers=2, num_query_heads=4,
              num_key_value_heads=2, hidden_dim=64, intermediate_dim=128,
              head_dim=16)
BATCH, LENGTH, PROMPT, CALLS = 8, 32, 4, 3


def build():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(**CONFIG)
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy")
    return lm


def prompts():
    rng = np.random.default_rng(0)
    mask = np.zeros((BATCH, LENGTH), bool)
    mask[:, :PROMPT] = True
    tokens = np.where(mask, rng.integers(1, 1024, (BATCH, LENGTH)), 0)
    return {"token_ids": tokens.astype("int32"), "padding_mask": mask}


def timed(lm):
    """(tokens per second, ids): the median of CALLS calls after a warm-up."""
    ids = np.asarray(lm.generate(prompts(), stop_token_ids=None)["token_ids"])
    seconds = []
    for _ in range(CALLS):
        start = time.perf_counter()
        lm.generate(prompts(), stop_token_ids=None)
        seconds.append(time.perf_counter() - start)
    return BATCH * (LENGTH - PROMPT) / statistics.median(seconds), ids


def model_parallel():
    mesh = keras.distribution.DeviceMesh(
        (DEVICES // 2, 2), ("batch", "model"),
        devices=keras.distribution.list_devices())
    distribution = keras.distribution.ModelParallel(
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
        batch_dim_name="batch")
    with distribution.scope():
        return timed(build())


def main():
    if PLAIN:
        rate, ids = model_parallel()
        print(f"PLAIN {rate} {','.join(map(str, ids.ravel()))}")
        return
    one_rate, one_ids = timed(build())
    rate, ids = model_parallel()
    np.testing.assert_array_equal(ids, one_ids)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print(f"{BACKEND}: greedy generate, {BATCH} x {LENGTH - PROMPT} new tokens, "
          f"{DEVICES} devices ({DEVICES // 2} x 2 mesh)")
    print(f"  one device:          {one_rate:8.1f} tokens/s")
    print(f"  ModelParallel (klm): {rate:8.1f} tokens/s  "
          f"ratio to one device {rate / one_rate:.2f}")
    if BACKEND == "jax":
        out = subprocess.run([sys.executable, __file__, "--plain"],
                             capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if x.startswith("PLAIN "))
        _, plain_rate, plain_ids = line.split()
        same = plain_ids == ",".join(map(str, ids.ravel()))
        print(f"  plain Keras (no klm): {float(plain_rate):7.1f} tokens/s  "
              f"klm / plain {rate / float(plain_rate):.2f}  "
              f"(ids {'identical' if same else 'DIFFER'})")
    print("generated ids identical to one device")


if __name__ == "__main__":
    main()
