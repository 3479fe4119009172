"""The extras state the ranges the code supports (a user's CUDA torch or GPU
TensorFlow satisfies them); the test sessions pin what they test, and what
this session runs on is inside its backend's range."""

import importlib.metadata
import os
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from keras_layoutmap import backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_EXTRAS = ("jax", "tensorflow", "tensorflow-cpu", "torch")


def extras():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def noxfile():
    with open(os.path.join(ROOT, "noxfile.py")) as f:
        return f.read()


def installed(name):
    """The installed version of distribution `name`, or None."""
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"] or "") == canonicalize_name(name):
            return dist.version
    return None


@pytest.mark.parametrize("extra", BACKEND_EXTRAS)
def test_backend_extras_are_lower_bounded_ranges(extra):
    (requirement,) = [Requirement(r) for r in extras()[extra]]
    assert requirement.name == extra
    operators = {s.operator for s in requirement.specifier}
    assert operators == {">="}, f"{extra}: {requirement} is not a range"


def test_torch_range_starts_where_the_public_dtensor_api_does():
    (requirement,) = [Requirement(r) for r in extras()["torch"]]
    assert not requirement.specifier.contains("2.4.1")
    assert requirement.specifier.contains("2.5.0")
    assert requirement.specifier.contains("2.14.0+cu128")  # a user's CUDA build


def test_nox_pins_the_cpu_builds_it_tests():
    source = noxfile()
    assert re.search(r'^TORCH = "torch==2\.13\.0"', source, re.M)
    # each test session installs the package with its backend's extra
    assert 'f".[{EXTRA[backend]},test]"' in source
    assert '"tensorflow": "tensorflow-cpu"' in source  # not full TensorFlow
    assert '"tensorflow": "tensorflow",' not in source
    assert '"torch": "torch"' in source  # the range holds the pinned build


def test_the_running_backend_is_in_its_extras_range():
    backend = backends.name()
    names = {"jax": ["jax"], "torch": ["torch"],
             "tensorflow": ["tensorflow-cpu", "tensorflow"]}[backend]
    found = [(n, installed(n)) for n in names if installed(n) is not None]
    assert found, f"none of {names} is installed, yet KERAS_BACKEND={backend}"
    for name, version in found:
        (requirement,) = [Requirement(r) for r in extras()[name]]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{name} {version} is outside the extra's {requirement}")
