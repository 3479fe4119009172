"""The layer sweep: every Keras layer that trains, one tiny model each,
under every plan, compared with one device.

A case is one layer in its smallest sensible config (or a custom layer on
`keras.ops`), between a `keras.Input` and a `Dense` head. `run` trains it
with SGD for 2 epochs (a short last batch each epoch) under a plan, from
the one-device model's initial weights, and compares the losses, the
weights and the predictions with one device's. Its outcome is "yes", or
what a user gets instead: a clear error (klm's, naming the layer), a wrong
result, or a raw error from inside the backend.

- `tests/test_layer_sweep.py` runs each case once per backend in its most
  demanding plan (`DEMANDING`), in every `nox` test session.
- `nox -s sweep` runs every case under every plan on each backend and
  writes the outcomes to `tests/data/sweep-<backend>.json`;
  `python tests/layer_sweep.py --table` writes docs/layers.md from them
  (`--check`: exit 1 if it is stale).

The case list is data: a row a user misses is one `Case(...)` line.
"""

import dataclasses
import json
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "tests" / "data"
TABLE = ROOT / "docs" / "layers.md"
PLANS = ("dp", "mp", "auto")
PLAN_TITLES = {"dp": "data parallel", "mp": "fsdp(model, min_bytes=0)",
               "auto": "auto plan"}
