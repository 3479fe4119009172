"""Test sessions, one per Keras backend (the backend is fixed at import).

`nox` runs lint and the three test sessions. `tests-jax` and
`tests-tensorflow` run every test; `tests-torch` runs the backend-neutral
tests (`-m "not sharding"`: torch cannot place tensors on a mesh yet).
Nothing claims what is not built.
"""

import nox

nox.options.sessions = ["lint", "tests-jax", "tests-tensorflow", "tests-torch"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = "3.11"
TORCH = "torch==2.13.0"  # the CPU build; a looser pin pulls CUDA wheels
# keras-hub's declared dependencies pull full TensorFlow through
# tensorflow-text; the backbones we build from a config need none of it.
KERAS_HUB = ["keras-hub>=0.32", "--no-deps"]
KERAS_HUB_DEPS = [
    "regex", "absl-py", "packaging", "kagglehub", "sentencepiece", "tokenizers"]


def _pytest(session, backend, *args):
    session.run(
        "pytest",
        *args,
        *session.posargs,
        env={"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )


@nox.session(name="tests-jax", python=PYTHON)
def tests_jax(session):
    session.install("-e", ".[jax,test]")
    session.install(*KERAS_HUB)
    session.install(*KERAS_HUB_DEPS)
    _pytest(session, "jax")


@nox.session(name="tests-tensorflow", python=PYTHON)
def tests_tensorflow(session):
    session.install("-e", ".[tensorflow,test]")
    session.install(*KERAS_HUB)
    session.install(*KERAS_HUB_DEPS)
    _pytest(session, "tensorflow")


@nox.session(name="tests-torch", python=PYTHON)
def tests_torch(session):
    session.install(TORCH)
    session.install("-e", ".[test]")
    _pytest(session, "torch", "-m", "not sharding")


@nox.session(python=PYTHON)
def example(session):
    """The main job: data- then model-parallel digits on 8 virtual CPUs."""
    session.install("-e", ".[jax,test]")
    session.run("python", "examples/train_digits.py", env={"KERAS_BACKEND": "jax"})


@nox.session(python=PYTHON)
def bench(session):
    """The figures of benchmarks/: JAX, TensorFlow (DTensor against
    MirroredStrategy) and the two side by side."""
    session.install("-e", ".[jax,tensorflow,test]")
    for script in ("overhead.py", "rules.py", "memory.py", "build.py"):
        session.run("python", f"benchmarks/{script}", env={"KERAS_BACKEND": "jax"})
    for script in ("memory.py", "tf_data_parallel.py"):
        session.run("python", f"benchmarks/{script}",
                    env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"})
    session.run("python", "benchmarks/backends.py")


@nox.session(python=PYTHON)
def lint(session):
    session.install("ruff")
    session.run("ruff", "check", "keras_layoutmap", "tests", "examples",
                "benchmarks", "noxfile.py")
