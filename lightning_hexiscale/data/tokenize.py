"""Tokenise local text or JSONL files into a token file plus a small JSON index (``hexiscale prepare-data``).

    hexiscale prepare-data corpus/*.jsonl --tokenizer /models/Llama-3.2-1B --field text --out data/train.bin

Output:

- ``data/train.bin``: the token ids of every document, one after the other, each document followed
  by the EOS token, as a flat little-endian array of ``uint16`` when the vocabulary has at most
  65,536 ids, else ``uint32`` (Llama 3's 128,256 ids need it): nanoGPT's ``.bin`` layout, read with
  ``np.memmap``;
- ``data/train.json``: the index (:data:`INDEX_FORMAT`): dtype, vocab_size, num_tokens, eos_id,
  bos_id, the tokenizer and each source file with its documents, tokens and bytes. The token-file
  dataset (:class:`lightning_hexiscale.data.datasets.TokenFileDataset`) reads it and checks dtype
  and vocabulary against the model.

Tokenisation is Hugging Face's ``tokenizers`` library (a ``tokenizer.json``, or a model directory
holding one), called with ``add_special_tokens=False``: the only special tokens in the output are
the EOS after each document and, with ``bos=True``, a BOS before it. Documents: one per line of a
JSONL file (the string under ``field``), one per text file. Files are read in chunks of
``chunk_bytes`` (a text file is cut after the last newline of each chunk), so files larger than
memory work; peak memory is about one chunk and its token ids. Outputs are written to temporary
names and renamed at the end: an interrupted run leaves no index that points at a partial file.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_hexiscale.config.file_errors import check_hub_id, expand_user
from lightning_hexiscale.config.units import format_bytes
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.progress import Heartbeat, shown_as

INDEX_FORMAT = "hexiscale-tokens/1"
UINT16_MAX_VOCAB = 1 << 16
"""Largest vocabulary whose ids fit uint16 (ids 0..65535)."""
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "<|im_end|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
DEFAULT_CHUNK_BYTES = 16 * 2**20
HEARTBEAT = Heartbeat(every_s=10.0)
"""prepare()'s plain progress lines where no bar is drawn (a pipe, a log file), one per 10 s at most."""


def token_dtype(vocab_size: int) -> str:
    """``uint16`` when every id fits (vocab <= 65,536), else ``uint32``."""
    return "uint16" if vocab_size <= UINT16_MAX_VOCAB else "uint32"


def index_path(token_file: str | Path) -> Path:
    """The JSON index beside a token file: ``train.bin`` -> ``train.json``."""
    return Path(token_file).with_suffix(".json")


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file or a directory holding one; also returns
    the directory (for tokenizer_config.json)."""
    from tokenizers import Tokenizer

    p = expand_user(path)
    f = p / "tokenizer.json" if p.is_dir() else p
    check_hub_id("--tokenizer", str(path), "--tokenizer DIR")
    if not p.exists():  # was "no tokenizer.json found", as if it were a directory without one
        raise ConfigError("--tokenizer", str(path), "no such file or directory",
                          "give a tokenizer.json file or a Hugging Face model directory with one")
    if not f.is_file():
        hint = (" (it has only a SentencePiece tokenizer.model: convert it once with transformers, "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))" if (p / "tokenizer.model").is_file() else "")
        raise ConfigError("--tokenizer", str(path), f"no tokenizer.json found{hint}",
                          "give a tokenizer.json file or a Hugging Face model directory with one")
    try:
        return Tokenizer.from_file(str(f)), f.parent
    except Exception as e:  # the Rust side raises a plain Exception with the parse error
        beside = f.parent / "tokenizer.json"
        if f.name != beside.name and beside.is_file():  # tokenizer_config.json, tokenizer.model, ... of a model dir
            fix = f"give the tokenizer.json beside it, --tokenizer {beside}, or the directory, --tokenizer {f.parent}"
        elif f.suffix == ".model":
            fix = ("it is a SentencePiece model: convert it once with transformers, AutoTokenizer.from_pretrained(DIR)"
                   ".save_pretrained(DIR), and give the tokenizer.json it writes")
        else:
            fix = "give a Hugging Face tokenizer.json (re-download it if this one is damaged)"
        raise ConfigError("--tokenizer", str(f), f"not a tokenizers JSON file ({e})", fix) from None


def _configured_token(directory: Path, key: str) -> str | None:
    f = directory / "tokenizer_config.json"
    if not f.is_file():
        return None
    try:
        value = json.loads(f.read_text()).get(key)
    except ValueError:
        return None
    return value.get("content") if isinstance(value, dict) else value


def special_id(tokenizer, directory: Path, which: str, given: str | None, required: bool) -> int | None:
    """Id of the EOS (``which="eos"``) or BOS token: ``given`` (a token string), else the
    tokenizer_config.json's ``eos_token``/``bos_token``, else a well-known name in the vocabulary."""
    key = "--eos" if which == "eos" else "--bos-token"  # --bos is a flag: the token is named by --bos-token
    if given is not None:
        tid = tokenizer.token_to_id(given)
        if tid is None:
            raise ConfigError(key, given, "not a token of this tokenizer", f"give the tokenizer's {which.upper()} token")
        return tid
    configured = _configured_token(directory, f"{which}_token")
    if configured and tokenizer.token_to_id(configured) is None:
        # a well-known name found instead would be another token than the model was trained to end on
        raise ConfigError(f"tokenizer_config.json: {which}_token", configured,
                          f"{directory / 'tokenizer_config.json'} names it, but tokenizer.json has no such token",
                          f"name the {which.upper()} token: {key} TOKEN (or fix tokenizer_config.json)")
    for tok in ((configured,) if configured else ()) + (EOS_CANDIDATES if which == "eos" else BOS_CANDIDATES):
        tid = tokenizer.token_to_id(tok)
        if tid is not None:
            return tid
    if required:
        raise ConfigError(key, None, f"the tokenizer has no recognisable {which.upper()} token",
                          f"name it: {key} '<token>'")
    return None