BACKENDS = ("jax", "tensorflow", "torch")
BACKEND_TITLES = {"jax": "JAX", "tensorflow": "TensorFlow", "torch": "torch"}
ROWS, BATCH, EPOCHS = 35, 16, 2  # batches of 16, 16 and 3 rows
# The default `nox` runs each case in one plan, the one that splits most:
# `klm.fsdp(min_bytes=0)` over `model` splits every weight the axis divides
# (a random layer's seed state among them), with the batch split over the
# mesh's other axis. Light: 2 epochs of 2 whole batches, no `predict`,
# one compiled step per model (the short batch and predictions: `nox -s
# sweep`).
DEMANDING = "mp"
LIGHT_ROWS = 32
LEARNING_RATE = 0.05
# To float32's rounding after 2 epochs of SGD (the matrix's tolerances):
# a split reduction sums in another order than one device.
RTOL, ATOL = 1e-4, 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: `name` (the test id), the example's input `shape` and
    `dtype`, and `body`, a function of the input tensor that returns the
    hidden tensor the head reads. `data`: "normal" (floats), "unit"
    (floats in [0, 1), images), or "ints:N" (ids below N)."""
    name: str
    shape: tuple
    body: object
    dtype: str = "float32"
    data: str = "normal"


def _layers():
    import keras
    return keras.layers


def _ops():
    import keras
    return keras.ops


class _Deferred:
    """A layer argument of a wrapper (`Bidirectional(LSTM(4))`), made when
    the body runs (under the plan's scope), not when the cases are
    listed."""

    def __init__(self, cls, *args, **kwargs):
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def made(self):
        return getattr(_layers(), self.cls)(*self.args, **self.kwargs)


def L(cls, *args, **kwargs):  # noqa: N802 (a layer, as Keras spells them)
    """A body that applies `keras.layers.<cls>(*args, **kwargs)`; an
    argument `_Deferred` is made first."""
    def body(x):
        made = [a.made() if isinstance(a, _Deferred) else a for a in args]
        return getattr(_layers(), cls)(*made, **kwargs)(x)
    return body


def seq(*bodies):
    def body(x):
        for b in bodies:
            x = b(x)
        return x
    return body


def dense(units, name="pre"):
    return L("Dense", units, name=name)


def _merge(cls):
    def body(x):
        layers = _layers()
        a = layers.Dense(4, name="a")(x)
        b = layers.Dense(4, name="b")(x)
        return getattr(layers, cls)()([a, b])
    return body


def _dot(x):
    layers = _layers()
    a = layers.Dense(4, name="a")(x)
    b = layers.Dense(4, name="b")(x)
    return layers.Dot(axes=1)([a, b])


def _attention(cls, **kwargs):
    def body(x):
        layers = _layers()
        q = layers.Dense(4, name="q")(x)
        v = layers.Dense(4, name="v")(x)
        return getattr(layers, cls)(**kwargs)([q, v])
    return body


def _mha(x):
    return _layers().MultiHeadAttention(2, 4, name="mha")(x, x)


def _gqa(x):
    return _layers().GroupQueryAttention(4, 4, 2, name="gqa")(x, x)


def _masked(rnn):
    def body(x):
        layers = _layers()
        h = layers.Masking(0.0)(x)
        return getattr(layers, rnn)(4, name="rnn")(h)
    return body


def _stacked_cells(x):
    layers = _layers()
    cells = [layers.SimpleRNNCell(4), layers.GRUCell(4)]
    return layers.RNN(layers.StackedRNNCells(cells), name="rnn")(x)


def _time_distributed(x):
    layers = _layers()
    return layers.TimeDistributed(layers.Dense(4), name="td")(x)


def _embedding(x):
    return _layers().Embedding(12, 4, name="embed")(x)


def _reversible_embedding(x):
    return _layers().ReversibleEmbedding(12, 4, name="embed")(x)


def _custom(kind):
    """A custom layer on `keras.ops`: its weight of shape (6, 4) used by
    `kind`."""
    def body(x):
        import keras
        ops = keras.ops

        class Custom(keras.layers.Layer):
            def build(self, shape):
                self.w = self.add_weight(shape=(shape[-1], 4), name="w")
                self.b = self.add_weight(shape=(4,), name="b",
                                         initializer="ones")

            def call(self, x):
                if kind == "einsum":
                    return ops.einsum("bi,ij->bj", x, self.w) + self.b
                if kind == "matmul":
                    return ops.matmul(x, self.w) * self.b
                h = ops.matmul(x, self.w) + self.b
                if kind == "cumsum":
                    return ops.cumsum(h, axis=-1)
                if kind == "sort":
                    return ops.sort(h, axis=-1)
                if kind == "take":  # rows of the weight, as a lookup
                    rows = ops.take(self.w, ops.convert_to_tensor([0, 2, 5]),
                                    axis=0)
                    return ops.matmul(x[:, :3], rows) + self.b
                if kind == "softmax":
                    return ops.softmax(h, axis=-1)
                if kind == "logsumexp":
                    return ops.logsumexp(h, axis=-1, keepdims=True) * h
                if kind == "segment_sum":
                    ids = ops.convert_to_tensor([0, 0, 1, 1])
                    return ops.transpose(ops.segment_sum(
                        ops.transpose(h), ids, num_segments=2))
                if kind == "top_k":
                    return ops.top_k(h, 2)[0]
                if kind == "norm":
                    return h / ops.norm(h, axis=-1, keepdims=True)
                raise ValueError(kind)

        return Custom(name="custom")(x)
    return body


def cases():
    """Every case, in the table's order."""
    img2, img1, img3 = (8, 8, 2), (8, 2), (4, 4, 4, 2)
    seq_ = (6, 3)
    vec = (6,)
    return [
        # -- core and activations --
        Case("Dense", vec, dense(4)),
        Case("EinsumDense", vec, L("EinsumDense", "ab,bc->ac", output_shape=4,
                                   bias_axes="c", name="pre")),
        Case("Embedding", (5,), _embedding, dtype="int32", data="ints:12"),
        Case("ReversibleEmbedding", (5,), _reversible_embedding, dtype="int32",
             data="ints:12"),
        Case("Identity", vec, seq(dense(4), L("Identity"))),
        Case("Lambda", vec, seq(dense(4), L("Lambda", lambda t: t * 2.0))),
        Case("Activation", vec, seq(dense(4), L("Activation", "tanh"))),
        Case("ELU", vec, seq(dense(4), L("ELU"))),
        Case("LeakyReLU", vec, seq(dense(4), L("LeakyReLU"))),
        Case("PReLU", vec, seq(dense(4), L("PReLU"))),
        Case("ReLU", vec, seq(dense(4), L("ReLU"))),
        Case("Softmax", vec, seq(dense(4), L("Softmax"))),
        # -- convolutions --
        Case("Conv1D", img1, L("Conv1D", 4, 3, name="pre")),
        Case("Conv1D-causal-dilated", img1, L("Conv1D", 4, 2, padding="causal",
                                              dilation_rate=2, name="pre")),
        Case("Conv1D-groups", img1, L("Conv1D", 4, 3, groups=2, name="pre")),
        Case("Conv2D", img2, L("Conv2D", 4, 3, name="pre")),
        Case("Conv2D-strided-same", img2, L("Conv2D", 4, 3, strides=2,
                                            padding="same", name="pre")),
        Case("Conv2D-groups", img2, L("Conv2D", 4, 3, groups=2, name="pre")),
        Case("Conv3D", img3, L("Conv3D", 4, 2, name="pre")),
        Case("Conv1DTranspose", img1, L("Conv1DTranspose", 4, 3, name="pre")),
        Case("Conv2DTranspose", img2, L("Conv2DTranspose", 4, 3, strides=2,
                                        name="pre")),
        Case("Conv3DTranspose", img3, L("Conv3DTranspose", 4, 2, name="pre")),
        Case("DepthwiseConv1D", img1, L("DepthwiseConv1D", 3, name="pre")),
        Case("DepthwiseConv2D", img2, L("DepthwiseConv2D", 3, name="pre")),
        Case("SeparableConv1D", img1, L("SeparableConv1D", 4, 3, name="pre")),
        Case("SeparableConv2D", img2, L("SeparableConv2D", 4, 3, name="pre")),
        # -- pooling --
        Case("MaxPooling1D", img1, seq(L("Conv1D", 4, 1, name="pre"),
                                       L("MaxPooling1D"))),
        Case("MaxPooling2D", img2, seq(L("Conv2D", 4, 1, name="pre"),
                                       L("MaxPooling2D"))),
        Case("MaxPooling3D", img3, seq(L("Conv3D", 4, 1, name="pre"),
                                       L("MaxPooling3D"))),
        Case("AveragePooling1D", img1, seq(L("Conv1D", 4, 1, name="pre"),
                                           L("AveragePooling1D", 2))),
        Case("AveragePooling2D", img2, seq(L("Conv2D", 4, 1, name="pre"),
                                           L("AveragePooling2D", 2))),
        Case("AveragePooling3D", img3, seq(L("Conv3D", 4, 1, name="pre"),
                                           L("AveragePooling3D", 2))),
        Case("GlobalMaxPooling1D", img1, seq(L("Conv1D", 4, 1, name="pre"),
                                             L("GlobalMaxPooling1D"))),
        Case("GlobalMaxPooling2D", img2, seq(L("Conv2D", 4, 1, name="pre"),
                                             L("GlobalMaxPooling2D"))),
        Case("GlobalMaxPooling3D", img3, seq(L("Conv3D", 4, 1, name="pre"),
                                             L("GlobalMaxPooling3D"))),
        Case("GlobalAveragePooling1D", img1, seq(
            L("Conv1D", 4, 1, name="pre"), L("GlobalAveragePooling1D"))),
        Case("GlobalAveragePooling2D", img2, seq(
            L("Conv2D", 4, 1, name="pre"), L("GlobalAveragePooling2D"))),
        Case("GlobalAveragePooling3D", img3, seq(
            L("Conv3D", 4, 1, name="pre"), L("GlobalAveragePooling3D"))),
        Case("AdaptiveAveragePooling1D", img1, seq(
            L("Conv1D", 4, 1, name="pre"), L("AdaptiveAveragePooling1D", 4))),
        Case("AdaptiveAveragePooling2D", img2, seq(
            L("Conv2D", 4, 1, name="pre"), L("AdaptiveAveragePooling2D", 4))),
        Case("AdaptiveMaxPooling1D", img1, seq(
            L("Conv1D", 4, 1, name="pre"), L("AdaptiveMaxPooling1D", 4))),
        Case("AdaptiveMaxPooling2D", img2, seq(
            L("Conv2D", 4, 1, name="pre"), L("AdaptiveMaxPooling2D", 4))),
        # -- normalization --
        Case("BatchNormalization", vec, seq(dense(4), L("BatchNormalization"))),
        Case("BatchNormalization-images", img2, seq(
            L("Conv2D", 4, 1, name="pre"), L("BatchNormalization"))),
        Case("LayerNormalization", vec, seq(dense(4), L("LayerNormalization"))),
        Case("GroupNormalization", img2, seq(
            L("Conv2D", 4, 1, name="pre"), L("GroupNormalization", 2))),
        Case("RMSNormalization", vec, seq(dense(4), L("RMSNormalization"))),
        Case("UnitNormalization", vec, seq(dense(4), L("UnitNormalization"))),
        Case("SpectralNormalization", vec, L("SpectralNormalization",
                                             _Deferred("Dense", 4, name="pre"))),
        Case("Normalization-fixed", vec, seq(
            L("Normalization", mean=0.5, variance=2.0), dense(4))),
        # -- regularization and noise --
        Case("Dropout", vec, seq(dense(4), L("Dropout", 0.5))),
        Case("SpatialDropout1D", img1, seq(L("Conv1D", 4, 1, name="pre"),
                                           L("SpatialDropout1D", 0.5))),
        Case("SpatialDropout2D", img2, seq(L("Conv2D", 4, 1, name="pre"),
                                           L("SpatialDropout2D", 0.5))),
        Case("GaussianDropout", vec, seq(dense(4), L("GaussianDropout", 0.3))),
        Case("GaussianNoise", vec, seq(dense(4), L("GaussianNoise", 0.3))),
        Case("AlphaDropout", vec, seq(dense(4), L("AlphaDropout", 0.3))),
        Case("Dense-L1L2-regularized", vec, L(
            "Dense", 4, kernel_regularizer="l1l2", bias_regularizer="l2",
            name="pre")),
        Case("ActivityRegularization", vec, seq(
            dense(4), L("ActivityRegularization", l1=0.01, l2=0.01))),
        # -- recurrent --
        Case("SimpleRNN", seq_, L("SimpleRNN", 4, name="rnn")),
        Case("LSTM", seq_, L("LSTM", 4, name="rnn")),
        Case("GRU", seq_, L("GRU", 4, name="rnn")),
        Case("LSTM-unrolled", seq_, L("LSTM", 4, unroll=True, name="rnn")),
        Case("GRU-sequences", seq_, L("GRU", 4, return_sequences=True,
                                      name="rnn")),
        Case("LSTM-go-backwards", seq_, L("LSTM", 4, go_backwards=True,
                                          name="rnn")),
        Case("Bidirectional", seq_, L("Bidirectional", _Deferred("LSTM", 4),
                                      name="bi")),
        Case("RNN-StackedRNNCells", seq_, _stacked_cells),
        Case("Masking-LSTM", seq_, _masked("LSTM")),
        Case("Masking-GRU", seq_, _masked("GRU")),
        Case("ConvLSTM1D", (3, 6, 2), L("ConvLSTM1D", 4, 3, name="rnn")),
        Case("ConvLSTM2D", (3, 4, 4, 2), L("ConvLSTM2D", 4, 3, name="rnn")),
        Case("TimeDistributed", seq_, _time_distributed),
        # -- attention --
        Case("Attention", seq_, _attention("Attention")),
        Case("Attention-scaled", seq_, _attention("Attention", use_scale=True)),
        Case("AdditiveAttention", seq_, _attention("AdditiveAttention")),
        Case("MultiHeadAttention", seq_, _mha),
        Case("GroupQueryAttention", seq_, _gqa),
        # -- reshaping --
        Case("Flatten", img2, seq(L("Conv2D", 4, 1, name="pre"), L("Flatten"))),
        Case("Reshape", vec, seq(dense(8), L("Reshape", (2, 4)))),
        Case("Permute", seq_, seq(dense(4), L("Permute", (2, 1)))),
        Case("RepeatVector", vec, seq(dense(4), L("RepeatVector", 3))),
        Case("Cropping1D", img1, seq(L("Conv1D", 4, 1, name="pre"),
                                     L("Cropping1D", 1))),
        Case("Cropping2D", img2, seq(L("Conv2D", 4, 1, name="pre"),
                                     L("Cropping2D", 1))),
        Case("Cropping3D", img3, seq(L("Conv3D", 4, 1, name="pre"),
                                     L("Cropping3D", 1))),
        Case("ZeroPadding1D", img1, seq(L("Conv1D", 4, 1, name="pre"),
                                        L("ZeroPadding1D", 1))),
        Case("ZeroPadding2D", img2, seq(L("Conv2D", 4, 1, name="pre"),
                                        L("ZeroPadding2D", 1))),
        Case("ZeroPadding3D", img3, seq(L("Conv3D", 4, 1, name="pre"),
                                        L("ZeroPadding3D", 1))),
        Case("UpSampling1D", img1, seq(L("Conv1D", 4, 1, name="pre"),
                                       L("UpSampling1D"))),
        Case("UpSampling2D", img2, seq(L("Conv2D", 4, 1, name="pre"),
                                       L("UpSampling2D"))),
        Case("UpSampling3D", img3, seq(L("Conv3D", 4, 1, name="pre"),
                                       L("UpSampling3D"))),
        # -- merging --
        Case("Add", vec, _merge("Add")),
        Case("Subtract", vec, _merge("Subtract")),
        Case("Multiply", vec, _merge("Multiply")),
        Case("Average", vec, _merge("Average")),
        Case("Maximum", vec, _merge("Maximum")),
        Case("Minimum", vec, _merge("Minimum")),
        Case("Concatenate", vec, _merge("Concatenate")),
        Case("Dot", vec, _dot),
        # -- preprocessing inside a model --
        Case("Rescaling", img2, seq(L("Rescaling", 0.5), L("Conv2D", 4, 1,
                                                             name="pre"))),
        Case("Resizing", img2, seq(L("Resizing", 4, 4), L("Conv2D", 4, 1,
                                                           name="pre")),
             data="unit"),
        Case("CenterCrop", img2, seq(L("CenterCrop", 6, 6), L("Conv2D", 4, 1,
                                                               name="pre")),
             data="unit"),
        Case("RandomFlip", img2, seq(L("RandomFlip", seed=1),
                                     L("Conv2D", 4, 1, name="pre")),
             data="unit"),
        Case("RandomRotation", img2, seq(L("RandomRotation", 0.1, seed=1),
                                         L("Conv2D", 4, 1, name="pre")),
             data="unit"),
        Case("RandomZoom", img2, seq(L("RandomZoom", 0.1, seed=1),
                                     L("Conv2D", 4, 1, name="pre")),
             data="unit"),
        Case("RandomTranslation", img2, seq(
            L("RandomTranslation", 0.1, 0.1, seed=1),
            L("Conv2D", 4, 1, name="pre")), data="unit"),
        Case("RandomContrast", img2, seq(L("RandomContrast", 0.2, seed=1),
                                         L("Conv2D", 4, 1, name="pre")),
             data="unit"),
        # (pooled: at inference it resizes, not crops, to 6x6)
        Case("RandomCrop", img2, seq(L("RandomCrop", 6, 6, seed=1),
                                     L("Conv2D", 4, 1, name="pre"),
                                     L("GlobalAveragePooling2D")),
             data="unit"),
        Case("CategoryEncoding", (3,), seq(
            L("CategoryEncoding", 8, output_mode="multi_hot"), dense(4)),
            dtype="int32", data="ints:8"),
        Case("Discretization", vec, seq(
            L("Discretization", bin_boundaries=[-0.5, 0.0, 0.5]),
            L("Embedding", 4, 3, name="embed")), data="normal"),
        Case("Hashing", (3,), seq(L("Hashing", 8),
                                  L("Embedding", 8, 3, name="embed")),
             dtype="int32", data="ints:100"),
        Case("IntegerLookup", (3,), seq(
            L("IntegerLookup", vocabulary=[1, 2, 3, 4]),
            L("Embedding", 5, 3, name="embed")), dtype="int32",
            data="ints:6"),
        # -- custom layers on keras.ops --
        Case("ops.einsum", vec, _custom("einsum")),
        Case("ops.matmul", vec, _custom("matmul")),
        Case("ops.cumsum", vec, _custom("cumsum")),
        Case("ops.sort", vec, _custom("sort")),
        Case("ops.take", vec, _custom("take")),
        Case("ops.softmax", vec, _custom("softmax")),
        Case("ops.logsumexp", vec, _custom("logsumexp")),
        Case("ops.segment_sum", vec, _custom("segment_sum")),
        Case("ops.top_k", vec, _custom("top_k")),
        Case("ops.norm", vec, _custom("norm")),
    ]


@dataclasses.dataclass(frozen=True)
class Known:
    """Cells that do not equal one device: on `backend`, under `plans`, the
    `cases`; what a user gets there (`word`, "refused" for klm's clear
    error, else an open bug), a part of its message (`match`) and why."""
    backend: str
    plans: tuple
    cases: tuple
    word: str
    match: str
    why: str


# Every cell that is not "yes", declared: tests/test_layer_sweep.py fails
# on any other outcome, and on a declared cell that now works.
KNOWN = (
    # TensorFlow (DTensor): refused with klm's clear error, which names the
    # layer; data parallel per replica, where DTensor has no rule for an
    # op, is an issue of its own.
    Known("tensorflow", ('auto',),
          ('Conv1D', 'Conv2D', 'Conv2D-strided-same', 'GlobalMaxPooling1D',
           'GlobalMaxPooling2D', 'GlobalAveragePooling1D',
           'GlobalAveragePooling2D', 'SpatialDropout1D', 'SpatialDropout2D',
           'Flatten', 'ZeroPadding1D', 'ZeroPadding2D', 'UpSampling1D',
           'UpSampling2D', 'Rescaling', 'Resizing', 'CenterCrop',
           'RandomContrast', 'RandomCrop'),
          'refused', "op 'tf.Conv2D'",
          "DTensor convolves only a batch-split input with a replicated "
          "filter; the auto plan splits the kernel or the channels"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('Conv1D-causal-dilated',),
          'refused', "op 'tf.SpaceToBatchND'",
          "a dilated convolution runs through SpaceToBatchND, which "
          "DTensor has no rule for"),
    Known("tensorflow", ('auto',),
          ('Conv1D-groups', 'Conv2D-groups'),
          'refused', 'SPMD expansion resulted in op output',
          "DTensor's rule for the op refuses the auto plan's layouts"),
    Known("tensorflow", ('auto',),
          ('Conv1DTranspose',),
          'refused', "op 'tf.Conv2DBackpropInput'",
          "DTensor's transposed convolution takes only batch-split "
          "layouts; the auto plan splits the kernel"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('DepthwiseConv1D', 'DepthwiseConv2D', 'SeparableConv1D',
           'SeparableConv2D'),
          'refused', "op 'tf.DepthwiseConv2dNativeBackpropFilter'",
          "DTensor has no rule for a depthwise kernel's gradient"),
    Known("tensorflow", ('auto',),
          ('MaxPooling1D',),
          'refused', "op 'tf.Squeeze'",
          "DTensor's rule for the op refuses the auto plan's layouts"),
    Known("tensorflow", ('auto',),
          ('MaxPooling3D',),
          'refused', "op 'tf.MaxPool3DGrad'",
          "DTensor's 3-D max pooling gradient takes only batch-split "
          "layouts"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('AveragePooling1D', 'AveragePooling2D',
           'AdaptiveAveragePooling1D', 'AdaptiveAveragePooling2D'),
          'refused', "op 'tf.AvgPoolGrad'",
          "DTensor has no rule for average pooling's gradient"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('AveragePooling3D',),
          'refused', "op 'tf.AvgPool3DGrad'",
          "DTensor has no rule for average pooling's gradient"),
    Known("tensorflow", ('auto',),
          ('GlobalMaxPooling3D', 'GlobalAveragePooling3D', 'ZeroPadding3D',
           'UpSampling3D'),
          'refused', "op 'tf.Conv3D'",
          "DTensor convolves only a batch-split input with a replicated "
          "filter; the auto plan splits the kernel or the channels"),
    Known("tensorflow", ('auto',),
          ('BatchNormalization-images', 'GroupNormalization'),
          'refused', "op 'tf.Conv2DBackpropFilter'",
          "DTensor's convolution gradient takes only batch-split layouts; "
          "the auto plan splits the channels"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('SimpleRNN', 'LSTM', 'GRU', 'GRU-sequences',
           'RNN-StackedRNNCells', 'Masking-LSTM', 'Masking-GRU',
           'ConvLSTM1D', 'ConvLSTM2D'),
          'refused', "op 'tf.EmptyTensorList'",
          "Keras' recurrent layers loop in a tf.while_loop over a "
          "TensorArray, which DTensor has no rule for (unroll=True runs "
          "them)"),
    Known("tensorflow", ('auto',),
          ('LSTM-unrolled',),
          'refused', "op 'tf.Split'",
          "DTensor's rule for the op refuses the auto plan's layouts"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('LSTM-go-backwards', 'Bidirectional', 'RandomFlip'),
          'refused', "op 'tf.ReverseV2'",
          "DTensor has no rule for tf.reverse (go_backwards, "
          "Bidirectional's backward half, RandomFlip)"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('RandomRotation', 'RandomZoom', 'RandomTranslation'),
          'refused', "op 'tf.ImageProjectiveTransformV3'",
          "DTensor has no rule for the image transform of the random "
          "affine augmentations"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('CategoryEncoding',),
          'refused', "op 'tf.DenseBincount'",
          "DTensor has no rule for CategoryEncoding's bincount"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('Discretization',),
          'refused', "op 'tf.Bucketize'",
          "DTensor has no rule for Discretization's bucketize"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('Hashing',),
          'refused', "op 'tf.AsString'",
          "DTensor has no rule for Hashing's string ops"),
    Known("tensorflow", ('dp', 'mp', 'auto'),
          ('IntegerLookup',),
          'refused', "op 'tf.LookupTableFindV2'",
          "DTensor has no rule for a lookup table"),
    Known("tensorflow", ('auto',),
          ('ops.sort',),
          'refused', "op 'tf.TopKV2'",
          "DTensor's rule for the op refuses the auto plan's layouts"),
    Known("tensorflow", ('auto',),
          ('ops.segment_sum',),
          'refused', "op 'tf.Transpose'",
          "DTensor's rule for the op refuses the auto plan's layouts"),
    Known("tensorflow", ('auto',),
          ('ops.top_k',),
          'refused', 'The sharding spec for axis',
          "DTensor's rule for the op refuses the auto plan's layouts"),
)


def expected(backend, plan, name):
    """The `Known` of a cell, or None: it equals one device."""
    return next((k for k in KNOWN if k.backend == backend
                 and plan in k.plans and name in k.cases), None)


def by_name():
    return {case.name: case for case in cases()}


# -- running a case -----------------------------------------------------------


def data(case, rows=ROWS):
    """`(x, y)`: `rows` examples of `case`'s input and regression targets."""
    import numpy as np
    rng = np.random.default_rng(0)
    shape = (rows, *case.shape)
    if case.data.startswith("ints:"):
        x = rng.integers(0, int(case.data[5:]), size=shape).astype(case.dtype)
    elif case.data == "unit":
        x = rng.uniform(size=shape).astype(case.dtype)
    else:
        x = rng.normal(size=shape).astype(case.dtype)
    y = rng.normal(size=(rows, 3)).astype("float32")
    return x, y


def build(case):
    """The case's model, compiled (SGD, mean squared error), its weights
    drawn from seed 0."""
    import keras
    keras.utils.set_random_seed(0)
    inputs = keras.Input(case.shape, dtype=case.dtype)
    hidden = case.body(inputs)
    if len(hidden.shape) > 2:
        hidden = keras.layers.Flatten()(hidden)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(LEARNING_RATE), "mse")
    return model


