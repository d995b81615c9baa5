"""CUDA device names -> catalog types (config/catalog.py: name_of_device), used by the strategy when
it describes the local devices and by recipes/check_gpu.py."""

import pytest

from lightning_hexiscale.config.catalog import name_of_device


@pytest.mark.parametrize("cuda_name, expected", [
    ("NVIDIA H100 80GB HBM3", "H100"),
    ("NVIDIA H100 PCIe", "H100"),
    ("NVIDIA H200", "H200"),          # not the H20 its name starts with
    ("NVIDIA H200 NVL", "H200"),
    ("NVIDIA H20", "H20"),
    ("NVIDIA H800", "H800"),
    ("NVIDIA A800-SXM4-80GB", "A800"),
    ("NVIDIA A100-SXM4-80GB", "A100-80G"),  # the memory in the name picks the variant
    ("NVIDIA A100-SXM4-40GB", "A100-40G"),
    ("NVIDIA A100 80GB PCIe", "A100-80G"),
    ("NVIDIA GeForce RTX 4090", "RTX4090"),  # two words joined
    ("NVIDIA GeForce RTX 3090", "RTX3090"),
    ("NVIDIA GeForce RTX 3080 Ti", "RTX3080Ti"),  # three words joined
    ("NVIDIA L40S", "L40S"),
])
def test_cuda_names_map_to_their_catalog_type(cuda_name, expected):
    assert name_of_device(cuda_name) == expected


@pytest.mark.parametrize("cuda_name", ["Tesla T4", "NVIDIA B200", "NVIDIA GeForce RTX 3080", "cpu"])
def test_unlisted_devices_are_none_not_a_near_name(cuda_name):
    assert name_of_device(cuda_name) is None
