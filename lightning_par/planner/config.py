"""The ``planner`` config group of ``recipes/plan.py``: a schema, and the multirun emitted for the best layouts.

:class:`PlannerConfig` is stored in Hydra's ConfigStore as ``planner/schema_planner`` (``conf/planner/*.yaml`` extend
it), so a bad override (``planner.top_k=two``) fails at compose time. :func:`write_layout_recipes` turns the top
layouts into option files of the ``recipe`` group (``# @package _global_``, as ``conf/recipe/*``), so one
``recipes/train.py -m --config-dir DIR +recipe=plan_1,plan_2,...`` runs them all, each in its own world, and the sweep
report sets predicted next to measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, make_dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional

import yaml

from lightning_par.planner.layouts import axis_choices
from lightning_par.planner.plan import Prediction

__all__ = ["PlannerConfig", "overrides_to_recipe", "register_planner_config", "write_layout_recipes"]


@dataclass
class _PlannerChoices:
    """:class:`PlannerConfig`'s fields before the axis choices."""

    #: a100-40gb | a100-80gb | h100-80gb | h200 | cpu (this machine, calibrated)
    device: str = "a100-80gb"
    num_devices: Optional[int] = None
    devices_per_node: int = 8
    global_batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    #: fp32 | amp-bf16 | mixed-bf16 (or a Lightning precision string)
    precision: Optional[str] = None
    dp_modes: list[str] = field(default_factory=lambda: ["ddp", "zero1", "zero2", "zero3"])
    schedules: list[str] = field(default_factory=lambda: ["gpipe", "1f1b", "interleaved_1f1b"])
    checkpointing: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    micro_batch_sizes: Optional[list[int]] = None
    sequence_parallel: list[bool] = field(default_factory=lambda: [False, True])


#: The axis choices (:func:`~lightning_par.planner.layouts.axis_choices`, ``plan()``'s keywords of the same names), one
#: field each, generated so that an axis added on the registry brings its own: ``<size>s`` (``list[int]``, default
#: ``[1]``) and ``<option>s`` (``list[str]``, default every value).
_AxisChoices = make_dataclass(
    "_AxisChoices",
    [(name, list[type(default[0])], field(default_factory=partial(list, default)))
     for name, default in axis_choices().items()],
    bases=(_PlannerChoices,),
)
_AxisChoices.__module__ = __name__


@dataclass
class PlannerConfig(_AxisChoices):  # type: ignore[valid-type, misc]
    """What to plan for (``recipes/plan.py``; the model comes from the ``model`` group).

    Fields left ``None`` follow the run config: ``num_devices`` is ``parallel.world_size``, ``global_batch_size`` is
    ``data.batch_size`` times the data-parallel size of ``parallel``, ``seq_len`` the model's ``block_size``,
    ``precision`` the device's default.

    The axis choices, after ``sequence_parallel`` (generated from :func:`~lightning_par.planner.layouts.axis_choices`):

    * ``cp_sizes``: context-parallel sizes to enumerate, e.g. ``[1,2,4]`` (``[1]``: no context parallelism; cp > 1
      needs pp_size = 1 and a sequence length divisible by 2 * cp);
    * ``cp_methods``: context-parallel attentions to enumerate when cp > 1: ring | all_to_all;
    * ``dp_replicate_sizes``: HSDP replica counts to enumerate, e.g. ``[1,2]`` (``[1]``: none; > 1 only under the
      ZeRO modes);
    * ``ep_sizes``: expert-parallel sizes to enumerate for a MoE model, e.g. ``[1,2,4]`` (``[1]``: none).
    """

    max_virtual_stages: int = 4
    #: rows of the printed table (the markdown and CSV files hold every layout)
    top: int = 15
    #: emit the best k layouts as a ready multirun of recipes/train.py (0: none)
    top_k: int = 0
    #: list the layouts that do not fit too (after those that do, with the reason)
    include_unfit: bool = True
    #: for device=cpu: the calibration JSON (None: the default file)
    calibration: Optional[str] = None


def register_planner_config(cs: Any = None) -> None:
    """Store :class:`PlannerConfig` in Hydra's ConfigStore as ``planner/schema_planner``."""
    from hydra.core.config_store import ConfigStore

    (cs or ConfigStore.instance()).store(group="planner", name="schema_planner", node=PlannerConfig)


def _value(text: str) -> Any:
    return yaml.safe_load(text)


def overrides_to_recipe(overrides: Sequence[str], comment: str = "") -> str:
    """A ``recipe`` group option (YAML, ``# @package _global_``) equivalent to ``overrides``.

    ``group=option`` overrides become ``override /group: option`` defaults; ``a.b=value`` ones nested keys.
    """
    defaults: list[str] = []
    body: dict[str, Any] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if "." not in key:
            defaults.append(f"  - override /{key}: {value}")
            continue
        node = body
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _value(value)
    lines = ["# @package _global_"] + [f"# {line}" for line in comment.splitlines() if line]
    if defaults:
        lines += ["defaults:"] + defaults
    text = "\n".join(lines) + "\n"
    if body:
        text += yaml.safe_dump(body, sort_keys=False, default_flow_style=None)
    return text


def write_layout_recipes(
    predictions: Sequence[Prediction],
    out_dir: str | Path,
    parallel_options: Sequence[str],
    num_layers: int,
    prefix: str = "plan",
) -> tuple[Path, list[str]]:
    """Write one ``recipe`` option per prediction into ``out_dir/recipe/`` and return ``(out_dir, option names)``.

    Run them with ``python recipes/train.py -m --config-dir OUT_DIR +recipe=plan_1,plan_2,...``.
    """
    from lightning_par.planner.overrides import layout_overrides

    out = Path(out_dir)
    (out / "recipe").mkdir(parents=True, exist_ok=True)
    names = []
    for i, pred in enumerate(predictions, 1):
        name = f"{prefix}_{i}"
        comment = (
            f"planner rank {i}: {pred.layout.describe()}\n"
            f"predicted {pred.step_time_s:.4g} s/step, {pred.tokens_per_s:,.0f} tokens/s, "
            f"{pred.bytes_per_device / 2**30:.2f} GiB/device" + "".join(f"\nnote: {n}" for n in pred.notes)
        )
        overrides = layout_overrides(pred.layout, parallel_options, num_layers)
        (out / "recipe" / f"{name}.yaml").write_text(overrides_to_recipe(overrides, comment))
        names.append(name)
    return out, names
