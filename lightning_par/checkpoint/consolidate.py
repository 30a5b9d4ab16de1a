"""``python -m lightning_par.checkpoint.consolidate CHECKPOINT_DIR OUTPUT_FILE``: a single-file Lightning checkpoint
(for ``LightningModule.load_from_checkpoint``) from a sharded lightning_par one."""

from __future__ import annotations

import argparse

from lightning_par.checkpoint.sharded import consolidate_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("checkpoint", help="a sharded checkpoint directory written by a lightning_par strategy")
    parser.add_argument("output", help="the single-file checkpoint to write")
    args = parser.parse_args(argv)
    print(consolidate_checkpoint(args.checkpoint, args.output))


if __name__ == "__main__":
    main()
