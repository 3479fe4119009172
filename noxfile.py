"""Test sessions, one per Keras backend (the backend is fixed at import).

`nox` runs lint, the docs site build and the three test sessions, each on
the supported Keras and then on Keras' next release, swapped into the same
virtualenv (a subset: `NEXT_TESTS`, the workflow matrix among them;
`tests-keras-next-*` run those alone). pytest runs in as many workers as
the machine has cores (pytest-xdist, at most 4). `tests-jax` and
`tests-tensorflow` run every test with 8 virtual devices per worker, then
the workflow matrix (tests/test_workflows.py), with the checkpoints' and
test_processes.py's tests across processes, under `python -m
keras_layoutmap.launch -n 2 -m pytest`: 2 processes of 4 devices
(TensorFlow: of 2), one mesh. `tests-torch` runs the tests twice: the tests
that need no mesh (and those that start processes of their own) in one
process, then every sharding and training test (the matrix among them)
under the launcher with 4 processes, each holding one device of the mesh
and running each test with the others (a torch mesh spans processes). Under
the launcher `-x` ends the run at the first failure on any process (the
launcher stops the others and prints the failing process's log),
collectives time out after 60 s, and every test after
`LAUNCHED_TEST_TIMEOUT` seconds: nothing hangs.

Sessions run on the interpreter nox itself runs on (`python=None`): no
version pinned that a machine may lack. keras 3.15 (and jax 0.7+, numpy 2.3+)
require Python >= 3.11, so an older interpreter is refused with what to do:
there is no 3.10 to test, though 3.10 interpreters exist.
"""

import os
import shutil
import sys

import nox

# docs is in the default list: it needs no backend (mkdocstrings reads the
# source), builds in 4 s (13-34 s with a fresh 177 MB venv), and so catches a
# broken docs link or a public name left out of the API reference every run.
nox.options.sessions = [
    "lint", "docs", "tests-jax", "tests-tensorflow", "tests-torch"]
nox.options.reuse_existing_virtualenvs = True

PYTHON = None  # the interpreter running nox
MIN_PYTHON = (3, 11)  # keras>=3.15's own Requires-Python
# What the test sessions install: exact versions, CPU builds. The package's
# extras (pyproject.toml) state the ranges it supports (`torch>=2.5`,
# `tensorflow>=2.21` or `tensorflow-cpu>=2.21`), which these satisfy.
TORCH = "torch==2.13.0"  # the CPU build; a looser pin pulls CUDA wheels
# keras-hub's declared dependencies pull full TensorFlow through
# tensorflow-text; the backbones we build from a config need none of it.
KERAS_HUB = ["keras-hub>=0.32", "--no-deps"]
KERAS_HUB_DEPS = [
    "regex", "absl-py", "packaging", "kagglehub", "sentencepiece", "tokenizers"]
# The docs site: mkdocstrings reads the docstrings from source (griffe), so
# the session installs neither keras_layoutmap nor a backend.
DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5,<10",
        "mkdocstrings>=1.0,<2", "mkdocstrings-python>=2.0,<3",
        "ruff"]  # ruff: mkdocstrings formats signatures with it


def _check_python(session):
    version = session.run("python", "-c", "import sys; print(sys.version_info[:2])",
                          silent=True) or repr(sys.version_info[:2])
    major, minor = (int(v) for v in version.strip(" ()\n").split(","))
    if (major, minor) < MIN_PYTHON:
        session.error(
            f"Python {major}.{minor}: keras>=3.15 needs Python >= "
            f"{'.'.join(map(str, MIN_PYTHON))}. Run nox with a newer one, "
            "e.g. `python3.11 -m nox`.")


