"""`python -m keras_layoutmap explain` (or `klm explain`): check a sharding
plan from the command line, without allocating the weights.

    klm explain MODEL --mesh batch=1,model=8 [--rules FILE | --auto] [--json]
                      [--strict] [--optimizer adam] [--device-memory 16GiB]
                      [--show REGEX] [--write-rules FILE]

MODEL is `module:function` (a function that returns a model, importable from
the current folder or `PYTHONPATH`) or a `.keras` file. The model is built
inside `keras.StatelessScope(initialize_variables=False)`: every weight
gets its shape, dtype and path, none gets memory, so a 7B-parameter model is
explained on a laptop in seconds. The mesh is made of named placeholder
devices: explain never places a tensor, so the mesh may be larger than the
devices this machine has (a plan for a cluster, checked on a laptop).

Rules come from `--rules` (a JSON, YAML or TOML rules file, see
`LayoutMap.from_file`), or else from the model's own
`get_layout_map(device_mesh)` (keras-hub backbones have one; a task model's
`backbone` is asked too). `--auto` plans the model with
`klm.auto_layout_map` instead (with `--device-memory`, weights are split
over the data axis only as far as they need to fit), and the table says why
each weight got its layout; `--write-rules FILE` (`.json`, `.yaml`) saves
the rules, to edit and pass back with `--rules`.

`--optimizer adam` adds gradients and the optimizer's state to the memory
per device, `--device-memory 16GiB` marks a plan that needs more.

Exit status: 0; 1 when `--strict` finds a rule that matches no weight, a
large weight no rule places, or a plan over `--device-memory`, and when the
rules cannot place the model (a rule whose mesh axis does not divide a
weight) or no automatic plan fits `--device-memory`; 2 for bad input (a
missing file, a mesh or a device memory that cannot be parsed, a rules file
of the wrong schema, a model that cannot be built, an unknown optimizer).
Every error is one line on stderr, never a traceback.

This module imports nothing heavy until the arguments are parsed: `--help`
needs no Keras and no backend.
"""

import argparse
import importlib
import json
import math
import os
import sys

# More devices than this is no mesh any machine builds: refuse it, rather
# than spend the memory on a table of placeholder devices.
MAX_MESH_DEVICES = 1 << 20


class InputError(Exception):
    """Bad input on the command line: reported in one line, exit status 2."""


class PlanRefused(Exception):
    """The rules cannot place the model, or no plan fits: one line, exit
    status 1."""


def parse_mesh(text):
    """`"batch=1,model=8"` -> `[("batch", 1), ("model", 8)]`."""
    dims = []
    for part in text.split(","):
        name, sep, size = part.strip().partition("=")
        name, size = name.strip(), size.strip()
        if not sep or not name or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"cannot parse {text!r}: expected comma-separated axis=size "
                "pairs with positive integer sizes, e.g. batch=1,model=8 "
                f"(the part {part!r} is not one)"
            )
        if name in dict(dims):
            raise argparse.ArgumentTypeError(
                f"cannot parse {text!r}: axis {name!r} appears twice"
            )
        dims.append((name, int(size)))
    size = math.prod(s for _, s in dims)
    if size > MAX_MESH_DEVICES:
        raise argparse.ArgumentTypeError(
            f"the mesh {text!r} has {size:,} devices; at most "
            f"{MAX_MESH_DEVICES:,} are accepted"
        )
    return dims


