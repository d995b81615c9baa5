"""Each rank's GPU must be the type its plan device describes (lightning/device_check.py). The
matcher is pure and tested here on CUDA names as torch reports them; the collective check runs on
GPU nodes only (recipes/check_gpu.py)."""

from __future__ import annotations

import pytest

from lightning_hexiscale.lightning.device_check import gpu_mismatch

GiB = 2.0**30


@pytest.mark.parametrize("gpu_type,memory,name,local", [
    ("A800", 80 * GiB, "NVIDIA A800-SXM4-80GB", 79.3 * GiB),
    ("A100-80G", 80 * GiB, "NVIDIA A100-SXM4-80GB", 79.2 * GiB),
    ("A100-40G", 40 * GiB, "NVIDIA A100-PCIE-40GB", 39.4 * GiB),
    ("H100", 80 * GiB, "NVIDIA H100 80GB HBM3", 79.1 * GiB),
    ("H20", 96 * GiB, "NVIDIA H20", 95.0 * GiB),
    ("RTX4090", 24 * GiB, "NVIDIA GeForce RTX 4090", 23.6 * GiB),
    ("RTX3080Ti", 12 * GiB, "NVIDIA GeForce RTX 3080 Ti", 11.8 * GiB),
    ("NVIDIA-L4", 22 * GiB, "NVIDIA L4", 22.0 * GiB),  # a profiled type (hexiscale profile names it so)
])
def test_matching_gpus(gpu_type, memory, name, local):
    assert gpu_mismatch(gpu_type, memory, name, local) is None


@pytest.mark.parametrize("gpu_type,memory,name,local,why", [
    ("A800", 80 * GiB, "NVIDIA GeForce RTX 4090", 23.6 * GiB, "not a A800"),
    ("H20", 96 * GiB, "NVIDIA H200", 140.0 * GiB, "not a H20"),  # h20 is not a word of "NVIDIA H200"
    ("A100-80G", 80 * GiB, "NVIDIA A100-PCIE-40GB", 39.4 * GiB, "the cluster describes 80.0 GiB"),
    ("RTX3090", 24 * GiB, "NVIDIA GeForce RTX 3080 Ti", 11.8 * GiB, "not a RTX3090"),
])
def test_mismatched_gpus_say_why(gpu_type, memory, name, local, why):
    assert why in gpu_mismatch(gpu_type, memory, name, local)