def detect_format(path: Path, fmt: str) -> str:
    """``fmt`` unless ``auto``: .jsonl/.ndjson are JSONL; so is a .json file whose first line is a
    JSON object (Hugging Face ``Dataset.to_json`` writes JSON Lines under .json), while a .json
    array or a multi-line object is refused; anything else is text (one document per file)."""
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return "jsonl"
    if suffix != ".json":
        return "text"
    with open(path, "rb") as f:  # (read as text it was ONE document of braces, keys and escapes)
        first = b""
        while not first.strip():
            first = f.readline()
            if not first:
                return "text"  # empty: no document either way
    if first.lstrip()[:1] == b"{":
        try:
            if isinstance(json.loads(first), dict):
                return "jsonl"
        except ValueError:
            pass
    shape = "a JSON array" if first.lstrip()[:1] == b"[" else "JSON, but not one object per line"
    raise ConfigError("INPUT", str(path), f"is {shape} (JSON Lines is what is read as JSON)",
                      f"convert it to JSONL, e.g. jq -c '.[]' {path} > {path.with_suffix('.jsonl')}, "
                      "or --format text to tokenise the file as one document")


def _text_pieces(path: Path, chunk_bytes: int) -> Iterator[tuple[list[str], list[bool], int]]:
    """A text file is ONE document: pieces cut after the last newline of each chunk."""
    carry = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            data = carry + block
            if not block:
                if data:
                    yield [_decode(data, path)], [True], 0
                else:
                    yield [], [True], 0  # empty file or exact chunk end: the document ends here
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no newline in the chunk: keep reading (a very long line)
                carry = data
                yield [], [], len(block)
                continue
            carry = data[cut:]
            yield [_decode(data[:cut], path)], [False], len(block)


def _decode(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("INPUT", str(path), f"not UTF-8 text ({e.reason} at a byte near offset {e.start})",
                          "convert the file to UTF-8") from None


def _jsonl_pieces(path: Path, field: str, chunk_bytes: int) -> Iterator[tuple[list[str], list[bool], int]]:
    """One document per line: batches of about ``chunk_bytes`` of text."""
    texts: list[str] = []
    size = consumed = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            consumed += len(raw)
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except ValueError as e:
                raise ConfigError("INPUT", f"{path}:{lineno}", f"not a JSON line ({e})", "fix the line or the file") from None
            if not isinstance(record, dict):  # [1, 2] or "text": said '(keys: list)', as if a field were missing
                kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(record), "a number")
                raise ConfigError("INPUT", f"{path}:{lineno}", f"is {kind}, not a JSON object holding the text in a "
                                  f"field ({field!r})", "write one object per line, e.g. {\"" + field + "\": \"...\"}")
            value = record.get(field)
            if not isinstance(value, str):
                held = "" if field not in record else f" ({field!r} holds {type(value).__name__} {str(value)[:40]!r})"
                raise ConfigError("--field", field, f"{path}:{lineno} has no string field {field!r}{held} (keys: "
                                  f"{sorted(record)[:8]})", "choose the field that holds the text: --field NAME")
            if not value.isascii():
                _check_encodable(value, f"{path}:{lineno}", field)
            texts.append(value)
            size += len(value)
            if size >= chunk_bytes:
                yield texts, [True] * len(texts), consumed
                texts, size, consumed = [], 0, 0
    yield texts, [True] * len(texts), consumed


