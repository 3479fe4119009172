"""The torch backend's Keras internals (see `keras_layoutmap.keras_internals`).

3.15 -> 3.16: `keras.src.backend.torch.{core,nn,numpy}` became
`...torch.ops.{core,nn,numpy}`; `TorchTrainer` became `Trainer` (with DDP for
`DataParallel`, metrics all-reduced over processes, and
`_distribute_data` / `TorchEpochIterator._get_distributed_iterator` for
`ModelParallel`); and Keras ships a torch `distribution_lib` (DTensor meshes
and layouts, `distribute_tensor`, `distribute_data_input`), which 3.15 lacks
(`keras_distribution_lib` is None there: our stand-in
`keras_layoutmap.backends.torch.keras_distribution` takes its place).
"""

import keras

from keras_layoutmap.keras_internals import modules_holding, optional, private

core = private("keras.src.backend.torch.ops.core", "keras.src.backend.torch.core")
Variable = core.Variable
# Keras 3.16 places a variable made under a distribution itself (None on
# 3.15): by `layout.backend_layout` through Keras' torch distribution_lib.
initialize_distributed = optional(f"{core.__name__}:Variable._initialize_distributed")
convert_to_numpy = core.convert_to_numpy
convert_to_tensor = core.convert_to_tensor
get_device = core.get_device
private(f"{core.__name__}:slice_update")
to_torch_dtype = core.to_torch_dtype
CONVERT_TO_NUMPY_MODULES = modules_holding(
    "convert_to_numpy",
    "keras.src.backend",  # 3.15
    "keras.src.backend.torch",  # 3.15
    "keras.src.backend.torch.ops",  # 3.16
    core.__name__,
)

# Modules whose functions are replaced in place (Keras calls them through
# the module: `backend.nn.conv` on 3.15, `backend.ops.nn.conv` on 3.16).
nn = private("keras.src.backend.torch.ops.nn", "keras.src.backend.torch.nn")
numpy = private("keras.src.backend.torch.ops.numpy", "keras.src.backend.torch.numpy")
math = private("keras.src.backend.torch.ops.math", "keras.src.backend.torch.math")
# `ops.rms_normalization` runs torch's `F.rms_norm` from here, not from
# the backend's `nn`.
ops_nn = private("keras.src.ops.nn")
private("keras.src.ops.nn:_rms_normalization")
linalg = private("keras.src.backend.torch.ops.linalg",
                 "keras.src.backend.torch.linalg")
NN_FUNCTIONS = ("dot_product_attention", "conv", "depthwise_conv",
                "separable_conv", "conv_transpose")
for _name in NN_FUNCTIONS:
    private(f"{nn.__name__}:{_name}")
private(f"{numpy.__name__}:take")
private(f"{numpy.__name__}:einsum")

random = private("keras.src.backend.torch.random")
torch_seed_generator = private("keras.src.backend.torch.random:torch_seed_generator")
private("keras.src.backend.torch.random:dropout")
private("keras.src.backend.torch.random:categorical")

trainer = private("keras.src.backend.torch.trainer")
Trainer = private("keras.src.backend.torch.trainer:Trainer",
                  "keras.src.backend.torch.trainer:TorchTrainer")
# Keras 3.16's torch trainer, where it runs its own multi-process paths
# (None on 3.15, which has none): DDP for `DataParallel` or no distribution,
# metrics all-reduced over the processes, `ModelParallel` batches placed by
# the first batch's layout, predictions cut to each process's rows.
initialize_ddp = optional(f"{Trainer.__module__}:{Trainer.__name__}._initialize_ddp")
# the torch trainer's own (3.16), not the one every trainer inherits
reduces_metrics = "get_metrics_result" in vars(Trainer)
TorchEpochIterator = optional("keras.src.backend.torch.trainer:TorchEpochIterator")
gather_non_batch_axes = optional(
    "keras.src.backend.torch.trainer:_gather_non_batch_axes")
# (3.16) how the `*_on_batch` methods place a batch: `ModelParallel`'s as
# each process's own rows of a larger batch
distribute_data = optional("keras.src.backend.torch.trainer:_distribute_data")
TorchOptimizer = private(
    "keras.src.backend.torch.optimizers.torch_optimizer:TorchOptimizer")
# Keras' optimizers whose own `apply` applies through other optimizers.
OUTER_OPTIMIZERS = tuple(
    cls for cls in (keras.optimizers.LossScaleOptimizer,
                    getattr(keras.optimizers, "MultiOptimizer", None))
    if cls is not None and "apply" in vars(cls))

# Keras' own torch distribution_lib (3.16+), else None.
keras_distribution_lib = optional("keras.src.backend.torch.distribution_lib")
HAS_KERAS_DISTRIBUTION_LIB = keras_distribution_lib is not None
