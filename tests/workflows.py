"""The workflow matrix: what users run (rows) in every cell they run it in
(backend x processes x Keras version), each compared with one device.

This module is the declaration: the rows, the cells, and the cells where a
row cannot work with the clear error a user gets there. `test_workflows.py`
runs every row in the cell of the session running it; nox runs each cell
(`tests-jax` in one process and under the launcher with 2, `tests-torch`
with 4, then each session the same on keras-nightly). The
README's "What works" table and docs/workflows.md are generated from it,
so they claim only what a cell shows:

    python tests/workflows.py           # rewrite both
    python tests/workflows.py --check   # exit 1 if either is stale

No backend is imported here: the generator runs without one.
"""

import dataclasses
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The cells' columns: (backend, processes). JAX and TensorFlow make 8
# devices in one process, or 4 in each of 2 under the launcher; torch has
# one device per process, 4 processes (a 1-process torch run has no mesh).
COLUMNS = (("jax", 1), ("jax", 2), ("tensorflow", 1), ("tensorflow", 2),
           ("torch", 4))
KERAS = ("3.15", "nightly")  # keras 3.15.x; keras-nightly (the next release)
BACKEND_TITLES = {"jax": "JAX", "tensorflow": "TensorFlow", "torch": "torch"}


@dataclasses.dataclass(frozen=True)
class Cannot:
    """Where a row cannot work: the cells it applies to (None matches any),
    the error a user gets there (`error`, whose message matches `match`)
    and why, in a sentence."""
    why: str
    match: str
    error: type = ValueError
    backend: str = None
    processes: int = None
    keras: str = None

    def applies(self, backend, processes, keras):
        return all(want is None or want == have for want, have in (
            (self.backend, backend), (self.processes, processes),
            (self.keras, keras)))


@dataclasses.dataclass(frozen=True)
class Workflow:
    """A row: `name` (the test id and docs anchor), what a user does, and
    the cells where it cannot work."""
    name: str
    does: str
    cannot: tuple = ()

    def expected(self, backend, processes, keras):
        """The `Cannot` for this cell, or None: the row equals one device."""
        return next((c for c in self.cannot
                     if c.applies(backend, processes, keras)), None)


