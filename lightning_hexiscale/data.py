"""Per-pipeline batches from a Plan, and three token datasets that need no download.

**Batches.** Pipeline i of a plan takes b_i sequences of every global batch of G = sum(b_i)
sequences. :class:`PlanBatchSampler` turns a dataset of N samples into exactly what one-device
training on batches of G would see, cut along the pipelines:

- per epoch e, one permutation of range(N) shared by every rank: ``randperm(N, seed + e)`` when
  shuffling (the same rule as ``DistributedSampler``), ``0..N-1`` otherwise;
- global batch k is ``perm[k*G : (k+1)*G]``; pipeline i takes its slice ``[off_i, off_i + b_i)``
  with off_i = b_0 + ... + b_(i-1); every rank of a pipeline loads the same samples (the first stage
  needs the tokens, the last the targets, the middle ones the shapes);
- a last, short global batch of n < G samples is split in proportion to the b_i (largest remainder),
  or dropped with ``drop_last``; training plans need full batches, so training loaders drop it.

**Datasets** yield 1-D int64 tensors of ``seq_len + 1`` tokens (inputs = [:-1], targets = [1:]):

- :class:`TokenFileDataset`: a tokenised ``.bin`` file (``np.memmap`` of uint16 token ids);
- :func:`text_file_dataset`: a local UTF-8 text file through the byte-level tokenizer (token = byte
  value, vocabulary 256, so ``llama_tiny`` needs nothing else);
- :func:`generated_corpus`: a deterministic English-like corpus generated from a seed (a small
  grammar over a fixed word list), so a demo has data that ships with the code and a loss that falls.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

from lightning_hexiscale.errors import ConfigError

BYTE_VOCAB = 256
"""Vocabulary of the byte-level tokenizer: one token per byte value."""


# ---- batch splitting ---------------------------------------------------------------------------
def split_proportional(n: int, weights: Sequence[int]) -> list[int]:
    """Split n items into len(weights) whole parts proportional to ``weights`` (largest remainder).

    Exact when n = sum(weights): split_proportional(16, [6, 5, 5]) = [6, 5, 5]; a short batch of 8
    gives [3, 3, 2] (quotas 3.0, 2.5, 2.5; ties go to the earlier pipeline).
    """
    total = sum(weights)
    quotas = [n * w / total for w in weights]
    parts = [math.floor(q) for q in quotas]
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - parts[i]), i))
    for i in order[: n - sum(parts)]:
        parts[i] += 1
    return parts


class _EpochPermutation(Sampler[int]):
    """The shared permutation of one epoch; ``set_epoch`` as on ``DistributedSampler``."""

    def __init__(self, num_samples: int, shuffle: bool, seed: int):
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=gen).tolist())

    def __len__(self) -> int:
        return self.num_samples


class PlanBatchSampler(Sampler[list[int]]):
    """Batches of indices for pipeline ``pipeline`` of a plan with pipeline batches ``batch_sizes``.

    Args:
        num_samples: dataset length N.
        batch_sizes: b_i of every pipeline (their sum is the global batch G).
        pipeline: index i of the pipeline whose slices this sampler yields.
        shuffle / seed: permutation per epoch (see the module doc); ``set_epoch`` through ``.sampler``.
        drop_last: drop a last global batch shorter than G (always on for training).
    """

    def __init__(self, num_samples: int, batch_sizes: Sequence[int], pipeline: int, *, shuffle: bool,
                 seed: int = 0, drop_last: bool = True):
        if not 0 <= pipeline < len(batch_sizes):
            raise ValueError(f"pipeline {pipeline} out of range for {len(batch_sizes)} pipelines")
        self.batch_sizes, self.pipeline, self.drop_last = list(batch_sizes), pipeline, drop_last
        self.global_batch = sum(batch_sizes)
        self.sampler = _EpochPermutation(num_samples, shuffle, seed)
        self.consumed = 0
        """Global batches of the current epoch the training loop has taken (the strategy counts them
        in ``training_step``: the sampler itself runs ahead by Lightning's prefetch)."""
        self._resume_at = 0

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    # ---- mid-epoch resume ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the epoch stands, in global batches: plan-independent (another plan with the same
        global batch resumes at the same window of the same permutation)."""
        s = self.sampler
        return {"epoch": s.epoch, "batches": self.consumed, "global_batch": self.global_batch,
                "num_samples": s.num_samples, "shuffle": s.shuffle, "seed": s.seed}

    def load_state_dict(self, state: dict) -> None:
        """The next iteration starts at global batch ``state["batches"]`` of the saved epoch."""
        batches = int(state.get("batches", 0))
        if not 0 < batches < len(self):
            return  # saved at an epoch boundary: the next epoch starts from its first batch anyway
        s = self.sampler
        now = {"global_batch": self.global_batch, "num_samples": s.num_samples, "shuffle": s.shuffle, "seed": s.seed}
        changed = [k for k in now if k in state and state[k] != now[k]]
        if changed:
            k = changed[0]
            raise ConfigError(f"resume: data {k}", now[k],
                              f"the checkpoint was saved {batches} global batches into an epoch with {k}="
                              f"{state[k]!r}, so its position means nothing here",
                              f"resume with the same data, global batch and seed, or from an end-of-epoch checkpoint")
        self._resume_at = batches

    def __iter__(self) -> Iterator[list[int]]:
        perm = list(self.sampler)
        g = self.global_batch
        # A resumed epoch skips the windows already trained on; the skip is cleared once the first
        # batch is produced, so an iterator Lightning creates and drops before training keeps it.
        first = self._resume_at
        self.consumed = first
        for start in range(first * g, len(perm), g):
            self._resume_at = 0
            window = perm[start:start + g]
            sizes = self.batch_sizes if len(window) == g else split_proportional(len(window), self.batch_sizes)
            if len(window) < g and (self.drop_last or min(sizes) == 0):
                return  # every pipeline needs at least one sample of a batch; all ranks stop together
            off = sum(sizes[:self.pipeline])
            yield window[off:off + sizes[self.pipeline]]

    def __len__(self) -> int:
        full, rest = divmod(self.sampler.num_samples, self.global_batch)
        if rest and not self.drop_last and min(split_proportional(rest, self.batch_sizes)) > 0:
            return full + 1
        return full


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


def loader_shuffles(loader: DataLoader) -> bool:
    """Whether a DataLoader shuffles: RandomSampler (``shuffle=True``) or a shuffling DistributedSampler.

    Other samplers cannot be re-cut into pipeline slices: ConfigError naming the sampler.
    """
    from torch.utils.data.distributed import DistributedSampler

    s = loader.sampler
    if isinstance(s, RandomSampler):
        return True
    if isinstance(s, SequentialSampler):
        return False
    if isinstance(s, DistributedSampler):
        return bool(s.shuffle)
    raise ConfigError("DataLoader.sampler", type(s).__name__,
                      "the hexiscale strategy cuts every global batch into per-pipeline slices and can only "
                      "replace RandomSampler / SequentialSampler (shuffle=True / False)",
                      "build the DataLoader with shuffle=True or False and no custom sampler")


def plan_dataloader(loader: DataLoader, batch_sizes: Sequence[int], pipeline: int, *, seed: int,
                    drop_last: bool, key: str = "train_dataloader") -> DataLoader:
    """A copy of ``loader`` that yields pipeline ``pipeline``'s slice of each global batch.

    The loader's ``batch_size`` is the global batch G of one-device training and must equal
    sum(batch_sizes) for training (``drop_last=True``); evaluation loaders may use any batch size,
    which is split in proportion to the plan's batches.
    """
    g = loader.batch_size
    if g is None:
        raise ConfigError(f"{key}.batch_size", None, "the hexiscale strategy needs a DataLoader with batch_size "
                          "(it replaces the batch sampler by per-pipeline slices)", "pass batch_size=G")
    plan_g = sum(batch_sizes)
    if drop_last and g != plan_g:
        raise ConfigError(f"{key}.batch_size", g,
                          f"the plan's pipelines take {list(batch_sizes)} sequences per step, {plan_g} in all",
                          f"use DataLoader(batch_size={plan_g}) or re-plan with global_batch={g}")
    sizes = list(batch_sizes) if g == plan_g else split_proportional(g, batch_sizes)
    if min(sizes) < 1:
        raise ConfigError(f"{key}.batch_size", g, f"split over the plan's pipelines as {sizes}; every pipeline "
                          "needs at least one sample per batch", f"use a batch size of at least {len(sizes)}")
    sampler = PlanBatchSampler(len(loader.dataset), sizes, pipeline, shuffle=loader_shuffles(loader),
                               seed=seed, drop_last=drop_last or loader.drop_last)
    return PlanDataLoader(loader.dataset, batch_sampler=sampler, num_workers=loader.num_workers,
                      collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
                      worker_init_fn=loader.worker_init_fn, persistent_workers=loader.persistent_workers,
                      multiprocessing_context=loader.multiprocessing_context if loader.num_workers else None)


# ---- datasets ----------------------------------------------------------------------------------
class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over a 1-D token array.

    Sample i = tokens[i*seq_len : i*seq_len + seq_len + 1] (consecutive windows share one token, so
    every token but the first is a target exactly once); N = (len - 1) // seq_len samples.
    """

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, vocab_size: int | None = None,
                 key: str = "data"):
        if seq_len < 1:
            raise ConfigError(f"{key}.seq_len", seq_len, "must be a positive integer", "use the model's seq_len")
        self.tokens, self.seq_len = tokens, seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError(key, f"{len(tokens)} tokens", f"needs at least seq_len + 1 = {seq_len + 1} tokens",
                              "use a longer file or a shorter model.seq_len")
        if vocab_size is not None and len(tokens):
            top = int(np.asarray(tokens[: min(len(tokens), 1 << 20)]).max())
            if top >= vocab_size:
                raise ConfigError(key, f"token id {top}", f"the model's vocabulary has {vocab_size} ids",
                                  "tokenise with the model's tokenizer or choose a model with a larger vocab_size")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        s = i * self.seq_len
        return torch.as_tensor(np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64))


