import gc
import hashlib
import os
import re

import pytest

# As helpers.SPANS_PROCESSES (not imported here: see pytest_configure).
SPANS_PROCESSES = int(os.environ.get("WORLD_SIZE", "1")) > 1


def _runs_no_test(config):
    """pytest-xdist's controller: it starts the workers, which collect and
    run every test, and gathers their reports."""
    return (not hasattr(config, "workerinput")
            and not config.getoption("collectonly")
            and config.getoption("dist", "no") != "no"
            and bool(config.getoption("tx", None)))


def pytest_configure(config):
    """Keras and the backend, with the run's devices, in every process that
    runs tests (before any test module is imported). Not in xdist's
    controller: importing them there took 5 to 11 s of one core (the other
    idle) before a worker started, at each pytest run of nox's sessions."""
    if _runs_no_test(config):
        return
    import sys

    import keras_layoutmap as klm  # a plain import, before any use
    from keras_layoutmap import initializers, layer_kwargs

    config.klm_plain_import = {  # test_devices_launch.py reads it
        "keras imported": "keras" in sys.modules,
        "layer kwargs": layer_kwargs._INSTALLED,
        "initializers": initializers._INSTALLED}
    from helpers import BACKEND, DEVICES, SHARDING

    # The first call after import, as a user script does (the run's device
    # count, and why: helpers.py).
    # On every backend the devices are CPUs, also on a machine with GPUs
    # (torch: one process, or each of the launcher's, on its CPU).
    if BACKEND == "torch" or SHARDING:
        klm.configure_virtual_devices(DEVICES)

    # KLM_TEST_FAST_GRAPHS=1 (nox's TensorFlow pytest runs, one process and
    # the matrix's two): TensorFlow's graph optimizer (grappler) is off in
    # this process, about 1.6 times faster on this suite's tests. DTensor's
    # SPMD expansion (its layout rules and refusals) is a pass of its own;
    # every comparison is one function against another built alike.
    # Processes that tests start keep it on, as users do (noxfile.py, FAST).
    if BACKEND == "tensorflow" and os.environ.get("KLM_TEST_FAST_GRAPHS") == "1":
        import tensorflow as tf

        tf.config.optimizer.set_experimental_options(
            {"disable_meta_optimizer": True})


@pytest.fixture
def mesh_2d():
    from helpers import fake_mesh

    return fake_mesh([("batch", 4), ("model", 2)])


@pytest.fixture(autouse=True)
def _clean_state():
    # clear_session's `gc.collect()` frees the last test's cycles, then
    # walks every object Python tracks: the backend's, Keras' and the test
    # modules' 250,000 and more, none of them garbage, 0.2 to 1.5 s a test,
    # a quarter of the suite's time (torch under the launcher: a third).
    # What is alive once it has run is moved out of the collector's sight
    # (`gc.freeze()`), so that the next collection walks only what a test
    # made. Measured on 87 JAX tests: 1,752 objects frozen then dropped, a
    # few MB; the collection no longer costs a test anything.
    import keras

    import keras_layoutmap as klm

    keras.backend.clear_session()
    gc.freeze()
    klm.set_distribution(None)
    yield
    klm.set_distribution(None)


def _collective(item):
    return "sharding" in item.keywords or "training" in item.keywords


if SPANS_PROCESSES:
    @pytest.fixture
    def tmp_path(request, tmp_path_factory):
        """pytest's `tmp_path`, except in a test that every rank executes
        together (`sharding`, `training`): there all ranks get the same
        folder, as a user's script saves and loads one checkpoint path on
        every rank."""
        name = re.sub(r"[\W]", "_", request.node.name)[:30]
        if not _collective(request.node):
            return tmp_path_factory.mktemp(name, numbered=True)
        from helpers import folder_every_rank_shares

        test = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
        return folder_every_rank_shares(f"{name}-{test}")


_ONE_PROCESS_PER_DEVICE = (
    "needs a mesh of several devices; on torch one device per process: run "
    "under `python -m keras_layoutmap.launch -n 4 -m pytest` (nox -s "
    "tests-torch does)")


def pytest_collection_modifyitems(config, items):
    from helpers import BACKEND, DEVICES, SHARDING, TRAINING

    for item in items:
        processes = "processes" in item.keywords
        if processes and SPANS_PROCESSES:
            item.add_marker(pytest.mark.skip(
                reason="starts its own processes; every rank of this run would "
                "start them: run it from one process"))
        elif (BACKEND == "torch" and DEVICES < 4 and _collective(item)
                and not processes):
            item.add_marker(pytest.mark.skip(reason=_ONE_PROCESS_PER_DEVICE))
        elif "sharding" in item.keywords and not SHARDING:
            item.add_marker(pytest.mark.skip(
                reason=f"needs a backend that places tensors on a mesh; the "
                f"{BACKEND} backend cannot yet"))
        elif "training" in item.keywords and not TRAINING:
            item.add_marker(pytest.mark.skip(
                reason=f"needs model.fit on a mesh; not built yet for the "
                f"{BACKEND} backend"))


if SPANS_PROCESSES:
    def pytest_unconfigure(config):
        """A rank whose tests failed ends at once, skipping the runtime's
        exit handshake (DTensor's waits for every rank): the others may be
        inside the next test's collective and never get there, and the
        launcher ends them as soon as this rank's failure is seen."""
        status = getattr(config, "_klm_exit_status", 0)
        if status not in (0, 5):  # 5: nothing collected
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    def pytest_sessionfinish(session, exitstatus):
        session.config._klm_exit_status = int(exitstatus)
