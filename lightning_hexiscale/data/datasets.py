"""Token datasets that need no download. Each yields 1-D int64 tensors of ``seq_len + 1`` tokens
(inputs = [:-1], targets = [1:]):

- :class:`TokenFileDataset`: a tokenised ``.bin`` file (``np.memmap`` of uint16 or uint32 token
  ids), with the JSON index ``hexiscale prepare-data`` writes beside it (dtype and vocabulary
  checked against the model);
- :func:`text_file_dataset`: a local UTF-8 text file through the byte-level tokenizer (token = byte
  value, vocabulary 256, so ``llama_tiny`` needs nothing else);
- :func:`generated_corpus`: a deterministic English-like corpus generated from a seed (a small
  grammar over a fixed word list), so a demo has data that ships with the code and a loss that falls.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_hexiscale.errors import ConfigError

BYTE_VOCAB = 256
"""Vocabulary of the byte-level tokenizer: one token per byte value."""


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens over a 1-D token array.

    Sample i = tokens[i*seq_len : i*seq_len + seq_len + 1] (consecutive windows share one token, so
    every token but the first is a target exactly once); N = (len - 1) // seq_len samples.
    """

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_len: int, vocab_size: int | None = None,
                 key: str = "data", source: str | None = None):
        """``source``: the file the tokens came from, named as ``key``'s value in the errors."""
        if seq_len < 1:
            raise ConfigError(f"{key}.seq_len", seq_len, "must be a positive integer", "use the model's seq_len")
        self.tokens, self.seq_len = tokens, seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            held = "is empty" if len(tokens) == 0 else f"holds {len(tokens)} tokens"
            raise ConfigError(key, source if source is not None else f"{len(tokens)} tokens",
                              (f"{held}, and one sample" if source is not None else "one sample") +
                              f" needs seq_len + 1 = {seq_len + 1} tokens", "use a longer file or a shorter model.seq_len")
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


TOKEN_DTYPES = ("uint16", "uint32")


class TokenFileDataset(TokenWindows):
    """A tokenised corpus on disk: a flat ``np.memmap`` of token ids (nanoGPT's ``.bin`` format).

    With the index ``hexiscale prepare-data`` writes (``train.bin`` -> ``train.json``, see
    :mod:`lightning_hexiscale.data.tokenize`) the dtype comes from it and is checked, and so are the
    vocabulary (the tokenizer's must not exceed the model's ``vocab_size``) and the token count.
    Without an index the file is read as ``dtype`` (default uint16, nanoGPT's files). A file whose
    size is not a whole number of tokens is refused.
    """

    def __init__(self, path: str | Path, seq_len: int, vocab_size: int | None = None, dtype: str | None = None):
        from lightning_hexiscale.data.tokenize import index_path, is_index, read_index

        p = Path(path)
        _check_data_file(p, "bin")
        if p.suffix == ".json" and is_index(p):
            raise ConfigError("data.path", str(p), "is the index of a token file, not its tokens",
                              f"give the token file beside it: data.path={p.with_suffix('.bin')}")
        _check_data_format(p, "bin")
        # prepare-data's token files end in .bin: train.jsonl's "index" train.json is train.bin's
        self.index = read_index(p) if p.suffix == ".bin" else None
        if self.index is not None:
            if dtype is not None and dtype != self.index["dtype"]:
                raise ConfigError("data.dtype", dtype, f"{index_path(p)} says the tokens are {self.index['dtype']}",
                                  "drop data.dtype (the index decides)")
            dtype = self.index["dtype"]
            if vocab_size is not None and int(self.index["vocab_size"]) > vocab_size:
                raise ConfigError("model.vocab_size", vocab_size,
                                  f"{p} was tokenised with a vocabulary of {self.index['vocab_size']} ids "
                                  f"({self.index.get('tokenizer')}), more than the model has",
                                  "use the model that goes with that tokenizer, or tokenise with the model's tokenizer")
        dtype = dtype or "uint16"
        if dtype not in TOKEN_DTYPES:
            raise ConfigError("data.dtype", dtype, f"must be one of {TOKEN_DTYPES}", "use uint16 or uint32")
        item = np.dtype(dtype).itemsize
        size = p.stat().st_size
        if size == 0:  # np.memmap cannot map it
            raise ConfigError("data.path", str(p), "the token file is empty", "tokenise a corpus into it")
        if size % item:
            raise ConfigError("data.path", str(p), f"{size} bytes is not a whole number of {dtype} tokens "
                              f"({item} bytes each): wrong dtype or a truncated file",
                              "tokenise again with `hexiscale prepare-data`, or set data.dtype to the file's dtype")
        if self.index is not None and size // item != int(self.index["num_tokens"]):
            raise ConfigError("data.path", str(p), f"holds {size // item} tokens but its index says "
                              f"{self.index['num_tokens']}", "tokenise again with `hexiscale prepare-data`")
        super().__init__(np.memmap(p, dtype=np.dtype(dtype), mode="r"), seq_len, vocab_size, key="data.path",
                         source=str(p))