def trained(model, x, y, weights=None, light=False):
    """`(losses, weights, predictions)` after EPOCHS of `fit` (`light`:
    no predictions, an empty array in their place)."""
    import numpy as np
    if weights is not None:
        model.set_weights(weights)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False,
                        verbose=0)
    predictions = [] if light else model.predict(x, batch_size=BATCH,
                                                 verbose=0)
    return (np.asarray(history.history["loss"]), model.get_weights(),
            np.asarray(predictions))


def one_device(case, light=False):
    """The one-device run: `(initial weights, losses, weights,
    predictions)`, or the error's first line (a string) when one device
    itself cannot run the case (a layer that needs TensorFlow)."""
    x, y = data(case, LIGHT_ROWS if light else ROWS)
    try:
        model = build(case)
        initial = model.get_weights()
        return (initial, *trained(model, x, y, light=light))
    except Exception as error:  # noqa: BLE001 (one device's own failure)
        return _first_line(error)


def plan_scope(plan, case, mesh_2d, mesh_1d):
    """The scope that builds `case` under `plan`."""
    import keras

    import keras_layoutmap as klm
    if plan == "dp":
        return keras.distribution.DataParallel(
            devices=keras.distribution.list_devices()).scope()
    if plan == "mp":
        return klm.fsdp(mesh_2d, axis="model", min_bytes=0).scope()
    if plan == "auto":
        return klm.auto_layout_map(lambda: build(case), mesh_2d).scope()
    raise ValueError(plan)


