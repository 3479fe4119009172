"""The README's first snippet runs as pasted, under the session's backend."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from keras_layoutmap import backends

README = Path(__file__).resolve().parent.parent / "README.md"


def first_python_block():
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    assert match, "README.md has no ```python block"
    return match.group(1)


def test_what_works_table_is_the_workflow_matrix():
    """README's "What works" table and docs/workflows.md are what
    tests/workflows.py generates from the matrix the tests run."""
    import workflows

    assert workflows.stale() == [], "run: python tests/workflows.py"


def test_first_snippet_sets_the_backend_before_keras():
    code = first_python_block()
    assert code.index("KERAS_BACKEND") < code.index("import keras")
    assert "from_logits=True" in code


@pytest.mark.processes
@pytest.mark.training
def test_first_snippet_runs_as_pasted(tmp_path):
    """On torch its 4 devices are 4 processes: the same file under
    `python -m keras_layoutmap.launch -n 4`, as docs/torch.md says."""
    pytest.importorskip("sklearn", reason="the snippet loads scikit-learn's "
                        "digits; install the test extra")
    # The snippet as pasted, then checks that it trained and placed.
    script = tmp_path / "snippet.py"
    script.write_text(first_python_block() + (
        "\nloss, accuracy = model.evaluate(x, y, verbose=0)\n"
        "assert accuracy > 0.8, accuracy\n"
        "assert klm.fetch_layout(model.layers[0].kernel).sharding_specs == "
        "['unsharded', 'model']\n"
        "print('SNIPPET OK', accuracy)\n"))
    # A terminal wide enough that explain's table keeps each path on a line.
    env = dict(os.environ, KERAS_BACKEND=backends.name(), TF_CPP_MIN_LOG_LEVEL="3",
               COLUMNS="160")
    command = [sys.executable, str(script)]
    if backends.name() == "torch":
        command[1:1] = ["-m", "keras_layoutmap.launch", "-n", "4"]
        env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command, env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "SNIPPET OK" in result.stdout
    assert "hidden_1.kernel" in result.stdout  # the explain table printed
