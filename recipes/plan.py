"""Plan a layout: rank every dp x tp x pp layout (dp mode, micro-batches, schedule, checkpointing) of a GPT on N
devices, and with ``planner.cp_sizes`` the dp x cp x tp layouts of context parallelism too.

    python recipes/plan.py model=gpt2 parallel.world_size=64 planner.device=h100-80gb planner.global_batch_size=512
    python recipes/plan.py model=small parallel.world_size=8 planner=cpu planner.top_k=4   # + a ready multirun
    python recipes/plan.py model=gpt2 parallel.world_size=64 planner.cp_sizes=[1,2,4]     # context parallelism too
    python recipes/plan.py model=moe_small parallel.world_size=16 planner.ep_sizes=[1,2,4]  # + planner.dp_replicate_sizes
    python recipes/plan.py --dry-run model=gpt2 parallel.world_size=1024 parallel.tp_size=8 parallel.pp_size=4 \
        strategy=parallel_3d strategy.dp_mode=zero1 strategy.pipeline.num_microbatches=4   # exact bytes, no hardware

``--dry-run`` (``--dry-run-rank=R``, default 0) builds the model on the meta device and runs the real
``parallelize()`` of the ``parallel`` + ``strategy`` layout for rank R and its peers on every pipeline stage, on a
fake process group (:mod:`lightning_par.planner.dry_run`), and prints each one's parameter, gradient and optimizer
state bytes next to the planner's prediction, and the worst rank over the pipeline stages; then exits.

Prints the ranked table (best first; layouts that do not fit last, with the reason) and writes ``plan.md`` and
``plan.csv`` into the Hydra run directory (``outputs/plan/<date>/<time>/``). With ``planner.top_k=K`` it also writes
the best K layouts as ``recipe`` options under ``<run dir>/layouts/recipe/`` and prints the multirun that trains them
all (one world per layout; the sweep report then sets predicted next to measured). The model comes from the ``model``
group, the device count from ``parallel.world_size`` and the batch from ``data.batch_size`` x the dp size of
``parallel`` unless ``planner.*`` says otherwise (see ``conf/planner/default.yaml``).
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_par.config.schema import register_configs
from lightning_par.planner import format_table, layout_overrides, model_spec, plan, to_csv, to_markdown
from lightning_par.planner.config import register_planner_config, write_layout_recipes
from lightning_par.planner.layouts import WORLD_SIZE_FIELDS, axis_choices
from lightning_par.planner.run_config import model_from_run

register_configs()
register_planner_config()

CONF = Path(__file__).resolve().parents[1] / "conf"
#: Overrides of the plan command that also mean something to recipes/train.py (passed on to the emitted runs).
_PASSED_ON = ("model", "data", "trainer", "seed")


_MiB = float(1 << 20)


def _pop_dry_run_flags(argv: list[str]) -> tuple[bool, int]:
    """Remove ``--dry-run`` and ``--dry-run-rank=R`` from ``argv`` (Hydra would refuse them); return them.

    Raises:
        ValueError: a rank that is not an integer >= 0.
    """
    dry, rank = False, 0
    for arg in list(argv[1:]):
        if arg == "--dry-run":
            dry = True
        elif arg.startswith("--dry-run-rank="):
            value = arg.split("=", 1)[1]
            if not value.isdigit():
                raise ValueError(f"--dry-run-rank={value!r} is not valid: expected an integer >= 0.")
            dry, rank = True, int(value)
        else:
            continue
        argv.remove(arg)
    return dry, rank


DRY_RUN, DRY_RUN_RANK = _pop_dry_run_flags(sys.argv)


def _predicted_states(run: dict[str, Any], pp_size: int) -> list[float | None]:
    """The planner's model-state bytes of each pipeline stage (None for a model it cannot read)."""
    from lightning_par.planner import get_precision
    from lightning_par.planner.memory import model_state_bytes, rank_params
    from lightning_par.planner.run_config import layout_from_run

    try:
        spec, layout = model_spec(model_from_run(run)), layout_from_run(run)
    except ValueError:
        return [None] * pp_size
    prec = get_precision(run.get("trainer", {}).get("precision", "32-true"))
    d = layout.dims().size("dp_cp")  # the ranks the dp modes shard the dense state over (dp x every split of it)
    return [model_state_bytes(rank_params(spec, layout, r), layout.dp_mode, d, prec) for r in range(pp_size)]


def dry_run_report(cfg: DictConfig, rank: int) -> str:
    """The dry run of ``rank`` and its peers on every pipeline stage, next to the planner's prediction."""
    from lightning_par.config.build import build_module, build_parallel_dims, build_strategy
    from lightning_par.planner.dry_run import dry_run_ranks, stage_ranks, worst_rank

    dims = build_parallel_dims(cfg)
    options = build_strategy(cfg, dims).options
    states = dry_run_ranks(lambda: build_module(cfg), dims, options, stage_ranks(dims, rank))
    predicted = _predicted_states(OmegaConf.to_container(cfg, resolve=True), dims.pp_size)
    lines = [f"Dry run (meta device, fake process group of {dims.world_size} ranks, dp_mode={options.dp_mode}): "
             f"model state per rank, MiB",
             f"{'rank':>6} {'pp':>3} {'params':>14} {'param':>10} {'grad':>10} {'optim':>10} {'buckets':>10} "
             f"{'total':>10} {'predicted':>10} {'ratio':>7}"]
    for s in states:
        pred = predicted[s.pp_rank]
        lines.append(
            f"{s.rank:>6} {s.pp_rank:>3} {s.params:>14,} {s.param_bytes / _MiB:>10.2f} {s.grad_bytes / _MiB:>10.2f} "
            f"{s.optimizer_state_bytes / _MiB:>10.2f} {s.bucket_bytes / _MiB:>10.2f} "
            f"{s.model_state_bytes / _MiB:>10.2f} "
            + (f"{pred / _MiB:>10.2f} {s.model_state_bytes / pred:>7.4f}" if pred else f"{'n/a':>10} {'':>7}"))
    worst = worst_rank(states)
    lines.append(f"worst rank over the pipeline stages: rank {worst.rank} (pp {worst.pp_rank}), "
                 f"{worst.model_state_bytes / _MiB:.2f} MiB of model state")
    lines.append("total = param + grad + optim (model state); buckets: the dp all-reduce's flat gradient buffers, "
                 "besides (a tensor-parallel gradient is held in both)")
    return "\n".join(lines)