def parse_device_memory(text):
    """`"16GiB"` -> bytes, for `--device-memory`."""
    # lazily: `--help` imports no Keras
    from keras_layoutmap.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser():
    parser = argparse.ArgumentParser(
        prog="klm",
        description="keras-layoutmap from the command line.",
    )
    commands = parser.add_subparsers(dest="command", required=True,
                                     metavar="COMMAND")
    explain = commands.add_parser(
        "explain",
        help="which rule places each weight of a model, and what it costs "
        "per device, without allocating the weights",
        description="Print which rule places each weight of MODEL on a mesh, "
        "the bytes per device, rules that match nothing or are shadowed, "
        "fallback layouts used and strict-mode findings. The weights are "
        "never allocated (shapes only).",
    )
    explain.add_argument(
        "model", metavar="MODEL",
        help="module:function returning a model (importable from the current "
        "folder or PYTHONPATH), or a .keras file",
    )
    explain.add_argument(
        "--mesh", required=True, type=parse_mesh, metavar="AXIS=SIZE,...",
        help="the mesh's axes and sizes, e.g. batch=1,model=8; it may be "
        "larger than this machine's devices",
    )
    source = explain.add_mutually_exclusive_group()
    source.add_argument(
        "--rules", metavar="FILE",
        help="a JSON, YAML or TOML rules file; default: the model's own "
        "get_layout_map(mesh)",
    )
    source.add_argument(
        "--auto", action="store_true",
        help="plan the model automatically (klm.auto_layout_map): tensor "
        "parallel over --model-axis, and over --data-axis as memory needs; "
        "the table says why each weight got its layout",
    )
    explain.add_argument(
        "--model-axis", default="model", metavar="AXIS",
        help="with --auto: the mesh axis tensor parallelism splits over "
        "(default: model)",
    )
    explain.add_argument(
        "--data-axis", default="batch", metavar="AXIS",
        help="with --auto: the mesh axis batches (and, as memory needs, "
        "weights) are split over (default: batch)",
    )
    explain.add_argument(
        "--write-rules", metavar="FILE", default=None,
        help="write the plan's rules to FILE (.json, .yaml or .yml), to edit "
        "and pass back with --rules",
    )
    explain.add_argument(
        "--json", action="store_true",
        help="print one JSON document instead of the table",
    )
    explain.add_argument(
        "--strict", action="store_true",
        help="exit with status 1 when a rule matches no weight, a weight "
        "larger than --max-replicated-bytes is replicated by no rule, or the "
        "plan needs more than --device-memory",
    )
    explain.add_argument(
        "--max-replicated-bytes", type=int, default=None, metavar="N",
        help="the largest weight strict mode lets go replicated without a "
        "rule (default: the rules file's, else 1 MiB)",
    )
    explain.add_argument(
        "--optimizer", metavar="NAME", default=None,
        help="count gradients and this optimizer's state (a keras.optimizers "
        "name: adam, adamw, sgd, ...) in the memory per device; without it "
        "the memory is the weights' (inference)",
    )
    explain.add_argument(
        "--device-memory", type=parse_device_memory, default=None,
        metavar="BYTES",
        help="each device's memory, e.g. 16GiB or 80GB: devices the plan "
        "needs more than are marked, and --strict exits with status 1",
    )
    explain.add_argument(
        "--show", metavar="REGEX", default=None,
        help="after the table, draw the blocks of each weight whose object "
        "path or variable path the regex matches whole, and the devices "
        "holding each (as klm.visualize does)",
    )
    explain.add_argument(
        "--width", type=int, default=None, metavar="COLUMNS",
        help="the table's width (default: the terminal's)",
    )
    return parser


def main(argv=None):
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _explain(args)
    except InputError as e:
        print(f"klm explain: error: {e}", file=sys.stderr)
        return 2
    except PlanRefused as e:
        print(f"klm explain: error: {e}", file=sys.stderr)
        return 1


def _full_package():
    # `python -m keras_layoutmap` may have imported the package without its
    # heavy part while Python located `__main__`; load it whole now.
    klm = importlib.import_module("keras_layoutmap")
    if not hasattr(klm, "LayoutMap"):
        klm = importlib.reload(klm)
    return klm


def planning_mesh(dims):
    """A mesh of named placeholder devices (`"cpu:0"`, ...): enough for
    rules and explain, which never place a tensor."""
    klm = _full_package()
    return klm.Mesh.for_planning(dims)


def build_model(spec):
    """The model named by `spec`, built with shapes only (no weight gets
    memory)."""
    from keras_layoutmap.auto_plan import build_shapes_only

    if spec.endswith(".keras"):
        return build_shapes_only(lambda: _load_keras_file(spec),
                                 keep_names=False)
    return build_shapes_only(lambda: _call_builder(spec), keep_names=False)


