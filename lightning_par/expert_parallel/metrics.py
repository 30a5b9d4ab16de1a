"""Per-step figures of a network's mixture-of-experts layers, logged under ``parallel/``.

A layer takes part by keeping a ``last_stats`` dict after each forward (:class:`lightning_par.models.moe.MoE` does):
``tokens_per_expert`` ``(E,)`` (this rank's routed copies per expert), ``dropped`` (copies over capacity),
``aux_loss`` and ``z_loss`` (unweighted).
"""

from __future__ import annotations

from torch import nn

__all__ = ["moe_step_metrics"]


def moe_step_metrics(network: nn.Module) -> dict[str, float]:
    """This rank's figures of the last forward of every MoE layer in ``network`` (``{}`` without one):

    * ``moe_load_imbalance``: the largest, over layers, of max/mean tokens per expert (1.0: perfectly balanced);
    * ``moe_dropped_tokens``: routed copies dropped over capacity, summed over layers;
    * ``moe_aux_loss`` / ``moe_z_loss``: the layers' mean load-balancing and z-loss (unweighted).
    """
    stats = [m.last_stats for m in network.modules()
             if isinstance(getattr(m, "last_stats", None), dict) and "tokens_per_expert" in m.last_stats]
    if not stats:
        return {}
    imbalance = 0.0
    for s in stats:
        counts = s["tokens_per_expert"].float()
        mean = float(counts.mean())
        imbalance = max(imbalance, float(counts.max()) / mean if mean > 0 else 0.0)
    return {
        "moe_load_imbalance": imbalance,
        "moe_dropped_tokens": float(sum(s["dropped"] for s in stats)),
        "moe_aux_loss": float(sum(float(s["aux_loss"]) for s in stats) / len(stats)),
        "moe_z_loss": float(sum(float(s["z_loss"]) for s in stats) / len(stats)),
    }
