"""A generated corpus too large to generate is a ConfigError naming data.num_samples: with 2**70,
hexiscale train generated text until the job was killed ("terminated while planning")."""

import signal
from contextlib import contextmanager

import pytest

from lightning_hexiscale.errors import ConfigError


@contextmanager
def _at_most(seconds: int):
    """The old code generated text forever: fail the test instead of hanging the suite."""
    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("build", ["generated_corpus", "make_dataset"])
def test_a_generated_corpus_too_large_to_generate_is_refused(build):
    from lightning_hexiscale.data import datasets

    with _at_most(10), pytest.raises(ConfigError, match=r"data.num_samples = 1180591620717411303424: the generated "
                                                         r"corpus holds at most 134,217,728 tokens"):
        if build == "generated_corpus":
            datasets.generated_corpus(2**70, 128)
        else:
            datasets.make_dataset("generated", 128, num_samples=2**70)
    assert len(datasets.generated_corpus(64, 16)) == 64


def test_val_samples_follow_the_corpus_cap():
    """data.val_samples=2**70 passed the checks made before planning (the ranks then held out a tenth
    of the corpus); it is bounded by the generated corpus's token cap, as data.num_samples is."""
    from lightning_hexiscale.config.recipe import MAX_VAL_SAMPLES, check_values
    from lightning_hexiscale.config.schema import compose
    from lightning_hexiscale.data.datasets import MAX_GENERATED_TOKENS

    assert MAX_VAL_SAMPLES == MAX_GENERATED_TOKENS
    with pytest.raises(ConfigError, match=r"data.val_samples = 1180591620717411303424: must be at most 134,217,728 "):
        check_values(compose(["cluster=cpu2", f"data.val_samples={2**70}"]))
    check_values(compose(["cluster=cpu2", f"data.val_samples={MAX_VAL_SAMPLES}"]))