# Tests run in as many pytest workers as the machine has cores
# (pytest-xdist; each worker makes its own 8 virtual devices), at most 4.
# worksteal: a worker that runs out of tests takes some of the other's, so
# that the slowest tests do not end the run on one worker alone.
WORKERS = ["--numprocesses=auto", "--maxprocesses=4", "--dist=worksteal"]
EXTRA = {"jax": "jax", "tensorflow": "tensorflow-cpu", "torch": "torch"}
TORCH_PROCESSES = 4
LAUNCHED_TEST_TIMEOUT = 300  # seconds, per test, under the launcher
MESH_TESTS = "sharding or training"
# The workflow matrix: its multi-process cells for JAX and TensorFlow,
# with the checkpoints' own tests that need several processes (those that
# start processes of their own, `processes`, run in the one-process run).
MATRIX = "tests/test_workflows.py"
CHECKPOINTS = "tests/test_checkpoints.py"
# Training across 2 processes as one device, each process running the tests
# with the other (on Keras 3.15; keras-nightly's multi-process cells are
# the matrix's): no processes of their own to start.
ACROSS_PROCESSES = "tests/test_processes.py"
# Saves called on some processes only (`if rank == 0:`): refused at once by
# a handshake outside any collective, or saved alone (Keras 3.15).
SOME_PROCESSES = "tests/test_saves_on_some_processes.py"
MATRIX_PROCESSES = 2
# The devices of the matrix's run in several processes, where not 8 (4 in
# each process). TensorFlow: 4, 2 in each process, a (2, 2) mesh whose
# batch axis spans the processes: DTensor runs each program once per local
# device, and the run took 20 % less (47 s against 59 s for four rows,
# 2026-11-27); JAX showed no difference (55 s against 52 s) and keeps 8.
MATRIX_DEVICES = {"tensorflow": 4}

# Keras' next release, before it ships: the nightly builds replace `keras`
# and `keras-hub` (they provide the same packages). Pinned, so that CI runs
# what was tested; move the pins forward with a green run, and raise the
# `keras` range of pyproject.toml (and keras_internals.SUPPORTED_KERAS) only
# with one on the release. On keras-nightly nox runs the workflow matrix
# (in one process and several: fit, evaluate, predict, generate,
# callbacks, LoRA and presets through Keras' classes and ours)
# and the seam to Keras internals (tests/test_keras_internals.py). Weights
# born sharded hook a Keras internal too: every matrix row builds its model
# through that hook and compares it with one device, and one test of their
# own file shows that layers still take the hook (no weight drawn whole);
# the rest of that file (the draws one by one) runs on Keras 3.15 only.
# Training's and torch's local step's own files ran here too until
# the matrix covered their workflows; the whole suite a second time would
# take nox far past 40 minutes on 2 cores.
NEXT_TESTS = [MATRIX, "tests/test_keras_internals.py",
              "tests/test_born_sharded.py::test_layer_kwargs_and_set_distribution"]
KERAS_NEXT = ["keras-nightly==3.16.0.dev2026102704",
              "keras-hub-nightly==0.33.0.dev202610250352"]


# pip writes every installed module's bytecode (about half of an install's
# time), and must: this machine sets PYTHONDONTWRITEBYTECODE=1, so without
# it every process (each xdist worker, launched process and script a test
# starts) would compile each module it imports from source. With pip's
# --no-compile (2026-11-26) installing took 36 s less a session and JAX's
# one-process run 9 min 58 s in place of 6 min 43 s.
def _install(session, backend, keras_next=False):
    """The package with `backend`'s extra (tensorflow-cpu for TensorFlow;
    for torch the pinned CPU build, in the same resolve, which the `torch`
    extra's range keeps), then keras-hub, or keras-nightly and
    keras-hub-nightly in their place."""
    _check_python(session)
    # A virtualenv a `tests-<backend>` session left on keras-nightly: the
    # nightlies go first (they provide the same packages as keras and
    # keras-hub, which pip would install over them).
    _uninstall_keras(session, "keras-nightly", "keras-hub-nightly")
    # One resolve for all of it (each pip call costs seconds of its own).
    session.install(*([TORCH] if backend == "torch" else []),
                    "-e", f".[{EXTRA[backend]},test]", *KERAS_HUB_DEPS)
    if keras_next:
        _to_keras_next(session)
    else:
        session.install(*KERAS_HUB)


def _uninstall_keras(session, *distributions):
    session.run_install("python", "-m", "pip", "uninstall", "--yes",
                        "--quiet", *distributions)


