"""One data-parallel `fit` on 8 devices, as 1 process x 8 and as
2 processes x 4, on the session's backend (`KERAS_BACKEND`).

    KERAS_BACKEND=jax python benchmarks/processes.py
    KERAS_BACKEND=tensorflow python benchmarks/processes.py

Prints the runtime start-up time (configure_virtual_devices, which joins the
multi-process runtime under the launcher), the first step (compile) and the
median step time of each layout, and the ratio. This machine has 2 cores:
8 virtual devices share them, so the ratio reports, it sets no goal.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

STEPS, BATCH = 40, 128

WORKER = r'''
import json, sys, time
t0 = time.perf_counter()
import keras_layoutmap as klm
klm.configure_virtual_devices(8)
startup = time.perf_counter() - t0
sys.path.insert(0, "benchmarks")
import keras, numpy as np
from common import StepTimer, build_mlp
x = np.random.RandomState(0).rand(BATCH * STEPS, 64).astype("float32")
y = np.random.RandomState(1).randint(0, 10, BATCH * STEPS).astype("int32")
klm.set_distribution(klm.DataParallel(klm.create_mesh([("batch", 8)])))
model = build_mlp(0, 64, 512, 10)
timer = StepTimer()
model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
          callbacks=[timer])
if klm.process_index() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"startup": startup, "first": timer.times[0],
                   "median": float(np.median(timer.times[1:]))}, f)
'''.replace("BATCH", str(BATCH)).replace("STEPS", str(STEPS))


def run(processes):
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out")
        with open(script, "w") as f:
            f.write(WORKER)
        command = [sys.executable, script, result]
        if processes > 1:
            command = [sys.executable, "-m", "keras_layoutmap.launch", "-n",
                       str(processes), script, result]
        subprocess.run(command, check=True, timeout=600,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(result) as f:
            return json.load(f)


def main():
    backend = os.environ.get("KERAS_BACKEND", "jax")
    start = time.perf_counter()
    one, two = run(1), run(2)
    print(f"data-parallel fit, {backend}, 8 devices, global batch {BATCH}, "
          f"{STEPS} steps")
    print(f"{'':28}{'1 process x 8':>16}{'2 processes x 4':>18}{'ratio':>8}")
    for key, label in (("startup", "runtime start-up (s)"),
                       ("first", "first step (s)"),
                       ("median", "median step (ms)")):
        scale = 1000 if key == "median" else 1
        a, b = one[key] * scale, two[key] * scale
        print(f"{label:28}{a:16.3f}{b:18.3f}{b / a:8.2f}")
    print(f"(measured in {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
