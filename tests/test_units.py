import math

import pytest

from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.config.units import format_bandwidth, format_bytes, format_seconds, parse_bandwidth, parse_bytes, parse_flops, parse_time


@pytest.mark.parametrize("text,expected", [
    ("200 GB/s", 200e9), ("1 GiB/s", 2**30), ("5.6 Gbps", 5.6e9 / 8), ("32GB/s", 32e9),
    ("80 Gbps", 10e9), ("100 MB/s", 1e8), ("1.5e3 MB/s", 1.5e9), ("400 Gbit/s", 50e9),
])
def test_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


@pytest.mark.parametrize("text,expected", [("80GB", 80e9), ("24 GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1 TB", 1e12)])
def test_bytes(text, expected):
    assert parse_bytes(text) == pytest.approx(expected)


@pytest.mark.parametrize("text,expected", [("10us", 1e-5), ("0.5 ms", 5e-4), ("2s", 2.0), ("0us", 0.0), ("100ns", 1e-7),
                                           ("10 \u00b5s", 1e-5), ("10 \u03bcs", 1e-5)])  # micro sign, Greek mu (both are typed)
def test_time(text, expected):
    assert parse_time(text) == pytest.approx(expected)


def test_flops():
    assert parse_flops("312 TFLOPS") == pytest.approx(312e12)
    assert parse_flops("71 TFLOP/s") == pytest.approx(71e12)


@pytest.mark.parametrize("parser,bad,fragment", [
    (parse_bandwidth, "200", "needs a unit"),
    (parse_bandwidth, 200, "needs a unit"),
    (parse_bandwidth, "200 GB", "unknown bandwidth unit"),
    (parse_bandwidth, "0 GB/s", "greater than zero"),
    (parse_bytes, "80", "needs a unit"),
    (parse_bytes, "80 Gbps", "unknown size unit"),
    (parse_time, "10", "needs a unit"),
    (parse_time, "10 parsecs", "unknown time unit"),
    (parse_time, "-5us", "a time must not be negative"),  # it said "greater than zero", and 0us is taken
    (parse_bandwidth, "fast", "not a bandwidth"),
    (parse_bandwidth, None, "written with its unit"),
])
def test_bad_values_name_key_rule_and_fix(parser, bad, fragment):
    with pytest.raises(ConfigError) as ei:
        parser(bad, "cluster.inter_machine.bandwidth")
    msg = str(ei.value)
    assert msg.startswith("cluster.inter_machine.bandwidth = ")
    assert fragment in msg and "Fix:" in msg


def test_format():
    assert format_bytes(24 * 2**30) == "24.0 GiB"
    assert format_bandwidth(200e9) == "200 GB/s"
    assert not math.isnan(parse_bandwidth("1e-3 GB/s"))


@pytest.mark.parametrize("seconds,text", [
    (7.3414, "7.341 s"), (0.0274, "0.027 s"), (0.0005, "0.001 s"), (0.0, "0.000 s"),
    (0.0004056, "406 us"), (2.26e-5, "22.6 us"), (4e-8, "40 ns"), (math.inf, "inf s"),
])
def test_format_seconds_keeps_three_decimals_and_names_what_they_would_print_as_zero(seconds, text):
    """A tiny model on big GPUs was reported as "iteration 0.000 s" by `hexiscale plan cluster=hetero3`."""
    assert format_seconds(seconds) == text
    assert format_seconds(seconds, "") == text.replace(" ", "")


def test_format_seconds_like_takes_the_unit_of_the_longest_time():
    assert format_seconds(0.0, like=4e-4) == "0 us"
    assert format_seconds(6.6e-5, "", like=0.236) == "0.000s"
    assert format_seconds(2.5e-5, like=4e-4) == "25 us"


def test_a_tiny_models_estimate_prints_no_zero_time_for_nonzero_work():
    """The estimate table of a 4-layer model on an A800: every nonzero time shows its digits."""
    from lightning_hexiscale.config.cluster import Cluster
    from lightning_hexiscale.models.config import LlamaConfig
    from lightning_hexiscale.planner import Pipeline, Plan, Stage, Workload, estimate

    model = LlamaConfig.load("llama_tiny")
    plan = Plan((Pipeline(6, 6, (Stage((0,), (0, model.num_layers)),)),), model.num_layers)
    est = estimate(plan, Cluster.load("hetero3"), Workload(model))
    assert 0 < est.iteration_time_s < 5e-4
    text = est.summary()
    assert "iteration 0.000 s" not in text and f"iteration {format_seconds(est.iteration_time_s)}," in text
    stage_row = text.splitlines()[2].split()
    assert all(cell.endswith("us") for cell in stage_row[4:9])  # compute to DP exposed, one unit


@pytest.mark.parametrize("text,rule,fix", [
    # read as 1 with the unit ",000 MB/s": "unknown bandwidth unit ',000 MB/s'" named no fix that helped
    ("1,000 MB/s", "is written without thousands separators", '"1000 MB/s"'),
    ("1,000,000 MB/s", "is written without thousands separators", '"1000000 MB/s"'),
    ("10_000 GB/s", "is written without thousands separators", '"10000 GB/s"'),
    ("1,5 GB/s", "is written with a decimal point, not a comma", '"1.5 GB/s"'),
])
def test_a_number_with_separators_is_named_with_its_plain_form(text, rule, fix):
    from lightning_hexiscale.config.units import parse_bandwidth

    with pytest.raises(ConfigError) as caught:
        parse_bandwidth(text, key="cluster.inter_machine.bandwidth")
    assert rule in str(caught.value) and f"Fix: write e.g. {fix}" in str(caught.value), str(caught.value)


def test_the_fix_suggests_a_size_of_the_kind_asked_for(capsys):
    """--chunk-size 0 was told 'write e.g. "80 GiB"' (a GPU's memory) for a tokenizer batch."""
    from lightning_hexiscale.cli.main import main

    assert main(["prepare-data", "in.txt", "--tokenizer", "tok", "--out", "o.bin", "--chunk-size", "0"]) == 2
    assert 'Fix: write e.g. "16 MiB"' in capsys.readouterr().err
    with pytest.raises(ConfigError, match='write e.g. "80 GiB"'):
        parse_bytes("80", "memory")
