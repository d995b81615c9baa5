"""Per-pipeline batches from a Plan: each pipeline's slice of every global batch.

**Batches.** Pipeline i of a plan takes b_i sequences of every global batch of G = sum(b_i)
sequences. :class:`PlanBatchSampler` turns a dataset of N samples into exactly what one-device
training on batches of G would see, cut along the pipelines:

- per epoch, one permutation of range(N) shared by every rank, drawn as the one-device
  ``DataLoader(dataset, batch_size=G, shuffle=True)`` draws it (its ``RandomSampler``): with no
  ``generator``, one int64 from torch's global generator seeds ``randperm(N)``; with the loader's
  ``generator``, ``randperm(N, generator=generator)``. Under ``seed_everything(s)`` (or any seeding)
  the pipelines therefore cut the very permutation a single device would train on. ``0..N-1`` when
  not shuffling; ``randperm(N)`` of ``seed + epoch`` when a fixed ``seed`` is given (the
  ``DistributedSampler`` rule);
- every rank draws (so its generator moves on as one device's does) and the ranks then take rank
  0's draw (``agree``: one broadcast per shuffled epoch), so no rank can cut another permutation;
- global batch k is ``perm[k*G : (k+1)*G]``; pipeline i takes its slice ``[off_i, off_i + b_i)``
  with off_i = b_0 + ... + b_(i-1); every rank of a pipeline loads the same samples (the first stage
  needs the tokens, the last the targets, the middle ones the shapes);
- a last, short global batch of n < G samples is split in proportion to the b_i (largest remainder),
  or dropped with ``drop_last``; training plans need full batches, so training loaders drop it.

**Resume.** The position in the epoch (in global batches), the epoch's draw and the generator's state
at the save are saved (:meth:`PlanBatchSampler.state_dict`); a resumed run continues the same
permutation at the next global batch and restores the generator, so later epochs draw what the
uninterrupted run draws.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, Sampler, SequentialSampler

from lightning_hexiscale.errors import ConfigError


# ---- batch splitting ---------------------------------------------------------------------------
def split_proportional(n: int, weights: Sequence[int]) -> list[int]:
    """Split n items into len(weights) whole parts proportional to ``weights`` (largest remainder).

    Exact when n = sum(weights): split_proportional(16, [6, 5, 5]) = [6, 5, 5]; a short batch of 8
    gives [3, 3, 2] (quotas 3.0, 2.5, 2.5; ties go to the earlier pipeline). When n is at least the
    number of parts, every part gets one, taken from the largest (earliest on ties): every pipeline
    needs a sample of a batch, so 2 over [3, 1] is [1, 1], not [2, 0] (which left the batch out).
    """
    total = sum(weights)
    quotas = [n * w / total for w in weights]
    parts = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in order[: n - sum(parts)]:
        parts[i] += 1
    if n >= len(parts):
        for i in [i for i, p in enumerate(parts) if p == 0]:
            parts[parts.index(max(parts))] -= 1  # n >= len(parts) with a 0 part: the largest holds 2 or more
            parts[i] = 1
    return parts


def short_last_batch(num_samples: int, batch_size: int, weights: Sequence[int]) -> int:
    """The samples of a last batch too small to give every pipeline one when split in proportion to
    ``weights`` (such a batch is left out: every pipeline needs a sample); 0 when there is none."""
    rest = num_samples % batch_size
    return rest if rest and min(split_proportional(rest, weights)) < 1 else 0


class _EpochPermutation(Sampler[int]):
    """The shared permutation of one epoch (see the module doc); ``set_epoch`` as on ``DistributedSampler``.

    ``key`` is what the current epoch's permutation was drawn from (an int64 seed, or the loader
    generator's state before ``randperm``); :meth:`permutation` draws a new one unless a resumed epoch
    supplies it.
    """

    def __init__(self, num_samples: int, shuffle: bool, seed: int | None = None,
                 generator: torch.Generator | None = None, agree: Callable[[Any], Any] | None = None):
        self.num_samples, self.shuffle, self.seed, self.generator = num_samples, shuffle, seed, generator
        self.agree = agree or (lambda value: value)
        self.epoch = 0
        self.key: Any = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rng_state(self) -> torch.Tensor:
        """State of the generator the draws come from (the loader's, else torch's global one)."""
        return self.generator.get_state() if self.generator is not None else torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.generator is not None:
            self.generator.set_state(state)
        else:
            torch.set_rng_state(state)

    def permutation(self, key: Any = None) -> list[int]:
        """This epoch's order; ``key``: a resumed epoch's saved draw (nothing is drawn then)."""
        n = self.num_samples
        if not self.shuffle:
            return list(range(n))
        if self.seed is not None:
            self.key = self.seed + self.epoch
            return torch.randperm(n, generator=torch.Generator().manual_seed(self.key)).tolist()
        if self.generator is not None:
            # RandomSampler(generator=g): randperm(n, generator=g). The state before it is the key;
            # the ranks take rank 0's, and randperm moves every rank's generator on alike.
            self.key = self.agree(self.generator.get_state()) if key is None else key
            self.generator.set_state(self.key)
            return torch.randperm(n, generator=self.generator).tolist()
        if key is None:
            # RandomSampler(generator=None): one int64 from the global generator seeds a fresh one.
            key = self.agree(int(torch.empty((), dtype=torch.int64).random_().item()))
        self.key = key
        return torch.randperm(n, generator=torch.Generator().manual_seed(key)).tolist()

    def exhausted(self) -> None:
        """The epoch's last index was taken. ``RandomSampler`` then still computes one more
        ``randperm(n, generator)`` (for its ``num_samples % n`` tail, empty here) before it stops:
        with the loader's generator that draw moves the generator on, so it is made here too."""
        if self.shuffle and self.seed is None and self.generator is not None:
            torch.randperm(self.num_samples, generator=self.generator)

    def __iter__(self) -> Iterator[int]:
        yield from self.permutation()
        self.exhausted()

    def __len__(self) -> int:
        return self.num_samples