class TokenFileDataset(TokenWindows):
    """A tokenised corpus on disk: a flat ``np.memmap`` of uint16 token ids (nanoGPT's ``.bin`` format)."""

    def __init__(self, path: str | Path, seq_len: int, vocab_size: int | None = None, dtype: str = "uint16"):
        p = Path(path)
        if not p.is_file():
            raise ConfigError("data.path", str(p), "no such token file", "give the path of a .bin file of uint16 ids")
        super().__init__(np.memmap(p, dtype=np.dtype(dtype), mode="r"), seq_len, vocab_size, key="data.path")


def byte_tokenize(text: str) -> np.ndarray:
    """Byte-level tokenizer: the UTF-8 bytes of ``text`` as token ids 0..255 (no vocabulary file)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def byte_detokenize(tokens: Sequence[int]) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def text_file_dataset(path: str | Path, seq_len: int) -> TokenWindows:
    """A local UTF-8 text file, byte-tokenised (vocabulary 256)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("data.path", str(p), "no such text file", "give the path of a local UTF-8 text file")
    return TokenWindows(byte_tokenize(p.read_text(encoding="utf-8")), seq_len, BYTE_VOCAB, key="data.path")


_SUBJECTS = ["the engineer", "a small model", "the cluster", "every pipeline", "the planner", "a fast GPU",
             "the slow machine", "each stage", "the optimizer", "a student"]