def _check_encodable(text: str, where: str, field: str) -> None:
    """JSON may escape half a UTF-16 pair (``"\\ud83d"``, an emoji cut in two by a scraper): Python
    takes it, the tokenizer's Rust side refuses it with a TypeError that names no line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError("INPUT", where, f"the {field!r} text holds a lone surrogate {text[e.start]!r} at character "
                          f"{e.start} (half of a UTF-16 pair, e.g. a cut emoji), which is not text a tokenizer reads",
                          "fix or drop that line, e.g. re-encode its text with "
                          "text.encode('utf-8', 'replace').decode()") from None


COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip -k"), (b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"),
              (b"\xfd7zXZ\x00", "xz", "unxz -k"), (b"PK\x03\x04", "zip", "unzip"))
"""(magic bytes at the start of a file, format, the command that unpacks it); bzip2 is ``BZh`` + a
digit 1-9 (:func:`compression`)."""


def compression(path: Path) -> tuple[str, str] | None:
    """(format, unpacking command) when ``path`` starts with a compressed format's magic bytes."""
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, name, tool in COMPRESSED:
        if head.startswith(magic):
            return name, tool
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[3:4] != b"0":
        return "bzip2", "bunzip2 -k"
    return None


def _temporary_names(out: Path) -> tuple[Path, Path]:
    idx = index_path(out)
    return out.with_name(out.name + ".tmp"), idx.with_name(idx.name + ".tmp")


def _check_outputs_spare_inputs(files: Sequence[Path], out: Path) -> None:
    """The token file, its index (``DATA.json``, a name a JSONL corpus may well have) and their
    temporary names are replaced by the run: none of them may be an input, or the corpus is lost."""
    written = [out, index_path(out), *_temporary_names(out)]
    for f in files:
        for w in written:
            if w.exists() and os.path.samefile(f, w):
                raise ConfigError("--out", str(out), f"the run writes {w}, which is the INPUT {f}: it would be "
                                  "replaced (the index of DATA.bin is DATA.json)",
                                  f"write elsewhere, e.g. --out {out.with_name(out.stem + '.tokens.bin')}")
    idx = index_path(out)
    if idx.is_file() and not is_index(idx):
        # Not an input, but still the user's file (a JSON corpus next to its JSONL copy, say): the
        # index is a name the user never typed, so replacing it would lose data without a word.
        raise ConfigError("--out", str(out), f"the run writes its index to {idx}, which exists and is not a "
                          f"{INDEX_FORMAT} index: it would be replaced (the index of DATA.bin is DATA.json)",
                          f"move {idx} away, or write elsewhere, e.g. --out {out.with_name(out.stem + '.tokens.bin')}")


def is_index(path: Path) -> bool:
    """Whether ``path`` starts as an index :func:`prepare` writes (``{"format": INDEX_FORMAT, ...``):
    its first KiB is enough (a JSON corpus may be gigabytes)."""
    with open(path, "rb") as f:
        head = f.read(1024)
    return f'"format": "{INDEX_FORMAT}"'.encode() in head


