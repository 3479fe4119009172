"""The examples in the public docstrings run and print what they say."""

import doctest
import importlib

import pytest

MODULES = ["mesh", "layout", "layout_map", "distributions", "data", "optimizers",
           "metrics", "placement", "processes", "initializers", "strict",
           "keras_classes", "fsdp", "visualize", "zero", "same_value",
           "one_writer", "save_handshake"]


@pytest.mark.sharding
@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(f"keras_layoutmap.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no docstring example"
