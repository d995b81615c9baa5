"""Under srun, the rendezvous of the commands whose ranks join a process group themselves
(``hexiscale discover``, ``profile``, ``calibrate``, ``check-estimate``), from SLURM's variables, as
Lightning's :class:`~lightning.fabric.plugins.environments.SLURMEnvironment` gives it to training.

srun sets neither ``MASTER_ADDR`` nor ``MASTER_PORT``. ``hexiscale train`` under srun gets both from
Lightning; the profiling commands, which join through
:func:`~lightning_hexiscale.profiling.launch.run_from_env` and do not use Lightning (the profiling
layer may not import it), refused to start and asked the user to export them. Here, before the
command runs, the missing ones are filled in by the same rules Lightning follows, so that
``srun hexiscale discover --model M`` and ``srun python recipes/train.py`` meet the same way:

- ``MASTER_ADDR``: the first host of the step's node list, read by Lightning's own
  ``SLURMEnvironment.resolve_root_node_address`` (``node[003-005],gpu1`` -> ``node003``). Only on
  more than one node: on one node the profiling launch's default 127.0.0.1 is rank 0's host, and
  a host name could resolve to an interface the ranks do not share.
  The step's list (``SLURM_STEP_NODELIST``) comes first: ``srun --nodes=2`` in an allocation of four
  nodes starts rank 0 on the step's first node, which need not be the allocation's.
- ``MASTER_PORT``: ``15000 + the last four digits of SLURM_JOB_ID`` (12910 without a job id), the
  port ``SLURMEnvironment.main_port`` picks: every rank of the job computes the same one, and two jobs
  on one node differ unless their ids agree in the last four digits (Lightning accepts that too).

What a user exported wins. A shell in an interactive allocation is not an srun launch
(:func:`~lightning_hexiscale.runtime.host.slurm_launched`): nothing is filled there.
"""

from __future__ import annotations

import os
from typing import MutableMapping

from lightning_hexiscale.runtime.host import slurm_launched, slurm_nodes

NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
"""Where the first host is read, first found wins: the step's nodes, then the job's."""

PORT_BASE, PORT_WITHOUT_JOB = 15000, 12910
"""``SLURMEnvironment.main_port``: ``PORT_BASE + int(SLURM_JOB_ID[-4:])``, else ``PORT_WITHOUT_JOB``."""


def slurm_port(job_id: str | None) -> int:
    """The rendezvous port of a SLURM job (module doc); a job id that is not a number gets the port
    without one (Lightning would fail on it; every rank still computes the same)."""
    try:
        return PORT_BASE + int(str(job_id)[-4:])
    except ValueError:
        return PORT_WITHOUT_JOB


def slurm_rendezvous(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The ``MASTER_ADDR`` / ``MASTER_PORT`` values that ``environ`` lacks and srun's variables give
    (module doc); empty where this is no srun launch or nothing is missing."""
    e = os.environ if environ is None else environ
    if not slurm_launched(e):
        return {}
    out: dict[str, str] = {}
    nodelist = next((e[k] for k in NODELIST_VARIABLES if e.get(k)), None)
    if not e.get("MASTER_ADDR") and slurm_nodes(e) > 1 and nodelist:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        out["MASTER_ADDR"] = SLURMEnvironment.resolve_root_node_address(nodelist)
    if not e.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(slurm_port(e.get("SLURM_JOB_ID")))
    return out


def fill_slurm_rendezvous(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set what :func:`slurm_rendezvous` finds missing in ``environ`` (default ``os.environ``, which
    the ranks' ``env://`` rendezvous reads); returns what was set."""
    e = os.environ if environ is None else environ
    found = slurm_rendezvous(e)
    e.update(found)
    return found
