"""Model-parallel and FSDP `fit` on P processes (`--processes`, default 2):
keras-layoutmap on the torch backend against torch's own engines on the
same `nn.Module`: `parallelize_module` (Colwise / Rowwise) and
`fully_shard` (FSDP2), over gloo.

The script is the launcher's parent, as `torch_ddp.py` is: it starts
itself once per process with `python -m keras_layoutmap.launch -n P
benchmarks/torch_parallel.py --worker`, every process with
`KERAS_BACKEND=torch` and `OMP_NUM_THREADS=1`, and prints what process 0
measured. In each process `klm.configure_virtual_devices(P)` joins the gloo
process group, and two models are trained, each in ten runs:

- **mlp**: a Megatron MLP, `Dense 128 -> 512 (relu) -> 128` on rows of
  128 features, global batch 128;
- **block**: a small pre-norm transformer block on sequences of 16 x 128,
  global batch 16: `LayerNormalization`, `MultiHeadAttention` (4 heads of
  32, no biases) and a residual, then `LayerNormalization`, the MLP
  `Dense 128 -> 512 (relu) -> 128` and a residual;

both with Adam 1e-3 and a mean squared error against random targets
(torch: `torch.optim.Adam(lr=1e-3, eps=1e-7)`, `nn.MSELoss`). The torch
twins (`nn.Linear`, `nn.LayerNorm(eps=1e-3)`, `scaled_dot_product_attention`)
start from the Keras model's initial weights, so the first step's loss of
every run is the same number.

Model parallel (all processes see the whole batch):

- **klm**: the Keras model built under a `klm.LayoutMap` on a mesh
  `[("batch", 1), ("model", P)]` (a batch axis of 1, so that batches stay
  whole: with a mesh of "model" alone, `ModelParallel` would split them
  over "model"): `up.kernel` `(None, "model")` and `up.bias` `("model",)`
  (column), `down.kernel` `("model", None)` (row), the query, key and value
  kernels `(None, "model", None)` and the output kernel
  `("model", None, None)` (heads); the rest replicated. `model.fit` on
  numpy arrays, every process passing the same data;
- **torch TP**: `parallelize_module` on a 1-D `init_device_mesh("cpu",
  (P,))` with `ColwiseParallel` on `up`, `query`, `key`, `value` and
  `RowwiseParallel` on `down` and the attention's `output`;
- the floors, **Keras piece** and **torch piece**: every process trains a
  model of its own the size of one process's piece, with no communication:
  the same model with `512 / P` hidden units and `4 / P` heads (what each
  process computes under Megatron's plan, less the collectives), on the
  whole batch.

FSDP (each process steps on its share of the global batch, the rows
`Shard(0)` gives it):

- **klm**: the Keras model built under `klm.fsdp(klm.create_mesh([("batch",
  P)]), axis="batch")`: every weight of 64 KiB or more split over "batch"
  along its largest dimension, the rest replicated; `model.fit` on the
  global batch;
- **torch FSDP2**: `fully_shard` on each of the model's parts (mlp: `up`,
  `down`; block: the attention, the MLP) and then on the root, over a 1-D
  `init_device_mesh("cpu", (P,))`, defaults otherwise (every parameter
  split along dimension 0, resharded after forward);
- the floors, **Keras share** and **torch share**: every process trains a
  whole model of its own on its share of every batch, with no
  communication (as `torch_ddp.py`'s Keras alone and torch alone).

And the whole model on one process, plain Keras and plain torch on the
whole batch (**Keras whole**, **torch whole**), every process a copy: what
one device's step costs, for reference.

The runs alternate in the same processes for `--rounds` rounds (the order
turning each round), so machine noise hits all alike; each round is one
epoch of `--skip` dropped warm-up steps and `--steps` timed steps. A Keras
step is timed in a callback's `on_train_batch_begin` / `on_train_batch_end`
(Keras' whole step), a torch step from slicing the batch to
`optimizer.step()` and `loss.item()`; process 0's CPU time per step is
reported beside the wall time.

Collectives: after the rounds, every distributed run takes `--count-steps`
more steps under a `TorchDispatchMode` that counts every collective op that
reaches torch's dispatcher, in the namespaces `c10d` (what
`torch.distributed.all_reduce`, `all_gather_single` and the rest call: FSDP2
calls `all_gather_single` and `reduce_scatter_single`) and
`_c10d_functional` (the functional collectives DTensor's redistributions
call on gloo: `all_reduce`, `all_gather_into_tensor`,
`reduce_scatter_tensor`), with its bytes: the larger of what it takes and
what it gives (an all-gather's output, a reduce-scatter's input, an
all-reduce's tensor). A DTensor op is let through to DTensor first, so its
collectives are counted as the local ops they become. Counted per step, on
process 0.

Checks: the first step's loss and the first epoch's mean loss of each klm
run against the same Keras model trained one epoch with no distribution on
the same batches (equal within a relative `TOLERANCE`: float rounding), and
the largest difference of the weights after that epoch; torch's engines'
losses are reported as their difference from the same numbers (the same
model in another framework: the first step agrees to float rounding, later
ones drift as Keras' Adam adds epsilon to sqrt(v) before bias correction
and torch's after).

Printed last, each alone on its line, `model-parallel overhead ratio:
R_mp` and `fsdp overhead ratio: R_fsdp`, with R = sum over the two models
of (klm - Keras floor) / sum of (torch's engine - torch floor) of the
median step times: what keras-layoutmap adds to Keras' step against what
torch's engine adds to plain torch's (the lines before give each model's).
Where torch's engine adds next to nothing, R's denominator is within noise
of 0 and R is not meaningful: read the differences.

Run: python benchmarks/torch_parallel.py [--processes 2] [--steps 12]
[--rounds 3] [--skip 2] [--count-steps 3]
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROCESSES = 2  # the default of --processes: one per core here
# mlp: rows of MLP_DIM features; block: sequences of SEQUENCE x DIM.
MLP_DIM, MLP_ROWS = 128, 128
DIM, HEADS, SEQUENCE, BLOCK_ROWS = 128, 4, 16, 16
WIDEN = 4  # the MLP's hidden width, in model widths
KINDS = ("mlp", "block")
SEED = 0
TOLERANCE = 1e-5  # klm's losses against one device's, relative


# The runs of each model: (key, label). "mp" runs see the whole batch,
# "fsdp" runs one process's share of it.
RUNS = (
    ("mp_klm", "klm ModelParallel"),
    ("mp_torch", "torch parallelize_module"),
    ("mp_keras_floor", "Keras piece (1/P width)"),
    ("mp_torch_floor", "torch piece (1/P width)"),
    ("fsdp_klm", "klm fsdp"),
    ("fsdp_torch", "torch fully_shard"),
    ("fsdp_keras_floor", "Keras share (1/P rows)"),
    ("fsdp_torch_floor", "torch share (1/P rows)"),
    ("keras_whole", "Keras whole, one process"),
    ("torch_whole", "torch whole, one process"),
)
DISTRIBUTED = ("mp_klm", "mp_torch", "fsdp_klm", "fsdp_torch")


def rows_of(kind):
    return MLP_ROWS if kind == "mlp" else BLOCK_ROWS


def width_of(kind):
    return MLP_DIM if kind == "mlp" else DIM


def build_keras(kind, parts=1):
    """The Keras model `kind` (seed 0), compiled; with `parts` > 1, one
    process's piece of it under Megatron's plan: 1/parts of the MLP's
    hidden units and of the heads."""
    import keras

    keras.utils.set_random_seed(SEED)
    width = width_of(kind)
    if kind == "mlp":
        inputs = keras.Input((width,))
        h = keras.layers.Dense(WIDEN * width // parts, activation="relu",
                               name="up")(inputs)
        outputs = keras.layers.Dense(width, name="down")(h)
    else:
        inputs = keras.Input((SEQUENCE, width))
        h = keras.layers.LayerNormalization(name="ln1")(inputs)
        h = keras.layers.MultiHeadAttention(
            HEADS // parts, width // HEADS, use_bias=False, name="mha")(h, h)
        x = keras.layers.Add(name="residual1")([inputs, h])
        h = keras.layers.LayerNormalization(name="ln2")(x)
        h = keras.layers.Dense(WIDEN * width // parts, activation="relu",
                               name="up")(h)
        h = keras.layers.Dense(width, name="down")(h)
        outputs = keras.layers.Add(name="residual2")([x, h])
    model = keras.Model(inputs, outputs, name=kind)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.MeanSquaredError())
    return model


def megatron_rules(klm, mesh, kind):
    """Column then row for the MLP, heads for the attention."""
    rules = klm.LayoutMap(mesh)
    rules[r"up\.kernel"] = (None, "model")
    rules[r"up\.bias"] = ("model",)
    rules[r"down\.kernel"] = ("model", None)
    if kind == "block":
        rules["mha/(query|key|value)/kernel"] = (None, "model", None)
        rules["mha/attention_output/kernel"] = ("model", None, None)
    return rules


def torch_models(torch):
    """The torch twins' classes: (MLP, Block)."""
    nn = torch.nn
    functional = torch.nn.functional

    class MLP(nn.Module):
        def __init__(self, width, hidden):
            super().__init__()
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    class Attention(nn.Module):
        """Keras' MultiHeadAttention with no biases, as four Linears: the
        heads are the Linears' output features in blocks of `head_dim`,
        so a ColwiseParallel split of them is a split of the heads."""

        def __init__(self, width, heads, head_dim):
            super().__init__()
            self.head_dim = head_dim
            self.query = nn.Linear(width, heads * head_dim, bias=False)
            self.key = nn.Linear(width, heads * head_dim, bias=False)
            self.value = nn.Linear(width, heads * head_dim, bias=False)
            self.output = nn.Linear(heads * head_dim, width, bias=False)

        def forward(self, x):
            b, s, _ = x.shape

            def heads(t):  # (b, s, heads here x head_dim) -> (b, heads, s, d)
                return t.view(b, s, -1, self.head_dim).transpose(1, 2)

            out = functional.scaled_dot_product_attention(
                heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
                scale=self.head_dim ** -0.5)
            return self.output(out.transpose(1, 2).reshape(b, s, -1))

    class Block(nn.Module):
        def __init__(self, width, heads, head_dim, hidden):
            super().__init__()
            self.ln1 = nn.LayerNorm(width, eps=1e-3)
            self.attention = Attention(width, heads, head_dim)
            self.ln2 = nn.LayerNorm(width, eps=1e-3)
            self.mlp = MLP(width, hidden)

        def forward(self, x):
            x = x + self.attention(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    return MLP, Block


def build_torch(torch, kind, parts=1):
    """The torch twin of `build_keras(kind, parts)` (torch's own initial
    weights; `copy_weights` gives it Keras')."""
    mlp, block = torch_models(torch)
    width = width_of(kind)
    if kind == "mlp":
        return mlp(width, WIDEN * width // parts)
    return block(width, HEADS // parts, width // HEADS, WIDEN * width // parts)


def copy_weights(torch, net, keras_model, kind):
    """Give `net` the weights of the whole Keras model `keras_model` (a
    Keras kernel is (in, out), a torch Linear weight (out, in))."""
    import numpy as np

    def put(parameter, array):
        parameter.copy_(torch.from_numpy(np.ascontiguousarray(array)))

    def dense(linear, layer):
        put(linear.weight, layer.kernel.numpy().T)
        put(linear.bias, layer.bias.numpy())

    with torch.no_grad():
        mlp = net if kind == "mlp" else net.mlp
        dense(mlp.up, keras_model.get_layer("up"))
        dense(mlp.down, keras_model.get_layer("down"))
        if kind == "mlp":
            return
        for norm, name in ((net.ln1, "ln1"), (net.ln2, "ln2")):
            layer = keras_model.get_layer(name)
            put(norm.weight, layer.gamma.numpy())
            put(norm.bias, layer.beta.numpy())
        mha = keras_model.get_layer("mha")
        width = width_of(kind)
        attention = net.attention
        for linear, layer in ((attention.query, mha.query_dense),
                              (attention.key, mha.key_dense),
                              (attention.value, mha.value_dense)):
            # (width, heads, head_dim) -> (heads x head_dim, width)
            put(linear.weight, layer.kernel.numpy().reshape(width, -1).T)
        # (heads, head_dim, width) -> (width, heads x head_dim)
        put(attention.output.weight,
            mha.output_dense.kernel.numpy().reshape(-1, width).T)


def collective_counter():
    """A `TorchDispatchMode` counting collectives: `calls` and `bytes` by
    op name, while it is entered."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    namespaces = {"c10d": "c10d", "_c10d_functional": "funcol",
                  "c10d_functional": "funcol",
                  "_c10d_functional_autograd": "funcol"}

    def size(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(size(i) for i in x)
        return 0

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = collections.Counter()
            self.bytes = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(issubclass(t, DTensor) for t in types):
                # DTensor turns it into local ops (and collectives) first:
                # those come back here.
                return NotImplemented
            out = func(*args, **kwargs)
            namespace, _, name = func.name().partition("::")
            if namespace in namespaces and "wait" not in name:
                key = f"{namespaces[namespace]}.{name}"
                self.calls[key] += 1
                self.bytes[key] += max([size(a) for a in args]
                                       + [size(v) for v in kwargs.values()]
                                       + [size(out)])
            return out

    return Counter()


def worker(args):
    import keras_layoutmap as klm

    klm.configure_virtual_devices(args.processes)

    import keras
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    steps = args.skip + args.steps
    rng = np.random.default_rng(SEED)
    data = {}
    for kind in KINDS:
        shape = (steps * rows_of(kind),) + (
            (MLP_DIM,) if kind == "mlp" else (SEQUENCE, DIM))
        data[kind] = (rng.standard_normal(shape, dtype=np.float32),
                      rng.standard_normal(shape, dtype=np.float32))

    tp_mesh = klm.create_mesh([("batch", 1), ("model", world)])
    fsdp_mesh = klm.create_mesh([("batch", world)])
    torch_tp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch_dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    loss_fn = torch.nn.MSELoss()

    def adam(net):
        return torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-7)

    # {(kind, run): fit} where fit() trains one epoch and returns (step
    # times, CPU times, first step's loss, mean loss); {(kind, run): count}
    # where count(counter, n) takes n steps under the counter.
    fits, counts, models, placements = {}, {}, {}, {}

    class Timer(keras.callbacks.Callback):
        """Wall and CPU time of every step, the first step's loss; with a
        counter, counts the steps' collectives."""

        def __init__(self, counter=None):
            super().__init__()
            self.times, self.cpu, self.first_loss = [], [], None
            self.counter = counter

        def on_train_batch_begin(self, batch, logs=None):
            if self.counter is not None:
                self.counter.__enter__()
            self._cpu = time.process_time()
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._start)
            self.cpu.append(time.process_time() - self._cpu)
            if self.counter is not None:
                self.counter.__exit__(None, None, None)
            if batch == 0 and logs and "loss" in logs:
                self.first_loss = float(logs["loss"])

    def keras_fit(model, xs, ys, batch):
        def fit():
            timer = Timer()
            history = model.fit(xs, ys, batch_size=batch, epochs=1,
                                shuffle=False, verbose=0, callbacks=[timer])
            return (timer.times, timer.cpu, timer.first_loss,
                    history.history["loss"][0])

        def count(counter, n):
            model.fit(xs[: n * batch], ys[: n * batch], batch_size=batch,
                      epochs=1, shuffle=False, verbose=0,
                      callbacks=[Timer(counter)])
        return fit, count

    def torch_fit(net, optimizer, xs, ys, rows, share):
        """Steps on the whole batch of `rows`, or (share) this process's
        1/world of it."""
        xt, yt = torch.from_numpy(xs), torch.from_numpy(ys)
        local = rows // world if share else rows
        offset = rank * local if share else 0

        def step(i):
            start = i * rows + offset
            optimizer.zero_grad()
            loss = loss_fn(net(xt[start:start + local]),
                           yt[start:start + local])
            loss.backward()
            optimizer.step()
            return loss.item()

        def fit():
            times, cpu, losses = [], [], []
            for i in range(steps):
                start, start_cpu = time.perf_counter(), time.process_time()
                losses.append(step(i))
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            return times, cpu, losses[0], statistics.fmean(losses)

        def count(counter, n):
            for i in range(n):
                with counter:
                    step(i)
        return fit, count

    for kind in KINDS:
        xs, ys = data[kind]
        rows = rows_of(kind)
        local = rows // world
        mine = np.concatenate([np.arange(i * rows + rank * local,
                                         i * rows + (rank + 1) * local)
                               for i in range(steps)])
        whole = build_keras(kind)  # one process, and the twins' weights

        def twin(parts=1, kind=kind, whole=whole):
            net = build_torch(torch, kind, parts)
            if parts == 1:
                copy_weights(torch, net, whole, kind)
            return net

        # Model parallel.
        with megatron_rules(klm, tp_mesh, kind).scope():
            mp_model = build_keras(kind)
        net = twin()
        if kind == "mlp":
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        else:
            plan = {"attention.query": ColwiseParallel(),
                    "attention.key": ColwiseParallel(),
                    "attention.value": ColwiseParallel(),
                    "attention.output": RowwiseParallel(),
                    "mlp.up": ColwiseParallel(),
                    "mlp.down": RowwiseParallel()}
        tp_net = parallelize_module(net, torch_tp_mesh, plan)
        piece = build_keras(kind, parts=world)
        piece_net = twin(parts=world)

        # FSDP.
        with klm.fsdp(fsdp_mesh, axis="batch").scope():
            fsdp_model = build_keras(kind)
        fsdp_net = twin()
        for part in ((fsdp_net.up, fsdp_net.down) if kind == "mlp"
                     else (fsdp_net.attention, fsdp_net.mlp)):
            fully_shard(part, mesh=torch_dp_mesh)
        fully_shard(fsdp_net, mesh=torch_dp_mesh)
        share = build_keras(kind)
        share_net = twin()
        whole_net = twin()

        runs = {
            "mp_klm": keras_fit(mp_model, xs, ys, rows),
            "mp_torch": torch_fit(tp_net, adam(tp_net), xs, ys, rows, False),
            "mp_keras_floor": keras_fit(piece, xs, ys, rows),
            "mp_torch_floor": torch_fit(piece_net, adam(piece_net), xs, ys,
                                        rows, False),
            "fsdp_klm": keras_fit(fsdp_model, xs, ys, rows),
            "fsdp_torch": torch_fit(fsdp_net, adam(fsdp_net), xs, ys, rows,
                                    True),
            "fsdp_keras_floor": keras_fit(share, xs[mine], ys[mine], local),
            "fsdp_torch_floor": torch_fit(share_net, adam(share_net), xs, ys,
                                          rows, True),
            "keras_whole": keras_fit(whole, xs, ys, rows),
            "torch_whole": torch_fit(whole_net, adam(whole_net), xs, ys, rows,
                                     False),
        }
        for run, (fit, count) in runs.items():
            fits[kind, run] = fit
            counts[kind, run] = count
        models[kind, "mp_klm"], models[kind, "fsdp_klm"] = mp_model, fsdp_model
        for run, model in (("mp_klm", mp_model), ("fsdp_klm", fsdp_model)):
            specs = {v.path: klm.fetch_layout(v).sharding_specs
                     for v in model.weights}
            placements[f"{kind} {run}"] = {
                path: spec for path, spec in specs.items()
                if any(s != klm.UNSHARDED for s in spec)}

    def host(variable):
        """The whole value of a variable (every process takes part when it
        is a sharded DTensor)."""
        value = variable.value
        if isinstance(value, DTensor):
            value = value.full_tensor()
        return value.detach().cpu().numpy().copy()

    names = list(fits)
    times = {k: [] for k in names}
    cpu = {k: [] for k in names}
    first, losses, after_one_epoch = {}, {}, {}
    started = time.perf_counter()
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            step_times, cpu_times, first_loss, mean_loss = fits[name]()
            first.setdefault(name, step_times[0])
            times[name].extend(step_times[args.skip:])
            cpu[name].extend(cpu_times[args.skip:])
            if i == 0:
                losses[name] = (first_loss, mean_loss)
                if name in models:
                    after_one_epoch[name] = [host(v) for v in models[name].weights]
    rounds_s = time.perf_counter() - started

    # Collectives per step, each distributed run on its own.
    collectives = {}
    for kind in KINDS:
        for run in DISTRIBUTED:
            counter = collective_counter()
            counts[kind, run](counter, args.count_steps)
            collectives[f"{kind} {run}"] = {
                op: [counter.calls[op] / args.count_steps,
                     counter.bytes[op] / args.count_steps]
                for op in sorted(counter.calls)}

    # One device's numbers: the same Keras model with no distribution,
    # trained one epoch on the same global batches (each process its own).
    single = {}
    for kind in KINDS:
        xs, ys = data[kind]
        model = build_keras(kind)
        timer = Timer()
        history = model.fit(xs, ys, batch_size=rows_of(kind), epochs=1,
                            shuffle=False, verbose=0, callbacks=[timer])
        weights = [v.numpy() for v in model.weights]
        diffs = {}
        for run in ("mp_klm", "fsdp_klm"):
            diffs[run] = max(float(np.abs(a - b).max()) for a, b in
                             zip(after_one_epoch[kind, run], weights))
        single[kind] = {"first_loss": timer.first_loss,
                        "mean_loss": history.history["loss"][0],
                        "weight_diff": diffs}

    # torch's FSDP and share runs see a share of the rows: their loss is
    # the mean over the processes.
    every = [None] * world
    dist.all_gather_object(every, {f"{k} {r}": v for (k, r), v in losses.items()})
    mean_losses = {}
    for key in every[0]:
        firsts = [e[key][0] for e in every]
        means = [e[key][1] for e in every]
        mean_losses[key] = (statistics.fmean(firsts), statistics.fmean(means))

    if rank == 0:
        result = {
            "torch": torch.__version__,
            "keras": keras.__version__,
            "threads": torch.get_num_threads(),
            "rounds_s": rounds_s,
            "first_ms": {f"{k} {r}": v * 1e3 for (k, r), v in first.items()},
            "median_ms": {f"{k} {r}": statistics.median(v) * 1e3
                          for (k, r), v in times.items()},
            "mean_ms": {f"{k} {r}": statistics.fmean(v) * 1e3
                        for (k, r), v in times.items()},
            "cpu_ms": {f"{k} {r}": statistics.median(v) * 1e3
                       for (k, r), v in cpu.items()},
            "steps": {f"{k} {r}": len(v) for (k, r), v in times.items()},
            "losses": mean_losses,
            "single": single,
            "collectives": collectives,
            "placements": placements,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)


def ratio(a, b):
    return a / b if b else float("inf")


def kib(n):
    return f"{n / 1024:.1f}"


def report(args, r, wall):
    """Print the tables and the two ratios, from process 0's result."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=130)
    cores = os.cpu_count()
    p = args.processes
    median = r["median_ms"]
    for kind in KINDS:
        shape = (f"Dense {MLP_DIM} -> {WIDEN * MLP_DIM} -> {MLP_DIM}, batch "
                 f"{MLP_ROWS}" if kind == "mlp" else
                 f"LayerNorm, attention {HEADS} x {DIM // HEADS}, LayerNorm, "
                 f"MLP {DIM} -> {WIDEN * DIM} -> {DIM}, batch {BLOCK_ROWS} x "
                 f"{SEQUENCE} x {DIM}")
        table = Table(title=(
            f"{kind}: {shape}; Adam, MSE; {p} processes x 1 CPU device "
            f"(gloo), OMP_NUM_THREADS=1, {cores} cores; {args.rounds} rounds "
            f"x {args.steps} timed steps"))
        for column in ("run", "first step (ms)", "median step (ms)",
                       "mean step (ms)", "CPU per step, process 0 (ms)",
                       "timed steps"):
            table.add_column(column, justify="left" if column == "run"
                             else "right")
        for run, label in RUNS:
            key = f"{kind} {run}"
            table.add_row(label, f"{r['first_ms'][key]:.1f}",
                          f"{median[key]:.2f}", f"{r['mean_ms'][key]:.2f}",
                          f"{r['cpu_ms'][key]:.2f}", str(r["steps"][key]))
        console.print(table)

    table = Table(title=(
        f"collectives per step, process 0 ({args.count_steps} steps counted "
        "at the dispatcher: c10d.* from torch.distributed, funcol.* from "
        "DTensor); KiB: the larger of each one's input and output"))
    for column in ("model", "run", "collective", "calls", "KiB"):
        table.add_column(column, justify="left" if column in (
            "model", "run", "collective") else "right")
    labels = dict(RUNS)
    for kind in KINDS:
        for run in DISTRIBUTED:
            ops = r["collectives"][f"{kind} {run}"]
            total_calls = sum(c for c, _ in ops.values())
            total_bytes = sum(b for _, b in ops.values())
            for op, (calls, size) in ops.items():
                table.add_row(kind, labels[run], op, f"{calls:g}", kib(size))
            table.add_row(kind, labels[run], "all", f"{total_calls:g}",
                          kib(total_bytes), style="bold")
    console.print(table)

    held = True
    for kind in KINDS:
        single = r["single"][kind]
        for run in ("mp_klm", "fsdp_klm", "mp_torch", "fsdp_torch"):
            first_loss, mean_loss = r["losses"][f"{kind} {run}"]
            first_diff = abs(first_loss - single["first_loss"])
            mean_diff = abs(mean_loss - single["mean_loss"])
            line = (f"{kind} {labels[run]}: first step's loss {first_loss:.7f}, "
                    f"first epoch's mean {mean_loss:.7f}; one device "
                    f"{single['first_loss']:.7f}, {single['mean_loss']:.7f}: "
                    f"differences {first_diff:.1e}, {mean_diff:.1e}")
            if run.endswith("klm"):
                ok = (first_diff <= TOLERANCE * abs(single["first_loss"]) and
                      mean_diff <= TOLERANCE * abs(single["mean_loss"]))
                held = held and ok
                line += (f" ({'within' if ok else 'NOT within'} {TOLERANCE:g} "
                         "relative); largest weight difference after it "
                         f"{single['weight_diff'][run]:.1e}")
            console.print(line)
    console.print(f"parity with one device: {'held' if held else 'NOT held'}")
    for key, specs in r["placements"].items():
        kind, run = key.split()
        shown = ", ".join(
            f"{path} ({', '.join(s if s != 'unsharded' else '-' for s in spec)})"
            for path, spec in specs.items())
        console.print(f"{kind} {labels[run]}, the weights it splits: "
                      f"{shown or 'none'}")
    console.print(
        f"torch {r['torch']}, keras {r['keras']}, {r['threads']} torch "
        f"thread(s) per process; rounds {r['rounds_s']:.0f} s, measured in "
        f"{wall:.0f} s; load average at the end "
        f"{', '.join(f'{v:.1f}' for v in os.getloadavg())} on {cores} cores")

    def added(kind, section, engine):
        floor = "keras_floor" if engine == "klm" else "torch_floor"
        return (median[f"{kind} {section}_{engine}"]
                - median[f"{kind} {section}_{floor}"])

    ratios = {}
    for section, name in (("mp", "model-parallel"), ("fsdp", "fsdp")):
        ours = theirs = 0.0
        for kind in KINDS:
            a, b = added(kind, section, "klm"), added(kind, section, "torch")
            ours, theirs = ours + a, theirs + b
            print(f"{name}, {kind}: klm adds {a:.2f} ms over Keras' floor, "
                  f"torch's engine {b:.2f} ms over torch's: ratio "
                  f"{ratio(a, b):.2f}")
        ratios[section] = ratio(ours, theirs)
    # Last, each alone on its line.
    print(f"model-parallel overhead ratio: {ratios['mp']:.2f}")
    print(f"fsdp overhead ratio: {ratios['fsdp']:.2f}")
    return ratios


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12,
                        help="timed steps per round (default 12)")
    parser.add_argument("--skip", type=int, default=2,
                        help="warm-up steps dropped per round (default 2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each one epoch of each run (default 3)")
    parser.add_argument("--count-steps", type=int, default=3, metavar="N",
                        help="steps each distributed run takes with its "
                        "collectives counted (default 3)")
    parser.add_argument("--processes", type=int, default=PROCESSES,
                        metavar="P",
                        help=f"processes, one CPU device each (default "
                        f"{PROCESSES})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    p = args.processes
    if p < 2:
        parser.error(f"--processes needs 2 or more (received {p})")
    for what, n in (("the heads", HEADS), ("the MLP batch", MLP_ROWS),
                    ("the block batch", BLOCK_ROWS)):
        if n % p:
            parser.error(f"--processes must divide {what}, {n} (received {p})")
    if args.steps < 1 or args.rounds < 1 or args.count_steps < 1:
        parser.error("--steps, --rounds and --count-steps need 1 or more")
    if args.count_steps > args.skip + args.steps:
        parser.error("--count-steps may not exceed --skip + --steps")
    if args.worker:
        worker(args)
        return

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(
                   q for q in (root, os.environ.get("PYTHONPATH")) if q))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "keras_layoutmap.launch", "-n",
                   str(p), "--log-dir", tmp, os.path.abspath(__file__),
                   "--worker", "--out", out, "--steps", str(args.steps),
                   "--skip", str(args.skip), "--rounds", str(args.rounds),
                   "--count-steps", str(args.count_steps),
                   "--processes", str(p)]
        done = subprocess.run(command, env=env, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"the worker processes failed ({done.returncode})")
        with open(out) as f:
            r = json.load(f)
    report(args, r, time.perf_counter() - start)


if __name__ == "__main__":
    main()
