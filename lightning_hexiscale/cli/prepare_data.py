"""`hexiscale prepare-data INPUT... --tokenizer DIR_OR_tokenizer.json --out DATA.bin`: tokenise local
text or JSONL files with a Hugging Face tokenizer into a token file + JSON index for training
(``hexiscale train data.kind=bin data.path=DATA.bin``). See :mod:`lightning_hexiscale.data.tokenize`.
"""

from __future__ import annotations

import argparse

from lightning_hexiscale.cli.common import subcommand


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="local .txt (one document per file) or .jsonl "
                   "(one document per line) files")
    p.add_argument("--tokenizer", required=True, metavar="DIR_OR_JSON",
                   help="a tokenizer.json, or a Hugging Face model directory holding one")
    p.add_argument("--out", required=True, metavar="DATA.bin", help="token file to write (its index goes to DATA.json)")
    p.add_argument("--field", default=None, help="JSONL: the key holding each document's text (default: text)")
    p.add_argument("--format", dest="fmt", choices=["auto", "text", "jsonl"], default="auto",
                   help="input format (auto: .jsonl/.ndjson, and .json of one object per line, are JSONL; "
                   "anything else text)")
    p.add_argument("--eos", default=None, metavar="TOKEN",
                   help="end-of-document token (default: tokenizer_config.json's eos_token or a well-known name)")
    p.add_argument("--bos", action="store_true", help="also put the BOS token before every document")
    p.add_argument("--bos-token", default=None, metavar="TOKEN",
                   help="the BOS token, implies --bos (default: tokenizer_config.json's bos_token or a "
                   "well-known name)")
    p.add_argument("--chunk-size", default="16MiB", metavar="SIZE", help="bytes of input per tokenizer batch")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines (into a pipe or a log file)")


@subcommand("prepare-data", "tokenise local text/JSONL into a token file + index for training", _args,
            no_overrides="the tokenizer is --tokenizer DIR_OR_JSON, the output --out DATA.bin")
def cmd_prepare_data(args: argparse.Namespace) -> int:
    from lightning_hexiscale.cli.common import check_output_file
    from lightning_hexiscale.config.units import parse_bytes
    from lightning_hexiscale.data.tokenize import index_path, prepare

    for path in (args.out, index_path(args.out)):  # before tokenising, not at the final rename
        check_output_file("--out", str(path), "train.bin")
    index = prepare(args.inputs, args.tokenizer, args.out, field=args.field, fmt=args.fmt,
                    eos=args.eos, bos=args.bos or args.bos_token is not None, bos_token=args.bos_token,
                    chunk_bytes=int(parse_bytes(args.chunk_size, "--chunk-size", "16 MiB")), progress=not args.no_progress)
    docs = sum(s["documents"] for s in index["sources"])
    documents = f"{docs:,} document{'' if docs == 1 else 's'}"
    print(f"{index['num_tokens']:,} tokens ({documents}, {index['dtype']}, vocabulary {index['vocab_size']:,}) "
          f"-> {args.out}")
    return 0