class PlanBatchSampler(Sampler[list[int]]):
    """Batches of indices for pipeline ``pipeline`` of a plan with pipeline batches ``batch_sizes``.

    Args:
        num_samples: dataset length N.
        batch_sizes: b_i of every pipeline (their sum is the global batch G).
        pipeline: index i of the pipeline whose slices this sampler yields.
        shuffle: a new permutation per epoch, drawn as a one-device ``RandomSampler`` draws it (module
            doc); ``set_epoch`` through ``.sampler``.
        seed: instead, ``randperm`` of ``seed + epoch`` (the ``DistributedSampler`` rule).
        generator: the one-device loader's ``generator`` (None: torch's global generator).
        agree: ``value -> rank 0's value`` (a broadcast); None in a single process.
        drop_last: drop a last global batch shorter than G (always on for training).
        one_device_keeps_last: the one-device loader uses such a last batch (its own ``drop_last`` is
            off) although ``drop_last`` drops it here: :attr:`left_out` counts it.
    """

    def __init__(self, num_samples: int, batch_sizes: Sequence[int], pipeline: int, *, shuffle: bool,
                 seed: int | None = None, generator: torch.Generator | None = None,
                 agree: Callable[[Any], Any] | None = None, drop_last: bool = True,
                 one_device_keeps_last: bool = False):
        if not 0 <= pipeline < len(batch_sizes):
            raise ValueError(f"pipeline {pipeline} out of range for {len(batch_sizes)} pipelines")
        self.batch_sizes, self.pipeline, self.drop_last = list(batch_sizes), pipeline, drop_last
        self.one_device_keeps_last = one_device_keeps_last
        self.global_batch = sum(batch_sizes)
        self.sampler = _EpochPermutation(num_samples, shuffle, seed, generator, agree)
        self.window: list[int] = []
        """The global batch (its sample indices, in batch order) of the slice yielded last."""
        self.consumed = 0
        """Global batches of the current epoch the training loop has taken (the strategy counts them
        in ``training_step``: the sampler itself runs ahead by Lightning's prefetch)."""
        self._resume_at = 0
        self._resume_key: Any = None
        self._resume_rng: torch.Tensor | None = None
        self._window_rng: torch.Tensor | None = None

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    # ---- mid-epoch resume ----------------------------------------------------------------------
    def window_starts(self) -> None:
        """The strategy calls it as the first batch of a gradient-accumulation window trains: the
        generator's state then (``window_rng``) is where a checkpoint saved later inside the window,
        rewound to the window's start, resumes drawing (lightning/strategy_checkpoints.py)."""
        s = self.sampler
        self._window_rng = s.rng_state() if s.shuffle and s.seed is None else None

    def state_dict(self) -> dict:
        """Where the epoch stands, in global batches: plan-independent (another plan with the same
        global batch resumes at the same window of the same permutation); plus the epoch's draw and
        the generator's state now, from which the uninterrupted run goes on drawing, and at the
        start of the current accumulation window."""
        s = self.sampler
        return {"epoch": s.epoch, "batches": self.consumed, "global_batch": self.global_batch,
                "num_samples": s.num_samples, "shuffle": s.shuffle, "seed": s.seed, "key": s.key,
                "rng": s.rng_state() if s.shuffle and s.seed is None else None, "window_rng": self._window_rng}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration starts at global batch ``state["batches"]`` of the saved epoch's
        permutation, and the generator continues from its saved state."""
        s = self.sampler
        self._resume_rng = state.get("rng") if s.shuffle and s.seed is None else None
        batches = int(state.get("batches", 0))
        now = {"global_batch": self.global_batch, "num_samples": s.num_samples, "shuffle": s.shuffle, "seed": s.seed}
        changed = [k for k in now if k in state and state[k] != now[k]]
        # The epoch boundary is the saved run's: 8 batches into an epoch of 10 is mid-epoch even
        # where the changed data or batch makes epochs of 7 (that was passed over in silence).
        full, rest = divmod(int(state.get("num_samples", s.num_samples)),
                            int(state.get("global_batch", self.global_batch)))
        saved_len = (full + (1 if rest and not self.drop_last else 0)) if changed else len(self)
        # A checkpoint rewound to the start of the epoch's first accumulation window (window_start:
        # lightning/strategy_checkpoints.py) resumes the epoch's saved permutation at batch 0
        at_window_start = batches == 0 and bool(state.get("window_start"))
        if not ((0 < batches or at_window_start) and batches < saved_len):
            return  # saved at an epoch boundary: the next epoch starts from its first batch anyway
        if changed:
            k = changed[0]
            raise ConfigError(f"resume: data {k}", now[k],
                              f"the checkpoint was saved {batches} global batches into an epoch with {k}="
                              f"{state[k]!r}, so its position means nothing here",
                              "resume with the same data, global batch and seed, or from an end-of-epoch checkpoint")
        self._resume_at = batches
        self._resume_key = state.get("key")

    def __iter__(self) -> Iterator[list[int]]:
        # A resumed epoch re-cuts the saved permutation and skips the windows already trained on;
        # the generator gets its saved state back here, after this iterator's own DataLoader drew
        # from it (the interrupted run had drawn that one long before the save). The skip is
        # cleared once the first batch is produced, so an iterator Lightning creates and drops
        # before training keeps it.
        first, key = self._resume_at, self._resume_key
        if self._resume_rng is not None:
            self.sampler.set_rng_state(self._resume_rng)
        perm = self.sampler.permutation(key)  # None (draw) unless a resumed epoch saved its draw
        g = self.global_batch
        self.consumed = first
        for start in range(first * g, len(perm), g):
            self._resume_at, self._resume_key, self._resume_rng = 0, None, None
            window = perm[start:start + g]
            sizes = self.batch_sizes if len(window) == g else split_proportional(len(window), self.batch_sizes)
            if len(window) < g:  # the one-device batch sampler ran out of indices filling this batch
                self.sampler.exhausted()
                if self.drop_last or min(sizes) == 0:
                    return  # every pipeline needs at least one sample of a batch; all ranks stop together
            off = sum(sizes[:self.pipeline])
            self.window = window
            yield window[off:off + sizes[self.pipeline]]
        if len(perm) % g == 0:  # asked for one more batch: the one-device sampler runs out now
            self.sampler.exhausted()

    def __len__(self) -> int:
        full, rest = divmod(self.sampler.num_samples, self.global_batch)
        return full + 1 if rest and not self.drop_last and not self.left_out else full

    @property
    def left_out(self) -> int:
        """Samples of a last batch that a one-device loader would use and this sampler does not (0:
        none): one too small to give every pipeline one although ``drop_last`` is false, or, where
        ``drop_last`` drops it (training) but the one-device loader keeps it, any short last batch."""
        if self.drop_last:
            return self.sampler.num_samples % self.global_batch if self.one_device_keeps_last else 0
        return short_last_batch(self.sampler.num_samples, self.global_batch, self.batch_sizes)

    def left_out_note(self, key: str) -> str | None:
        """What to tell the user when :attr:`left_out` is not 0 (None otherwise)."""
        n, total, p = self.left_out, self.sampler.num_samples, len(self.batch_sizes)
        if not n:
            return None
        if self.drop_last:  # training: every optimizer step takes exactly G sequences
            g = self.global_batch
            return (f"{key}: the last batch holds {n} of the {total} samples; one device trains on it, but each "
                    f"optimizer step of the plan takes a whole global batch of {g}, so it is dropped every epoch "
                    f"({len(self)} steps an epoch, not {len(self) + 1}); pass DataLoader(..., drop_last=True) to drop "
                    f"it on one device too, or use a number of samples that {g} divides")
        return (f"{key}: the last batch holds {n} of the {total} samples, too few to give each of the plan's {p} "
                f"pipelines one, so it is left out (one device would use it); use a batch size that divides {total} "
                f"or leaves at least {p} samples in the last batch")


class PlanDataLoader(DataLoader):
    """A DataLoader over a :class:`PlanBatchSampler` that Lightning can save and restore mid-epoch.

    Lightning restarts a DataLoader without ``state_dict`` / ``load_state_dict`` from its first
    batch when resuming a checkpoint saved mid-epoch (the batches seen before the save are seen
    twice, those after it never); with them, its fit loop stores the state in the checkpoint and
    loads it before the resumed epoch starts, so the run continues at the next global batch.
    """

    def state_dict(self) -> dict:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.batch_sampler.load_state_dict(state)

    def with_batch_sampler(self, batch_sampler) -> PlanDataLoader:
        """The same loader (dataset, workers, collate, generator, ...) over ``batch_sampler``, e.g. this
        one's batch sampler wrapped to record what it yields (a DataLoader's cannot be replaced)."""
        return PlanDataLoader(self.dataset, batch_sampler=batch_sampler, **self.settings)


def loader_shuffles(loader: DataLoader) -> bool:
    """Whether a DataLoader shuffles: RandomSampler (``shuffle=True``) or a shuffling DistributedSampler.

    Other samplers cannot be re-cut into pipeline slices: ConfigError naming the sampler.
    """
    from torch.utils.data.distributed import DistributedSampler

    check_map_style(loader, "DataLoader")
    s = _sampler(loader)
    if isinstance(s, RandomSampler):
        if s.replacement or s.num_samples != len(loader.dataset):
            raise ConfigError("DataLoader.sampler", f"RandomSampler(replacement={s.replacement}, num_samples="
                              f"{s.num_samples})", "the hexiscale strategy cuts one permutation of the whole "
                              "dataset per epoch into per-pipeline slices", "use shuffle=True (a permutation of "
                              "every sample) or subset the dataset")
        return True
    if isinstance(s, SequentialSampler):
        return False
    if isinstance(s, DistributedSampler):
        return bool(s.shuffle)
    raise ConfigError("DataLoader.sampler", type(s).__name__,
                      "the hexiscale strategy cuts every global batch into per-pipeline slices and can only "
                      "replace RandomSampler / SequentialSampler (shuffle=True / False)",
                      "build the DataLoader with shuffle=True or False and no custom sampler")


def check_map_style(loader: DataLoader, key: str) -> None:
    """An IterableDataset cannot be cut by index: ConfigError keyed ``key.dataset`` (its sampler is
    torch's placeholder, which the sampler check named as if the user had chosen it; an evaluation
    loader's was a TypeError from ``len``)."""
    from torch.utils.data import IterableDataset

    if isinstance(loader.dataset, IterableDataset):
        raise ConfigError(f"{key}.dataset", type(loader.dataset).__name__,
                          "is an IterableDataset; the hexiscale strategy gives each pipeline its slice of every "
                          "global batch by sample index, so it needs a map-style dataset (__getitem__ and __len__)",
                          "index the data: a map-style Dataset, e.g. lightning_hexiscale.data.TokenFileDataset over "
                          "a file from `hexiscale prepare-data`, or TokenWindows over a token array")


def _batch_size(loader: DataLoader, key: str) -> int:
    # Lightning re-creates predict loaders around its own batch-sampler wrapper (to record the
    # indices), so their batch_size moves to the batch sampler.
    g = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
    if g is None:
        raise ConfigError(f"{key}.batch_size", None, "the hexiscale strategy needs a DataLoader with batch_size "
                          "(it replaces the batch sampler by per-pipeline slices)", "pass batch_size=G")
    return int(g)


def _sampler(loader: DataLoader) -> Sampler:
    """The loader's sampler (for Lightning's predict wrapper, the one its batch sampler draws from)."""
    return getattr(loader.batch_sampler, "sampler", None) or loader.sampler


def check_train_loader(loader: DataLoader, global_batch: int | None) -> None:
    """The checks :func:`plan_dataloader` makes on a training loader, before a plan exists: a batch
    size, equal to ``global_batch`` when that is known, and a sampler that can be cut per pipeline."""
    g = _batch_size(loader, "train_dataloader")
    if global_batch is not None and g != global_batch:
        raise ConfigError("train_dataloader.batch_size", g, f"the plan takes {global_batch} sequences per step",
                          f"use DataLoader(batch_size={global_batch}) or re-plan with global_batch={g}")
    loader_shuffles(loader)


def plan_dataloader(loader: DataLoader, batch_sizes: Sequence[int], pipeline: int, *, drop_last: bool,
                    seed: int | None = None, agree: Callable[[Any], Any] | None = None,
                    key: str = "train_dataloader") -> DataLoader:
    """A copy of ``loader`` that yields pipeline ``pipeline``'s slice of each global batch.

    The loader's ``batch_size`` is the global batch G of one-device training and must equal
    sum(batch_sizes) for training (``drop_last=True``); evaluation loaders may use any batch size,
    which is split in proportion to the plan's batches. Shuffled, the order is the one-device
    loader's (its ``generator``, else torch's global one), unless a fixed ``seed`` is given;
    ``agree`` makes every rank take rank 0's draw.
    """
    check_map_style(loader, key)
    g = _batch_size(loader, key)
    plan_g = sum(batch_sizes)
    if drop_last and g != plan_g:
        raise ConfigError(f"{key}.batch_size", g,
                          f"the plan's pipelines take {list(batch_sizes)} sequences per step, {plan_g} in all",
                          f"use DataLoader(batch_size={plan_g}) or re-plan with global_batch={g}")
    sizes = list(batch_sizes) if g == plan_g else split_proportional(g, batch_sizes)
    if min(sizes) < 1:
        raise ConfigError(f"{key}.batch_size", g, f"split over the plan's pipelines as {sizes}; every pipeline "
                          "needs at least one sample per batch", f"use a batch size of at least {len(sizes)}")
    rest = short_last_batch(len(loader.dataset), g, sizes)
    if key == "predict_dataloader" and rest:
        # Evaluation drops such a last batch (every pipeline needs a sample); predictions must not.
        raise ConfigError(f"{key}.batch_size", g, f"the last batch holds {rest} of the {len(loader.dataset)} "
                          f"samples, too few for every one of the plan's {len(sizes)} pipelines",
                          f"use a batch size that divides {len(loader.dataset)}, or leaves a last batch of at least "
                          f"{len(sizes)}")
    from torch.utils.data.distributed import DistributedSampler

    if seed is None and isinstance(_sampler(loader), DistributedSampler):
        seed = _sampler(loader).seed  # its own rule: randperm of seed + epoch
    generator = getattr(_sampler(loader), "generator", None) if seed is None else None
    sampler = PlanBatchSampler(len(loader.dataset), sizes, pipeline, shuffle=loader_shuffles(loader), seed=seed,
                               generator=generator, agree=agree, drop_last=drop_last or loader.drop_last,
                               one_device_keeps_last=not loader.drop_last)
    # The loader's generator goes along: each DataLoader iterator draws its workers' base seed from
    # it (or from the global generator), as the one-device loader's iterators do.
    settings = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                    worker_init_fn=loader.worker_init_fn, persistent_workers=loader.persistent_workers,
                    generator=loader.generator,
                    multiprocessing_context=loader.multiprocessing_context if loader.num_workers else None)
    out = PlanDataLoader(loader.dataset, batch_sampler=sampler, **settings)
    out.settings = settings  # PlanDataLoader.with_batch_sampler
    return out
