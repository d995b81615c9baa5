"""An empty output path is a ConfigError naming its flag, before the work that fills it:
`hexiscale plan --out ''` searched and wrote nothing, silently (and --picture '' the same)."""

import pytest

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.config.recipe import check_output_file
from lightning_hexiscale.errors import ConfigError


@pytest.mark.parametrize("flag", ["--out", "--picture"])
def test_hexiscale_plan_refuses_an_empty_output_path(flag, capsys, searches):
    assert main(["plan", "cluster=cpu_hetero4", "model=llama_tiny", "planner.iterations=1", flag, ""]) == 2
    captured = capsys.readouterr()
    assert f"{flag} = '': is empty" in captured.err and "Fix:" in captured.err
    assert not searches  # before the search


@pytest.mark.parametrize("path", ["", "   "])
def test_check_output_file_refuses_an_empty_path(path):
    with pytest.raises(ConfigError, match="is empty"):
        check_output_file("--out", path, "cluster.yaml")


@pytest.mark.parametrize("flag", ["--out", "--picture"])
@pytest.mark.parametrize("path", ["", "plan.yaml"])
def test_a_sweep_refuses_out_and_picture_even_when_empty(flag, path, tmp_path, capsys):
    """`hexiscale plan -m ... --out ''` swept and ignored the flag silently, where a single run refuses
    `--out ''`; a sweep refuses either flag, empty or not, before its first run."""
    assert main(["plan", "-m", "cluster=cpu2", "model=llama_tiny", "train.global_batch=8", "planner.iterations=1",
                 "--sweep-dir", str(tmp_path / "sweep"), flag, path]) == 2
    err = capsys.readouterr().err
    assert f"{flag} = {path!r}: a sweep (-m) writes one plan file per run into its sweep directory" in err
    assert "Fix:" in err and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("where,fragment", [("", "--sweep-dir = '': is empty"),
                                            ("a_file", "is a file, not a directory"),
                                            ("a_file/below", "lies below")])
def test_a_sweep_checks_its_folder_first(where, fragment, tmp_path, capsys):
    """--sweep-dir '' swept into the default outputs/plan-sweep-* folder silently, and a file was
    mkdir's FileExistsError traceback; both are refused before the first run."""
    (tmp_path / "a_file").write_text("")
    path = str(tmp_path / where) if where else ""
    assert main(["plan", "-m", "cluster=cpu2", "model=llama_tiny", "train.global_batch=8", "planner.iterations=1",
                 "--sweep-dir", path]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Fix:" in err and "Traceback" not in err


def test_a_single_plan_refuses_a_sweep_dir(tmp_path, capsys, searches):
    """--sweep-dir without -m was ignored silently (one plan searched, nothing written there), as a
    sweep's --out was; a single run refuses it before the search."""
    assert main(["plan", "cluster=cpu2", "model=llama_tiny", "train.global_batch=8", "planner.iterations=1",
                 "--sweep-dir", str(tmp_path / "sweep")]) == 2
    captured = capsys.readouterr()
    assert "--sweep-dir = " in captured.err and "names the folder of a sweep (-m)" in captured.err
    assert "Fix:" in captured.err and not searches


@pytest.mark.parametrize("argv,flag", [
    (["checkpoint", "info", ""], "CKPT"),
    (["checkpoint", "consolidate", "", "{tmp}/llama.pt"], "CKPT"),
    (["checkpoint", "consolidate", "{tmp}/last.ckpt", ""], "OUT.pt"),
    (["export", "", "--hf", "{tmp}/hf"], "CKPT"),
    (["export", "{tmp}/last.ckpt", "--hf", ""], "--hf"),
    (["export", "{tmp}/last.ckpt", "--hf", "{tmp}/hf", "--tokenizer", ""], "--tokenizer"),
])
def test_checkpoint_and_export_refuse_an_empty_path(argv, flag, tmp_path, monkeypatch, capsys):
    """An empty path (an unset shell variable) was read as the working directory: an empty CKPT made
    every output "inside the checkpoint ''" (the message named OUT.pt or --hf), and an empty OUT.pt,
    --hf or --tokenizer was named '.' or the working directory's path. Now the empty one is named."""
    (tmp_path / "last.ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {flag} = '': is empty; it names" in err and "Fix: give the path" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
