"""Measures the rounding floors behind the tests' widest tolerances: how far
one device's own result moves when nothing but rounding changes. A mesh
changes rounding the same way (a sum taken in another order), so a
comparison with one device can be no tighter than these floors.

    KERAS_BACKEND=jax python tests/tolerances.py [reorder|nudge] [runs]

- reorder: the digits MLP of tests/test_training.py, 2 epochs of
  Adam(0.01), with the rows of each batch permuted: the largest weight
  difference (`helpers.REORDER_ATOL` bounds it).
- nudge: the workflow matrix's hub-quantized row (a Gemma quantized to
  int4, int8 and float8, LoRA on two projections, `fit`), with every norm
  scale moved by one float32 ulp of (1 + scale) before `fit`, under the
  row's optimizer and under Adam(1e-2): per LoRA matrix, the largest
  element's move and the move's norm over the norm of its update
  (test_workflows.py's `hub_quantized_tolerance`).
"""

import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402


def reorder(runs):
    import test_training as tt
    from helpers import digits_data

    digits = digits_data()
    reference = tt.build()
    tt.train(reference, digits)
    for seed in range(runs):
        model = tt.build()
        tt.train(model, tt.reordered_within_batches(*digits, seed))
        moved = max(float(np.max(np.abs(a - b))) for a, b in
                    zip(tt.weights(model), tt.weights(reference)))
        print(f"reorder {seed}: largest weight difference {moved:.2e}")


def nudge(runs):
    import test_workflows as tw

    for name, optimizer in (("the row's", None),
                            ("Adam(1e-2)", lambda: keras.optimizers.Adam(1e-2))):
        folder = pathlib.Path(tempfile.mkdtemp())
        reference = tw.hub_quantized(False, folder, optimizer=optimizer)
        start = tw.hub_quantized(False, folder, optimizer=optimizer, fit=False)
        for seed in range(runs):
            got = tw.hub_quantized(False, folder, optimizer=optimizer,
                                   nudge=np.random.default_rng(seed))
            for key in sorted(k for k in reference if "lora" in k):
                moved = np.asarray(got[key]) - np.asarray(reference[key])
                update = np.asarray(reference[key]) - np.asarray(start[key])
                print(f"nudge, {name} optimizer, {seed}: {key}: largest "
                      f"{np.max(np.abs(moved)):.1e}, norm "
                      f"{np.linalg.norm(moved) / np.linalg.norm(update):.1%}"
                      " of the update")
            loss = abs(got["loss"][0] / reference["loss"][0] - 1)
            print(f"nudge, {name} optimizer, {seed}: loss {loss:.1e} relative")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "reorder"
    {"reorder": reorder, "nudge": nudge}[what](
        int(sys.argv[2]) if len(sys.argv) > 2 else 3)
