"""`LayoutMap.scope()` for subclassed, Functional and Sequential models.

This is the "Specify Layout for existing model code" part of the TF DTensor
Keras tutorial, on Keras 3. The model code is untouched; one `LayoutMap`
says where its weights go:

- a subclassed model's weights are keyed by attribute path
  (`feature.kernel`, `feature_2.bias`), as `tf.Module` checkpoints name them;
- a Functional or Sequential model's by layer name (`feature.kernel` again,
  because the layers are *named* `feature` and `feature_2`).

The subclassed model builds its weights at its first call, *outside* the
scope; the layers remember the scope they were made in. Each model then
trains a few epochs on scikit-learn's digits with plain `fit`.

Run: `KERAS_BACKEND=jax python examples/subclassed_scope.py [--epochs N]`
(or `KERAS_BACKEND=tensorflow`).
Exits non-zero if a weight lands on the wrong layout or a model ends below
90% validation accuracy.
"""

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras_layoutmap as klm  # noqa: E402

klm.configure_virtual_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

MIN_ACCURACY = 0.9
HIDDEN = 64
CLASSES = 10


class SubclassedModel(keras.Model):
    """The tutorial's model, sized for 8x8 digits and ten classes."""

    def __init__(self, hidden=HIDDEN, classes=CLASSES, name=None):
        super().__init__(name=name)
        self.feature = keras.layers.Dense(hidden, activation="relu")
        self.feature_2 = keras.layers.Dense(classes)
        self.dropout = keras.layers.Dropout(0.1)

    def call(self, inputs, training=None):
        x = self.feature(inputs)
        x = self.dropout(x, training=training)
        return self.feature_2(x)


def functional_model():
    inputs = keras.Input((64,))
    x = keras.layers.Dense(HIDDEN, activation="relu", name="feature")(inputs)
    x = keras.layers.Dropout(0.1)(x)
    outputs = keras.layers.Dense(CLASSES, name="feature_2")(x)
    return keras.Model(inputs, outputs, name="functional")


def sequential_model():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(HIDDEN, activation="relu", name="feature"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(CLASSES, name="feature_2"),
        ],
        name="sequential",
    )


def make_layout_map(mesh):
    layout_map = klm.LayoutMap(mesh)
    # As in the tutorial, 'feature.*kernel' matches feature.kernel and
    # feature_2.kernel: split their first (input) dimension. The tutorial
    # splits it over its only axis, `batch`; here it goes over `model`...
    layout_map["feature.*kernel"] = klm.Layout(["model", klm.UNSHARDED], mesh)
    # ...the axis that splits the biases (10 classes do not divide over
    # `batch`=4, but they do over `model`=2). `feature`'s output is then
    # split over `model` exactly as `feature_2.kernel`'s rows are. TensorFlow
    # needs that: DTensor refuses a matmul whose contracted dimension is
    # split over one axis on one side and another on the other (JAX
    # reshards).
    layout_map["feature.*bias"] = klm.Layout(["model"], mesh)
    return layout_map


def load_data(seed=0):
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    x = (digits.data[order] / 16.0).astype("float32")
    return x, digits.target[order].astype("int32")


def check_layouts(name, layers, expected, failures):
    for layer_name, layer in zip(("feature", "feature_2"), layers):
        for weight in ("kernel", "bias"):
            got = klm.fetch_layout(getattr(layer, weight))
            if got != expected[weight]:
                failures.append(
                    f"{name}: {layer_name}.{weight} is {got.sharding_specs}, "
                    f"expected {expected[weight].sharding_specs}"
                )


def fit(name, model, x, y, epochs, failures):
    # Compiled and trained outside the scope: the model remembers it.
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(x, y, batch_size=128, epochs=epochs,
                        validation_split=0.2, verbose=2)
    accuracy = float(history.history["val_accuracy"][-1])
    print(f"{name}: final val_accuracy = {accuracy:.4f}")
    if accuracy < MIN_ACCURACY:
        failures.append(f"{name}: val_accuracy {accuracy:.4f} < {MIN_ACCURACY}")
    return accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()

    mesh = klm.create_mesh([("batch", 4), ("model", 2)])
    layout_map = make_layout_map(mesh)
    print(layout_map)
    expected = {"kernel": klm.Layout(["model", klm.UNSHARDED], mesh),
                "bias": klm.Layout(["model"], mesh)}
    x, y = load_data()
    failures, results = [], {}

    # -- Subclassed: created in the scope, built at the first call outside.
    keras.utils.set_random_seed(0)
    with layout_map.scope():
        subclassed = SubclassedModel()
    print(f"\nbuilt inside the scope? {subclassed.built}")
    first_batch = klm.copy_to_mesh(x[:16], klm.Layout.replicated(mesh, 2))
    subclassed(first_batch)  # creates the weights, with their layouts
    print(f"model.feature.kernel: {klm.fetch_layout(subclassed.feature.kernel)}")
    print(f"per-device shards: "
          f"{[tuple(s.shape) for s in klm.unpack(subclassed.feature.kernel)]}")
    print(layout_map.explain(subclassed))
    check_layouts("subclassed", (subclassed.feature, subclassed.feature_2),
                  expected, failures)
    results["subclassed"] = fit("subclassed", subclassed, x, y, args.epochs,
                                failures)

    # -- Functional and Sequential: the same rules, matched on layer names.
    for name, build in (("functional", functional_model),
                        ("sequential", sequential_model)):
        keras.utils.set_random_seed(0)
        with layout_map.scope():
            model = build()
        kernel = model.get_layer("feature_2").kernel
        print(f"\n{name}: feature_2.kernel {klm.fetch_layout(kernel)}")
        report = layout_map.explain(model)
        for row in report.rows:
            print(f"  {row.object_path:<18} rule {row.rule!s:<16} "
                  f"{row.layout.sharding_specs}")
        check_layouts(name, (model.get_layer("feature"),
                             model.get_layer("feature_2")), expected, failures)
        results[name] = fit(name, model, x, y, args.epochs, failures)

    print()
    for name, accuracy in results.items():
        print(f"{name:>11}: val_accuracy {accuracy:.4f}")
    if failures:
        raise SystemExit("FAILED:\n  " + "\n  ".join(failures))


if __name__ == "__main__":
    main()
