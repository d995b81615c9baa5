"""The profiling commands under srun meet where Lightning's training would (cli/slurm_env.py): srun
sets no MASTER_ADDR / MASTER_PORT, and `srun hexiscale discover` on several nodes was refused with
"export MASTER_ADDR=..." although SLURM's own variables say where rank 0 is. No process starts here."""

from __future__ import annotations

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment

import lightning_hexiscale.profiling.launch as launch
from lightning_hexiscale.cli.main import main
from lightning_hexiscale.cli.slurm_env import fill_slurm_rendezvous, slurm_rendezvous

NODELISTS = ["node[003-005],gpu1", "node[7,9-12]", "host0,host1,host3", "a100-[01-04]", "solo", "gpu-x[2]",
             "n1,n[2-3]", "rack1-node[0010-0011]"]
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


def _srun(nodes: int = 2, **extra: str) -> dict[str, str]:
    """What srun puts in a rank's environment (rank 1 of 16), plus ``extra``."""
    env = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8",
           "SLURM_NNODES": str(nodes), "SLURM_JOB_NAME": "discover", "SLURM_JOB_ID": "4812345"}
    env.update(extra)
    return env


@pytest.mark.parametrize("nodelist", NODELISTS)
@pytest.mark.parametrize("job_id", ["4812345", "77", None])
def test_the_address_and_port_are_lightnings(monkeypatch, nodelist, job_id):
    """The values Lightning's SLURMEnvironment would give this rank for training (it writes them into
    os.environ; monkeypatch restores it)."""
    env = _srun(SLURM_NODELIST=nodelist)
    if job_id is None:
        del env["SLURM_JOB_ID"]
    else:
        env["SLURM_JOB_ID"] = job_id
    for k in RENDEZVOUS + ("SLURM_JOB_ID",):
        monkeypatch.setenv(k, "x")  # recorded, so that the delenv and Lightning's writes are undone
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    lightning = SLURMEnvironment()
    assert slurm_rendezvous(env) == {"MASTER_ADDR": lightning.main_address, "MASTER_PORT": str(lightning.main_port)}


def test_the_steps_first_node_and_exported_values_win():
    # srun --nodes=2 inside an allocation of four: rank 0 is on the step's first node
    env = _srun(SLURM_STEP_NODELIST="node[3-4]", SLURM_NODELIST="node[1-4]", SLURM_JOB_NODELIST="node[1-4]")
    assert slurm_rendezvous(env)["MASTER_ADDR"] == "node3"
    assert slurm_rendezvous(_srun(SLURM_JOB_NODELIST="b[5-6]"))["MASTER_ADDR"] == "b5"
    given = _srun(SLURM_NODELIST="node[1-4]", MASTER_ADDR="login1", MASTER_PORT="29500")
    assert slurm_rendezvous(given) == {}
    assert slurm_rendezvous(_srun(SLURM_NODELIST="n[1-2]", MASTER_PORT="29500")) == {"MASTER_ADDR": "n1"}
    assert slurm_rendezvous(_srun(SLURM_JOB_ID="job-x")) == {"MASTER_PORT": "12910"}  # not a number: one port for all


def test_one_node_keeps_the_loopback_and_no_srun_fills_nothing():
    one = _srun(nodes=1, SLURM_NODELIST="node7")
    assert slurm_rendezvous(one) == {"MASTER_PORT": str(15000 + 2345)}  # 127.0.0.1 stays rank 0's host
    assert slurm_rendezvous(_srun()) == {"MASTER_PORT": "17345"}  # no node list: the launch refuses, as before
    assert slurm_rendezvous(_srun(SLURM_JOB_NAME="interactive", SLURM_NODELIST="n[1-2]")) == {}
    assert slurm_rendezvous(_srun(SLURM_JOB_NAME="bash", SLURM_NODELIST="n[1-2]")) == {}
    assert slurm_rendezvous({"RANK": "0", "WORLD_SIZE": "2", "SLURM_NODELIST": "n[1-2]"}) == {}  # torchrun
    env = _srun(SLURM_NODELIST="n[1-2]")
    assert fill_slurm_rendezvous(env) == {"MASTER_ADDR": "n1", "MASTER_PORT": "17345"}
    assert env["MASTER_ADDR"] == "n1" and fill_slurm_rendezvous(env) == {}


@pytest.mark.parametrize("argv, joins", [
    (["discover", "--model", "llama_tiny"], True),
    (["profile", "--model", "llama_tiny"], True),
    (["discover", "--local", "2", "--model", "llama_tiny"], False),  # forked ranks meet on their own port
])
def test_srun_discover_on_two_nodes_joins_rank_zeros_node(monkeypatch, argv, joins):
    """Through the command line: the rendezvous the ranks' env:// join reads. Before, the same launch
    stopped at check_rendezvous_env ("MASTER_ADDR and MASTER_PORT are not set under SLURM on 2 nodes")."""
    seen = {}

    def joined(fn, *args, **kwargs):
        launch.check_rendezvous_env(launch.env_rank())
        seen.update({k: launch.os.environ.get(k) for k in RENDEZVOUS})
        raise SystemExit(0)

    for k in RENDEZVOUS:
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    for k, v in _srun(SLURM_NODELIST="gpu[07-08]").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(launch, "run_from_env", joined)
    monkeypatch.setattr(launch, "run_local", lambda *a, **k: (_ for _ in ()).throw(SystemExit(0)))
    monkeypatch.setattr("lightning_hexiscale.cli.discover_local.run_local_ranks",
                        lambda *a, **k: (_ for _ in ()).throw(SystemExit(0)), raising=False)
    with pytest.raises(SystemExit):
        main(argv)
    if joins:
        assert seen == {"MASTER_ADDR": "gpu07", "MASTER_PORT": "17345"}
    else:
        assert seen == {} and "MASTER_ADDR" not in launch.os.environ
