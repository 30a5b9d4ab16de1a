"""``python -m lightning_par.hf export CHECKPOINT OUTPUT_DIR``: a Hugging Face ``save_pretrained`` directory from a
lightning_par checkpoint of ``HFCausalLM`` (any strategy and layout), written one safetensors shard at a time; with
``--adapter`` a LoRA run's PEFT adapter directory, with ``--merged`` its model with the adapter merged."""

from __future__ import annotations

import argparse

from lightning_par.hf.export import DEFAULT_SHARD_BYTES, export_hf, export_lora


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write a save_pretrained directory from a checkpoint")
    export.add_argument("checkpoint", help="a checkpoint directory (*.ckpt) written by a lightning_par strategy")
    export.add_argument("output", help="the directory to write (must not exist or be empty)")
    export.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES,
                        help=f"largest safetensors shard in bytes (default {DEFAULT_SHARD_BYTES})")
    export.add_argument("--tokenizer", default=None,
                        help="a local tokenizer directory to copy into the output (e.g. the one of data.tokenizer)")
    lora = export.add_mutually_exclusive_group()
    lora.add_argument("--adapter", action="store_true",
                      help="a LoRA run: write its adapter as a PEFT directory (PeftModel.from_pretrained loads it)")
    lora.add_argument("--merged", action="store_true",
                      help="a LoRA run: write the model with the adapter merged (AutoModelForCausalLM loads it)")
    export.add_argument("--base", default=None,
                        help="with --adapter/--merged: the base's save_pretrained directory (default: the run's "
                             "model.pretrained)")
    args = parser.parse_args(argv)
    if args.adapter or args.merged:
        print(export_lora(args.checkpoint, args.output, merged=args.merged, base=args.base))
        return
    print(export_hf(args.checkpoint, args.output, max_shard_bytes=args.max_shard_bytes, tokenizer=args.tokenizer))


if __name__ == "__main__":
    main()
