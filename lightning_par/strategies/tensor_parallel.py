"""``TensorParallelStrategy``: Megatron tensor parallelism on the tp axis, bucketed data parallelism on the dp axis."""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_par.strategies.base import MeshStrategy

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(MeshStrategy):
    """Tensor parallelism over the tp axis (Megatron-LM, Shoeybi et al. 2019, §3), data parallelism over dp (2D).

    Every layer listed in the plan is split across the ``tp_size`` ranks of the tp axis with DTensor (see
    :mod:`lightning_par.tensor_parallel`); with ``sequence_parallel`` the norms and dropouts run on sequence shards
    too (Korthikanti et al. 2022). When the plan has a ``vocab_head``, the steps and backward run under the
    vocab-parallel loss context, so the LightningModule's ordinary ``F.cross_entropy`` never gathers the logits. On the
    dp axis, gradients of the local shards are averaged by the bucketed, overlapped reducer of ``ddp_overlap``.

    The plan, relative to the network (``lightning_module.model``, or the LightningModule itself when it has no
    ``model``): the ``plan`` option, else ``tp_plan()`` of the network or of the LightningModule (the reference GPT
    has one); see :mod:`lightning_par.contract`; its styles: :mod:`lightning_par.tensor_parallel.plan`. A preset of
    :class:`MeshStrategy` with ``dp_mode="ddp"`` and every axis but pp. Registered as ``"tensor_parallel"``.

    Args:
        tp_size: tensor-parallel size.
        dp_size: data-parallel size (``-1``: ``world_size // tp_size``).
        **options: the tensor_parallel group (``sequence_parallel``, ``plan``), the reducer group, and
            :class:`MeshStrategy`'s keywords.

    Raises:
        ValueError: here, an invalid option or plan style name; before the process group starts, a model the plan or
            ``tp_size`` does not fit (heads or widths not divisible by ``tp_size``, a plan naming a missing module,
            sequence parallelism with a model it does not support), each naming the field, value and what is valid.
    """

    strategy_name: ClassVar[str] = "tensor_parallel"
    excluded_axes: ClassVar[frozenset[str]] = frozenset({"pp"})
    description: ClassVar[str] = "Megatron tensor parallelism on tp (DTensor), data parallel on dp"

    def __init__(self, tp_size: int = 2, dp_size: int = -1, **options: Any) -> None:
        super().__init__(dp_size=dp_size, tp_size=tp_size, dp_mode="ddp", **options)