JSON_LINES = (".jsonl", ".ndjson", ".json")
"""Suffixes of JSON (Lines) corpora: ``hexiscale prepare-data`` reads their text field."""
TEXT_SUFFIXES = (".txt", ".md", ".csv", ".tsv", *JSON_LINES)
"""Suffixes of text files, which data.kind=bin (token ids) does not read."""


def _check_data_file(p: Path, kind: str) -> None:
    """``data.path`` is a file, not missing and not a folder."""
    if p.is_dir():
        raise ConfigError("data.path", str(p), f"is a directory; data.kind={kind} reads one file",
                          "give the path of the file itself" + (" (hexiscale prepare-data writes one .bin file from "
                                                                 "many inputs)" if kind == "bin" else ""))
    if not p.is_file():
        raise ConfigError("data.path", str(p), f"no such {'text' if kind == 'text' else 'token'} file",
                          "give the path of a local UTF-8 text file" if kind == "text" else
                          "give a .bin file made by `hexiscale prepare-data` (or of uint16 ids)")


def _check_data_format(p: Path, kind: str) -> None:
    """``data.path`` is not a JSON (Lines) corpus read as text (its braces, keys and escapes would be
    the training text) nor a text file read as token ids (two bytes of text per uint16 "token"), by
    its suffix."""
    prepare = f"hexiscale prepare-data {p} --tokenizer DIR --out data/train.bin, then data.kind=bin data.path=data/train.bin"
    suffix = p.suffix.lower()
    if kind == "text" and suffix in JSON_LINES:
        raise ConfigError("data.path", str(p), f"is JSON ({suffix}); data.kind=text would train on its braces, keys "
                          "and escapes as if they were the text", f"tokenise its text field: {prepare}")
    if kind == "bin" and suffix in TEXT_SUFFIXES:
        raise ConfigError("data.path", str(p), f"is a text file ({suffix}); data.kind=bin reads token ids, and its "
                          "bytes would be read as ids", f"tokenise it: {prepare}" + ("" if suffix in JSON_LINES else
                                                                                   "; or data.kind=text (byte tokens)"))


