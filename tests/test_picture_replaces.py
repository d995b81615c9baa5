"""`hexiscale plan --picture PATH` replaced whatever PATH held without a word (``echo precious >
keep.png``: "picture written to keep.png", the notes gone), where ``--out`` refuses a file that is no
plan. Refused before the search unless the file is a picture of the format written (PNG or SVG by the
extension, told by its first bytes) or empty; re-running over its own earlier picture still works."""

from __future__ import annotations

import pytest

from lightning_hexiscale.cli.main import main

ARGV = ["plan", "cluster=cpu_hetero4", "model=llama_tiny", "planner.iterations=1", "planner.progress=false"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SVG = b'<?xml version="1.0" encoding="utf-8" standalone="no"?>\n<svg xmlns="http://www.w3.org/2000/svg"></svg>\n'

REFUSED = {  # name -> (what is there, what the refusal says of it)
    "notes.png": (b"precious\n", "exists and is not a PNG picture"),
    "notes.svg": (b"precious\n", "exists and is not an SVG picture"),
    "plan.png": (b"pipelines: []\n", "exists and is not a PNG picture"),
    "svg_under_png.png": (SVG, "exists and is an SVG picture, not a PNG one"),
    "png_under_svg.svg": (PNG_SIGNATURE + b"\0" * 64, "exists and is a PNG picture, not an SVG one"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_file_that_is_no_such_picture_is_kept(name, tmp_path, capsys, searches):
    content, rule = REFUSED[name]
    path = tmp_path / name
    path.write_bytes(content)
    assert main([*ARGV, "--picture", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--picture = '{path}': {rule}" in err and "Fix: give a new path" in err and "Traceback" not in err
    assert not searches  # before the search
    assert path.read_bytes() == content


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_its_own_picture_and_an_empty_file_are_replaced(ext, tmp_path, capsys):
    pic, empty = tmp_path / f"plan.{ext}", tmp_path / f"empty.{ext}"
    empty.write_bytes(b"")
    for path in (pic, pic, empty):  # the second run replaces the first run's picture
        assert main([*ARGV, "--picture", str(path)]) == 0, capsys.readouterr().err
        assert f"picture written to {path}" in capsys.readouterr().out
    assert pic.read_bytes().startswith(PNG_SIGNATURE) == (ext == "png") and empty.stat().st_size > 1000
