"""`python -m keras_layoutmap explain` / `klm explain` (backend-neutral)."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest

from keras_layoutmap import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUILDERS = '''
import keras


def mlp():
    inputs = keras.Input((64,))
    x = keras.layers.Dense(128, name="d1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(8, name="d2")(x), name="mlp")


class WithRules(keras.Model):
    """A model class that brings its own rules, as keras-hub backbones do."""

    def __init__(self):
        inputs = keras.Input((64,))
        x = keras.layers.Dense(128, name="d1")(inputs)
        super().__init__(inputs, x, name="with_rules")

    @classmethod
    def get_layout_map(cls, device_mesh):
        layout_map = keras.distribution.LayoutMap(device_mesh)
        layout_map["d1/kernel"] = (None, "model")
        return layout_map


def with_rules():
    return WithRules()


def huge():
    """4 GiB of float32 weights."""
    inputs = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(1 << 20, 1024, name="embed")(inputs)
    return keras.Model(inputs, x)


def not_a_model():
    return 3


class Refused(keras.Model):
    """A model whose own recipe splits 6 outputs over a model axis of 4."""

    def __init__(self):
        inputs = keras.Input((64,))
        super().__init__(inputs, keras.layers.Dense(6, name="d1")(inputs))

    @classmethod
    def get_layout_map(cls, device_mesh):
        layout_map = keras.distribution.LayoutMap(device_mesh)
        layout_map["d1/kernel"] = (None, "model")
        return layout_map


def refused():
    return Refused()


def broken():
    raise KeyError("num_heads")
'''

RULES = {"rules": [[r"d1\.kernel", [None, "model"]],
                   [r"d2\.kernel", [[None, "model"], [None, None]]]]}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "klm_builders.py").write_text(BUILDERS)
    (tmp_path / "rules.json").write_text(json.dumps(RULES))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("klm_builders", None)
    return tmp_path


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_table(workdir, capsys):
    code, out, _ = run(capsys, "explain", "klm_builders:mlp", "--mesh",
                       "batch=2,model=4", "--rules", "rules.json", "--width", "200")
    assert code == 0
    assert "model 'mlp' from klm_builders:mlp: 4 weights, 9,352 parameters" in out
    assert "d1.kernel" in out and "['unsharded', 'model']" in out
    # d2's kernel (128, 8) fits the first layout; its 8 columns on 4 devices.
    assert "total bytes per device: 9,760 (8 devices)" in out
    assert "mesh Mesh(batch=2, model=4)" in out


def test_json_fallbacks_and_mesh_larger_than_the_machine(workdir, capsys):
    # 64 devices: more than this process has; explain places nothing.
    code, out, _ = run(capsys, "explain", "klm_builders:mlp", "--mesh",
                       "batch=1,model=64", "--rules", "rules.json", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["mesh"] == {"batch": 1, "model": 64}
    weights = {w["object_path"]: w for w in doc["weights"]}
    d2 = weights["d2.kernel"]
    assert d2["layout"] == ["unsharded", "unsharded"] and d2["alternative"] == 1
    assert d2["refused"] == [{"layout": ["unsharded", "model"], "reason":
                              "mesh axis 'model' (size 64) does not divide "
                              "dimension 1 (size 8)"}]
    assert weights["d1.kernel"]["bytes_per_device"] == 64 * 128 // 64 * 4
    assert doc["parameters"] == 9352 and doc["strict_findings"] == []


def test_strict_exit_status(workdir, capsys):
    (workdir / "rules.yaml").write_text(
        "rules:\n  - ['renamed\\.kernel', [null, model]]\n")
    args = ["explain", "klm_builders:mlp", "--mesh", "model=2", "--rules",
            "rules.yaml", "--max-replicated-bytes", "1000"]
    code, out, _ = run(capsys, *args)
    assert code == 0 and "strict mode would find: 3 problem(s)" in out
    code, out, _ = run(capsys, *args, "--strict", "--json")
    assert code == 1
    findings = json.loads(out)["strict_findings"]
    assert [(f["kind"], f["subject"]) for f in findings] == [
        ("unused_rule", r"renamed\.kernel"),
        ("replicated_weight", "d1/kernel"), ("replicated_weight", "d2/kernel")]


def test_rules_from_the_model_class(workdir, capsys):
    code, out, _ = run(capsys, "explain", "klm_builders:with_rules", "--mesh",
                       "batch=1,model=8", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["rules_source"] == "WithRules.get_layout_map"
    assert doc["weights"][0]["rule"] == "d1/kernel"
    assert doc["weights"][0]["layout"] == ["unsharded", "model"]


def test_keras_file(workdir, capsys):
    import klm_builders

    klm_builders.mlp().save(workdir / "m.keras")
    code, out, _ = run(capsys, "explain", "m.keras", "--mesh", "model=2",
                       "--rules", "rules.json", "--json")
    assert code == 0
    assert len(json.loads(out)["weights"]) == 4


@pytest.mark.processes
def test_weights_are_not_allocated(workdir):
    model = cli.build_model("klm_builders:huge")
    (embed,) = model.weights
    assert tuple(embed.shape) == (1 << 20, 1024)
    assert embed._value is None  # deferred: no memory behind it
    # and the same in a fresh process, as `python -m keras_layoutmap
    # explain ... --strict` runs it: Python imports the package while it
    # locates `-m keras_layoutmap` (light: no Keras yet), then runs its
    # `__main__` (runpy, as `-m` does), whose first use of a public name
    # completes the import, installs included. Measured: 4 GiB of weights,
    # well under 1.5 GiB of memory (TensorFlow's runtime alone takes 0.7 to
    # 1.05 GiB here, seen over 1 GiB in a fresh clone's nox; allocated, the
    # weights would add 4), on a mesh of 8 devices, more than a fresh
    # process has. (A plain import installs everything at once: conftest.py
    # checks it in each test process, test_a_plain_import_installs_all.)
    code = textwrap.dedent('''
        import runpy, sys
        sys.argv[0] = "-m"  # as while `python -m keras_layoutmap` locates it
        sys.orig_argv = [sys.executable, "-m", "keras_layoutmap"]
        import keras_layoutmap as klm
        assert "keras" not in sys.modules, "locating the tool imported keras"
        sys.argv = ["keras_layoutmap", "explain", "klm_builders:huge",
                    "--mesh", "batch=2,model=4", "--json", "--rules", "r.toml",
                    "--strict"]
        try:
            runpy.run_module("keras_layoutmap", run_name="__main__",
                             alter_sys=True)
            status = 0
        except SystemExit as exit:
            status = exit.code
        from keras_layoutmap import initializers, layer_kwargs
        assert layer_kwargs._INSTALLED and initializers._INSTALLED
        # The peak of this process's own address space (VmHWM): getrusage's
        # ru_maxrss also counts the parent's pages shared at the fork, so a
        # pytest worker grown by earlier tests pushed it over the bound.
        with open("/proc/self/status") as proc:
            peak = next(line.split()[1] for line in proc
                        if line.startswith("VmHWM:"))
        print("MAXRSS_KB", peak)
        sys.exit(status)
    ''')
    (workdir / "r.toml").write_text('rules = [["embed.*", ["model", "unsharded"]]]\n')
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        cwd=workdir, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(
            None, [str(ROOT), str(workdir), os.environ.get("PYTHONPATH")]))},
        timeout=300)
    assert result.returncode == 0, result.stderr
    out, maxrss = result.stdout.rsplit("MAXRSS_KB", 1)
    report = json.loads(out)
    assert report["bytes_per_device"] == (1 << 30) and report["strict"] is True
    assert int(maxrss) < 3 << 19  # KiB: under 1.5 GiB


# --- bad input ---------------------------------------------------------------

def test_missing_files(workdir, capsys):
    code, _, err = run(capsys, "explain", "nope.keras", "--mesh", "model=2",
                       "--rules", "rules.json")
    assert code == 2 and "model file 'nope.keras' does not exist" in err
    code, _, err = run(capsys, "explain", "klm_builders:mlp", "--mesh", "model=2",
                       "--rules", "missing.yaml")
    assert code == 2 and "rules file 'missing.yaml' does not exist" in err
    code, _, err = run(capsys, "explain", "no_such_module:f", "--mesh", "model=2")
    assert code == 2 and "cannot import module 'no_such_module'" in err
    code, _, err = run(capsys, "explain", "klm_builders:nothing", "--mesh", "model=2")
    assert code == 2 and "module 'klm_builders' has no 'nothing'" in err
    code, _, err = run(capsys, "explain", "klm_builders:not_a_model", "--mesh",
                       "model=2", "--rules", "rules.json")
    assert code == 2 and "returned int, expected a keras.Model" in err
    code, _, err = run(capsys, "explain", "klm_builders", "--mesh", "model=2")
    assert code == 2 and "neither a .keras file nor module:function" in err


@pytest.mark.parametrize("mesh, message", [
    ("batch:2", "cannot parse 'batch:2': expected comma-separated axis=size"),
    ("batch=2,model=x", "the part 'model=x' is not one"),
    ("batch=0", "positive integer sizes"),
    ("model=2,model=4", "axis 'model' appears twice"),
    ("a=1024,b=1024,c=2", "has 2,097,152 devices; at most 1,048,576"),
])
def test_bad_mesh(capsys, mesh, message):
    with pytest.raises(SystemExit) as info:
        cli.main(["explain", "x:y", "--mesh", mesh])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_rules_file_of_the_wrong_schema(workdir, capsys):
    (workdir / "bad.json").write_text(json.dumps({"layouts": {"d1": ["model"]}}))
    code, _, err = run(capsys, "explain", "klm_builders:mlp", "--mesh", "model=2",
                       "--rules", "bad.json")
    assert code == 2 and "bad.json: A LayoutMap config is a dict with a 'rules'" in err
    (workdir / "bad.toml").write_text('[[rules]]\nrule = "d1.*"\n')
    code, _, err = run(capsys, "explain", "klm_builders:mlp", "--mesh", "model=2",
                       "--rules", "bad.toml")
    assert code == 2 and "missing ['layout']" in err
    (workdir / "bad.yaml").write_text("rules:\n  - [d1.kernel, [feature, null]]\n")
    code, _, err = run(capsys, "explain", "klm_builders:mlp", "--mesh", "model=2",
                       "--rules", "bad.yaml")
    assert code == 2 and "Rule 'd1.kernel': axis 'feature' is not in the mesh" in err


# --- the command line itself ---------------------------------------------------

@pytest.mark.processes
def test_help_needs_no_keras():
    # cli.py alone (as `python -m keras_layoutmap` runs it once the package
    # import is light) parses --help without importing Keras.
    code = textwrap.dedent(f'''
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location(
            "klm_cli", {os.path.join(ROOT, "keras_layoutmap", "cli.py")!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for argv in (["--help"], ["explain", "--help"]):
            try:
                module.main(argv)
            except SystemExit as e:
                assert e.code == 0
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("keras", "jax", "tensorflow", "torch"))
        assert not heavy, heavy
    ''')
    result = subprocess.run([sys.executable, "-c", code], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: klm [-h] COMMAND" in result.stdout
    assert "--mesh AXIS=SIZE,..." in result.stdout


@pytest.mark.processes
def test_python_dash_m(workdir):
    """`python -m keras_layoutmap`: its help (an explain through the
    package's `__main__`: test_weights_are_not_allocated)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{workdir}"}
    result = subprocess.run([sys.executable, "-m", "keras_layoutmap", "--help"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "explain" in result.stdout


def test_console_script_is_declared():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["klm"] == "keras_layoutmap.cli:main"


def test_keras_is_importable_here():
    assert keras.__version__  # the in-process tests above need a backend


@pytest.mark.processes
def test_help_imports_no_keras_through_python_m(tmp_path):
    # `python -m keras_layoutmap --help` imports the package while Python
    # locates __main__: it must stay light (no Keras, no backend).
    (tmp_path / "keras.py").write_text(
        "raise ImportError('keras must not be imported')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    result = subprocess.run([sys.executable, "-m", "keras_layoutmap", "--help"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "explain" in result.stdout


# --- --auto: klm.auto_layout_map from the command line ---------------------

def test_cli_auto(workdir, capsys):
    code, out, err = run(capsys, "explain", "klm_builders:mlp", "--mesh",
                         "batch=4,model=2", "--auto", "--json",
                         "--write-rules", "plan.yaml")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["rules_source"] == "klm.auto_layout_map"
    d1 = next(w for w in doc["weights"] if w["object_path"] == "d1.kernel")
    assert d1["layout"] == ["batch", "model"]
    assert d1["reason"].startswith("column-parallel: feeds d2")
    # The rules written, edited and passed back.
    code, out, err = run(capsys, "explain", "klm_builders:mlp", "--mesh",
                         "batch=4,model=2", "--rules", "plan.yaml",
                         "--width", "250")
    assert code == 0, err
    assert "column-parallel: feeds d2" in out


def test_cli_errors_are_one_line(workdir, capsys):
    code, out, err = run(capsys, "explain", "klm_builders:refused",
                         "--mesh", "batch=2,model=4")
    assert code == 1 and "Traceback" not in err and len(err.splitlines()) == 1
    assert "cannot place" in err and "4 does not divide 6" in err
    code, _, err = run(capsys, "explain", "klm_builders:mlp", "--mesh",
                       "batch=4,model=2", "--auto", "--device-memory", "1KiB")
    assert code == 1 and len(err.splitlines()) == 1 and "at least" in err
    code, _, err = run(capsys, "explain", "klm_builders:broken", "--mesh",
                       "batch=4,model=2", "--auto")
    assert code == 2 and len(err.splitlines()) == 1
    assert "KeyError: 'num_heads'" in err
    code, _, err = run(capsys, "explain", "klm_builders:mlp", "--mesh",
                       "data=4,model=2", "--auto")
    assert code == 2 and "data_axis='batch' is not an axis" in err