def _peak_line(run: dict[str, Any], device: str, devices_per_node: int) -> str:
    """The predicted peak memory per device of the run's own layout (``parallel`` + ``strategy``)."""
    from lightning_par.planner.run_config import predict_run

    try:
        pred = predict_run(run, device=device, devices_per_node=devices_per_node)
    except ValueError as e:
        return f"Predicted peak memory of the given layout: n/a ({e})"
    return (f"Predicted peak memory per rank of the given layout {pred['layout']} on {pred['device']}: "
            f"{pred['bytes_per_device'] / 2**30:.3f} GiB on the fullest rank (model state "
            f"{pred['model_state_bytes'] / 2**30:.3f} GiB at most, activations {pred['activation_bytes'] / 2**30:.3f} "
            f"GiB); fits: {pred['fits']}")


#: Config keys whose override on the command line gives the plan a layout of its own (``parallel.world_size`` alone is
#: the device count, not a layout).
_LAYOUT_KEYS = ("parallel", "strategy")


def _layout_given(overrides: list[str]) -> bool:
    """Whether the command line chose a layout (``parallel=tp2``, ``parallel.tp_size=4``, ``strategy=zero3``,
    ``strategy.dp_mode=zero1``, ...), whose predicted peak memory the plan then prints above the ranking."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key.split(".")[0] in _LAYOUT_KEYS and key != "parallel.world_size":
            return True
    return False


def _global_batch(cfg: DictConfig) -> int:
    par = cfg.parallel
    split = math.prod(int(par.get(size, 1)) for size in WORLD_SIZE_FIELDS if size != "dp_size")  # tp, pp, cp
    dp = par.dp_size if par.dp_size != -1 else par.world_size // split
    return int(cfg.data.batch_size) * max(1, int(dp))


@hydra.main(version_base=None, config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    p = cfg.planner
    run = OmegaConf.to_container(cfg, resolve=True)
    if DRY_RUN:
        print(dry_run_report(cfg, DRY_RUN_RANK))
        return
    try:
        gpt = model_from_run(run)
    except ValueError as err:  # a model the planner cannot read from the config: the message alone, status 1
        sys.stderr.write(f"Error: {err}\n")
        raise SystemExit(1) from None
    num_devices = p.num_devices or cfg.parallel.world_size
    batch = p.global_batch_size or _global_batch(cfg)
    predictions = plan(
        gpt, num_devices=num_devices, devices_per_node=p.devices_per_node, device=p.device, global_batch_size=batch,
        seq_len=p.seq_len, precision=p.precision, dp_modes=list(p.dp_modes), schedules=list(p.schedules),
        checkpointing=list(p.checkpointing), micro_batch_sizes=p.micro_batch_sizes,
        max_virtual_stages=p.max_virtual_stages, sequence_parallel=list(p.sequence_parallel),
        include_unfit=p.include_unfit, calibration=p.calibration,
        **{name: list(p[name]) for name in axis_choices()},  # planner.cp_sizes, .cp_methods, .ep_sizes, ...
    )
    spec = model_spec(gpt, p.seq_len)
    fits = sum(x.fits for x in predictions)
    out = Path(HydraConfig.get().runtime.output_dir)
    header = (
        f"{spec.describe()}; {num_devices} x {p.device} ({p.devices_per_node} per node); global batch {batch} "
        f"sequences of {spec.seq_len} tokens; {len(predictions)} layouts, {fits} fit"
    )
    print(header)
    if _layout_given(list(HydraConfig.get().overrides.task)):
        print(_peak_line(run, p.device, p.devices_per_node))
    print(format_table(predictions, top=p.top))
    (out / "plan.md").write_text(f"# Plan\n\n{header}\n\n" + to_markdown(predictions))
    to_csv(predictions, out / "plan.csv")
    print(f"\nAll {len(predictions)} layouts: {out / 'plan.md'} and {out / 'plan.csv'}")
    if p.top_k > 0:
        options = sorted(q.stem for q in (CONF / "parallel").glob("*.yaml"))
        best = [x for x in predictions if x.fits][: p.top_k]
        layouts_dir, names = write_layout_recipes(best, out / "layouts", options, spec.num_layers)
        passed = [o for o in HydraConfig.get().overrides.task if o.split("=")[0].split(".")[0] in _PASSED_ON]
        print(f"\nThe best {len(best)} layouts as one multirun (each a world of {num_devices} processes):")
        print(shlex.join(["python", "recipes/train.py", "-m", "--config-dir", str(layouts_dir),
                          f"+recipe={','.join(names)}", *passed]))
        print("\nor one at a time:")
        for x in best:
            overrides = layout_overrides(x.layout, options, spec.num_layers)
            print("  " + shlex.join(["python", "recipes/train.py", *overrides, *passed]))
            for note in x.notes:
                print(f"    note: {note}")


if __name__ == "__main__":
    main()
