r"""Calibrate the planner's "cpu" device on this machine and validate its predictions against measured runs.

    python recipes/plan_validate.py                       # worlds 2, 4, 8 with the small GPT (~20-40 min on 2 cores)
    python recipes/plan_validate.py --worlds 8 --rounds 3 # the world-8 layouts, each run 3 times (fastest)
    python recipes/plan_validate.py --quick               # worlds 2 and 4, fewer steps (a few minutes)
    python recipes/plan_validate.py --calibrate-only      # write the calibration file that device="cpu" reads
    python recipes/plan_validate.py --worlds 8 --rounds 1 --model moe_small --dp-modes zero2 \
        --cp-sizes 1,2 --dp-replicate-sizes 1,2 --ep-sizes 1,2,4     # every axis: cp, HSDP and ep layouts too

For each world size N: calibrate N processes (:func:`lightning_par.planner.calibrate_cpu`: matmul FLOP/s, gloo
all-reduce latency and bandwidth, framework overheads, all measured with every process busy), then train every
``(dp, tp, pp, dp_mode)`` layout of the model for a few steps with ``recipes/train.py``'s job (global batch fixed, so
every layout does the same work), and set the planner's prediction for each run's own config next to its
``summary.json``: step time (median of the slowest rank) and model-state bytes (parameters + gradients + optimizer
state of the largest rank). Reports, per world, Spearman's rank correlation of predicted vs measured step time, the
worst step-time ratio, and the largest model-state error. Writes ``validation.md``, ``validation.csv``,
``summaries.json`` and ``calibration.json`` into ``--out``.

Timings on a shared machine move with the load of other processes, which only ever add time: each layout runs
``--rounds`` times and its fastest round counts, each calibration figure is the best of ``--calibration-repeats``;
the load average is recorded per world. ``--from DIR`` re-compares an earlier run's files without running anything.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

from lightning_par.models.gpt import GPTConfig
from lightning_par.planner.calibrate import CpuCalibration, calibrate_cpu, default_calibration_path
from lightning_par.planner.layouts import size_fields
from lightning_par.planner.model import model_spec
from lightning_par.planner.validate import compare, cpu_validation_layouts, run_layouts, save_json, spearman_rho

_MiB = 1 << 20


def _fastest_runs(rounds: list[list[dict]]) -> list[dict]:
    """Per layout, the round with the shortest step time (its summary kept whole): other processes on a shared
    machine only ever add time, so the fastest round is the least disturbed."""
    merged = []
    for runs in zip(*rounds):
        ok = [r for r in runs if "error" not in r and r.get("step_time_s") is not None]
        if not ok:
            merged.append(runs[0])
            continue
        pick = dict(min(ok, key=lambda r: r["step_time_s"]))
        pick["step_time_s_rounds"] = [r["step_time_s"] for r in ok]
        merged.append(pick)
    return merged


def _world_table(world: int, rows: list[dict], load: tuple[float, float]) -> tuple[str, dict]:
    ok = [r for r in rows if "error" not in r]
    pred = [r["predicted_step_s"] for r in ok]
    meas = [r["measured_step_s"] for r in ok]
    rho = spearman_rho(pred, meas) if len(ok) > 1 else float("nan")
    ratios = [r["step_ratio"] for r in ok]
    worst = max(ratios, key=lambda x: max(x, 1 / x)) if ratios else float("nan")
    state_err = max(abs(r["state_ratio"] - 1) for r in ok) if ok else float("nan")
    stats = {"world_size": world, "layouts": len(rows), "failed": len(rows) - len(ok), "spearman_rho": rho,
             "worst_step_ratio": worst, "max_state_error": state_err, "loadavg_start": load[0], "loadavg_end": load[1]}
    lines = [
        f"## World {world}: {len(ok)} layouts (load average {load[0]:.1f} -> {load[1]:.1f})",
        "",
        f"Spearman rho (predicted vs measured step time) = **{rho:.3f}**; worst step ratio predicted/measured = "
        f"**{worst:.2f}**; largest model-state error = **{100 * state_err:.2f}%**.",
        "",
        "| layout | measured s/step | predicted s/step | ratio | measured state MiB | predicted state MiB | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | failed: {r['error'][:80]} | | | | | |")
            continue
        lines.append(
            f"| {r['layout']} | {r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | {r['step_ratio']:.2f} | "
            f"{r['measured_state_bytes'] / _MiB:.3f} | {r['predicted_state_bytes'] / _MiB:.3f} | "
            f"{r['state_ratio']:.4f} |"
        )
    return "\n".join(lines) + "\n", stats


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4,8", help="comma-separated world sizes (default 2,4,8)")
    parser.add_argument("--model", default="small", help="GPT preset (default small)")
    parser.add_argument("--global-batch", type=int, default=32, help="sequences per step, every layout (default 32)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run; 2 are warm-up (default 8)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per layout, in rounds; the fastest counts (default 2)")
    parser.add_argument("--calibration-repeats", type=int, default=3,
                        help="calibrations per world; each figure's best counts (default 3)")
    parser.add_argument("--out", default=None, help="output directory (default outputs/plan_validate/<time>)")
    parser.add_argument("--calibrate-only", action="store_true", help="calibrate worlds 1,2,4,8, save, stop")
    parser.add_argument("--calibration", default=None, help="calibration file to write (default: the planner's)")
    parser.add_argument("--quick", action="store_true", help="worlds 2 and 4, 6 steps")
    for size in size_fields():  # --cp-sizes 1,2 (ring attention), --dp-replicate-sizes 1,2 (HSDP), --ep-sizes (MoE)
        flag = size.replace("_", "-")
        parser.add_argument(f"--{flag}s", default="1", help=f"{size} values to measure too, e.g. 1,2")
    parser.add_argument("--dp-modes", default="ddp,zero1,zero2,zero3", help="dp modes to measure")
    parser.add_argument("--from", dest="from_dir", default=None,
                        help="re-compare the summaries.json and calibration.json of an earlier --out, without running")
    args = parser.parse_args(argv)
    cal_path = Path(args.calibration) if args.calibration else default_calibration_path()
    if args.calibrate_only:
        cal = calibrate_cpu((1, 2, 4, 8), repeats=args.calibration_repeats)
        print(json.dumps({str(k): v for k, v in cal.worlds.items()}, indent=2))
        print(f"calibration written to {cal.save(cal_path)}")
        return 0
    worlds = [2, 4] if args.quick else [int(w) for w in args.worlds.split(",") if w.strip()]
    steps = 6 if args.quick else args.steps
    out = Path(args.out or f"outputs/plan_validate/{time.strftime('%Y-%m-%d/%H-%M-%S')}")
    out.mkdir(parents=True, exist_ok=True)
    gpt = GPTConfig.from_preset(args.model)
    spec = model_spec(gpt)
    base = [f"model={args.model}", "data=synthetic", "trainer=smoke", f"trainer.max_steps={steps}",
            "trainer.val_check_interval=100000", "trainer.enable_progress_bar=false"]
    calibration = CpuCalibration.load(cal_path) if cal_path.exists() else CpuCalibration()
    earlier: dict[int, list[dict]] = {}
    if args.from_dir:
        calibration = CpuCalibration.load(Path(args.from_dir) / "calibration.json")
        for s in json.loads((Path(args.from_dir) / "summaries.json").read_text()):
            earlier.setdefault(s["config"]["parallel"]["world_size"], []).append(s)
        worlds = sorted(earlier)
    sections, stats, all_rows, all_summaries = [], [], [], []
    for world in worlds:
        load_start = os.getloadavg()[0]
        if args.from_dir:
            summaries = earlier[world]
            load_start = summaries[0].get("loadavg_start", float("nan"))
        else:
            layouts = cpu_validation_layouts(
                spec, world, args.global_batch,
                **{f"{size}s": _ints(getattr(args, f"{size}s")) for size in size_fields()},
                dp_modes=[m.strip() for m in args.dp_modes.split(",") if m.strip()],
            )
            fresh = calibrate_cpu((world,), repeats=args.calibration_repeats)  # right before the runs
            calibration.worlds[world] = fresh.worlds[world]
            calibration.machine = fresh.machine
            rounds = [run_layouts(layouts, out / f"world{world}" / f"round{k}", base, spec.num_layers)
                      for k in range(args.rounds)]
            summaries = _fastest_runs(rounds)
            for s in summaries:
                s.update(loadavg_start=load_start, loadavg_end=os.getloadavg()[0])
        rows = compare(summaries, calibration.device_spec(world))
        load_end = summaries[-1].get("loadavg_end", os.getloadavg()[0])
        text, st = _world_table(world, rows, (load_start, load_end))
        print(text, flush=True)
        sections.append(text)
        stats.append(st)
        all_rows += [{"world_size": world, **r} for r in rows]
        all_summaries += summaries
    calibration.save(out / "calibration.json")
    if not args.from_dir:
        calibration.save(cal_path)
    header = [
        "# Planner validation on this machine",
        "",
        f"Model: {spec.describe()}; global batch {args.global_batch} sequences; {steps} steps per run (2 warm-up), "
        f"{args.rounds} round(s); {os.cpu_count()} CPUs. Command: `python recipes/plan_validate.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        "| world | layouts | Spearman rho | worst step ratio | max state error | load avg |",
        "|---:|---:|---:|---:|---:|---|",
    ] + [
        f"| {s['world_size']} | {s['layouts'] - s['failed']}/{s['layouts']} | {s['spearman_rho']:.3f} | "
        f"{s['worst_step_ratio']:.2f} | {100 * s['max_state_error']:.2f}% | {s['loadavg_start']:.1f} -> "
        f"{s['loadavg_end']:.1f} |" for s in stats
    ]
    (out / "validation.md").write_text("\n".join(header) + "\n\n" + "\n".join(sections))
    keys = sorted({k for r in all_rows for k in r})
    with (out / "validation.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(all_rows)
    save_json(out / "summaries.json", all_summaries)
    print("\n".join(header))
    print(f"\nWritten: {out / 'validation.md'}, validation.csv, summaries.json, calibration.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
