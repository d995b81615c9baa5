"""What the `hexiscale` commands outside `train` promise their user:

- a command that reads no configuration refuses KEY=VALUE overrides instead of ignoring them, and
  its --help does not offer them (`hexiscale export CKPT --hf OUT model=llama_tiny` exported with
  the checkpoint's own model and said nothing about the override);
- every `hexiscale COMMAND --help` shows examples, and each one parses with the command's own
  parser (so the help cannot go stale);
- the files a command writes are checked before its work: a path it cannot write is a one-line
  ConfigError naming the option, never a traceback from the last rename (prepare-data --out onto a
  directory or below a file, checkpoint consolidate and export below a file).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from lightning_hexiscale.cli import common
from lightning_hexiscale.cli.main import build_parser, main

sys.path.insert(0, str(Path(__file__).parent / "data"))
from test_prepare_data import make_tokenizer  # noqa: E402

PARSER = build_parser()
COMMANDS = next(a for a in PARSER._subparsers._group_actions).choices


# ---- overrides ----------------------------------------------------------------------------------
NO_CONFIG = {  # command -> arguments that parse (the command itself is replaced below and must not run)
    "export": ["ckpt", "--hf", "out"],
    "prepare-data": ["a.txt", "--tokenizer", "tok.json", "--out", "a.bin"],
    "profile": ["--local", "2"],
    "discover": ["--local", "2", "--model", "llama_tiny"],
    "rendezvous-store": [],
    "checkpoint": ["consolidate", "ckpt", "out.pt"],
    "list": [],
    "emulate": ["emu_4to1", "--cores", "1"],
}


@pytest.mark.parametrize("command", list(NO_CONFIG))
def test_overrides_are_refused_before_the_command_runs(command, monkeypatch, capsys):
    ran = []
    help_, configure, _fn = common.SUBCOMMANDS[command]
    monkeypatch.setitem(common.SUBCOMMANDS, command, (help_, configure, lambda args: ran.append(args) or 0))
    assert main([command, *NO_CONFIG[command], "model=llama_tiny"]) == 2
    err = capsys.readouterr().err
    assert f"hexiscale {command} = 'model=llama_tiny': takes no overrides" in err and "Fix: drop them" in err
    assert not ran


@pytest.mark.parametrize("command", list(NO_CONFIG))
def test_help_offers_no_overrides_to_a_command_that_reads_none(command):
    sub = COMMANDS[command]
    text = sub.format_help()
    assert "KEY=VALUE" not in text and "Hydra" not in text


def test_a_command_that_composes_the_config_still_offers_them():
    sub = COMMANDS["estimate"]
    assert "KEY=VALUE" in sub.format_help() and "cluster=NAME" in sub.format_help()


def test_checkpoint_info_refuses_an_output_file(tmp_path, capsys):
    """`checkpoint info CKPT X` took X as OUT.pt and ignored it (so `info CKPT model=...` said nothing)."""
    assert main(["checkpoint", "info", str(tmp_path / "ckpt"), "model=llama_tiny"]) == 2
    err = capsys.readouterr().err
    assert "OUT.pt = 'model=llama_tiny'" in err and "info writes nothing" in err


@pytest.mark.parametrize("argv,fix", [
    (["checkpoint", "{d}"], "Fix: run `hexiscale checkpoint info {d}`"),
    (["checkpoint", "runs/last.ckpt"], "'runs/last.ckpt' is a path, and the first argument says what to do with the "
                                       "checkpoint: info or consolidate. Fix: run `hexiscale checkpoint info runs/last.ckpt`"),
    (["checkpoint", "inf", "{d}"], "'inf' is no action: the first argument is info or consolidate. Fix: did you mean info?"),
    (["checkpoint", "consolidat", "{d}", "x.pt"], "Fix: did you mean consolidate?"),
])
def test_checkpoint_without_its_action_says_which_and_how(tmp_path, argv, fix, capsys):
    """`hexiscale checkpoint CKPT` was argparse's "invalid choice: 'CKPT' (choose from 'info', 'consolidate')"."""
    with pytest.raises(SystemExit) as stop:
        main([a.format(d=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and fix.format(d=tmp_path) in err and "invalid choice" not in err, err


# ---- examples in --help ---------------------------------------------------------------------------
def examples(command: str) -> list[str]:
    text = COMMANDS[command].format_help()
    head = "examples:" if "examples:" in text else "example:"
    assert head in text, f"`hexiscale {command} --help` shows no example"
    block = text.split(head, 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip().startswith(("hexiscale", "sudo hexiscale"))]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "train"])  # train: Hydra's own help, tested apart
def test_help_shows_examples_that_parse(command):
    shown = examples(command)
    assert shown
    for line in shown:
        argv = [a for a in shlex.split(line.split("  #", 1)[0]) if a != "&"]  # & : run in the background
        argv = argv[argv.index("hexiscale") + 1:]
        if "--" in argv:  # emulate: the command after -- is not ours to parse
            argv = argv[:argv.index("--")]
        args = PARSER.parse_args(argv)
        assert args.command == command, line


# ---- outputs ----------------------------------------------------------------------------------------
@pytest.fixture
def workdir(tmp_path):
    make_tokenizer(tmp_path)
    (tmp_path / "a.txt").write_text("the cluster trains a small model\n")
    (tmp_path / "taken.bin").mkdir()
    return tmp_path


@pytest.mark.parametrize("argv, key", [
    (["prepare-data", "{d}/a.txt", "--tokenizer", "{d}/tokenizer.json", "--out", "{d}/taken.bin", "--no-progress"],
     "--out"),
    (["prepare-data", "{d}/a.txt", "--tokenizer", "{d}/tokenizer.json", "--out", "{d}/a.txt/x.bin", "--no-progress"],
     "--out"),
    (["checkpoint", "consolidate", "{d}/no.ckpt", "{d}/a.txt/llama.pt"], "OUT.pt"),
    (["export", "{d}/no.ckpt", "--hf", "{d}/a.txt/hf"], "--hf"),
])
def test_an_output_that_cannot_be_written_is_refused_first(workdir, argv, key, capsys):
    assert main([a.format(d=workdir) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {key} = " in err and "Traceback" not in err
    assert sorted(p.name for p in workdir.iterdir()) == ["a.txt", "taken.bin", "tokenizer.json"]
    assert list((workdir / "taken.bin").iterdir()) == []


@pytest.mark.parametrize("argv, key", [
    (["checkpoint", "consolidate", "{d}/last.ckpt", "{d}/last.ckpt/llama.pt"], "OUT.pt"),
    (["export", "{d}/last.ckpt", "--hf", "{d}/last.ckpt/hf"], "--hf"),
])
def test_an_output_inside_the_checkpoint_it_comes_from_is_refused(tmp_path, argv, key, capsys):
    """Written into the checkpoint directory, it was lost with it at the next save of that path."""
    (tmp_path / "last.ckpt").mkdir()
    assert main([a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {key} = " in err and "inside the checkpoint" in err and "Traceback" not in err, err
    assert list((tmp_path / "last.ckpt").iterdir()) == []


def test_consolidate_into_a_safetensors_name_is_refused(tmp_path, capsys):
    """`checkpoint consolidate CKPT model.safetensors` wrote a torch.save pickle under that name, which
    safetensors then failed to read ("header too large"); refused first, pointing to export."""
    (tmp_path / "last.ckpt").mkdir()
    assert main(["checkpoint", "consolidate", str(tmp_path / "last.ckpt"), str(tmp_path / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "error: OUT.pt = " in err and "not a safetensors file" in err and "model.pt" in err, err
    assert "hexiscale export" in err and "Traceback" not in err
    # model.pt.safetensors: the fix named model.pt.pt
    assert main(["checkpoint", "consolidate", str(tmp_path / "last.ckpt"), str(tmp_path / "model.pt.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "name it model.pt," in err, err


def test_a_consolidated_file_is_named_as_such(tmp_path, capsys):
    """`hexiscale export llama.pt` (the output of `checkpoint consolidate`) was told "a single-file
    checkpoint of another strategy? Fix: resume from a checkpoint saved with strategy='hexiscale'"."""
    import torch

    torch.save({"embed.weight": torch.zeros(4, 2)}, tmp_path / "llama.pt")
    for argv in (["export", str(tmp_path / "llama.pt"), "--hf", str(tmp_path / "hf")],
                 ["checkpoint", "info", str(tmp_path / "llama.pt")]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "a consolidated state dict" in err and "give the checkpoint directory it came from" in err, err
    (tmp_path / "other.pt").write_bytes(b"not a pickle")
    assert main(["checkpoint", "info", str(tmp_path / "other.pt")]) == 2
    err = capsys.readouterr().err
    assert "not a hexiscale checkpoint directory" in err and "resume" not in err, err


def test_sweeps_read_hydras_sweep_grammar():
    """`-m` points are Hydra's: range(), choice(), glob() over a group's presets, and a quoted value
    keeps its comma. Splitting at commas made range(8,17,8) the points 'range(8', '17' and '8)':
    `hexiscale plan -m` planned nothing and `hexiscale train -m` refused a valid sweep before Hydra ran."""
    from lightning_hexiscale.cli.plan import sweep_overrides
    from lightning_hexiscale.cli.train_job import check_overrides
    from lightning_hexiscale.config.schema import preset_names
    from lightning_hexiscale.errors import ConfigError

    assert sweep_overrides(["train.global_batch=range(8,17,8)", "cluster=cpu2"]) == [
        ["train.global_batch=8", "cluster=cpu2"], ["train.global_batch=16", "cluster=cpu2"]]
    assert sweep_overrides(["trainer.lr=choice(1e-3,3e-3)", "data.path='a,b.txt'"]) == [
        ["trainer.lr=0.001", "data.path='a,b.txt'"], ["trainer.lr=0.003", "data.path='a,b.txt'"]]
    cpus = [n for n in preset_names("cluster") if n.startswith("cpu_hetero")]
    assert len(cpus) >= 2 and sweep_overrides(["cluster=glob(cpu_hetero*)"]) == [[f"cluster={n}"] for n in cpus]
    check_overrides(["-m", "cluster=cpu2", "model=llama_tiny", "train.global_batch=range(8,17,8)"])
    with pytest.raises(ConfigError, match=r"train.global_batch = 'many': must be an integer"):
        check_overrides(["-m", "cluster=cpu2", "train.global_batch=choice(8,many)"])


def test_train_help_lists_every_key_as_an_override_that_composes():
    """`hexiscale train --help` listed train, trainer and data keys but no planner.* nor trainer.fast_path.*,
    and wrote defaults as Python reprs: trainer.precision=None copied from it is the text "None" to Hydra
    (refused as a precision), not null. Every entry is now a key=value that composes to the default."""
    import re

    from omegaconf import OmegaConf

    from lightning_hexiscale.cli.train import help_text
    from lightning_hexiscale.config.schema import compose

    text = help_text().split("\nkeys (defaults")[1].split("cluster=auto")[0]
    entries = re.findall(r"(?<=\s)((?:train|planner|trainer|data)\.[\w.]+=\S+)", text)
    default = compose([])

    def keys(node: dict, prefix: str) -> set[str]:
        return {x for k, v in node.items() for x in (keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k})}

    want = set().union(*(keys(OmegaConf.to_container(default[top]), top + ".") for top in ("train", "planner", "trainer", "data")))
    flat = {e.split("=", 1)[0] for e in entries}
    assert "planner.iterations" in flat and "trainer.fast_path.compile" in flat and want - flat == set()
    composed = compose(entries)
    for e in entries:
        key = e.split("=", 1)[0]
        assert OmegaConf.select(composed, key) == OmegaConf.select(default, key), e


# ---- rendezvous-store: its two options -------------------------------------------------------------
@pytest.mark.parametrize("argv, key, rule", [
    (["--port", "99999"], "--port = 99999", "a TCP port is 1-65535"),
    (["--port", "-1"], "--port = -1", "a TCP port is 1-65535"),
    (["--port", "0"], "--port = 0", "a TCP port is 1-65535"),
    (["--host", "nonexistent.invalid"], "--host = 'nonexistent.invalid'", "no such host"),
    (["--port", "abc"], "argument --port: 'abc'", "is not a port number, e.g. 29400"),  # was "invalid int value"
])
def test_rendezvous_store_refuses_a_bad_port_or_host(argv, key, rule, capsys):
    """A port out of range was a pybind TypeError traceback; an unknown host printed C++ frames, then
    blamed the port ("pick a free port")."""
    try:
        code = main(["rendezvous-store", *argv])
    except SystemExit as e:  # argparse's own refusal (a value its type rejects)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert key in err and rule in err and "Traceback" not in err and "frame #" not in err, err


# ---- unknown flags ----------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, usage, fix", [
    (["cluster", "--json"], "usage: hexiscale cluster",
     "hexiscale cluster takes no options (only KEY=VALUE overrides)"),  # it has no --json
    (["plan", "cluster=cpu2", "--jsn"], "usage: hexiscale plan", "did you mean --json?"),
    (["estimate", "--plan", "p.yaml", "--jsno"], "usage: hexiscale estimate", "did you mean --json?"),
    (["profile", "--locall", "2"], "usage: hexiscale profile", "did you mean --local?"),
    (["estimate", "--plan", "p.yaml", "--zzz"], "usage: hexiscale estimate", "hexiscale estimate takes --plan, --json"),
])
def test_an_unknown_flag_is_refused_with_the_commands_usage_and_options(argv, usage, fix, monkeypatch, capsys):
    """`hexiscale cluster --json` printed the usage of `hexiscale` itself (`hexiscale [-h] COMMAND ...`)
    and no hint; the flag is refused by the command's own parser, with its closest option or its list."""
    command = argv[0]
    monkeypatch.setitem(common.SUBCOMMANDS, command, (*common.SUBCOMMANDS[command][:2],
                                                      lambda args: pytest.fail("the command ran")))
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(usage), err
    bad = next(a for a in argv[1:] if a.startswith("--") and a not in ("--plan",))
    assert f"{command}: error: unrecognized arguments: {bad}. Fix: {fix}" in err, err
    assert "COMMAND ..." not in err, err


@pytest.mark.parametrize("argv, message", [
    (["plna"], "no command 'plna'. Fix: did you mean plan? See hexiscale --help"),
    (["xyzzy"], f"no command 'xyzzy'. Fix: use one of {', '.join(sorted(common.SUBCOMMANDS))}. See hexiscale --help"),
    (["cluster=cpu2", "model=llama_tiny"], "'cluster=cpu2' comes before any command. Fix: name the command first, "
                                           "e.g. hexiscale plan cluster=cpu2"),
    (["--json"], "unrecognized arguments: --json. Fix: a command comes first (hexiscale COMMAND [options]"),
])
def test_a_first_word_that_names_no_command_gets_the_closest_command(argv, message, capsys):
    """`hexiscale plna` said argparse's `invalid choice: 'plna' (choose from ...)`; `hexiscale --json`
    printed the help and exited 2 with no error line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"hexiscale: error: {message}" in err, err


def test_no_arguments_still_prints_the_help(capsys):
    assert main([]) == 2
    assert "usage: hexiscale" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--version"], ["train", "--version"]])
def test_version_names_the_package_torch_lightning_hydra_and_python(argv, capsys):
    """`hexiscale --version` said `unrecognized arguments: --version`, and `hexiscale train --version`
    printed Hydra's version alone (`Hydra 1.3.8`): a bug report had no versions."""
    from importlib import metadata

    try:
        code = main(argv)
    except SystemExit as e:  # argparse's version action exits
        code = e.code
    out = capsys.readouterr().out.strip()
    python = ".".join(map(str, sys.version_info[:3]))
    assert code == 0
    assert out == (f"hexiscale {metadata.version('lightning-hexiscale')} (torch {metadata.version('torch')}, "
                   f"lightning {metadata.version('lightning')}, hydra {metadata.version('hydra-core')}, "
                   f"Python {python})"), out


@pytest.mark.parametrize("value", ["x", "2.5"])
def test_a_count_flag_that_is_no_whole_number_says_so(value, capsys):
    """`hexiscale discover --local x` said argparse's "invalid positive_int value: 'x'": the name of
    a function, not the rule."""
    with pytest.raises(SystemExit) as stop:
        main(["discover", "--local", value, "--model", "llama_tiny"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"argument --local: {value!r} is not a whole number" in err, err


@pytest.mark.parametrize("word, fix", [
    ("hetero1", "did you mean cluster=hetero1?"),
    ("llama_tiny", "did you mean model=llama_tiny?"),
    ("hetro3", "did you mean cluster=hetero3?"),  # a near preset
    ("conf/cluster/cpu2.yaml", "did you mean cluster=conf/cluster/cpu2.yaml?"),
    ("conf/model/llama_tiny.yaml", "did you mean model=conf/model/llama_tiny.yaml?"),
    ("conf/plans/hetero3_llama30b_tab7.yaml", "did you mean plan=conf/plans/hetero3_llama30b_tab7.yaml?"),
    ("xyzzy", "write KEY=VALUE, e.g. cluster=hetero3 or model=llama_tiny"),
])
@pytest.mark.parametrize("command", ["plan", "cluster", "train"])
def test_a_word_without_equals_gets_the_override_it_meant(command, word, fix, monkeypatch, capsys):
    """`hexiscale plan hetero1` said "override 'hetero1' is not KEY=VALUE. Fix: write e.g. cluster=hetero3",
    whatever the word; `hexiscale train hetero1` was Hydra's "Error parsing override 'hetero1' / missing
    EQUAL at '<EOF>'". Both now name the override the word most likely meant."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the conf/ paths above are the repository's
    if command == "train":
        from lightning_hexiscale.cli.train import main as train_main

        assert train_main([word]) == 2
    else:
        monkeypatch.setitem(common.SUBCOMMANDS, command, (*common.SUBCOMMANDS[command][:2],
                                                          lambda args: pytest.fail("the command ran")))
        assert main([command, "model=llama_tiny", word]) == 2
    err = capsys.readouterr().err
    assert f"hexiscale {command}: error: override = {word!r}: is not KEY=VALUE. Fix: {fix}" in err, err


@pytest.mark.parametrize("word", ["x" * 300, "~no_such_user_here", "~/nope.yaml"])
def test_a_word_that_names_no_file_the_os_can_open_is_still_refused_in_one_line(word, capsys):
    """A word longer than the OS's NAME_MAX made Path.is_dir raise OSError (File name too long), and
    ~name of no such user made Path.expanduser raise RuntimeError: tracebacks, not the error."""
    assert main(["plan", word]) == 2
    err = capsys.readouterr().err
    assert f"override = {word!r}: is not KEY=VALUE" in err and "Traceback" not in err, err


def test_a_hugging_face_directory_as_a_word_is_meant_as_model_hf(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["plan", str(tmp_path)]) == 2
    assert f"Fix: did you mean model=hf:{tmp_path}?" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--cfg", "job", "hetero1"], ["-cn", "config", "hetero1"], ["--info", "hetero1"], ["~train.seed", "hetero1"],
])
def test_train_tells_a_flags_value_from_a_bare_word(argv, capsys):
    """A word after a flag that takes a value is the flag's (`--cfg job`), not an override."""
    from lightning_hexiscale.cli.train import main as train_main

    assert train_main(argv) == 2
    assert "override = 'hetero1': is not KEY=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flags", [
    (["--cfg", "job", "--info"], "--cfg --info"),
    (["-m", "cluster=cpu2,cpu_hetero4", "--cfg=job"], "-m --cfg"),
    (["--info", "config", "-c", "job"], "--info -c"),
])
def test_train_refuses_two_of_hydras_modes_without_a_traceback(argv, flags, capsys):
    """Hydra raised "ValueError: Only one of --run, --multirun, --cfg, --info and --shell_completion can be
    specified" with its traceback."""
    from lightning_hexiscale.cli.train import main as train_main

    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert f"hexiscale train: error: Hydra's flags = {flags!r}: only one of" in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag, fix", [("--multi-run", "did you mean --multirun?"), ("--cfgg=job", "did you mean --cfg?"),
                                       ("-x", "the flags are --cfg, --package, ")])
def test_train_refuses_a_flag_it_does_not_take_with_the_closest(flag, fix, capsys):
    """Hydra's argparse printed its usage under the name `hexiscale` and "unrecognized arguments: --multi-run"."""
    from lightning_hexiscale.cli.train import main as train_main

    assert train_main([flag, "cluster=cpu2"]) == 2
    err = capsys.readouterr().err
    assert f"hexiscale train: error: unrecognized argument: {flag}. Fix: {fix}" in err and "usage" not in err, err


@pytest.mark.parametrize("argv", [["--cfg", "job", "cluster=cpu2"], ["--info", "config"], ["--info", "cluster=cpu2"],
                                  ["-cd", "my_conf", "~train.seed", "-m", "-m", "+a=b"], ["--cfg=job", "-p", "trainer"],
                                  ["--resolve", "--cfg", "all", "--config-name=config"], ["--hydra-help"]])
def test_train_still_takes_a_flags_value_and_a_deletion(argv):
    """What the check passes on to Hydra (run here without Hydra: its in-process run leaves a logging
    handler on the test's closed stderr)."""
    from lightning_hexiscale.cli.train_job import check_command_line

    check_command_line(argv)
