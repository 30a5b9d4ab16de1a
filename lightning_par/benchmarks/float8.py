"""Benchmark rows for float8 training: the loss curve of the small GPT in float8 against bf16.

The reference GPT's ``small`` preset (4 layers x 128, context 128) trains on the byte-level standard-library corpus
(:class:`lightning_par.data.ByteCorpusDataModule`), one process on the CPU, through lightning_par's strategy
(``ddp_overlap`` at world 1) under ``precision="bf16-mixed"``, twice from the same initial weights and batches:
``strategy.float8.enabled`` off (bf16) and on (torchao tensorwise float8 on every linear layer but the LM head). The
table gives the training loss averaged over windows of steps and the validation loss (the same ``val_batches``
windows) at the end, and the relative gap float8 / bf16 - 1 of each.

On the CPU this measures numerics only (``torch._scaled_mm`` runs float8 products there, slowly); the speed of float8
is a GPU question (``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["run", "train"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only float8``) and its place in the full run.
SECTION = "float8"
ORDER = 85

_FULL = dict(steps=300, window=50, batch=16, val_batches=16)
_QUICK = dict(steps=40, window=10, batch=16, val_batches=4)


def train(float8: bool, steps: int, batch: int, val_batches: int, preset: str = "small",
          progress: str | None = None) -> dict[str, Any]:
    """Train the GPT ``preset`` for ``steps`` steps (bf16-mixed, one process) and return ``losses`` (per step),
    ``val_loss`` (after the last step) and ``seconds``; with ``progress`` (a file path), each step's loss is appended
    to that file as it comes (a long CPU run can be read while it goes)."""
    import lightning as L
    import torch

    from lightning_par.data import ByteCorpusDataModule
    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.strategies import DDPOverlapStrategy

    class Losses(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss.detach()))
            if progress:
                with open(progress, "a") as f:
                    f.write(f"{len(self.losses)} {self.losses[-1]:.5f} {time.perf_counter():.1f}\n")

    L.seed_everything(0, verbose=False)
    torch.manual_seed(0)
    config = GPTConfig.from_preset(preset)
    module = GPTLightningModule(config, learning_rate=1e-3, warmup_steps=20, max_steps=steps)
    data = ByteCorpusDataModule(block_size=config.block_size, batch_size=batch, val_batches=val_batches)
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=DDPOverlapStrategy(float8={"enabled": float8}),
        precision="bf16-mixed", max_steps=steps, limit_val_batches=val_batches, val_check_interval=None,
        check_val_every_n_epoch=None, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[losses],
    )
    start = time.perf_counter()
    trainer.fit(module, data)
    seconds = time.perf_counter() - start
    val = trainer.validate(module, data, verbose=False)[0]
    val_loss = next(v for k, v in val.items() if "loss" in k)
    return {"losses": losses.losses, "val_loss": float(val_loss), "seconds": seconds,
            "float8_layers": sum(type(m).__name__ == "Float8Linear" for m in module.modules())}


def _table(bf16: dict[str, Any], f8: dict[str, Any], steps: int, window: int, preset: str = "small") -> str:
    lines = [
        f"float8 vs bf16: GPT {preset}, {steps} steps, one process on the CPU, bf16-mixed; float8 (tensorwise) on "
        f"{f8['float8_layers']} linear layers. Training loss averaged over {window}-step windows, validation loss at "
        f"the end.",
        "",
        "| steps | bf16 loss | float8 loss | float8 / bf16 - 1 |",
        "|---|---|---|---|",
    ]
    for start in range(0, steps, window):
        a = bf16["losses"][start:start + window]
        b = f8["losses"][start:start + window]
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        lines.append(f"| {start + 1}-{start + len(a)} | {ma:.4f} | {mb:.4f} | {mb / ma - 1:+.2%} |")
    va, vb = bf16["val_loss"], f8["val_loss"]
    lines.append(f"| validation | {va:.4f} | {vb:.4f} | {vb / va - 1:+.2%} |")
    lines.append("")
    lines.append(f"Wall time: bf16 {bf16['seconds']:.0f} s, float8 {f8['seconds']:.0f} s (CPU: float8 products are "
                 f"not faster here).")
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    """Train bf16 and float8 and return the Markdown table (``quick``: 40 steps instead of 300)."""
    from lightning_par.float8 import float8_available

    if not float8_available():
        return "float8: not measured (torchao is not installed: pip install 'lightning_par[float8]')."
    cfg = _QUICK if quick else _FULL
    bf16 = train(False, cfg["steps"], cfg["batch"], cfg["val_batches"])
    f8 = train(True, cfg["steps"], cfg["batch"], cfg["val_batches"])
    return _table(bf16, f8, cfg["steps"], cfg["window"])


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 steps instead of 300")
    parser.add_argument("--one", choices=("bf16", "float8"), help="train only this one and write --json (to run the "
                        "two in parallel processes); --table A.json B.json prints the table of two such runs")
    parser.add_argument("--json", help="where --one writes its result")
    parser.add_argument("--progress", help="with --one: a file each step's loss is appended to")
    parser.add_argument("--table", nargs=2, metavar=("BF16_JSON", "FLOAT8_JSON"))
    parser.add_argument("--preset", default="small", help="GPT preset (lightning_par.models.GPT_PRESETS)")
    args = parser.parse_args()
    cfg = _QUICK if args.quick else _FULL
    if args.one:
        result = train(args.one == "float8", cfg["steps"], cfg["batch"], cfg["val_batches"], preset=args.preset,
                       progress=args.progress)
        with open(args.json, "w") as f:
            json.dump(result, f)
    elif args.table:
        runs = [json.load(open(p)) for p in args.table]
        print(_table(runs[0], runs[1], cfg["steps"], cfg["window"], args.preset))
    else:
        print(run(quick=args.quick))
