"""`hexiscale export CKPT --hf OUT [--tokenizer DIR]`: a checkpoint of any plan -> a Hugging Face Llama
directory (config.json, sharded *.safetensors, tokenizer files) that
``transformers.LlamaForCausalLM.from_pretrained(OUT)`` loads.

Built on :func:`lightning_hexiscale.runtime.checkpoint.load_llama` (the full, plan-independent
model of a checkpoint by global name); the writing is :func:`lightning_hexiscale.data.hf_export.save_hf`.
"""

from __future__ import annotations

import argparse

from lightning_hexiscale.cli.common import check_outside_checkpoint, refuse_empty_path, subcommand


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT", help="a checkpoint directory saved by the hexiscale strategy")
    p.add_argument("--hf", required=True, metavar="OUT", help="output directory (new or empty; see --overwrite)")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="copy tokenizer.json / tokenizer_config.json / ... from this directory (e.g. the HF model "
                        "directory you fine-tuned from); bos/eos ids are taken from its config.json")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="tensor dtype in the files (default: as in the checkpoint)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest *.safetensors file, with a unit (default 5GB, as transformers)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT if it holds a previous export (only config.json, *.safetensors, the index and "
                        "tokenizer files; anything else is refused)")


@subcommand("export", "export a checkpoint as a Hugging Face Llama directory (safetensors)", _export_args,
            no_overrides="the model and its shape come from the checkpoint: `hexiscale export CKPT --hf OUT`")
def cmd_export(args: argparse.Namespace) -> int:
    from lightning_hexiscale.config.units import parse_bytes
    from lightning_hexiscale.data.hf_export import check_export_target, check_tokenizer_dir, save_hf
    from lightning_hexiscale.runtime.checkpoint import load_llama

    refuse_empty_path("CKPT", args.checkpoint, "the checkpoint directory",
                      "hexiscale export run/checkpoints/last.ckpt --hf OUT")
    refuse_empty_path("--hf", args.hf, "the directory to write", "--hf /models/tuned")
    refuse_empty_path("--tokenizer", args.tokenizer, "the Hugging Face directory of the tokenizer",
                      "--tokenizer /models/Llama-3.2-1B")
    max_bytes = int(parse_bytes(args.max_shard_size, "--max-shard-size", "5 GB"))
    check_export_target(args.hf, args.overwrite)  # before reading a checkpoint that may take minutes
    check_outside_checkpoint("--hf", args.hf, args.checkpoint, "hf")
    check_tokenizer_dir(args.tokenizer)
    model = load_llama(args.checkpoint)
    out = save_hf(model.state_dict(), model.config, args.hf, dtype=args.dtype, max_shard_bytes=max_bytes,
                  tokenizer_dir=args.tokenizer, overwrite=args.overwrite)
    n = sum(p.numel() for p in model.parameters())
    print(f"exported {model.config.name} ({n / 1e6:.1f} M parameters) to {out}")
    return 0
