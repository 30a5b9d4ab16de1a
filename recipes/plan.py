"""Plan a layout: rank every dp x tp x pp layout (dp mode, micro-batches, schedule, checkpointing) of a GPT on N
devices, and with ``planner.cp_sizes`` the dp x cp x tp layouts of context parallelism too.

    python recipes/plan.py model=gpt2 parallel.world_size=64 planner.device=h100-80gb planner.global_batch_size=512
    python recipes/plan.py model=small parallel.world_size=8 planner=cpu planner.top_k=4   # + a ready multirun
    python recipes/plan.py model=gpt2 parallel.world_size=64 planner.cp_sizes=[1,2,4]     # context parallelism too
    python recipes/plan.py model=moe_small parallel.world_size=16 planner.ep_sizes=[1,2,4]  # + planner.dp_replicate_sizes

Prints the ranked table (best first; layouts that do not fit last, with the reason) and writes ``plan.md`` and
``plan.csv`` into the Hydra run directory (``outputs/plan/<date>/<time>/``). With ``planner.top_k=K`` it also writes
the best K layouts as ``recipe`` options under ``<run dir>/layouts/recipe/`` and prints the multirun that trains them
all (one world per layout; the sweep report then sets predicted next to measured). The model comes from the ``model``
group, the device count from ``parallel.world_size`` and the batch from ``data.batch_size`` x the dp size of
``parallel`` unless ``planner.*`` says otherwise (see ``conf/planner/default.yaml``).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_par.config.schema import register_configs
from lightning_par.planner import format_table, layout_overrides, model_spec, plan, to_csv, to_markdown
from lightning_par.planner.config import register_planner_config, write_layout_recipes
from lightning_par.planner.run_config import model_from_run

register_configs()
register_planner_config()

CONF = Path(__file__).resolve().parents[1] / "conf"
#: Overrides of the plan command that also mean something to recipes/train.py (passed on to the emitted runs).
_PASSED_ON = ("model", "data", "trainer", "seed")


def _global_batch(cfg: DictConfig) -> int:
    par = cfg.parallel
    dp = par.dp_size if par.dp_size != -1 else par.world_size // (par.tp_size * par.pp_size * par.cp_size)
    return int(cfg.data.batch_size) * max(1, int(dp))


@hydra.main(version_base=None, config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    p = cfg.planner
    run = OmegaConf.to_container(cfg, resolve=True)
    gpt = model_from_run(run)
    num_devices = p.num_devices or cfg.parallel.world_size
    batch = p.global_batch_size or _global_batch(cfg)
    predictions = plan(
        gpt, num_devices=num_devices, devices_per_node=p.devices_per_node, device=p.device, global_batch_size=batch,
        seq_len=p.seq_len, precision=p.precision, dp_modes=list(p.dp_modes), schedules=list(p.schedules),
        checkpointing=list(p.checkpointing), micro_batch_sizes=p.micro_batch_sizes,
        max_virtual_stages=p.max_virtual_stages, sequence_parallel=list(p.sequence_parallel),
        cp_sizes=list(p.cp_sizes), cp_methods=list(p.cp_methods), include_unfit=p.include_unfit,
        dp_replicate_sizes=list(p.dp_replicate_sizes), ep_sizes=list(p.ep_sizes),
        calibration=p.calibration,
    )
    spec = model_spec(gpt, p.seq_len)
    fits = sum(x.fits for x in predictions)
    out = Path(HydraConfig.get().runtime.output_dir)
    header = (
        f"{spec.describe()}; {num_devices} x {p.device} ({p.devices_per_node} per node); global batch {batch} "
        f"sequences of {spec.seq_len} tokens; {len(predictions)} layouts, {fits} fit"
    )
    print(header)
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
