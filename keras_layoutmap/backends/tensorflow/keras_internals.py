"""The TensorFlow backend's Keras internals (see
`keras_layoutmap.keras_internals`).

3.15 -> 3.16: `keras.src.backend.tensorflow.core` became `...ops.core`
(and `numpy`, `...ops.numpy`);
`TensorFlowTrainer` became `Trainer`. `random`, `optimizer` and
`distribution_lib` stayed (`distribution_lib` still has no
`distribute_tensor`: we provide it).
"""

from keras_layoutmap.keras_internals import modules_holding, private

core = private("keras.src.backend.tensorflow.ops.core",
               "keras.src.backend.tensorflow.core")
Variable = core.Variable
convert_to_numpy = core.convert_to_numpy
CONVERT_TO_NUMPY_MODULES = modules_holding(
    "convert_to_numpy",
    "keras.src.backend",  # 3.15
    "keras.src.backend.tensorflow",  # 3.15
    "keras.src.backend.tensorflow.ops",  # 3.16
    core.__name__,
)

numpy = private("keras.src.backend.tensorflow.ops.numpy",
                "keras.src.backend.tensorflow.numpy")
math = private("keras.src.backend.tensorflow.ops.math",
               "keras.src.backend.tensorflow.math")
nn = private("keras.src.backend.tensorflow.ops.nn",
             "keras.src.backend.tensorflow.nn")
linalg = private("keras.src.backend.tensorflow.ops.linalg",
                 "keras.src.backend.tensorflow.linalg")

distribution_lib = private("keras.src.backend.tensorflow.distribution_lib")
TFOptimizer = private("keras.src.backend.tensorflow.optimizer:TFOptimizer")

# Random draws: the module (its functions are replaced in place) and the
# helpers our in-step draws reuse.
random = private("keras.src.backend.tensorflow.random")
draw_seed = private("keras.src.backend.tensorflow.random:draw_seed")
cast_seed = private("keras.src.backend.tensorflow.random:_cast_seed")
get_concrete_noise_shape = private(
    "keras.src.backend.tensorflow.random:_get_concrete_noise_shape")
RANDOM_DRAWS = ("normal", "uniform", "truncated_normal", "randint", "dropout",
                "categorical")
for _name in RANDOM_DRAWS:
    private(f"keras.src.backend.tensorflow.random:{_name}")

trainer = private("keras.src.backend.tensorflow.trainer")
Trainer = private("keras.src.backend.tensorflow.trainer:Trainer",
                  "keras.src.backend.tensorflow.trainer:TensorFlowTrainer")

# float8's quantize-then-dequantize: 3.15 looks it up on the package
# `keras.src.quantizers`, 3.16 imports it by name into its float8 mode.
FLOAT8_QDQ_MODULES = modules_holding(
    "quantize_and_dequantize",
    "keras.src.quantizers.modes.float8",  # 3.16
    "keras.src.quantizers",
)
