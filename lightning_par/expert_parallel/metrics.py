"""Per-step figures of a network's mixture-of-experts layers, logged under ``parallel/`` and summed up in
``summary.json``.

A layer takes part by keeping a ``last_stats`` dict after each forward (:class:`lightning_par.models.moe.MoE` does):
``tokens_per_expert`` ``(E,)`` (this rank's routed copies per expert), ``dropped`` (copies over capacity, an int or a
0-dim tensor), ``aux_loss`` and ``z_loss`` (unweighted). The figures are read to the host once per training step,
after it (not inside a layer's forward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["MoEFigures", "moe_step_metrics"]


def _layers(network: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    return [(name, m.last_stats) for name, m in network.named_modules()
            if isinstance(getattr(m, "last_stats", None), dict) and "tokens_per_expert" in m.last_stats]


def _imbalance(mean: float, most: float) -> float:
    """max / mean tokens per expert (1.0: balanced; 0.0: no tokens)."""
    return most / mean if mean > 0 else 0.0


def moe_step_metrics(network: nn.Module) -> dict[str, float]:
    """This rank's figures of the last forward of every MoE layer in ``network`` (``{}`` without one):

    * ``moe_load_imbalance``: the largest, over layers, of max/mean tokens per expert (1.0: perfectly balanced);
    * ``moe_load_imbalance/<layer path>``: the same for each layer (``moe_load_imbalance/blocks.1.mlp``);
    * ``moe_dropped_tokens``: routed copies dropped over capacity, summed over layers;
    * ``moe_aux_loss`` / ``moe_z_loss``: the layers' mean load-balancing and z-loss (unweighted).

    One read to the host per call (one step), whatever the number of layers: every layer's five numbers are stacked on
    the device and read in one ``.tolist()`` (``docs/host-syncs.md``).
    """
    stats = _layers(network)
    if not stats:
        return {}
    device = stats[0][1]["tokens_per_expert"].device
    rows = []
    for _, s in stats:
        counts = s["tokens_per_expert"].float()
        rows.append(torch.stack([counts.mean(), counts.max(),
                                 *(torch.as_tensor(s[k], device=device).float().reshape(())
                                   for k in ("dropped", "aux_loss", "z_loss"))]))
    host = torch.stack(rows).tolist()  # (layers, 5): the step's one host read
    per_layer = {f"moe_load_imbalance/{name}": _imbalance(row[0], row[1]) for (name, _), row in zip(stats, host)}
    return {
        "moe_load_imbalance": max(per_layer.values()),
        **per_layer,
        "moe_dropped_tokens": float(sum(row[2] for row in host)),
        "moe_aux_loss": float(sum(row[3] for row in host) / len(stats)),
        "moe_z_loss": float(sum(row[4] for row in host) / len(stats)),
    }


class MoEFigures:
    """The step figures of :func:`moe_step_metrics`, and their run totals for ``summary.json``.

    Args:
        network: this rank's network (its part of it under pipelining).
    """

    def __init__(self, network: nn.Module) -> None:
        self.network = network
        self.steps = 0
        self.dropped = 0.0
        self.imbalance_sum: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def step(self) -> dict[str, float]:
        """This step's figures (:func:`moe_step_metrics`), counted into the totals."""
        figures = moe_step_metrics(self.network)
        if figures:
            self.steps += 1
            self.dropped += figures["moe_dropped_tokens"]
            for key, value in figures.items():
                if key.startswith("moe_load_imbalance/"):
                    layer = key.split("/", 1)[1]
                    self.imbalance_sum[layer] = self.imbalance_sum.get(layer, 0.0) + value
                    self.last[layer] = value
        return figures

    def summary(self) -> dict[str, Any]:
        """``moe_load_imbalance_per_layer`` (``{layer: {"mean": over steps, "last": last step}}``, max/mean tokens per
        expert on this rank), ``moe_dropped_tokens_total`` (routed copies dropped over the run) and ``moe_steps``
        (steps counted); ``{}`` before the first step."""
        if not self.steps:
            return {}
        return {
            "moe_steps": self.steps,
            "moe_dropped_tokens_total": self.dropped,
            "moe_load_imbalance_per_layer": {layer: {"mean": total / self.steps, "last": self.last[layer]}
                                             for layer, total in self.imbalance_sum.items()},
        }
