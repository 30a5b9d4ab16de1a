"""lightning_par: PyTorch Lightning strategies for data, tensor, pipeline and 3-D parallel training.

Importing the package registers its strategies with Lightning, so ``Trainer(strategy="ddp_overlap")`` works.
"""

from lightning_par import quiet

quiet.install()  # known third-party lines that say nothing to a user (lightning_par/quiet.py)

from lightning_par.parallel_dims import MESH_AXES, ParallelDims  # noqa: E402
from lightning_par.strategies import STRATEGIES, DDPOverlapStrategy, MeshStrategy, Parallel3DStrategy, PipelineStrategy, TensorParallelStrategy, ZeroStrategy, register_all

__all__ = ["MESH_AXES", "DDPOverlapStrategy", "MeshStrategy", "Parallel3DStrategy", "ParallelDims", "PipelineStrategy", "TensorParallelStrategy", "ZeroStrategy"]
__version__ = "0.1.0.dev0"

register_all()

from lightning_par.fabric import register_all as _register_fabric  # noqa: E402

_register_fabric()  # Fabric(strategy="zero3") and the other names (lightning_par.runtime.presets)

from lightning_par.checkpoint.loading import install_directory_loading  # noqa: E402

install_directory_loading()  # MyModule.load_from_checkpoint(DIR) reads a lightning_par checkpoint directory