def prepare(inputs: Sequence[str | Path], tokenizer_path: str | Path, out: str | Path, *, field: str | None = None,
            fmt: str = "auto", eos: str | None = None, bos: bool = False, bos_token: str | None = None,
            chunk_bytes: int = DEFAULT_CHUNK_BYTES, progress: bool = True) -> dict[str, Any]:
    """Tokenise ``inputs`` into ``out`` (+ its index, see the module doc); returns the index. ``field``:
    the JSONL key holding the text (default ``text``); given while no input is JSONL, it is refused."""
    from tqdm.auto import tqdm

    files = [expand_user(p) for p in inputs]
    for p in files:
        if p.is_dir():  # one level of glob is the shell's job, so that the order of documents is visible
            suffixes = sorted({f.suffix for f in p.iterdir() if f.is_file() and f.suffix})
            example = " ".join(f"{p}/*{x}" for x in suffixes[:3]) or f"{p}/*.txt"
            raise ConfigError("INPUT", str(p), "is a directory; the inputs are files",
                              f"give its files, e.g. {example}")
        if not p.is_file():
            raise ConfigError("INPUT", str(p), "no such file", "give local text or JSONL files")
        packed = compression(p)
        if packed is not None:  # read as text it was "not UTF-8 text. Fix: convert the file to UTF-8"
            name, tool = packed
            raise ConfigError("INPUT", str(p), f"is {name}-compressed; the inputs are plain text or JSONL",
                              f"decompress it first, e.g. {tool} {p}")
    if chunk_bytes < 1:  # a text file read 0 bytes at a time is one empty document: its text would be lost
        raise ConfigError("--chunk-size", f"{chunk_bytes} bytes", "must be at least 1 byte (whole bytes, rounded down)",
                          "use the default, --chunk-size 16MiB")
    if fmt not in ("auto", "text", "jsonl"):
        raise ConfigError("--format", fmt, "must be auto, text or jsonl", "use --format auto")
    kinds = [detect_format(p, fmt) for p in files]  # before anything is written
    if field is not None and "jsonl" not in kinds:  # was ignored: every input read as text, the field unread
        raise ConfigError("--field", field, f"names the JSONL key holding each document's text, but no input is "
                          f"JSONL (--format {fmt}: {', '.join(sorted({p.suffix or p.name for p in files}))} read as "
                          "text), so it changes nothing", "drop --field, or give JSONL inputs (.jsonl, or --format jsonl)")
    field = "text" if field is None else field
    out = expand_user(out)
    if out.suffix != ".bin":
        raise ConfigError("--out", str(out), "the token file must end in .bin (its index is written beside it as .json)",
                          f"use --out {out.with_suffix('.bin')}")
    _check_outputs_spare_inputs(files, out)
    tokenizer, tok_dir = load_tokenizer(tokenizer_path)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(token_dtype(vocab))
    eos_id = special_id(tokenizer, tok_dir, "eos", eos, required=True)
    bos_id = special_id(tokenizer, tok_dir, "bos", bos_token, required=True) if bos else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = _temporary_names(out)
    sources, total = [], 0
    size = sum(p.stat().st_size for p in files)
    # a bar on a terminal; into a pipe or a log file (a bar there is a line of carriage returns) a
    # plain line every 10 s at most (lightning_hexiscale.progress)
    shown = shown_as(progress, sys.stderr)
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="tokenizing", disable=shown != "bar")
    HEARTBEAT.restart()
    done = 0
    try:
        with open(tmp_bin, "wb") as fh:
            for path, kind in zip(files, kinds):
                if path.stat().st_size == 0:  # no document at all (not an empty one)
                    sources.append({"path": str(path.resolve()), "format": kind, "documents": 0, "tokens": 0, "bytes": 0})
                    continue
                pieces = _jsonl_pieces(path, field, chunk_bytes) if kind == "jsonl" else _text_pieces(path, chunk_bytes)
                docs = tokens = 0
                starting = True  # the next piece starts a document
                for texts, ends, consumed in pieces:
                    encoded = tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
                    parts = []
                    for i, end in enumerate(ends):
                        if starting and bos_id is not None:
                            parts.append(np.array([bos_id], dtype=dtype))
                        if i < len(encoded):
                            parts.append(np.asarray(encoded[i].ids, dtype=dtype))
                        starting = end
                        if end:
                            parts.append(np.array([eos_id], dtype=dtype))
                            docs += 1
                    if parts:
                        arr = np.concatenate(parts)
                        arr.astype(dtype.newbyteorder("<"), copy=False).tofile(fh)
                        tokens += arr.size
                    bar.update(consumed)
                    done += consumed
                    if shown == "lines":
                        HEARTBEAT.beat(lambda: f"tokenizing: {format_bytes(done)} of {format_bytes(size)} "
                                       f"({100 * done / max(size, 1):.0f} %), {path.name}")
                total += tokens
                sources.append({"path": str(path.resolve()), "format": kind, "documents": docs, "tokens": tokens,
                                "bytes": path.stat().st_size})
        if total == 0:  # every input empty: a token file of nothing would fail only when training starts
            raise ConfigError("INPUT", " ".join(str(p) for p in files), "every input file is empty: no tokens",
                              "give files that hold text (an earlier token file at --out is kept)")
        index = {"format": INDEX_FORMAT, "dtype": dtype.name, "vocab_size": vocab, "num_tokens": total,
                 "eos_id": eos_id, "bos_id": bos_id, "tokenizer": str(expand_user(tokenizer_path).resolve()),
                 "field": field, "sources": sources}
        tmp_idx.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp_bin, out)
        os.replace(tmp_idx, index_path(out))
    finally:
        bar.close()
        for t in (tmp_bin, tmp_idx):
            if t.exists():
                t.unlink()
    return index


def read_index(token_file: str | Path) -> dict[str, Any] | None:
    """The index of a token file written by :func:`prepare`, or None when there is none."""
    f = index_path(token_file)
    if not f.is_file():
        return None
    try:
        index = json.loads(f.read_text())
    except ValueError as e:
        raise ConfigError("data.path", str(f), f"the token index is not valid JSON ({e})",
                          "run hexiscale prepare-data again") from None
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT:
        raise ConfigError("data.path", str(f), f"not a {INDEX_FORMAT} index", "run hexiscale prepare-data again")
    return index
