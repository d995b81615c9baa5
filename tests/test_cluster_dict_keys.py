"""Cluster.from_config(dict) checks the dict's keys and flags as a cluster file's: a number for
gpu_types.<type>.hopper ran as a flag (OmegaConf: -1 is true, 0 false), and a misspelt key got
OmegaConf's message without the closest key."""

import pytest

from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.errors import ConfigError

BASE = dict(machines=[dict(gpu="MYGPU", count=1)], inter_machine=dict(bandwidth="1 GB/s"),
            gpu_types=dict(MYGPU=dict(flops="1 TFLOPS", memory="4 GiB")))


@pytest.mark.parametrize("hopper", [-1, 0, 2**70])
def test_a_number_for_hopper_is_refused(hopper):
    d = {**BASE, "gpu_types": {"MYGPU": {**BASE["gpu_types"]["MYGPU"], "hopper": hopper}}}
    with pytest.raises(ConfigError, match=r"cluster.gpu_types.MYGPU.hopper = .*: must be true or false"):
        Cluster.from_config(d)


def test_a_misspelt_key_names_the_closest():
    d = {**BASE, "machines": [dict(gpu="A800", count=2, intra_bandwith="200 GB/s")]}
    with pytest.raises(ConfigError, match=r"cluster.machines\[0\].intra_bandwith = .*did you mean intra_bandwidth"):
        Cluster.from_config(d)


def test_a_good_dict_still_builds():
    d = {**BASE, "gpu_types": {"MYGPU": {**BASE["gpu_types"]["MYGPU"], "hopper": True}}}
    assert Cluster.from_config(d).devices[0].hopper is True
