"""The examples each `hexiscale COMMAND --help` shows (``train`` and ``emulate`` write their own).

In one table rather than beside each command's options so that `hexiscale --help` stays the only
place that imports every command; ``tests/test_cli_help_examples.py`` parses every line with the
command's own parser, so an example cannot outlive an option it uses.
"""

from __future__ import annotations

EXAMPLES: dict[str, tuple[str, ...]] = {
    "plan": (
        "hexiscale plan cluster=case_study model=llama2_7b train.global_batch=24 --baselines",
        "hexiscale plan cluster=cpu_hetero4 model=llama_demo --out plan.yaml --picture plan.png",
        "hexiscale plan -m cluster=hetero1,hetero2 model=llama2_7b,llama2_13b   # a sweep, one table",
    ),
    "estimate": (
        "hexiscale estimate --plan conf/plans/hetero3_llama30b_tab7.yaml",
        "hexiscale estimate --plan plan.yaml train.dp_sharding=zero3 --json   # cluster, model from the plan's meta",
    ),
    "list": ("hexiscale list",),
    "cluster": ("hexiscale cluster cluster=hetero3", "hexiscale cluster cluster=outputs/cpu2.yaml"),
    "profile": (
        "hexiscale profile --local 2 --out outputs/cpu2.yaml   # 2 forked CPU ranks",
        "hexiscale profile --local 2 --model llama_tiny --out outputs/cpu2.yaml   # + layer times",
    ),
    "discover": ("hexiscale discover --local 4 --model llama_tiny --out outputs/disc.yaml",),
    "calibrate": ("hexiscale calibrate --local 2 cluster=outputs/cpu2.yaml model=llama_tiny",),
    "check-estimate": (
        "hexiscale check-estimate --local 2 --plan plan.yaml cluster=outputs/cpu2.yaml model=llama_tiny",
    ),
    "prepare-data": (
        "hexiscale prepare-data corpus/*.jsonl --tokenizer /models/Llama-3.2-1B --out data/train.bin",
        "hexiscale prepare-data book.txt --tokenizer tokenizer.json --out data/book.bin --bos",
    ),
    "export": (
        "hexiscale export run/checkpoints/last.ckpt --hf /models/tuned --tokenizer /models/Llama-3.2-1B "
        "--dtype bfloat16",
    ),
    "checkpoint": (
        "hexiscale checkpoint info run/checkpoints/last.ckpt",
        "hexiscale checkpoint consolidate run/checkpoints/last.ckpt llama.pt   # torch.load-able state dict",
    ),
    "rendezvous-store": ("hexiscale rendezvous-store --port 29400 &   # then torchrun --rdzv-endpoint=HOST:29400 ...",),
}


def examples_text(command: str) -> str | None:
    """The ``examples:`` block of a command's --help, or None when it has none."""
    lines = EXAMPLES.get(command)
    return "examples:\n" + "\n".join(f"  {line}" for line in lines) if lines else None
