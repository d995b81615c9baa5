"""``cluster=`` / ``model=`` values that name no preset but something in the working directory (a
directory, a file without a .yaml ending, a Hugging Face model directory) or nothing at all (an
unset shell variable) say so, with the fix: they were Hydra's "Could not find 'cluster/adir'" and the
preset list, as for a misspelt preset."""

from __future__ import annotations

import pytest

from lightning_hexiscale.config import compose
from lightning_hexiscale.errors import ConfigError


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "noext").write_text("name: x\n")
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("override, message", [
    ("cluster=adir", r"cluster = 'adir': names no preset; it is a directory here, not a YAML file\. Fix: name the "
                     r"\.yaml file inside it, e\.g\. cluster=adir/cluster\.yaml, or a preset: case_study"),
    ("cluster=noext", r"cluster = 'noext': names no preset; it is a file here, but a cluster file is read only when "
                      r"its name ends in \.yaml or \.yml\. Fix: rename it to noext\.yaml and pass cluster=noext\.yaml"),
    ("model=noext", r"model = 'noext': names no preset; it is a file here, but a model file is read only"),
    ("cluster=", r"cluster = '': is empty: it takes a preset name or a \.yaml file\. Fix: name one, e\.g\. "
                 r"cluster=path/to/cluster\.yaml, or a preset: case_study"),
    ("model=hfdir", r"model = 'hfdir': names no preset; it is a directory here, not a YAML file \(it holds a Hugging "
                    r"Face config\.json\)\. Fix: read it as one: model=hf:hfdir"),
    ("model=./hfdir", r"model = '\./hfdir': a directory, not a YAML file \(it holds a Hugging Face config\.json\)\. "
                      r"Fix: read it as one: model=hf:\./hfdir"),
])
def test_a_group_value_that_is_a_path_here_says_what_it_is(here, override, message):
    with pytest.raises(ConfigError, match="^" + message):
        compose([override])


def test_presets_and_a_misspelt_name_are_as_before(here):
    (here / "cpu2").mkdir()  # a preset's name wins over a directory of that name
    assert compose(["cluster=cpu2"]).cluster.name == "cpu2"
    with pytest.raises(ConfigError, match=r"cluster = 'cpu3': .*Could not find 'cluster/cpu3'.*did you mean cluster=cpu2"):
        compose(["cluster=cpu3"])