def _call_builder(spec):
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise InputError(
            f"MODEL {spec!r} is neither a .keras file nor module:function "
            "(e.g. my_models:build_gemma)"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise InputError(
                f"cannot import module {module_name!r} of MODEL {spec!r} from "
                f"the current folder ({os.getcwd()}) or PYTHONPATH"
            ) from None
        raise
    builder = module
    for part in attr.split("."):
        if not hasattr(builder, part):
            raise InputError(f"module {module_name!r} has no {attr!r} (MODEL {spec!r})")
        builder = getattr(builder, part)
    try:
        model = builder() if callable(builder) else builder
    except Exception as e:
        raise InputError(
            f"building MODEL {spec!r} failed: {type(e).__name__}: {e}"
        ) from None
    import keras

    if not isinstance(model, keras.Model):
        raise InputError(
            f"{spec} returned {type(model).__name__}, expected a keras.Model"
        )
    return model


def _load_keras_file(path):
    import zipfile

    import keras

    if not os.path.exists(path):
        raise InputError(f"model file {path!r} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            config = json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, KeyError, ValueError) as e:
        raise InputError(f"{path!r} is not a .keras model file: {e}") from None
    config.pop("compile_config", None)  # no optimizer: only the weights count
    return keras.saving.deserialize_keras_object(config)


def _model_layout_map(model, mesh):
    """The rules the model's class provides (`get_layout_map(mesh)`), looking
    at a task model's backbone too."""
    klm = _full_package()
    for owner in (model, getattr(model, "backbone", None)):
        get = getattr(type(owner), "get_layout_map", None)
        if owner is not None and get is not None:
            return klm.LayoutMap.from_keras(get(mesh), mesh), (
                f"{type(owner).__name__}.get_layout_map")
    raise InputError(
        f"no --rules given and {type(model).__name__} has no get_layout_map(); "
        "pass --rules FILE"
    )


def _explain(args):
    if args.show is not None and args.json:
        raise InputError("--show draws pictures, which --json does not carry; "
                         "pass one of them")
    klm = _full_package()
    mesh = planning_mesh(args.mesh)
    if args.rules is not None and not os.path.exists(args.rules):
        raise InputError(f"rules file {args.rules!r} does not exist")
    if args.write_rules is not None and not args.write_rules.endswith(
            (".json", ".yaml", ".yml")):
        raise InputError(f"--write-rules {args.write_rules!r}: expected a "
                         ".json, .yaml or .yml file")
    model = build_model(args.model)
    if args.rules is not None:
        try:
            layout_map = klm.LayoutMap.from_file(args.rules, mesh=mesh)
        except (ValueError, TypeError) as e:
            raise InputError(str(e)) from None
        source = args.rules
    elif args.auto:
        layout_map, source = _auto_layout_map(klm, model, mesh, args)
    else:
        layout_map, source = _model_layout_map(model, mesh)
    if args.strict:
        layout_map.strict = True
    if args.max_replicated_bytes is not None:
        layout_map.max_replicated_bytes = args.max_replicated_bytes
    try:
        report = layout_map.explain(model, optimizer=args.optimizer,
                                    device_memory=args.device_memory)
    except (ValueError, TypeError) as e:
        if args.optimizer is None or "optimizer" not in str(e):
            raise PlanRefused(f"the rules from {source} cannot place "
                              f"{model.name!r}: {e}") from None
        raise InputError(f"--optimizer: {e}") from None
    if args.write_rules is not None:
        _write_rules(layout_map, args.write_rules)
    params = sum(math.prod(r.shape) for r in report.rows)
    if args.json:
        document = {"model": args.model, "model_name": model.name,
                    "parameters": params, "rules_source": source,
                    **report.to_dict()}
        print(json.dumps(document, indent=2))
    else:
        print(f"model {model.name!r} from {args.model}: {len(report.rows)} "
              f"weights, {params:,} parameters; mesh {mesh!r}; rules from "
              f"{source}")
        print(report.render(width=args.width), end="")
        if args.show is not None:
            try:
                report.show(args.show, file=sys.stdout)
            except ValueError as e:
                raise InputError(f"--show: {e}") from None
    return 1 if args.strict and report.findings else 0


def _auto_layout_map(klm, model, mesh, args):
    """`klm.auto_layout_map` of the model, its errors as one line."""
    try:
        plan = klm.auto_layout_map(
            model, mesh, model_axis=args.model_axis,
            data_axis=args.data_axis, device_memory=args.device_memory)
    except (ValueError, TypeError, RuntimeError) as e:
        kind = PlanRefused if "device_memory" in str(e) else InputError
        raise kind(str(e)) from None
    return plan, "klm.auto_layout_map"


def _write_rules(layout_map, path):
    """The map's rules (and reasons) to a JSON or YAML file."""
    config = layout_map.get_config()
    try:
        with open(path, "w") as f:
            if path.endswith(".json"):
                json.dump(config, f, indent=2)
                f.write("\n")
            else:
                import yaml

                yaml.safe_dump(config, f, sort_keys=False)
    except OSError as e:
        raise InputError(f"--write-rules: cannot write {path!r}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
