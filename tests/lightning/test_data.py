"""Per-pipeline batches and the token datasets (pure, milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hexiscale.data import (PlanBatchSampler, TokenFileDataset, generated_corpus, plan_dataloader,
                                      split_proportional, text_file_dataset)
from lightning_hexiscale.errors import ConfigError


def test_split_proportional():
    assert split_proportional(16, [6, 5, 5]) == [6, 5, 5]
    assert split_proportional(8, [6, 5, 5]) == [3, 3, 2]
    assert sum(split_proportional(7, [3, 1])) == 7


@pytest.mark.parametrize("shuffle", [False, True])
def test_pipelines_cut_one_shared_permutation(shuffle):
    sizes = [3, 1, 2]
    samplers = [PlanBatchSampler(24, sizes, i, shuffle=shuffle, seed=5) for i in range(3)]
    for epoch in (0, 1):
        for s in samplers:
            s.sampler.set_epoch(epoch)
        per_pipe = [list(s) for s in samplers]
        assert [len(b) for b in per_pipe[0]] == [3] * 4 and len(samplers[1]) == 4
        steps = [sum((per_pipe[i][k] for i in range(3)), []) for k in range(4)]
        flat = sum(steps, [])
        assert sorted(flat) == list(range(24))  # every sample once per epoch, batch k = window k
        assert (flat == list(range(24))) == (not shuffle)
    if shuffle:  # the permutation changes with the epoch
        samplers[0].set_epoch(0)
        a = list(samplers[0])
        samplers[0].set_epoch(1)
        assert a != list(samplers[0])


def test_plan_dataloader_checks_the_global_batch():
    ds = generated_corpus(20, 8)
    with pytest.raises(ConfigError, match="batch_size=6"):
        plan_dataloader(DataLoader(ds, batch_size=4), [4, 2], 0, seed=0, drop_last=True)
    val = plan_dataloader(DataLoader(ds, batch_size=3), [4, 2], 1, seed=0, drop_last=False)
    assert [b.shape[0] for b in val] == [1] * 7  # 20 = 6 full batches of 3 (2+1) + 2 (1+1)


def test_datasets(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("héllo world, " * 20)
    ds = text_file_dataset(text, 16)
    assert ds[0].shape == (17,) and int(ds[0].max()) < 256 and torch.equal(ds[0][16:], ds[1][:1])
    ids = np.arange(1000, dtype=np.uint16) % 300
    ids.tofile(tmp_path / "t.bin")
    assert TokenFileDataset(tmp_path / "t.bin", 32)[1][0].item() == 32
    with pytest.raises(ConfigError, match="vocabulary"):
        TokenFileDataset(tmp_path / "t.bin", 32, vocab_size=256)
    g1, g2 = generated_corpus(8, 32, seed=1), generated_corpus(8, 32, seed=1)
    assert torch.equal(g1[3], g2[3])


def test_predict_loader_never_drops_its_last_batch():
    ds = generated_corpus(21, 8)  # batches of 5: the last one holds 1 sample, for 2 pipelines
    with pytest.raises(ConfigError, match=r"predict_dataloader.batch_size = 5: the last batch holds 1 of the 21"):
        plan_dataloader(DataLoader(ds, batch_size=5), [4, 2], 0, drop_last=False, key="predict_dataloader")
    loaders = [plan_dataloader(DataLoader(ds, batch_size=7), [4, 2], i, drop_last=False, key="predict_dataloader")
               for i in range(2)]
    assert sum(b.shape[0] for dl in loaders for b in dl) == 21  # every sample, once


def test_an_evaluation_loader_says_what_its_last_batch_leaves_out():
    """Evaluation leaves out a last batch too small for every pipeline (13 samples in batches of 6 for
    2 pipelines: the last holds 1); the metric then covers 12 samples, and the user is told."""
    ds = generated_corpus(13, 8)
    loaders = [plan_dataloader(DataLoader(ds, batch_size=6), [4, 2], i, drop_last=False, key="eval_dataloader")
               for i in range(2)]
    assert sum(b.shape[0] for dl in loaders for b in dl) == 12
    sampler = loaders[0].batch_sampler
    assert sampler.left_out == 1
    assert sampler.left_out_note("eval_dataloader") == (
        "eval_dataloader: the last batch holds 1 of the 13 samples, too few to give each of the plan's 2 pipelines "
        "one, so it is left out (one device would use it); use a batch size that divides 13 or leaves at least 2 "
        "samples in the last batch")
    kept = plan_dataloader(DataLoader(generated_corpus(14, 8), batch_size=6), [4, 2], 0, drop_last=False,
                           key="eval_dataloader")  # a last batch of 2: one sample each
    assert kept.batch_sampler.left_out == 0 and kept.batch_sampler.left_out_note("eval_dataloader") is None
    asked = plan_dataloader(DataLoader(ds, batch_size=6, drop_last=True), [4, 2], 0, drop_last=False,
                            key="eval_dataloader")  # the user's own drop_last: nothing to say
    assert asked.batch_sampler.left_out == 0


def test_a_training_loader_says_it_drops_a_last_batch_one_device_trains_on():
    """Training takes whole global batches: 32 samples in batches of 6 leave a last batch of 2, which
    one device trains on (the loader's drop_last is off) and the strategy drops every epoch (5 steps
    an epoch where one device takes 6). It said nothing; now the note says so and how to agree."""
    ds = generated_corpus(32, 8)
    sampler = plan_dataloader(DataLoader(ds, batch_size=6, shuffle=True), [4, 2], 0, drop_last=True).batch_sampler
    assert len(sampler) == 5 and sampler.left_out == 2
    assert sampler.left_out_note("train_dataloader") == (
        "train_dataloader: the last batch holds 2 of the 32 samples; one device trains on it, but each optimizer "
        "step of the plan takes a whole global batch of 6, so it is dropped every epoch (5 steps an epoch, not 6); "
        "pass DataLoader(..., drop_last=True) to drop it on one device too, or use a number of samples that 6 "
        "divides")
    for quiet in (DataLoader(ds, batch_size=6, drop_last=True), DataLoader(generated_corpus(30, 8), batch_size=6)):
        sampler = plan_dataloader(quiet, [4, 2], 0, drop_last=True).batch_sampler  # as one device: nothing to say
        assert sampler.left_out == 0 and sampler.left_out_note("train_dataloader") is None


def test_a_batch_with_a_sample_for_every_pipeline_gives_each_one():
    """Largest remainder alone split a batch of 2 over pipelines of 3 and 1 as [2, 0]: a validation
    loader of 14 samples in batches of 4 (over a plan's 4 and 2) left its last 2 samples out, and the
    warning said 'too few to give each of the plan's 2 pipelines one ... leaves at least 2 samples'
    (it held 2); a batch of 3 over [10, 1, 1] was refused with 'use a batch size of at least 3'."""
    assert split_proportional(2, [3, 1]) == [1, 1]
    assert split_proportional(3, [10, 1, 1]) == [1, 1, 1]
    assert split_proportional(4, [10, 1, 1]) == [2, 1, 1]
    assert split_proportional(1, [3, 1]) == [1, 0]  # fewer samples than pipelines: still proportional
    loaders = [plan_dataloader(DataLoader(generated_corpus(14, 8), batch_size=4), [4, 2], i, drop_last=False,
                               key="eval_dataloader") for i in range(2)]
    assert loaders[0].batch_sampler.left_out == 0
    assert sum(b.shape[0] for dl in loaders for b in dl) == 14  # every sample, as one device
    assert len(plan_dataloader(DataLoader(generated_corpus(9, 8), batch_size=3), [10, 1, 1], 2, drop_last=False,
                               key="eval_dataloader")) == 3


def test_a_data_file_is_never_ignored(tmp_path):
    """`hexiscale train data.path=book.txt` (data.kind left at generated) trained on the generated
    corpus and never read the book; data.dtype with data.kind=text was ignored as silently."""
    from lightning_hexiscale.data import make_dataset

    book = tmp_path / "book.txt"
    book.write_text("héllo world, " * 20)
    with pytest.raises(ConfigError, match="data.path = .*book.txt.*reads no file.*Fix: set data.kind=text"):
        make_dataset("generated", 16, path=str(book))
    with pytest.raises(ConfigError, match="Fix: set data.kind=bin"):
        make_dataset("generated", 16, path=str(tmp_path / "train.bin"))
    with pytest.raises(ConfigError, match="data.dtype = 'uint32': only data.kind=bin"):
        make_dataset("text", 16, path=str(book), dtype="uint32")
    assert len(make_dataset("text", 16, path=str(book))) == len(text_file_dataset(book, 16))


def test_a_text_file_that_is_not_utf8_is_a_config_error(tmp_path):
    """`hexiscale train data.kind=text data.path=latin1.txt` failed with a UnicodeDecodeError
    traceback on the ranks."""
    f = tmp_path / "latin1.txt"
    f.write_bytes(b"the cluster trains\n" * 40 + b"caf\xe9 au lait\n")
    with pytest.raises(ConfigError, match=r"data.path = .*latin1.txt.*not UTF-8 text \(invalid continuation byte "
                                          r"at byte 763\).*Fix: convert the file to UTF-8"):
        text_file_dataset(f, 16)


def test_a_compressed_text_file_is_named_as_such(tmp_path):
    """`data.kind=text data.path=book.txt.gz` said "not UTF-8 text ... convert the file to UTF-8"."""
    import gzip

    f = tmp_path / "book.txt.gz"
    f.write_bytes(gzip.compress(b"the cluster trains\n" * 40))
    with pytest.raises(ConfigError, match=r"data.path = .*book.txt.gz.*is gzip-compressed; data.kind=text reads plain "
                                          r"UTF-8 text. Fix: decompress it first, e.g. gunzip -k "):
        text_file_dataset(f, 16)


def test_a_text_file_costs_no_more_memory_than_its_size(tmp_path, monkeypatch):
    """data.kind=text read the whole file into a str and then int64 ids: about 10 bytes of RAM per
    byte of text on every rank (0.5 GB for a 55 MB book). Now the file is mapped as uint8 (or, with
    "\\r" line ends to translate, copied once); the tokens are the ones the old reading gave."""
    import tracemalloc

    from lightning_hexiscale.data import datasets

    big = tmp_path / "big.txt"
    big.write_bytes("the cluster trains a small model, héllo\n".encode() * 100_000)  # 4.1 MB
    monkeypatch.setattr(datasets, "TEXT_READ_BYTES", 2**20, raising=False)  # the check reads 1 MiB at a time
    tracemalloc.start()
    ds = text_file_dataset(big, 64)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert isinstance(ds.tokens, np.memmap) and peak < big.stat().st_size
    assert torch.equal(ds[5], torch.as_tensor(np.frombuffer(big.read_bytes()[320:385], np.uint8).astype(np.int64)))
    monkeypatch.setattr(datasets, "TEXT_READ_BYTES", 7)  # chunks end inside characters and inside "\r\n"
    for raw in ["é\r\nab\rcd\n" * 9 + "€", "a\r" * 30, "€x" * 20]:
        f = tmp_path / "t.txt"
        f.write_bytes(raw.encode())
        want = np.frombuffer(f.read_text(encoding="utf-8").encode(), np.uint8)  # text mode, as before
        assert np.array_equal(np.asarray(text_file_dataset(f, 4).tokens), want)
    f.write_bytes("é".encode() * 10 + b"ab\xe9c\n")  # the bad byte is in the 4th chunk of 7
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(invalid continuation byte at byte 22\)"):
        text_file_dataset(f, 4)


def test_a_token_file_reads_only_its_own_index(tmp_path):
    """data.kind=bin data.path=train.jsonl took train.json (train.bin's index) for its own: "holds 9
    tokens but its index says 4"; data.path=train.json read the index as tokens ("343 bytes is not a
    whole number of uint16 tokens")."""
    from lightning_hexiscale.data.tokenize import INDEX_FORMAT

    np.arange(40, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "train.json").write_text(f'{{"format": "{INDEX_FORMAT}", "dtype": "uint16", "vocab_size": 64, '
                                         '"num_tokens": 40}\n')
    with pytest.raises(ConfigError, match=r"train.json': is the index of a token file, not its tokens. "
                                          r"Fix: give the token file beside it: data.path=.*train.bin"):
        TokenFileDataset(tmp_path / "train.json", 4)
    np.arange(30, dtype=np.uint16).tofile(tmp_path / "train.u16")  # raw ids of another name: no index
    ds = TokenFileDataset(tmp_path / "train.u16", 4)
    assert ds.index is None and len(ds) == 7
    assert TokenFileDataset(tmp_path / "train.bin", 4).index["num_tokens"] == 40


def test_a_token_file_is_not_read_as_text(tmp_path):
    """data.kind=text data.path=train.bin said "not UTF-8 text. Fix: convert the file to UTF-8", or,
    with ids below 128 (their bytes pass as UTF-8), trained on the ids' bytes as text."""
    (np.arange(200, dtype=np.uint16) % 100).tofile(tmp_path / "train.bin")
    with pytest.raises(ConfigError, match=r"train.bin': data.kind=text reads a UTF-8 text file.*Fix: set data.kind="
                                          r"bin"):
        text_file_dataset(tmp_path / "train.bin", 16)


def test_a_token_width_is_checked_before_the_file_is_read():
    """data.dtype=uint8 was refused only when the file was opened: a dry run (which reads no file) let it pass."""
    from lightning_hexiscale.data.datasets import check_data_settings

    with pytest.raises(ConfigError, match="data.dtype = 'uint8': must be one of uint16, uint32"):
        check_data_settings("bin", "nowhere/tokens.bin", dtype="uint8")
    check_data_settings("bin", "nowhere/tokens.bin", dtype="uint32")  # a width it reads: the file is not looked at


@pytest.mark.parametrize("kind,name,rule,fix", [
    ("text", "c.jsonl", r"is JSON \(.jsonl\); data.kind=text would train on its braces",
     r"tokenise its text field: hexiscale prepare-data .*c.jsonl --tokenizer DIR --out data/train.bin, then data.kind=bin"),
    ("bin", "c.jsonl", r"is a text file \(.jsonl\); data.kind=bin reads token ids", r"tokenise it: hexiscale prepare-data"),
    ("bin", "book.TXT", r"is a text file \(.txt\); data.kind=bin reads token ids", r"; or data.kind=text \(byte tokens\)"),
    ("text", "folder", r"is a directory; data.kind=text reads one file", r"give the path of the file itself"),
    ("bin", "folder", r"is a directory; data.kind=bin reads one file", r"hexiscale prepare-data writes one .bin file"),
])
def test_a_data_file_of_the_other_kind_or_a_folder_is_refused(tmp_path, kind, name, rule, fix):
    """A JSON Lines corpus as data.kind=text trained on its JSON as text, and as data.kind=bin on its
    bytes as token ids, silently; a folder was "no such text file"."""
    from lightning_hexiscale.data.datasets import make_dataset

    path = tmp_path / name
    if name == "folder":
        path.mkdir()
    else:
        path.write_text('{"text": "a document long enough to be many windows of sixteen tokens each"}\n' * 20)
    with pytest.raises(ConfigError, match=rf"^data.path = '.*{name}': {rule}.*Fix: .*{fix}"):
        make_dataset(kind, 16, path=str(path))


def test_a_file_too_short_is_named_with_what_it_holds(tmp_path):
    """It was ``data.path = '76 tokens': needs at least ...``: the value was not the file."""
    short, empty = tmp_path / "short.txt", tmp_path / "empty.txt"
    short.write_text("x" * 10)
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"^data.path = '.*short.txt': holds 10 tokens, and one sample needs "
                                          r"seq_len \+ 1 = 17 tokens"):
        text_file_dataset(short, 16)
    with pytest.raises(ConfigError, match=r"^data.path = '.*empty.txt': is empty, and one sample needs"):
        text_file_dataset(empty, 16)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from (torch.zeros(17, dtype=torch.long) for _ in range(8))


def test_an_iterable_dataset_is_named_as_such():
    # was "DataLoader.sampler = '_InfiniteConstantSampler' ... Fix: ... no custom sampler" (none was given)
    from lightning_hexiscale.data.samplers import check_train_loader

    loader = DataLoader(_Stream(), batch_size=4)
    with pytest.raises(ConfigError, match=r"DataLoader.dataset = '_Stream': is an IterableDataset; .*needs a map-style "
                                          r"dataset \(__getitem__ and __len__\)\. Fix: index the data"):
        check_train_loader(loader, 4)
    with pytest.raises(ConfigError, match=r"val_dataloader.dataset = '_Stream': is an IterableDataset"):
        plan_dataloader(loader, [2, 2], 0, drop_last=False, key="val_dataloader")  # was len()'s TypeError
