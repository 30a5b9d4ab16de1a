"""The reference GPT's tensor-parallel plan, beside the model (torchtitan keeps each model's plan next to it).

Megatron-LM layout (Shoeybi et al. 2019, §3): in attention, ``q_proj``/``k_proj``/``v_proj`` column-parallel (each rank
runs ``n_head / tp`` heads) and ``c_proj`` row-parallel; in the MLP, ``c_fc`` column-parallel and ``c_proj``
row-parallel — one all-reduce forward (after the row-parallel layer) and one backward (at the ``colwise_input`` of
the sub-block) per sub-block. The token embedding and the LM head are vocab-parallel. With sequence parallelism
(Korthikanti et al. 2022, §4.2.2) the layer norms, dropouts and the position table work on sequence shards, and each
all-reduce becomes an all-gather plus a reduce-scatter.
"""

from __future__ import annotations

from torch.distributed.tensor.parallel import ParallelStyle

from lightning_par.models.gpt import GPTConfig

__all__ = ["GPT_TP_PLAN", "gpt_tp_plan", "validate_gpt_tp"]

#: Module path (relative to a :class:`~lightning_par.models.gpt.GPT`) -> style name.
GPT_TP_PLAN: dict[str, str] = {
    "wte": "vocab_embedding",
    "wpe": "position_embedding",
    "drop": "sequence_parallel",
    "blocks.*.ln_1": "sequence_parallel",
    "blocks.*.attn": "colwise_input",
    "blocks.*.attn.q_proj": "colwise",
    "blocks.*.attn.k_proj": "colwise",
    "blocks.*.attn.v_proj": "colwise",
    "blocks.*.attn.c_proj": "rowwise",
    "blocks.*.attn.resid_drop": "sequence_parallel",
    "blocks.*.ln_2": "sequence_parallel",
    "blocks.*.mlp": "colwise_input",
    "blocks.*.mlp.c_fc": "colwise",
    "blocks.*.mlp.c_proj": "rowwise",
    "blocks.*.mlp.dropout": "sequence_parallel",
    "ln_f": "sequence_parallel",
    "lm_head": "vocab_head",
}


def gpt_tp_plan(
    sequence_parallel: bool | None = None, moe_layers: list[int] | tuple[int, ...] = (), n_layer: int = 0
) -> dict[str, str | ParallelStyle]:
    """The GPT's plan, relative to the :class:`~lightning_par.models.gpt.GPT` module.

    Args:
        sequence_parallel: None returns style names (one plan for both modes; ``apply_tensor_parallel`` resolves
            them); True/False returns the torch ``ParallelStyle`` objects for that mode, e.g. for
            ``torch.distributed.tensor.parallel.parallelize_module``.
        moe_layers: blocks whose MLP is a mixture of experts. Their router and experts stay whole on every tp rank
            (each tp rank computes the same tokens: splitting an expert's matrices would need two collectives per
            expert on top of the ep all-to-all, and expert parallelism already divides the expert weights); under
            sequence parallelism the layer gathers the sequence first and keeps its own piece of the output.
        n_layer: the number of blocks (needed with ``moe_layers``).

    Returns:
        A new dict: module path (``*`` matches every block) -> style.
    """
    plan = dict(GPT_TP_PLAN)
    if moe_layers:
        for path in [p for p in plan if p.startswith("blocks.*.mlp")]:
            style = plan.pop(path)
            plan.update({path.replace("*", str(i)): style for i in range(n_layer) if i not in moe_layers})
        plan.update({f"blocks.{i}.mlp": "replicate" for i in moe_layers})
    if sequence_parallel is None:
        return plan
    from lightning_par.tensor_parallel.plan import resolve_style

    return {path: resolve_style(style, sequence_parallel) for path, style in plan.items()}


def validate_gpt_tp(config: GPTConfig, tp_size: int, sequence_parallel: bool = False) -> None:
    """Check that a GPT of this shape can be split over ``tp_size`` ranks.

    Raises:
        ValueError: ``n_head`` or ``n_embd`` not divisible by ``tp_size`` (heads are split whole across ranks), or,
            with sequence parallelism, ``block_size`` not divisible by ``tp_size`` (each rank holds
            ``seq / tp_size`` positions). The message names the field, its value and the valid choices.
    """
    def divisors(n: int) -> list[int]:
        return [d for d in range(1, n + 1) if n % d == 0]

    if config.n_embd % tp_size:
        raise ValueError(
            f"GPTConfig.n_embd={config.n_embd} is not divisible by tp_size={tp_size}: choose tp_size in "
            f"{divisors(config.n_embd)} or change n_embd."
        )
    if config.n_head % tp_size:
        raise ValueError(
            f"GPTConfig.n_head={config.n_head} is not divisible by tp_size={tp_size}: tensor parallelism splits whole "
            f"heads across ranks; choose tp_size in {divisors(config.n_head)} or change n_head."
        )
    if sequence_parallel and config.num_experts and tp_size > 1:
        raise ValueError(
            f"sequence_parallel=True is not valid with GPTConfig.num_experts={config.num_experts}: the mixture-of-experts "
            f"blocks keep their router and experts whole on every tp rank and run on the whole sequence, which "
            f"sequence parallelism splits; use sequence_parallel=False (tensor parallelism still splits attention and "
            f"the dense blocks)."
        )
    if sequence_parallel and config.block_size % tp_size:
        raise ValueError(
            f"GPTConfig.block_size={config.block_size} is not divisible by tp_size={tp_size}, which "
            f"sequence_parallel=True needs (each rank holds seq / tp_size positions); choose tp_size in "
            f"{divisors(config.block_size)} or sequence_parallel=False."
        )