def _to_keras_next(session):
    """keras-nightly and keras-hub-nightly in place of keras and keras-hub,
    in this virtualenv (both provide the packages `keras` and `keras_hub`):
    the backend and the rest stay installed."""
    _uninstall_keras(session, "keras", "keras-hub", "keras-nightly",
                     "keras-hub-nightly")
    session.install("--no-deps", *KERAS_NEXT)


# Compiling is most of a test's time on a CPU. The test runs compile as
# fast as they can where that changes no result's meaning (FAST):
# - JAX: XLA's CPU backend at LLVM's lowest optimization level, about half
#   the time of the default level on this suite (2026-11-26, 2 cores). No
#   XLA pass changes (the sharding and the collectives are the same), only
#   how CPU code is generated: every comparison is one program against
#   another compiled alike. The tests that compare bits with Keras' own
#   draws compiled at the default level, as users run them (EXACT_COMPILE:
#   weights born sharded, whose threefry and erf_inv code the level
#   changes), run at the default level.
# - TensorFlow, the one-process run: grappler, TensorFlow's graph
#   optimizer, off in pytest's own processes (tests/conftest.py), about 1.6
#   times faster. DTensor's SPMD expansion, where its layout rules and
#   refusals live, is a pass of its own (the TensorFlow-specific tests and
#   the layer zoo's refusals give the same results with grappler off).
#   The run in 2 processes too (the matrix, so that it compares with the
#   one-device numbers the one-process run computed, and test_processes.py's
#   training across them). Every process a test starts keeps it on, as
#   users do: the examples (the DTensor tutorial among them), the README's
#   snippet, the launcher's jobs and the schedulers' (whose SLURM job
#   trains model parallel across 2 processes).
# - TensorFlow, every run and the processes its tests start: one thread
#   for TensorFlow's inter-op and one for its intra-op pool. The tests'
#   tensors are tiny, and 2 pytest workers (or 2 launched processes) share
#   2 cores: threads only wait for each other there. Measured 2026-11-27,
#   side by side: the matrix's 2-process run 102-104 s against 111 s, three
#   files in one process 109 s against 119 s. What is computed is the same:
#   every number a test compares (the one-device references the 2-process
#   run reads included) is computed under the same setting.
# - JAX, every run of a session: XLA's programs kept on disk
#   (`JAX_COMPILATION_CACHE_DIR`, JAX's persistent compilation cache, in
#   the session's tmp folder): a program compiled again (a one-device
#   reference, the multi-process run's, keras-nightly's where its graph
#   is the same) is read back, not compiled. The key is the program, its
#   options and XLA's flags: what is read is what compiling would give.
FAST = {"jax": {"XLA_FLAGS": "--xla_backend_optimization_level=0"},
        "tensorflow": {"KLM_TEST_FAST_GRAPHS": "1",
                       "TF_NUM_INTEROP_THREADS": "1",
                       "TF_NUM_INTRAOP_THREADS": "1"}}
EXACT_COMPILE = "tests/test_born_sharded.py"


def _references(session):
    """Where the matrix's one-process run leaves its one-device numbers for
    the run in several processes (tests/test_workflows.py, `one_device`)."""
    return os.path.join(session.create_tmp(), "one-device-references")


def _env(session, backend, fast=False, **more):
    env = {"KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3",
           "KLM_TEST_REFERENCES": _references(session), **more}
    if fast:
        env.update(FAST.get(backend, {}))
    if backend == "jax":
        env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(
            session.create_tmp(), "jax-compilation-cache"),
            # every program, however quick to compile (the default keeps
            # those over 1 s)
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def _pytest(session, backend, *args, fast=True, **run):
    session.run("pytest", *WORKERS, *args, env=_env(session, backend, fast),
                **run)


def _launched(session, backend, processes, *args, **env):
    """pytest `args` under `python -m keras_layoutmap.launch -n processes`:
    every process runs each test with the others, on one mesh."""
    session.run(
        "python", "-m", "keras_layoutmap.launch", "-n", str(processes),
        "--log-dir", session.create_tmp(), "-m", "pytest", "-x", "-p",
        "no:cacheprovider", f"--timeout={LAUNCHED_TEST_TIMEOUT}", *args,
        env=_env(session, backend, fast=True, OMP_NUM_THREADS="1", **env),
    )


