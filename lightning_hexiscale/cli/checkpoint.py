"""`hexiscale checkpoint`: look into a sharded checkpoint, or convert it to one full state dict.

    hexiscale checkpoint info outputs/.../checkpoints/last.ckpt
    hexiscale checkpoint consolidate outputs/.../checkpoints/last.ckpt llama.pt

``consolidate`` writes the plain single-device Llama's state dict (global parameter names, full
tensors, the training dtype) with ``torch.save``, whatever plan, TP layout or ``dp_sharding`` saved
the checkpoint: ``Llama(config).load_state_dict(torch.load("llama.pt"))``. It runs in one process
and holds the whole model (not the optimizer state) in memory once.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_hexiscale.cli.common import check_output_file, check_outside_checkpoint, refuse_empty_path, subcommand
from lightning_hexiscale.errors import ConfigError

ACTIONS = ("info", "consolidate")


def _action(word: str) -> str:
    """The first argument: info or consolidate. A checkpoint path there (``hexiscale checkpoint
    outputs/.../last.ckpt``) was argparse's "invalid choice: 'outputs/...'" with no hint."""
    if word in ACTIONS:
        return word
    if Path(word).exists() or "/" in word or word.endswith(".ckpt"):
        # "is a path", not "is a checkpoint": it may not exist (the corrected command's CKPT check says so)
        raise argparse.ArgumentTypeError(f"{word!r} is a path, and the first argument says what to do with the "
                                         f"checkpoint: info or consolidate. Fix: run `hexiscale checkpoint info "
                                         f"{word}` (or `hexiscale checkpoint consolidate {word} OUT.pt`)")
    from lightning_hexiscale.config.suggest import closest

    near = closest(word, list(ACTIONS))
    raise argparse.ArgumentTypeError(f"{word!r} is no action: the first argument is info or consolidate. Fix: "
                                     + (f"did you mean {near[0]}?" if near else "run e.g. `hexiscale checkpoint info CKPT`"))


def _args(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", type=_action, metavar="{info,consolidate}",
                   help="info: what the checkpoint holds; consolidate: write one full state dict of the model")
    p.add_argument("ckpt", metavar="CKPT", help="a checkpoint directory saved by strategy='hexiscale'")
    p.add_argument("out", metavar="OUT.pt", nargs="?", help="consolidate: the torch.save file to write")
    p.add_argument("--force", action="store_true", help="consolidate: overwrite OUT.pt if it exists")


@subcommand("checkpoint", "inspect a sharded checkpoint or consolidate it into one full state dict (OUT.pt)", _args,
            no_overrides="run e.g. `hexiscale checkpoint consolidate CKPT OUT.pt`")
def cmd_checkpoint(args: argparse.Namespace) -> int:
    from lightning_hexiscale.runtime import checkpoint as ckpt

    refuse_empty_path("CKPT", args.ckpt, "the checkpoint directory",
                      f"hexiscale checkpoint {args.action} run/checkpoints/last.ckpt{' llama.pt' if args.out else ''}")
    refuse_empty_path("OUT.pt", args.out, "the file to write", f"hexiscale checkpoint consolidate {args.ckpt} llama.pt")
    if args.action == "info" and args.out is not None:  # argparse's optional OUT.pt swallows an override too
        raise ConfigError("OUT.pt", args.out, "hexiscale checkpoint info writes nothing and takes no overrides",
                          "run `hexiscale checkpoint info CKPT`, or `consolidate CKPT OUT.pt` to write a file")
    if args.action == "info" and args.force:  # was ignored: info writes nothing for it to overwrite
        raise ConfigError("--force", "with info", "lets consolidate overwrite OUT.pt; hexiscale checkpoint info writes "
                          "nothing, so alone it changes nothing", "drop --force, or run `hexiscale checkpoint "
                          "consolidate CKPT OUT.pt --force`")
    if args.action == "info":
        meta = ckpt.read_meta(args.ckpt)
        tensors, nbytes = ckpt.stored_tensors(args.ckpt)  # before any line: a damaged index is the one message
        info = meta["hexiscale"]
        plan = info.get("plan") or {}
        print(f"checkpoint   {args.ckpt}")
        print(f"format       {info['format']}")
        print(f"model        {info['model'].get('name')} ({info['model'].get('num_layers')} layers, hidden "
              f"{info['model'].get('hidden_size')})")
        print(f"step         {meta.get('global_step')} (epoch {meta.get('epoch')})")
        print(f"saved under  {info.get('world_size', '?')} ranks, {len(plan.get('pipelines', []))} pipeline(s), "
              f"dp_sharding={plan.get('dp_sharding', '?')}")
        opt = info.get("optimizer")
        print(f"optimizer    {opt['class'] if opt else 'none (weights only)'}")
        print(f"tensors      {tensors} ({nbytes / 1e6:.1f} MB)")
        return 0
    if args.out is None:
        raise ConfigError("hexiscale checkpoint consolidate", args.ckpt, "needs the output file",
                          "run `hexiscale checkpoint consolidate CKPT OUT.pt`")
    out = Path(args.out)
    if out.is_dir():
        raise ConfigError("OUT.pt", str(out), "is a directory", "give a file path such as llama.pt")
    if out.suffix == ".safetensors":  # a pickle under that name: safetensors then fails on its "header"
        raise ConfigError("OUT.pt", str(out), "consolidate writes a torch.save pickle, not a safetensors file",
                          f"name it {out.stem if out.stem.endswith('.pt') else out.stem + '.pt'}, or write "
                          f"safetensors with `hexiscale export {args.ckpt} --hf DIR` (a Hugging Face Llama directory)")
    if out.exists() and not args.force:
        raise ConfigError("OUT.pt", str(out), "exists", "choose another path or pass --force")
    check_output_file("OUT.pt", str(out), "llama.pt")  # a folder below a file, or one we cannot write in
    check_outside_checkpoint("OUT.pt", str(out), args.ckpt, "llama.pt")
    summary = ckpt.consolidate(args.ckpt, out)
    print(f"wrote {out}: {summary['tensors']} tensors, {summary['bytes'] / 1e6:.1f} MB, model {summary['model']}, "
          f"step {summary['global_step']}")
    return 0
