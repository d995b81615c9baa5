"""One workload per run, made in one place (``Workload.for_devices``) from the cluster's device kind and
the precision, whichever entry point plans: the strategy's search (the Lightning example of docs/guide/lightning.md:
``HexiScaleStrategy(cluster="cpu_demo", global_batch=32)``, 4 CPU devices), elastic restarts, the
recipe and the ``hexiscale`` commands (``workload_from_config``). Before, the strategy priced a CPU
cluster as CUDA (NCCL buffers on every device) and found no plan for cpu_demo at all.

And when nothing fits, the message names the term that does not fit, with a readable parameter count.
"""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch

import lightning_hexiscale  # noqa: F401  (registers "hexiscale")
from lightning_hexiscale.config.cluster import Cluster
from lightning_hexiscale.config.schema import compose
from lightning_hexiscale.errors import InfeasiblePlan
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.lightning.strategy import HexiScaleStrategy
from lightning_hexiscale.models.config import LlamaConfig
from lightning_hexiscale.planner import SearchSettings, Workload, search, workload_from_config


@pytest.mark.parametrize("cluster,precision,device,dtype", [
    ("cpu_demo", None, "cpu", "fp32"), ("cpu_demo", "bf16-mixed", "cpu", "bf16"),
    ("hetero3", None, "cuda", "bf16"), ("hetero3", "32-true", "cuda", "fp32")])
def test_the_recipe_cli_and_strategy_price_the_same_workload(cluster, precision, device, dtype):
    model = LlamaConfig.load("llama_demo")
    overrides = [f"cluster={cluster}", "model=llama_demo"] + ([f"trainer.precision={precision}"] if precision else [])
    from_config = workload_from_config(compose(overrides))  # recipe, hexiscale plan / estimate
    direct = Workload.for_cluster(model, Cluster.load(cluster), precision)  # strategy, elastic
    assert from_config == direct
    assert (direct.device, direct.dtype) == (device, dtype)


def _resolve(strategy: HexiScaleStrategy, devices: int, precision: str = "32-true"):
    """The strategy's own planning step (what each rank runs in ``setup``), in this process."""
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = LlamaLitModule("llama_demo")
    with torch.device("meta"):
        module.configure_model()
    strategy._resolve_plan(module, trainer, True)
    return strategy


def test_strategy_plans_the_readme_example_on_cpu_demo():
    """The example of docs/guide/lightning.md: HexiScaleStrategy(cluster="cpu_demo", global_batch=32), devices=4."""
    s = _resolve(HexiScaleStrategy(cluster="cpu_demo", global_batch=32, planner_iterations=5), 4)
    assert s.workload == Workload.for_cluster(LlamaConfig.load("llama_demo"), s.cluster, "32-true")
    assert s.workload.device == "cpu"
    assert s.plan.world_size == 4 and s.plan.global_batch == 32


def test_strategy_prices_the_trainer_precision():
    s = _resolve(HexiScaleStrategy(cluster="cpu_demo", global_batch=32, planner_iterations=3), 4, "bf16-mixed")
    assert (s.workload.dtype, s.workload.param_dtype, s.workload.device) == ("bf16", "fp32", "cpu")


def test_infeasible_message_names_the_term_that_does_not_fit():
    c, m = Cluster.load("cpu_demo"), LlamaConfig.load("llama_demo")
    cuda = dataclasses.replace(Workload.for_cluster(m, c), device="cuda")  # the old pricing of this cluster
    # every device must take work: leaving the small devices idle, the big ones alone hold it under CUDA pricing
    with pytest.raises(InfeasiblePlan) as e:
        search(c, cuda, 32, SearchSettings(iterations=3, progress=False, use_all_devices=True))
    msg = str(e.value)
    assert "3.1M parameters" in msg and "0.00B" not in msg
    assert "CPU-SMALL" in msg and "1,045.0 MiB each" in msg
    assert "communicator buffers do not fit" in msg and "runs on cuda" in msg and "Workload.for_cluster" in msg
    # 8 devices with 7 MiB each beyond the reserve: the states (47 MiB) fit in all of them, one layer
    # does not fit in any: that term is named
    tiny = Cluster.from_config({"name": "tiny", "gpu_types": {"CPU-T": {"flops": "1 TFLOPS", "memory": "1031 MiB"}},
                                "machines": [{"name": "a", "gpu": "CPU-T", "count": 8, "intra_bandwidth": "1 GB/s"}],
                                "inter_machine": {"bandwidth": "1 GB/s", "latency": "50us"}})
    with pytest.raises(InfeasiblePlan, match=r"8 CPU-T device\(s\) \(1,031.0 MiB each\).*one layer does not fit"):
        search(tiny, Workload.for_cluster(m, tiny, "32-true"), 8, SearchSettings(iterations=2, progress=False))