def _paths(tests):
    """The arguments of `tests` that name tests (a file or folder, with or
    without `::`); the others are options and their values (`-k hub`)."""
    return [t for t in tests if os.path.exists(t.split("::")[0])]


def _pytest_jax(session, tests):
    """`tests` (every test when they name none) on JAX in one process:
    those of EXACT_COMPILE at XLA's default level, the rest at
    FAST's."""
    paths = _paths(tests)
    options = [t for t in tests if t not in paths]
    exact = [t for t in paths if t.startswith(EXACT_COMPILE)]
    rest = [t for t in paths if not t.startswith(EXACT_COMPILE)]
    if not paths:
        exact, rest = [EXACT_COMPILE], [f"--ignore={EXACT_COMPILE}"]
    if rest:
        _pytest(session, "jax", *options, *rest)
    if exact:
        # Options that select (`-k hub`) may leave none of these: pytest's
        # status 5, no test ran, is then no failure.
        _pytest(session, "jax", *options, *exact, fast=False,
                success_codes=[0, 5] if options else [0])


def _run_tests(session, backend, tests=()):
    """The tests (`tests`, or those given after `--`, else all) on
    `backend`. JAX and TensorFlow: in one process, then the workflow matrix
    (when it is among them) in 2 processes under the launcher. torch: the
    tests that need no mesh (and those that start processes of their own)
    in one process, then the sharding and training tests under the
    launcher, 4 processes of one device each."""
    tests = [*tests, *session.posargs]
    if backend != "torch":
        if backend == "jax":
            _pytest_jax(session, tests)
        else:
            _pytest(session, backend, *tests)
        paths = _paths(tests)
        launched = [MATRIX, CHECKPOINTS] if not paths or any(
            t.startswith(MATRIX) for t in paths) else []
        for own in (ACROSS_PROCESSES, SOME_PROCESSES):
            if not paths or any(t.startswith(own) for t in paths):
                launched.append(own)
        if launched:
            devices = MATRIX_DEVICES.get(backend)
            _launched(session, backend, MATRIX_PROCESSES, *launched,
                      "-m", "not processes",
                      **({"KLM_TEST_DEVICES": str(devices)} if devices else {}))
        return
    _pytest(session, "torch", "-m", f"not ({MESH_TESTS}) or processes", *tests)
    _launched(session, "torch", TORCH_PROCESSES,
              "-m", f"({MESH_TESTS}) and not processes", *tests)


def _both_kerases(session, backend):
    """Keras 3.15: every test (or those given after `--`, then only on
    3.15); then keras-nightly swapped into the same virtualenv (its
    backend's install is most of a session's, 1 to 1.5 minutes) for the
    `NEXT_TESTS`. The virtualenv is left on keras-nightly; the next run's
    install puts 3.15 back."""
    _install(session, backend)
    # The numbers of an earlier run may be of other code.
    shutil.rmtree(_references(session), ignore_errors=True)
    _run_tests(session, backend)
    if session.posargs:
        return
    session.log("The keras-nightly cells: the workflow matrix and the seam "
                "to Keras' internals, on %s", " ".join(KERAS_NEXT))
    _to_keras_next(session)
    _run_tests(session, backend, NEXT_TESTS)


@nox.session(name="tests-jax", python=PYTHON)
def tests_jax(session):
    _both_kerases(session, "jax")


@nox.session(name="tests-tensorflow", python=PYTHON)
def tests_tensorflow(session):
    _both_kerases(session, "tensorflow")


@nox.session(name="tests-torch", python=PYTHON)
def tests_torch(session):
    _both_kerases(session, "torch")


def _keras_next_alone(session, backend):
    """keras-nightly's cells alone (`nox` runs them inside
    `tests-<backend>`), in a virtualenv of their own:
    `nox -s tests-keras-next-jax -- -k hub`."""
    _install(session, backend, keras_next=True)
    shutil.rmtree(_references(session), ignore_errors=True)
    _run_tests(session, backend, NEXT_TESTS)