_VERBS = ["trains", "sends", "reads", "splits", "balances", "measures", "writes", "computes", "moves", "checks"]
_OBJECTS = ["the gradients", "a batch of tokens", "the layers", "its activations", "the network links",
            "a long sequence", "the weights", "every shard", "the loss", "a plan"]
_ENDS = ["before the next step", "over the slow link", "in parallel", "with care", "on every rank",
         "at the end of the epoch", "without waiting", "for the whole cluster"]


def generated_text(num_chars: int, seed: int = 0) -> str:
    """Deterministic English-like text of about ``num_chars`` characters: sentences drawn from a small
    grammar (subject verb object [ending].) with a seeded generator. Its byte-level entropy is far
    below log(256), so a tiny model's loss falls quickly from ~5.5 nats."""
    rng = np.random.default_rng(seed)
    out: list[str] = []
    n = 0
    while n < num_chars:
        words = [_SUBJECTS[rng.integers(len(_SUBJECTS))], _VERBS[rng.integers(len(_VERBS))],
                 _OBJECTS[rng.integers(len(_OBJECTS))]]
        if rng.random() < 0.5:
            words.append(_ENDS[rng.integers(len(_ENDS))])
        s = " ".join(words).capitalize() + ". "
        out.append(s)
        n += len(s)
    return "".join(out)[:num_chars]


def generated_corpus(num_samples: int, seq_len: int, seed: int = 0) -> TokenWindows:
    """``num_samples`` windows of :func:`generated_text`, byte-tokenised."""
    text = generated_text(num_samples * seq_len + 1, seed)
    return TokenWindows(byte_tokenize(text), seq_len, BYTE_VOCAB, key="data")


def make_dataset(kind: str, seq_len: int, *, path: str | None = None, num_samples: int = 512, seed: int = 0,
                 vocab_size: int | None = None) -> TokenWindows:
    """Dataset by kind: ``generated`` (default demo data), ``text`` (``path``: UTF-8 file) or ``bin``
    (``path``: uint16 token file)."""
    if kind == "generated":
        return generated_corpus(num_samples, seq_len, seed)
    if path is None:
        raise ConfigError("data.path", None, f"data.kind={kind} reads a local file", "set data.path=/path/to/file")
    if kind == "text":
        ds = text_file_dataset(path, seq_len)
        if vocab_size is not None and vocab_size < BYTE_VOCAB:
            raise ConfigError("model.vocab_size", vocab_size, "byte-level text needs a vocabulary of 256",
                              "use a model with vocab_size >= 256")
        return ds
    if kind == "bin":
        return TokenFileDataset(path, seq_len, vocab_size)
    raise ConfigError("data.kind", kind, "must be one of generated, text, bin", "use data.kind=generated")
