"""Every Keras layer of the sweep (tests/layer_sweep.py) trains in the
sweep's most demanding plan equal to one device, or gives the clear error
the sweep declares for it on this backend; never a wrong result or a raw
error. `nox -s sweep` runs every plan and writes docs/layers.md."""

import keras
import pytest
from layer_sweep import DEMANDING, by_name, expected, meshes, one_device, run

from keras_layoutmap import backends

BACKEND = backends.name()


@pytest.fixture(scope="module")
def the_meshes():
    return meshes()


@pytest.mark.sharding
@pytest.mark.training
@pytest.mark.parametrize("name", list(by_name()))
def test_layer_under_the_demanding_plan(name, the_meshes):
    case = by_name()[name]
    reference = one_device(case, light=True)
    if isinstance(reference, str):
        pytest.skip(f"{name}: one device itself fails: {reference}")
    keras.backend.clear_session()
    outcome = run(case, DEMANDING, reference, the_meshes, light=True)
    known = expected(BACKEND, DEMANDING, name)
    if known is None:
        assert outcome.word == "yes", f"{name} under {DEMANDING}: {outcome}"
        return
    assert outcome.word != "yes", (
        f"{name} now equals one device: remove its `Known` ({known.why})")
    assert outcome.word == known.word and known.match in outcome.detail, (
        f"{name}: {outcome}, declared {known}")
    if known.word != "refused":
        pytest.xfail(f"an open bug, declared in layer_sweep.KNOWN: {known.why}")


def _recorded():
    import json

    from layer_sweep import BACKENDS, RESULTS
    return {b: json.loads((RESULTS / f"sweep-{b}.json").read_text())
            for b in BACKENDS if (RESULTS / f"sweep-{b}.json").exists()}


@pytest.mark.parametrize("name", list(by_name()))
def test_every_recorded_cell_that_fails_is_declared(name):
    """What `nox -s sweep` recorded (tests/data/sweep-*.json) agrees with
    `KNOWN`: a cell that is not "yes" is declared with its outcome, a
    declared cell was recorded so (an open bug, wrong or raw, is declared
    as one and listed in docs/layers.md)."""
    from layer_sweep import PLANS
    for backend, recorded in _recorded().items():
        row = recorded["results"].get(name)
        assert row is not None, f"{name}: not in sweep-{backend}.json"
        for plan in PLANS:
            word, detail = row[plan]
            known = expected(backend, plan, name)
            if word in ("yes", "n/a"):
                assert known is None, f"{backend} {plan} {name}: {known}"
            else:
                assert known is not None and known.word == word and \
                    known.match in detail, (
                        f"{backend} {plan} {name}: recorded {word}: {detail}")


def test_the_table_is_the_recorded_sweep():
    from layer_sweep import TABLE, table
    assert TABLE.read_text() == table(), "run: python tests/layer_sweep.py --table"


def test_every_declared_cell_names_a_case_and_a_plan():
    from layer_sweep import KNOWN, PLANS
    names = set(by_name())
    for known in KNOWN:
        assert set(known.cases) <= names, set(known.cases) - names
        assert set(known.plans) <= set(PLANS), known.plans
        assert known.word in ("refused", "wrong", "raw"), known.word
