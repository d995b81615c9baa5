"""The plan as a picture (``hexiscale plan --picture``, the recipe's ``plan.png``), readable on its own.

One row per pipeline (a data-parallel replica), labelled with its batch in words ("batch 17 = 17
micro-batches of 1"); one box per stage spanning its layers, coloured by GPU type, saying its
devices (machine and device ids), TP degree and layers; the bottleneck stage (the slowest stage of
the slowest pipeline, from the estimate) drawn with a thick red edge and marked; a legend of the GPU
types and a line saying how to read it.

A PNG also carries, in a text chunk (:data:`DESCRIPTION_KEY`), the JSON of what it shows: the title,
every label, the plan and the bottleneck. Comparing that description tells whether a picture in the
docs is the one the code draws now without comparing pixels, which differ with the matplotlib
version and its fonts (:func:`read_description`; ``tests/docs`` uses it for ``docs/demo_plan.png``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_hexiscale.errors import ConfigError

DESCRIPTION_KEY = "hexiscale-picture"
"""PNG text chunk holding the JSON description of the picture."""

HOW_TO_READ = ("row = a pipeline (data-parallel replica); box = a stage: its devices (machine: ids), TP degree "
               "and layers; red edge = the bottleneck stage")


def plan_title(model_name: str, cluster_name: str, estimate) -> str:
    """The picture's title, the same for ``hexiscale plan --picture`` and the recipe's ``plan.png``:
    ``"<model> on <cluster>: <s>/iteration (estimated), <FLOP/s>"`` (``estimate``: the plan's
    :class:`~lightning_hexiscale.planner.cost.estimate.Estimate`)."""
    from lightning_hexiscale.config.units import format_flops, format_seconds

    return (f"{model_name} on {cluster_name}: {format_seconds(estimate.iteration_time_s)}/iteration (estimated), "
            f"{format_flops(estimate.pflops * 1e15)}")


def id_ranges(ids: list[int]) -> str:
    """Device ids compactly: [0, 1, 2, 3, 6] -> "0-3,6"."""
    ids = sorted(ids)
    parts, start = [], None
    for i, d in enumerate(ids):
        start = d if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != d + 1:
            parts.append(f"{start}" if start == d else f"{start}-{d}")
            start = None
    return ",".join(parts)


def stage_devices(cluster, devices) -> str:
    """"small: devices 2-3" (one machine) or "a: devices 0-3 + b: device 8" (a stage across machines)."""
    by_machine: dict[int, list[int]] = {}
    for d in devices:
        by_machine.setdefault(cluster.devices[d].machine, []).append(d)
    return " + ".join(f"{cluster.machines[m].name}: device{'s' if len(ids) > 1 else ''} {id_ranges(ids)}"
                      for m, ids in by_machine.items())


def batch_words(batch: int, micro_batch: int) -> str:
    n = batch // micro_batch
    return f"batch {batch} = {n} micro-batch{'es' if n != 1 else ''} of {micro_batch}"


def bottleneck(estimate) -> tuple[int, int] | None:
    """(pipeline, stage) of the slowest stage of the slowest pipeline, or None without an estimate."""
    if estimate is None or not estimate.pipelines:
        return None
    i = estimate.bottleneck_pipeline
    stages = estimate.pipelines[i].stages
    return i, max(range(len(stages)), key=lambda j: stages[j].time_per_micro_batch_s)


def describe(plan, cluster, estimate=None, title: str = "") -> dict[str, Any]:
    """What the picture shows (its labels, the plan, the bottleneck), also written into a PNG."""
    rows = [f"pipeline {i}: {batch_words(p.batch_size, p.micro_batch_size)}" for i, p in enumerate(plan.pipelines)]
    boxes = [[_box_label(cluster, st) for st in p.stages] for p in plan.pipelines]
    return {"title": title, "rows": rows, "boxes": boxes, "how_to_read": HOW_TO_READ,
            "bottleneck": list(bottleneck(estimate) or []), "plan": plan.to_dict()}


def _box_label(cluster, st) -> str:
    kinds: dict[str, int] = {}
    for d in st.devices:
        kinds[cluster.devices[d].gpu_type] = kinds.get(cluster.devices[d].gpu_type, 0) + 1
    a, b = st.layers
    layers = f"layer {a}" if b - a == 1 else f"layers {a}-{b - 1}"
    return (f"{stage_devices(cluster, st.devices)}\n{'+'.join(f'{n}x{t}' for t, n in kinds.items())}, TP {st.tp}\n"
            f"{layers}")


def check_picture_path(path: str | Path) -> Path:
    """``path`` ends in .png or .svg (the format is chosen by the extension)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ConfigError("--picture", str(path), "the picture is PNG or SVG, chosen by the extension",
                          "use a path ending in .png or .svg")
    return path


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
"""The first 8 bytes of every PNG file (the PNG specification, section 5.2)."""