WORKFLOWS = (
    Workflow("keras-data-parallel",
             "The Keras distribution guide's `DataParallel(devices="
             "keras.distribution.list_devices())`, "
             "`set_distribution`, then `fit` (a short last batch), "
             "`evaluate`, `predict` and a step of each `*_on_batch` method "
             "of a Sequential MLP with `Dropout` on the digits."),
    Workflow("keras-steps-per-execution",
             "`compile(steps_per_execution=2)` under the guide's "
             "`DataParallel`: `fit` of the MLP with `Dropout` (two steps per "
             "execution, then a last execution of one short batch), "
             "`evaluate` and `predict`.",
             cannot=(Cannot(
                 "Keras 3.15's torch trainer runs one step per execution, "
                 "on one device too.", match="steps_per_execution.* must be 1",
                 backend="torch", keras="3.15"),)),
    Workflow("keras-model-parallel",
             "The guide's `ModelParallel` with a Keras `LayoutMap` "
             "(`d1/kernel`, `d1/bias`, `d2/kernel` over `model`) on a "
             "(batch, model) mesh, the model built in `distribution.scope()`, "
             "then `fit`, `evaluate`, `predict` and the `*_on_batch` "
             "methods (the MLP with `Dropout`); the kernel's layout read "
             "back from the backend."),
    Workflow("keras-settings-after-use",
             "Keras' objects changed after first use: the guide's "
             "`DataParallel` builds the MLP, then "
             "`distribution.auto_shard_dataset = False` (Keras' own error "
             "for per-process numpy prescribes it), and `fit` and "
             "`evaluate` with each process passing its own rows equal one "
             "device on the same global batches; the guide's "
             "`ModelParallel` builds one, then a rule is deleted from its "
             "`LayoutMap` and one added: a second model built in its scope "
             "is placed by the changed map (read from the backend) and "
             "evaluates each process's own rows as one device."),
    Workflow("klm-strict-two-models",
             "One strict `klm.LayoutMap` whose rules place two models built "
             "in its `scope()` (an encoder and a classifier), each then "
             "trained with `fit` and a step of each `*_on_batch` method: no "
             "rule of the other model is called unused."),
    Workflow("callbacks",
             "`fit` under klm rules with `BackupAndRestore` and "
             "`ModelCheckpoint(save_weights_only=True)`, interrupted after "
             "the first epoch and run again (it resumes), then the "
             "checkpoint loaded into a model with no distribution."),
    Workflow("orbax-checkpoint",
             "Keras' `OrbaxCheckpoint` in `fit` under the guide's "
             "`ModelParallel` (each process writes only its own shards), "
             "saving in the background (Keras' default): each epoch's step, "
             "read with `load_weights(<directory>/<step>)`, holds that "
             "epoch's weights; `keras.models.load_model(directory)`: "
             "weights, Adam's moments and step count exact, the kernel "
             "laid out as the plan says; resumed with "
             "`fit(initial_epoch=2)` (saving before training goes on, "
             "`save_best_only` on the loss), equal to the run never "
             "stopped; read again under `DataParallel`."),
    Workflow("orbax-other-backends",
             "`load_model` under the guide's `ModelParallel` of the "
             "checkpoints `OrbaxCheckpoint` wrote under JAX (2 processes), "
             "TensorFlow (2) and torch (4) (tests/data/orbax): every weight "
             "and optimizer variable exact."),
    Workflow("hub-fit",
             "keras-hub's recipe, `ModelParallel(layout_map="
             "GemmaBackbone.get_layout_map(mesh))`: a tiny `GemmaCausalLM` "
             "built from a config, `fit`."),
    Workflow("hub-generate-greedy",
             "The recipe, greedy `generate()` on prompts of mixed lengths "
             "(3 to 7 tokens, right-padded): ids identical to one device, "
             "prompts intact."),
    Workflow("hub-generate-seeded",
             "The recipe, `generate()` with a seeded `TopKSampler`, prompts "
             "of mixed lengths: ids identical to one device.",
             cannot=(Cannot(
                 "DTensor has no rule for `tf.StatelessMultinomial`, the "
                 "categorical draw; the error says to use greedy sampling.",
                 match="StatelessMultinomial.*greedy", backend="tensorflow"),)),
    Workflow("hub-generate-indivisible",
             "The recipe, greedy `generate()` of 3 prompts, a batch the "
             "batch axis does not divide (computed whole on every device)."),
    Workflow("hub-generate-data-parallel",
             "`keras.distribution.DataParallel`, greedy `generate()` of 8 "
             "prompts of mixed lengths (one per device on 8 devices, two on 4)."),
    Workflow("hub-lora",
             "The recipe, `backbone.enable_lora(2)`, then `fit`: the LoRA "
             "weights equal one device's, the frozen ones bit-identical."),
    Workflow("auto-plan",
             "`klm.auto_layout_map(build, mesh)` of a small Functional CNN "
             "(a convolution, pooling, a Dense pair), planned from its "
             "builder with nothing allocated, the model built in the plan's "
             "`scope()`, then `fit` and `predict`: every weight held as the "
             "plan says, read from the backend (on TensorFlow the plan keeps "
             "the convolution's kernel whole, which DTensor needs)."),
    Workflow("hub-auto-plan",
             "`klm.auto_layout_map(build, mesh)` of keras-hub's Mistral "
             "causal LM (no recipe; 2 key/value heads), planned from its "
             "builder, then `fit` and greedy `generate()` of 8 prompts: "
             "every weight held as the plan says, read from the backend."),
    Workflow("quantized-lora-fit",
             "A Functional MLP quantized to int8 with Keras' `ModelParallel` "
             "set (its rule `d1/kernel` also matches `d1/kernel_scale`), and "
             "to int4 on a model a klm `LayoutMap.scope()` placed before "
             "`quantize`; then `enable_lora(2)`, `predict`, `fit` and "
             "`predict`: losses, LoRA weights and predictions equal; the "
             "quantized kernels bit-identical to one device's, before and "
             "after training; every weight where the plan puts it, each "
             "added variable (scales, zero points, int4's `g_idx`, LoRA's "
             "matrices) following its kernel's split, read from the "
             "backend."),
    Workflow("quantized-float8-fit",
             "`quantize(\"float8\")` inside a klm scope, `predict`, then "
             "`fit` with Adam: losses, kernels, scales and every amax "
             "history equal (biases to bfloat16 rounding: Keras' float8 "
             "Dense rounds their gradient); the amax histories and scales "
             "replicated, the kernels where their rules put them."),
    Workflow("hub-quantized",
             "keras-hub's recipe, a tiny `GemmaCausalLM` quantized inside "
             "the scope in all three modes, a layer each "
             "(`quantize(mode, filters=...)`: int4 on the embedding, query "
             "and gate projections, int8 on the value and output ones, "
             "float8 on the rest), greedy `generate()` of prompts of mixed "
             "lengths (ids identical), then `backbone.enable_lora(2)` (on an "
             "int4 and an int8 projection), compiled outside the scope (with "
             "a `SparseCategoricalAccuracy` object, as keras-hub's `compile` "
             "makes), and `fit` with SGD: losses and weights equal to the "
             "quantized layers' rounding (docs/quantized.md), amax "
             "histories included, the "
             "int8 and packed int4 kernels bit-identical before and after; "
             "every int8 kernel where the recipe's rule puts it, int4's "
             "where their packed size allows, the scales following them, "
             "float8's per-tensor scales and histories replicated, read from "
             "the backend (Llama's recipe: tests/test_keras_hub_tasks.py)."),
    Workflow("hub-preset",
             "The recipe, `save_to_preset` then `from_preset` of that folder "
             "under the distribution: weights exact, laid out as the rules "
             "say."),
)


