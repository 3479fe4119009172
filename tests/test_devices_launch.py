"""Devices and the process launcher (backend-neutral)."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import SPANS_PROCESSES, as_launched_process

import keras_layoutmap as klm
from keras_layoutmap import backends


@pytest.mark.parametrize("n", [0, -1, 2.0, "8", True])
def test_configure_virtual_devices_rejects_bad_counts(n):
    with pytest.raises(ValueError, match="positive integer"):
        klm.configure_virtual_devices(n)


@pytest.mark.skipif(backends.name() != "torch",
                    reason="torch meshes span processes; JAX and TF make "
                    "devices in-process")
@pytest.mark.skipif(SPANS_PROCESSES, reason="this run was started by a launcher")
def test_torch_outside_launcher_says_how_to_launch():
    with pytest.raises(RuntimeError, match=r"python -m keras_layoutmap.launch -n 8"):
        klm.configure_virtual_devices(8)


def test_list_devices_names_devices():
    devices = klm.list_devices()
    assert devices and all(":" in d for d in devices)


@pytest.mark.processes
def test_launch_starts_one_process_per_rank(tmp_path):
    script = tmp_path / "worker.py"
    out = tmp_path / "out"
    out.mkdir()
    script.write_text(
        "import os, pathlib, sys\n"
        f"pathlib.Path({str(out)!r}, os.environ['RANK']).write_text("
        "os.environ['WORLD_SIZE'] + ' ' + os.environ['MASTER_ADDR'] + ' ' + "
        "sys.argv[1])\n"
    )
    code = subprocess.call([sys.executable, "-m", "keras_layoutmap.launch", "-n",
                            "3", str(script), "hello"])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["0", "1", "2"]
    assert (out / "2").read_text() == "3 127.0.0.1 hello"


@pytest.mark.processes
def test_launch_returns_first_failure(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    code = subprocess.call([sys.executable, "-m", "keras_layoutmap.launch", "-n",
                            "2", str(script)])
    assert code == 3


@pytest.mark.processes
def test_launch_ends_the_others_when_one_process_dies(tmp_path):
    # Rank 1 is killed; rank 0 would sleep for 10 minutes. The launcher must
    # stop rank 0 and return rank 1's status, well within 60 s.
    script = tmp_path / "die.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(0.5)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(600)\n")
    start = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "keras_layoutmap.launch", "-n",
                            "2", str(script)], timeout=120)
    assert code == 128 + signal.SIGKILL
    assert time.monotonic() - start < 60


@pytest.mark.processes
def test_launch_help_describes_its_arguments():
    result = subprocess.run(
        [sys.executable, "-m", "keras_layoutmap.launch", "--help"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--nproc", "--devices-per-process", "script"):
        assert flag in result.stdout


@pytest.mark.skipif(backends.name() == "torch",
                    reason="torch has one device per process")
def test_devices_per_process_must_add_up(monkeypatch):
    # As `launch -n 2 --devices-per-process 3` starts a script asking for 8.
    as_launched_process(monkeypatch, 2, 0, KLM_DEVICES_PER_PROCESS=3)
    with pytest.raises(ValueError, match="--devices-per-process 3 for 2 "
                       "processes, 6 devices"):
        klm.configure_virtual_devices(8)


@pytest.mark.skipif(backends.get().SHARDING,
                    reason="this backend places tensors on a mesh")
def test_unbuilt_backend_refuses_to_shard_clearly():
    mesh = klm.create_mesh([("batch", 2)], devices=["cpu:0", "cpu:1"])
    layout_map = klm.LayoutMap(mesh)
    with pytest.raises(NotImplementedError, match="not built yet.*KERAS_BACKEND=jax"):
        with layout_map.scope():
            pass
    with pytest.raises(NotImplementedError, match="not built yet"):
        klm.distribute(np.ones(2), klm.Layout([None], mesh))
    one = klm.LayoutMap(klm.create_mesh([("batch", 1)], devices=["cpu:0"]))
    with one.scope():  # one device: nothing to place, so it is allowed
        pass


@pytest.mark.sharding
def test_mesh_size_must_match_the_devices_unless_named():
    n = len(klm.list_devices())
    with pytest.raises(ValueError, match=rf"has 3 devices, but there are {n}"):
        klm.create_mesh([("batch", 3)])
    subset = klm.create_mesh([("batch", 3)], devices=klm.list_devices()[:3])
    assert subset.size == 3
    assert klm.create_mesh([("batch", n)]).size == n


@pytest.mark.sharding
def test_mesh_refuses_a_device_named_twice():
    with pytest.raises(ValueError, match="names device 'cpu:0' more than once"):
        klm.create_mesh([("batch", 8)], devices=["cpu:0"] * 8)


@pytest.mark.parametrize("size", [2.5, 2.0, "2", True, 0, -2])
def test_mesh_refuses_a_size_that_is_not_a_positive_integer(size):
    with pytest.raises(ValueError, match="must be a positive integer"):
        klm.create_mesh([("batch", size)], devices=["cpu:0", "cpu:1"])


@pytest.mark.sharding
def test_mesh_refuses_an_unknown_device_and_lists_those_that_exist():
    with pytest.raises(ValueError, match=r"\['cpu:99'\] that do not exist.*cpu:0"):
        klm.create_mesh([("batch", 2)], devices=["cpu:0", "cpu:99"])


def test_mesh_accepts_numpy_integer_sizes():
    # One device: every run has it, whatever backend and device count.
    mesh = klm.create_mesh([("batch", np.int64(1))], devices=klm.list_devices()[:1])
    assert mesh.shape == (1,) and type(mesh.shape[0]) is int


def _python_without_keras(tmp_path, args):
    """Run `python ARGS...` with `keras` made unimportable."""
    import os

    fake = tmp_path / "blocked"
    (fake / "keras").mkdir(parents=True)
    (fake / "keras" / "__init__.py").write_text(
        "raise ImportError('keras imported')\n")
    env = dict(os.environ)
    paths = [str(fake), os.getcwd(), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return subprocess.run([sys.executable, *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.processes
def test_launch_help_imports_no_keras_and_documents_its_arguments(tmp_path):
    result = _python_without_keras(
        tmp_path, ["-m", "keras_layoutmap.launch", "--help"])
    assert result.returncode == 0, result.stderr
    assert "how many processes to start" in result.stdout
    assert "the Python script each process runs" in result.stdout


def test_a_plain_import_installs_all(pytestconfig):
    """`import keras_layoutmap` outside its own tools (here: this test
    process, conftest.py's first import of it) imports Keras and installs
    everything at once, before any use of a public name. (The light import
    of `python -m keras_layoutmap`, completed on first use, runs in the
    fresh process of test_cli.py::test_weights_are_not_allocated.)"""
    assert pytestconfig.klm_plain_import == {
        "keras imported": True, "layer kwargs": True, "initializers": True}