def picture_kind(path: str | Path) -> str | None:
    """What the regular file at ``path`` holds, by its first bytes: ``"png"`` (the PNG signature),
    ``"svg"`` (XML text whose first 4 KiB open an ``<svg`` element: matplotlib writes the XML
    declaration and a DOCTYPE first), ``"empty"``, or None (anything else, or unreadable)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if not head.strip():
        return "empty"
    if head.startswith(PNG_SIGNATURE):
        return "png"
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
    return "svg" if text.startswith("<") and "<svg" in text else None


def check_replaced_picture(path: str | Path, flag: str = "--picture") -> None:
    """An existing file that ``flag PATH`` would replace must be a picture of the format written there
    (PNG or SVG by the extension, told by its first bytes: :func:`picture_kind`) or empty: ``hexiscale plan
    --picture notes.png`` replaced whatever the file held without a word. A picture is replaced, so that
    re-running a command over its own earlier picture works."""
    path = Path(path)
    if not path.is_file():
        return
    wanted = path.suffix.lower()[1:]
    found = picture_kind(path)
    if found in (wanted, "empty"):
        return
    a = {"png": "a PNG", "svg": "an SVG"}
    why = {"png": "it does not start with the PNG signature", "svg": "it is no XML text with an <svg> element"}
    what = (f"is {a[found]} picture, not {a[wanted]} one" if found is not None
            else f"is not {a[wanted]} picture ({why[wanted]})")
    raise ConfigError(flag, str(path), f"exists and {what}; drawing the plan there would replace what it holds",
                      f"give a new path, or the path of {a[wanted]} picture to replace (delete this file first if "
                      "it is meant to go)")


def draw_plan(plan, cluster, path: str | Path, title: str = "", estimate=None) -> None:
    """Draw ``plan`` (see the module doc) to ``path``, PNG or SVG by the extension; ``estimate``
    (the plan's :class:`~lightning_hexiscale.planner.cost.estimate.Estimate`) marks the bottleneck stage."""
    path = check_picture_path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise ConfigError("--picture", str(path), "drawing needs matplotlib, which is not installed",
                          "pip install 'lightning-hexiscale[plot]' or leave out --picture") from None
    p, d = plan.num_pipelines, plan.world_size
    doc = describe(plan, cluster, estimate, title or f"plan: {p} pipeline{'s' * (p != 1)}, {d} device{'s' * (d != 1)}")
    types = sorted({cluster.devices[d].gpu_type for p in plan.pipelines for d in p.devices})
    palette = plt.get_cmap("tab10")
    colour = {t: palette(i % 10) for i, t in enumerate(types)}
    P, L = plan.num_pipelines, plan.num_layers
    fig, ax = plt.subplots(figsize=(max(9.0, L * 0.25), 1.1 * P + 1.6))
    worst = tuple(doc["bottleneck"]) if doc["bottleneck"] else None
    for i, pipe in enumerate(plan.pipelines):
        y = P - 1 - i
        for j, st in enumerate(pipe.stages):
            main = max(types, key=lambda t: sum(cluster.devices[d].gpu_type == t for d in st.devices))
            a, b = st.layers
            hot = worst == (i, j)
            ax.add_patch(Rectangle((a, y + 0.08), b - a, 0.84, facecolor=colour[main], alpha=0.85,
                                   edgecolor="red" if hot else "black", linewidth=3.0 if hot else 1.0))
            # narrow boxes get fewer lines (or none) so that neighbours do not overprint; the full
            # label is in the PNG's description either way
            width = (b - a) / L * fig.get_figwidth() * 72  # points
            label = (doc["boxes"][i][j] if width >= 90 else f"{id_ranges(list(st.devices))}\nTP {st.tp}" if width >= 50
                     else f"TP {st.tp}" if width >= 24 else "")
            if hot and width >= 90:
                label += "\nbottleneck"
            ax.text((a + b) / 2, y + 0.5, label, ha="center", va="center", fontsize=7, clip_on=True)
    ax.set_xlim(0, L)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layer boundaries
    ax.set_ylim(0, P)
    ax.set_yticks([P - 1 - i + 0.5 for i in range(P)], [r.replace(": ", ":\n", 1) for r in doc["rows"]], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.set_xlabel(f"transformer layer\n{HOW_TO_READ}", fontsize=8)
    ax.set_title(doc["title"], fontsize=10)
    ax.legend(handles=[Patch(color=colour[t], label=t) for t in types], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    metadata = {DESCRIPTION_KEY: json.dumps(doc, sort_keys=True)} if path.suffix.lower() == ".png" else None
    fig.savefig(path, format=path.suffix.lower()[1:], metadata=metadata)
    plt.close(fig)


def read_description(path: str | Path) -> dict[str, Any] | None:
    """The description a PNG drawn by :func:`draw_plan` carries (None if it has none)."""
    from PIL import Image

    with Image.open(path) as img:
        text = img.info.get(DESCRIPTION_KEY)
    return json.loads(text) if text else None