def by_name():
    return {w.name: w for w in WORKFLOWS}


# -- the generated README table and docs page ---------------------------------

README = ROOT / "README.md"
DOCS = ROOT / "docs" / "workflows.md"
BEGIN = "<!-- workflow matrix: generated by `python tests/workflows.py` -->"
END = "<!-- end of the workflow matrix -->"


def _column_title(backend, processes):
    unit = "process" if processes == 1 else "processes"
    return f"{BACKEND_TITLES[backend]}, {processes} {unit}"


def _cell_word(workflow, backend, processes):
    """One word for a cell over both Keras versions."""
    outcomes = [workflow.expected(backend, processes, k) for k in KERAS]
    if not any(outcomes):
        return "yes"
    if all(outcomes):
        return f"[error](docs/workflows.md#{workflow.name})"
    works = [k for k, o in zip(KERAS, outcomes) if o is None]
    return f"[{'/'.join(works)} only](docs/workflows.md#{workflow.name})"


def readme_table():
    head = "| workflow | " + " | ".join(
        _column_title(*c) for c in COLUMNS) + " |"
    rule = "|---" * (len(COLUMNS) + 1) + "|"
    rows = [f"| [{w.name}](docs/workflows.md#{w.name}) | " + " | ".join(
        _cell_word(w, *c) for c in COLUMNS) + " |" for w in WORKFLOWS]
    return "\n".join([BEGIN, head, rule, *rows, END])


def docs_page():
    lines = [
        "# The workflow matrix",
        "",
        "<!-- generated by `python tests/workflows.py` from tests/workflows.py;"
        " do not edit -->",
        "",
        "Each row is a workflow written as users write it "
        "(`tests/test_workflows.py`); each cell runs it on a backend, in one "
        "process or several, on Keras "
        f"{' and '.join(KERAS)} (keras-nightly, Keras' next release), and "
        "compares every number with the same code on one device (same "
        "seed): weights, losses, metrics, predictions, generated ids. "
        "A cell that cannot work states the error a user gets there, and "
        "its test checks that error. `nox` runs every cell: `tests-jax` and "
        "`tests-tensorflow` in one process (8 devices) and under "
        "`python -m keras_layoutmap.launch -n 2` (8 devices, 4 in each; "
        "TensorFlow 4, 2 in each), "
        "`tests-torch` under the launcher with 4 processes (one device "
        "each), then each session the same on "
        "keras-nightly.",
        "",
    ]
    for w in WORKFLOWS:
        lines += [f"## {w.name}", "", w.does, ""]
        if not w.cannot:
            lines += ["Every cell: equal to one device.", ""]
            continue
        for c in w.cannot:
            where = ", ".join(f"{k} {v}" for k, v in (
                ("backend", c.backend), ("processes", c.processes),
                ("Keras", c.keras)) if v is not None) or "every cell"
            lines += [f"- **{where}**: a `{c.error.__name__}` "
                      f"(matching `{c.match}`). {c.why}"]
        lines += ["", "Every other cell: equal to one device.", ""]
    return "\n".join(lines)


def _with_table(readme):
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(readme):
        raise SystemExit(f"README.md has no {BEGIN!r} ... {END!r} block")
    return pattern.sub(lambda _: readme_table(), readme)


def stale():
    """The generated files that differ from what the matrix gives."""
    out = []
    if _with_table(README.read_text()) != README.read_text():
        out.append(README)
    if not DOCS.exists() or DOCS.read_text() != docs_page():
        out.append(DOCS)
    return out


def main(argv):
    if "--check" in argv:
        files = stale()
        for path in files:
            print(f"{path.relative_to(ROOT)} is stale: run python "
                  "tests/workflows.py")
        return 1 if files else 0
    README.write_text(_with_table(README.read_text()))
    DOCS.write_text(docs_page())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