def meshes():
    """`(mesh_2d, mesh_1d)` over every device: (batch, model=2), (batch,)."""
    import keras_layoutmap as klm
    n = len(klm.list_devices())
    return (klm.create_mesh([("batch", n // 2), ("model", 2)]),
            klm.create_mesh([("batch", n)]))


@dataclasses.dataclass
class Outcome:
    """What a case gave under a plan: `word` is "yes", "refused" (klm's
    clear error), "wrong" or "raw" (an error from inside the backend);
    `detail` the error's first line or the largest difference."""
    word: str
    detail: str = ""


def _is_clear(error):
    """klm's own refusal: raised by keras_layoutmap's code with a message
    that says what to do (not a backend's error passing through)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and "keras_layoutmap" in frames[-1].filename and \
        isinstance(error, (ValueError, NotImplementedError, TypeError))


def _first_line(error):
    lines = [line for line in str(error).strip().splitlines()
             if line.strip() and "Exception encountered" not in line]
    return f"{type(error).__name__}: {(lines or [''])[0][:300]}"


def compare(got, reference):
    """The largest relative difference beyond the tolerances, or None."""
    import numpy as np
    worst = None
    for what, a, b in [("loss", got[0], reference[0]),
                       ("predictions", got[2], reference[2]),
                       *(("weight", wa, wb) for wa, wb in zip(got[1],
                                                             reference[1]))]:
        a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
        if a.shape != b.shape:
            return f"{what}: shape {a.shape} against {b.shape}"
        excess = np.abs(a - b) - (ATOL + RTOL * np.abs(b))
        if excess.size and excess.max() > 0:
            d = float(np.abs(a - b).max())
            if worst is None or d > worst[1]:
                worst = (what, d)
    return None if worst is None else f"{worst[0]} {worst[1]:.3g} away"


def run(case, plan, reference, meshes_, light=False):
    """`case` under `plan`, against `reference` (`one_device(case,
    light)`)."""
    x, y = data(case, LIGHT_ROWS if light else ROWS)
    try:
        with plan_scope(plan, case, *meshes_):
            model = build(case)
        got = trained(model, x, y, reference[0], light=light)
    except Exception as error:  # noqa: BLE001 (the outcome to report)
        word = "refused" if _is_clear(error) else "raw"
        return Outcome(word, _first_line(error))
    difference = compare(got, reference[1:])
    return Outcome("wrong", difference) if difference else Outcome("yes")


# -- the whole sweep and its table -------------------------------------------


def sweep(backend, plans=PLANS, names=None, out=None):
    """Every case (or `names`) under `plans`: `{case: {plan: [word,
    detail]}}`, written to `out` as JSON (with `names`, into the outcomes
    `out` holds already)."""
    import keras
    results = {}
    meshes_ = meshes()
    for case in cases():
        if names and case.name not in names:
            continue
        keras.backend.clear_session()
        reference = one_device(case)
        if isinstance(reference, str):
            results[case.name] = {p: ["n/a", reference] for p in plans}
            print(f"{case.name:28} all   n/a      {reference}", flush=True)
            continue
        row = {}
        for plan in plans:
            keras.backend.clear_session()
            outcome = run(case, plan, reference, meshes_)
            row[plan] = [outcome.word, outcome.detail]
            print(f"{case.name:28} {plan:5} {outcome.word:8} {outcome.detail}",
                  flush=True)
        results[case.name] = row
    if out and names and pathlib.Path(out).exists():
        # some cases run again: the others keep their recorded outcomes
        earlier = json.loads(pathlib.Path(out).read_text())["results"]
        results = {c.name: results.get(c.name, earlier.get(c.name))
                   for c in cases()
                   if c.name in results or c.name in earlier}
    if out:
        pathlib.Path(out).write_text(json.dumps(
            {"backend": backend, "keras": keras.__version__,
             "results": results}, indent=1) + "\n")
    return results


def table():
    """docs/layers.md from the three backends' results."""
    found = {b: json.loads((RESULTS / f"sweep-{b}.json").read_text())
             for b in BACKENDS if (RESULTS / f"sweep-{b}.json").exists()}
    lines = [
        "# Every Keras layer under every plan",
        "",
        "<!-- generated by `python tests/layer_sweep.py --table` from "
        "tests/data/sweep-<backend>.json (`nox -s sweep`) -->",
        "",
        "One tiny model per Keras layer (`tests/layer_sweep.py`), trained "
        f"with SGD for {EPOCHS} epochs of {ROWS} rows in batches of {BATCH} "
        "(a short last batch), from one device's initial weights, under "
        "each plan; \"yes\": its losses, weights and predictions equal one "
        f"device's (rtol {RTOL}, atol {ATOL}). Otherwise the cell gives "
        "what a user gets.",
        "",
        "Plans: " + "; ".join(f"**{p}** {PLAN_TITLES[p]}" for p in PLANS)
        + ". " + "; ".join(
            f"{BACKEND_TITLES[b]}: Keras {r['keras']}" for b, r in found.items())
        + ".",
        "",
    ]
    counts = []
    for b, r in found.items():
        for p in PLANS:
            words = [row.get(p, ["-"])[0] for row in r["results"].values()]
            counts.append(f"| {BACKEND_TITLES[b]} | {p} | "
                          f"{words.count('yes')} | {words.count('refused')} | "
                          f"{words.count('wrong')} | {words.count('raw')} | "
                          f"{words.count('n/a')} |")
    lines += ["| backend | plan | yes | clear error | wrong | raw error | "
              "one device fails |", "|---|---|---|---|---|---|---|",
              *counts, ""]
    header = ["layer"] + [f"{BACKEND_TITLES[b]} {p}" for b in found
                          for p in PLANS]
    lines += ["| " + " | ".join(header) + " |",
              "|" + "---|" * len(header)]
    notes, numbered = [], {}
    for case in cases():
        cells = []
        for b, r in found.items():
            row = r["results"].get(case.name, {})
            for p in PLANS:
                word, detail = row.get(p, ["-", ""])
                if word in ("yes", "-"):
                    cells.append(word)
                else:
                    # one note for the cells of a row that say the same
                    key = (case.name, b, detail)
                    if key not in numbered:
                        numbered[key] = len(numbered) + 1
                        notes.append(f"{numbered[key]}. {case.name}, "
                                     f"{BACKEND_TITLES[b]}: {detail}")
                    cells.append(f"{word} [{numbered[key]}]")
        lines.append(f"| {case.name} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "## What a user gets", "", *notes]
    return "\n".join(lines) + "\n"


def main(argv):
    if "--table" in argv or "--check" in argv:
        text = table()
        if "--check" in argv:
            if not TABLE.exists() or TABLE.read_text() != text:
                print(f"{TABLE} is stale: run `python tests/layer_sweep.py "
                      "--table`")
                return 1
            return 0
        TABLE.write_text(text)
        return 0
    import keras

    import keras_layoutmap as klm
    from keras_layoutmap import backends
    klm.configure_virtual_devices(int(_option(argv, "--devices", "8")))
    plans = _option(argv, "--plans", ",".join(PLANS)).split(",")
    names = _option(argv, "--cases", "")
    out = _option(argv, "--out", "")
    if backends.get().process_index() != 0:
        out = ""
    sweep(keras.backend.backend(), plans, names.split(",") if names else None,
          out or None)
    return 0


def _option(argv, name, default):
    return argv[argv.index(name) + 1] if name in argv else default


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
