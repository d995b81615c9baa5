"""hexiscale train refuses trainer.timeout_s=1e308 (no timedelta holds it) before planning, under its
own key: the strategy refused it only after the search, as HexiScaleStrategy(timeout)."""


def test_hexiscale_train_refuses_a_timeout_no_timedelta_holds_before_planning(tmp_path, capsys):
    from lightning_hexiscale.cli.main import main

    rc = main(["train", "cluster=cpu_hetero4", "model=llama_tiny", "trainer.max_steps=1", "dry_run=true",
               f"hydra.run.dir={tmp_path}", "trainer.timeout_s=1e308"])
    err = capsys.readouterr()
    assert rc == 2 and "trainer.timeout_s = " in err.err and "Traceback" not in err.err
    assert "plan written" not in err.out + err.err  # refused before the search