def byte_tokenize(text: str) -> np.ndarray:
    """Byte-level tokenizer: the UTF-8 bytes of ``text`` as token ids 0..255 (no vocabulary file)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def byte_detokenize(tokens: Sequence[int]) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


TEXT_READ_BYTES = 16 * 2**20
"""Bytes of a text file read at a time to check that it is UTF-8 (and characters at a time to
translate its line ends)."""


def text_file_dataset(path: str | Path, seq_len: int) -> TokenWindows:
    """A local UTF-8 text file, byte-tokenised (vocabulary 256), with Python's text-mode line ends
    ("\\r\\n" and a lone "\\r" read as "\\n").

    Memory: the file's own bytes are the tokens (a read-only uint8 ``np.memmap``, shared by the ranks
    of a machine through the page cache) when it has no "\\r"; otherwise one uint8 array of at most
    its size. (The whole text as a str plus int64 ids took about 10 bytes of RAM per byte of text on
    every rank: 0.5 GB for a 55 MB file.)
    """
    p = Path(path)
    _check_data_file(p, "text")
    _check_data_format(p, "text")
    if p.suffix == ".bin":  # token ids, not text: uint16 ids below 128 would even pass as UTF-8
        raise ConfigError("data.path", str(p), "data.kind=text reads a UTF-8 text file (byte tokens); a .bin file "
                          "holds token ids", "set data.kind=bin for a token file of `hexiscale prepare-data`")
    from lightning_hexiscale.data.tokenize import compression

    packed = compression(p)
    if packed is not None:  # read as text it was "not UTF-8 text. Fix: convert the file to UTF-8"
        raise ConfigError("data.path", str(p), f"is {packed[0]}-compressed; data.kind=text reads plain UTF-8 text",
                          f"decompress it first, e.g. {packed[1]} {p}")
    has_cr = _check_utf8(p)
    size = p.stat().st_size
    if size == 0:  # np.memmap cannot map an empty file; TokenWindows says it is too short
        tokens = np.zeros(0, dtype=np.uint8)
    elif not has_cr:
        tokens = np.memmap(p, dtype=np.uint8, mode="r")
    else:
        tokens = np.empty(size, dtype=np.uint8)  # translated line ends only shorten the text
        n = 0
        with open(p, encoding="utf-8") as f:
            while chunk := f.read(TEXT_READ_BYTES):
                data = chunk.encode("utf-8")
                tokens[n:n + len(data)] = np.frombuffer(data, dtype=np.uint8)
                n += len(data)
        tokens = tokens[:n]
    return TokenWindows(tokens, seq_len, BYTE_VOCAB, key="data.path", source=str(p))


def _check_utf8(p: Path) -> bool:
    """Reads ``p`` once in chunks, a ConfigError at the first byte that is not UTF-8; returns
    whether it holds a "\\r" (then its line ends need translating)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, has_cr = 0, False
    with open(p, "rb") as f:
        while True:
            block = f.read(TEXT_READ_BYTES)
            held = len(decoder.getstate()[0])  # an incomplete character carried from the last block
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:  # was a traceback from every rank
                raise ConfigError("data.path", str(p), f"not UTF-8 text ({e.reason} at byte {offset - held + e.start})",
                                  "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if not block:
                return has_cr
            has_cr = has_cr or b"\r" in block
            offset += len(block)


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


MAX_GENERATED_TOKENS = 2**27
"""Most tokens the generated corpus holds (num_samples x seq_len = 134,217,728: about 20 s to generate and
1 GiB of token ids); data.num_samples=2**70 generated text until the job was killed."""


def generated_corpus(num_samples: int, seq_len: int, seed: int = 0) -> TokenWindows:
    """``num_samples`` windows of :func:`generated_text`, byte-tokenised."""
    if isinstance(num_samples, int) and isinstance(seq_len, int) and num_samples * seq_len > MAX_GENERATED_TOKENS:
        raise ConfigError("data.num_samples", num_samples, f"the generated corpus holds at most "
                          f"{MAX_GENERATED_TOKENS:,} tokens, and {num_samples:,} sequences of {seq_len} tokens are "
                          f"{num_samples * seq_len:,}", f"use at most {MAX_GENERATED_TOKENS // seq_len:,} samples "
                          "(the default is 2048), or train on a file (data.kind=bin, hexiscale prepare-data)")
    text = generated_text(num_samples * seq_len + 1, seed)
    return TokenWindows(byte_tokenize(text), seq_len, BYTE_VOCAB, key="data")


def check_data_settings(kind: str, path: str | None = None, vocab_size: int | None = None,
                        dtype: str | None = None) -> None:
    """What :func:`make_dataset` refuses without reading a file: an unknown ``kind``, a ``path`` that
    ``generated`` would never read, a ``dtype`` of a kind that reads no token ids, a file kind without
    a ``path``, a ``dtype`` other than uint16 / uint32, a text file (by its suffix) read as token ids or
    JSON read as text, byte-level text for a vocabulary under 256. ``hexiscale train dry_run=true`` checks
    these alone: the file itself may be on the training machines only."""
    if kind not in ("generated", "text", "bin"):
        raise ConfigError("data.kind", kind, "must be one of generated, text, bin", "use data.kind=generated")
    if kind == "generated" and path is not None:
        # data.path=book.txt alone would train on the generated corpus, and the book never be read
        guess = "bin" if Path(path).suffix == ".bin" else "text"
        raise ConfigError("data.path", path, "data.kind=generated (the default) reads no file: it trains on the "
                          "generated corpus", f"set data.kind={guess} to train on this file "
                          f"({'a token file of hexiscale prepare-data' if guess == 'bin' else 'UTF-8, byte tokens'}), "
                          "or drop data.path")
    if dtype is not None and kind != "bin":
        raise ConfigError("data.dtype", dtype, f"only data.kind=bin reads token ids of a dtype, not data.kind={kind}",
                          "drop data.dtype, or set data.kind=bin for a file of raw token ids")
    if kind != "generated" and path is None:
        raise ConfigError("data.path", None, f"data.kind={kind} reads a local file", "set data.path=/path/to/file")
    if kind != "generated":
        _check_data_format(Path(path), kind)  # by its suffix: the file need not be here
    if dtype is not None and dtype not in TOKEN_DTYPES:  # a dry run said "planned only" to data.dtype=uint8
        raise ConfigError("data.dtype", dtype, f"must be one of {', '.join(TOKEN_DTYPES)} (the width of the file's "
                          "token ids)", "use uint16 or uint32, or drop it for a file of hexiscale prepare-data (its "
                          "index says)")
    if kind == "text" and vocab_size is not None and vocab_size < BYTE_VOCAB:
        raise ConfigError("model.vocab_size", vocab_size, "byte-level text needs a vocabulary of 256",
                          "use a model with vocab_size >= 256")


def make_dataset(kind: str, seq_len: int, *, path: str | None = None, num_samples: int = 512, seed: int = 0,
                 vocab_size: int | None = None, dtype: str | None = None) -> TokenWindows:
    """Dataset by kind: ``generated`` (default demo data), ``text`` (``path``: UTF-8 file, byte
    tokens) or ``bin`` (``path``: token file of ``hexiscale prepare-data``, or raw ids of ``dtype``).
    The settings are checked first (:func:`check_data_settings`), then the file."""
    check_data_settings(kind, path, vocab_size, dtype)
    if kind == "generated":
        return generated_corpus(num_samples, seq_len, seed)
    if kind == "text":
        return text_file_dataset(path, seq_len)
    return TokenFileDataset(path, seq_len, vocab_size, dtype)