@nox.session(name="tests-keras-next-jax", python=PYTHON)
def tests_keras_next_jax(session):
    _keras_next_alone(session, "jax")


@nox.session(name="tests-keras-next-tensorflow", python=PYTHON)
def tests_keras_next_tensorflow(session):
    _keras_next_alone(session, "tensorflow")


@nox.session(name="tests-keras-next-torch", python=PYTHON)
def tests_keras_next_torch(session):
    _keras_next_alone(session, "torch")


@nox.session(python=PYTHON)
def example(session):
    """The main job: data- then model-parallel digits on 8 virtual CPUs."""
    _check_python(session)
    session.install("-e", ".[jax,test]")
    session.run("python", "examples/train_digits.py", env={"KERAS_BACKEND": "jax"})


@nox.session(python=PYTHON)
@nox.parametrize("backend", ["jax", "tensorflow", "torch"])
def sweep(session, backend):
    """Every Keras layer of tests/layer_sweep.py under every plan on
    `backend` (torch: 4 processes), compared with one device; the outcomes
    to tests/data/sweep-<backend>.json, then docs/layers.md from all three
    (`nox -s sweep`: every backend; `nox -s "sweep(backend='jax')"`: one).
    Pass `-- --cases Conv2D,LSTM` for some cases (not written)."""
    _install(session, backend)
    out = os.path.join("tests", "data", f"sweep-{backend}.json")
    args = list(session.posargs) or ["--out", out]
    env = _env(session, backend, fast=True, OMP_NUM_THREADS="1")
    if backend == "torch":
        session.run("python", "-m", "keras_layoutmap.launch", "-n",
                    str(TORCH_PROCESSES), "--log-dir", session.create_tmp(),
                    "tests/layer_sweep.py", "--devices",
                    str(TORCH_PROCESSES), *args, env=env)
    else:
        session.run("python", "tests/layer_sweep.py", *args, env=env)
    session.run("python", "tests/layer_sweep.py", "--table", env=env)


@nox.session(python=PYTHON)
def bench(session):
    """The figures of benchmarks/: JAX, TensorFlow (DTensor against
    MirroredStrategy) and the two side by side."""
    session.install("-e", ".[jax,tensorflow-cpu,test]")
    session.install(*KERAS_HUB)
    session.install(*KERAS_HUB_DEPS)
    for script in ("overhead.py", "rules.py", "memory.py", "build.py",
                   "processes.py", "fsdp.py", "zero.py", "generate.py",
                   "auto_plan.py"):
        session.run("python", f"benchmarks/{script}", env={"KERAS_BACKEND": "jax"})
    for script in ("memory.py", "tf_data_parallel.py", "processes.py", "fsdp.py",
                   "zero.py", "generate.py"):
        session.run("python", f"benchmarks/{script}",
                    env={"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3"})
    session.run("python", "benchmarks/backends.py")
    # torch: 4 processes under the launcher (the scripts set KERAS_BACKEND
    # and OMP_NUM_THREADS for their workers); backends_torch.py and
    # build_memory.py run all three.
    session.install(TORCH)
    for script in ("torch_ddp.py", "torch_memory.py", "backends_torch.py",
                   "build_memory.py"):
        session.run("python", f"benchmarks/{script}")


@nox.session(python=PYTHON)
def lint(session):
    """ruff, and the layering contracts of pyproject.toml (import-linter:
    one direction of dependencies, no import circle, only backends/ imports
    a backend). import-linter reads the source; nothing is installed."""
    session.install("ruff", "import-linter>=2.5,<3")
    session.run("ruff", "check", "keras_layoutmap", "tests", "examples",
                "benchmarks", "docs", "noxfile.py")
    session.run("lint-imports", env={"PYTHONPATH": session.invoked_from})


@nox.session(python=PYTHON)
def docs(session):
    """The docs site (mkdocs.yml), warnings as errors, into site/ (or the
    folder given after `--`)."""
    session.install(*DOCS)
    site = session.posargs[0] if session.posargs else "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", site,
                env={"NO_MKDOCS_2_WARNING": "1"})
