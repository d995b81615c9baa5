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


HUB_ID_CASES = [
    # a hub id: nothing is downloaded; the fix downloads it once and reads the folder, or names a preset of its shape
    ("model=meta-llama/Llama-3.2-1B", r"model = 'meta-llama/Llama-3\.2-1B': names nothing here; it looks like a "
                                      r"Hugging Face model id, and nothing is downloaded\. Fix: download it once "
                                      r"\(huggingface-cli download meta-llama/Llama-3\.2-1B --local-dir DIR\), then "
                                      r"model=hf:DIR; or, for a model of its shape with fresh weights, the preset "
                                      r"model=llama3_2_1b$"),
    ("model=meta-llama/Meta-Llama-3-8B", r".*the preset model=llama3_8b$"),
    ("model=TinyLlama/TinyLlama-1.1B-Chat-v1.0", r".*--local-dir DIR\), then model=hf:DIR$"),  # no preset alike
    # a path: its whole name is matched (was the text before its first dot: 'Llama-3' -> llama_30b)
    ("model=./models/Llama-3.2-1B", r"model = '\./models/Llama-3\.2-1B': no such file .*Fix: check the path, or use "
                                    r"the preset llama3_2_1b \(model=llama3_2_1b\)$"),
]


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
    *HUB_ID_CASES,
])
def test_a_group_value_that_is_a_path_here_says_what_it_is(here, override, message):
    # also a Hugging Face hub id (HUB_ID_CASES): nothing is downloaded, and the fix says how to get it
    with pytest.raises(ConfigError, match="^" + message):
        compose([override])


def test_presets_and_a_misspelt_name_are_as_before(here):
    (here / "cpu2").mkdir()  # a preset's name wins over a directory of that name
    assert compose(["cluster=cpu2"]).cluster.name == "cpu2"
    with pytest.raises(ConfigError, match=r"cluster = 'cpu3': .*Could not find 'cluster/cpu3'.*did you mean cluster=cpu2"):
        compose(["cluster=cpu3"])


def test_the_api_answers_a_hugging_face_model_id_in_its_own_words(here):
    from lightning_hexiscale import LlamaLitModule
    from lightning_hexiscale.models.config import LlamaConfig

    with pytest.raises(ConfigError, match=r"^LlamaLitModule\(config\) = 'meta-llama/Llama-3\.2-1B': names nothing "
                                          r"here; it looks like a Hugging Face model id.*then "
                                          r"LlamaLitModule\(config='hf:DIR'\); "
                                          r".*LlamaLitModule\(config='llama3_2_1b'\)$"):
        LlamaLitModule("meta-llama/Llama-3.2-1B")
    with pytest.raises(ConfigError, match=r"^model = 'meta-llama/Llama-3\.2-1B': .*then 'hf:DIR'; .*'llama3_2_1b'$"):
        LlamaConfig.load("meta-llama/Llama-3.2-1B")
    (here / "meta-llama").mkdir()  # a folder of that name here: no longer read as an id
    with pytest.raises(ConfigError, match=r"no such preset or file"):
        LlamaConfig.load("meta-llama/Llama-3.2-1B")
