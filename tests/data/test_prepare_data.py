"""`hexiscale prepare-data` with a tiny tokenizer built here (no downloads): JSONL and chunked text in,
uint16 / uint32 token file + JSON index out, read back by the token dataset and trained on for one
step; bad inputs are ConfigErrors naming what is wrong."""

from __future__ import annotations

import io
import json
import re
import sys

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hexiscale.cli.main import main
from lightning_hexiscale.data import tokenize
from lightning_hexiscale.data.datasets import TokenFileDataset, make_dataset
from lightning_hexiscale.data.tokenize import prepare
from lightning_hexiscale.errors import ConfigError
from lightning_hexiscale.lightning.example import LlamaLitModule
from lightning_hexiscale.models.config import LlamaConfig

WORDS = "the cluster trains a small model over slow links while every pipeline sends its activations".split()
DOCS = ["the cluster trains a small model", "every pipeline sends its activations over slow links",
        "a small model trains while the cluster sends"] * 6


def make_tokenizer(tmp_path, extra_words: int = 0):
    """A word-level tokenizer.json: <unk>, </s>, <s>, the words (plus ``extra_words`` filler ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2}
    for i in range(extra_words):
        vocab[f"w{i}"] = len(vocab)
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return tok, path


def write_jsonl(path, docs, field="body"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


def test_prepare_jsonl_then_train_one_step(tmp_path, capsys):
    tok, tok_path = make_tokenizer(tmp_path)
    src = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    out = tmp_path / "data" / "train.bin"
    assert main(["prepare-data", str(src), "--tokenizer", str(tok_path), "--out", str(out), "--field", "body",
                 "--no-progress"]) == 0
    assert "tokens" in capsys.readouterr().out
    index = json.loads((tmp_path / "data" / "train.json").read_text())
    want = np.concatenate([np.array(tok.encode(d).ids + [1]) for d in DOCS])  # EOS (</s> = 1) after each
    assert index["dtype"] == "uint16" and index["vocab_size"] == tok.get_vocab_size()
    assert index["num_tokens"] == len(want) and index["eos_id"] == 1
    assert index["sources"][0]["documents"] == len(DOCS) and index["sources"][0]["path"].endswith("corpus.jsonl")
    assert np.array_equal(np.fromfile(out, dtype=np.uint16), want)

    config = LlamaConfig(name="tiny_words", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         ffn_hidden_size=64, vocab_size=32, seq_len=8)
    ds = make_dataset("bin", config.seq_len, path=str(out), vocab_size=config.vocab_size)
    assert isinstance(ds, TokenFileDataset) and len(ds) == (len(want) - 1) // 8
    assert torch.equal(ds[1], torch.as_tensor(want[8:17]))
    module = LlamaLitModule(config, lr=1e-2, warmup_steps=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    before = None

    class Snap(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            nonlocal before
            before = pl_module.model.embed.weight.detach().clone()

    trainer.callbacks.append(Snap())
    trainer.fit(module, DataLoader(ds, batch_size=4))
    assert trainer.global_step == 1 and torch.isfinite(trainer.callback_metrics["train_loss"])
    assert (module.model.embed.weight - before).abs().max() > 0


def test_large_vocabulary_is_uint32_and_text_is_read_in_chunks(tmp_path):
    tok, tok_path = make_tokenizer(tmp_path, extra_words=70_000)  # ids beyond 65535
    text = "\n".join(f"w69990 {d} w42" for d in DOCS) + "\n"
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text("the model")  # no trailing newline
    out = tmp_path / "t.bin"
    index = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tok_path, out, chunk_bytes=64, bos=True, progress=False)
    assert index["dtype"] == "uint32" and index["vocab_size"] > 65536
    # each text file is one document: BOS, its tokens, EOS (cut into 64-byte chunks at newlines)
    want = np.concatenate([[2], tok.encode(text).ids, [1], [2], tok.encode("the model").ids, [1]])
    assert np.array_equal(np.fromfile(out, dtype=np.uint32), want)
    assert [s["documents"] for s in index["sources"]] == [1, 1]
    assert max(want) > 65535
    ds = TokenFileDataset(out, seq_len=4, vocab_size=index["vocab_size"])
    assert torch.equal(ds[0], torch.as_tensor(want[:5].astype(np.int64)))


def test_bad_inputs_are_config_errors(tmp_path):
    tok, tok_path = make_tokenizer(tmp_path)
    src = write_jsonl(tmp_path / "c.jsonl", DOCS, field="text")
    with pytest.raises(ConfigError, match="--field.*'body'.*c.jsonl:1"):
        prepare([src], tok_path, tmp_path / "x.bin", field="body", progress=False)
    with pytest.raises(ConfigError, match="--eos"):
        prepare([src], tok_path, tmp_path / "x.bin", eos="<nope>", progress=False)
    with pytest.raises(ConfigError, match="--tokenizer"):
        prepare([src], tmp_path / "missing", tmp_path / "x.bin", progress=False)
    out = tmp_path / "ok.bin"
    prepare([src], tok_path, out, progress=False)
    with pytest.raises(ConfigError, match="model.vocab_size"):  # tokenised with more ids than the model has
        TokenFileDataset(out, seq_len=4, vocab_size=8)
    with pytest.raises(ConfigError, match="data.dtype"):
        TokenFileDataset(out, seq_len=4, dtype="uint32")
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"\x01\x00\x02\x00\x03")  # 5 bytes: not whole uint16 tokens
    with pytest.raises(ConfigError, match="not a whole number of uint16 tokens"):
        TokenFileDataset(raw, seq_len=1)
    with open(out, "ab") as f:  # the index no longer matches the file
        f.write(b"\x00\x00")
    with pytest.raises(ConfigError, match="index says"):
        TokenFileDataset(out, seq_len=4)


def test_an_input_is_never_overwritten_by_the_outputs(tmp_path):
    """`--out docs.bin` writes its index to docs.json: when docs.json is one of the inputs (a JSONL
    corpus named .json, read with --format jsonl), the run must refuse before writing anything, not
    replace the user's corpus with the index."""
    tok, tok_path = make_tokenizer(tmp_path)
    src = write_jsonl(tmp_path / "docs.json", DOCS, field="text")
    before = src.read_bytes()
    with pytest.raises(ConfigError, match="--out.*docs.json.*INPUT"):
        prepare([src], tok_path, tmp_path / "docs.bin", fmt="jsonl", progress=False)
    assert src.read_bytes() == before and not (tmp_path / "docs.bin").exists()
    raw = tmp_path / "raw.bin"  # the token file itself named as an input
    raw.write_text("the model\n")
    with pytest.raises(ConfigError, match="--out.*raw.bin.*INPUT"):
        prepare([raw], tok_path, raw, fmt="text", progress=False)
    assert raw.read_text() == "the model\n"


def test_a_directory_input_names_its_files(tmp_path):
    """`prepare-data corpus/` said "no such file" of a directory that exists."""
    tok, tok_path = make_tokenizer(tmp_path)
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "a.jsonl", DOCS, field="text")
    with pytest.raises(ConfigError, match="INPUT.*is a directory.*corpus/\\*.jsonl"):
        prepare([tmp_path / "corpus"], tok_path, tmp_path / "x.bin", progress=False)


def test_only_empty_inputs_are_refused_and_an_earlier_token_file_is_kept(tmp_path):
    """Empty files only: it wrote a 0-token file over the earlier one and exited 0 (training then
    failed on a dataset of no samples)."""
    tok, tok_path = make_tokenizer(tmp_path)
    out = tmp_path / "ok.bin"
    prepare([write_jsonl(tmp_path / "c.jsonl", DOCS, field="text")], tok_path, out, progress=False)
    before = out.read_bytes()
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(ConfigError, match="INPUT.*every input file is empty: no tokens"):
        prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tok_path, out, progress=False)
    assert out.read_bytes() == before and not list(tmp_path.glob("*.tmp"))


def test_a_json_file_that_is_not_an_index_is_not_replaced(tmp_path):
    """`prepare-data train.jsonl --out train.bin` replaced a train.json beside it (the user's JSON
    corpus, not an input) with the index, without a word; an earlier index is still replaced."""
    tok, tok_path = make_tokenizer(tmp_path)
    src = write_jsonl(tmp_path / "train.jsonl", DOCS, field="text")
    theirs = tmp_path / "train.json"
    theirs.write_text(json.dumps([{"text": d} for d in DOCS]))
    before = theirs.read_bytes()
    with pytest.raises(ConfigError, match="--out.*train.json, which exists and is not a hexiscale-tokens/1 index"):
        prepare([src], tok_path, tmp_path / "train.bin", progress=False)
    assert theirs.read_bytes() == before and not (tmp_path / "train.bin").exists()
    out = tmp_path / "tokens.bin"
    prepare([src], tok_path, out, progress=False)
    prepare([src], tok_path, out, progress=False)  # its own index: replaced, as before
    assert json.loads((tmp_path / "tokens.json").read_text())["num_tokens"] == out.stat().st_size // 2


def test_a_bos_token_the_tokenizer_does_not_name_can_be_given(tmp_path, capsys):
    """With --bos and a BOS of no well-known name, the fix said `--bos '<token>'`, which argparse
    takes as an INPUT (--bos is a flag): the token is now named by --bos-token (which implies --bos)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, "</s>": 1, "[START]": 2, **{w: 3 + i for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:2], field="text")
    out = tmp_path / "t.bin"
    args = ["prepare-data", str(src), "--tokenizer", str(tmp_path), "--out", str(out), "--no-progress"]
    assert main(args + ["--bos"]) == 2
    assert "--bos-token = None: the tokenizer has no recognisable BOS token. Fix: name it: --bos-token '<token>'" \
        in capsys.readouterr().err
    assert main(args + ["--bos-token", "[START]"]) == 0
    want = np.concatenate([[2, *tok.encode(d).ids, 1] for d in DOCS[:2]])
    assert np.array_equal(np.fromfile(out, dtype=np.uint16), want)
    assert main(args + ["--bos-token", "<nope>"]) == 2
    assert "--bos-token = '<nope>': not a token of this tokenizer" in capsys.readouterr().err


def test_a_chunk_size_under_one_byte_is_refused(tmp_path, capsys):
    """`--chunk-size 0.5B` (0 whole bytes) read every text file as one empty document and wrote
    only its EOS, exit 0: the corpus's tokens were lost without a word."""
    tok, tok_path = make_tokenizer(tmp_path)
    (tmp_path / "a.txt").write_text("\n".join(DOCS))
    out = tmp_path / "a.bin"
    assert main(["prepare-data", str(tmp_path / "a.txt"), "--tokenizer", str(tok_path), "--out", str(out),
                 "--chunk-size", "0.5B", "--no-progress"]) == 2
    assert "--chunk-size = '0 bytes': must be at least 1 byte" in capsys.readouterr().err
    assert not out.exists()


def test_a_lone_surrogate_names_its_line(tmp_path):
    """A JSONL line escaping half an emoji ("\\ud83d") stopped the run with the tokenizer's TypeError
    ('TextEncodeInput must be Union[...]'), naming no file or line; the other text tokenises."""
    tok, tok_path = make_tokenizer(tmp_path)
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "the model \\u00e9"}\n{"text": "the cluster \\ud83d trains"}\n')
    with pytest.raises(ConfigError, match=r"INPUT = '.*c.jsonl:2': the 'text' text holds a lone surrogate '\\ud83d'"):
        prepare([src], tok_path, tmp_path / "x.bin", progress=False)
    src.write_text('{"text": "the model \\u00e9 \\ud83d\\ude00"}\n')  # a whole pair is fine
    assert prepare([src], tok_path, tmp_path / "x.bin", progress=False)["num_tokens"] == 5


def test_a_compressed_input_is_named_as_such(tmp_path):
    """corpus.jsonl.gz was read as text: "not UTF-8 text. Fix: convert the file to UTF-8" (or, with
    --format jsonl, "not a JSON line"), though it is UTF-8 once decompressed."""
    import gzip

    tok, tok_path = make_tokenizer(tmp_path)
    src = write_jsonl(tmp_path / "c.jsonl", DOCS, field="text")
    packed = tmp_path / "c.jsonl.gz"
    packed.write_bytes(gzip.compress(src.read_bytes()))
    for fmt in ("auto", "jsonl"):
        with pytest.raises(ConfigError, match=r"INPUT = '.*c.jsonl.gz': is gzip-compressed.*Fix: decompress it "
                                              r"first, e.g. gunzip -k"):
            prepare([packed], tok_path, tmp_path / "x.bin", fmt=fmt, progress=False)
    (tmp_path / "b.txt").write_text("BZh is not bzip2 here, and BZh0 neither\n")
    assert prepare([tmp_path / "b.txt"], tok_path, tmp_path / "x.bin", progress=False)["num_tokens"] > 0


def test_a_file_beside_the_tokenizer_points_to_it(tmp_path):
    """--tokenizer DIR/tokenizer_config.json (or DIR/tokenizer.model) said "Fix: re-download
    tokenizer.json", though the tokenizer.json is right beside it."""
    tok, tok_path = make_tokenizer(tmp_path)
    src = write_jsonl(tmp_path / "c.jsonl", DOCS, field="text")
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(ConfigError, match=r"--tokenizer = .*tokenizer_config.json.*Fix: give the tokenizer.json beside "
                                          r"it, --tokenizer .*/tokenizer.json, or the directory"):
        prepare([src], tmp_path / "tokenizer_config.json", tmp_path / "x.bin", progress=False)
    (tmp_path / "sp").mkdir()
    (tmp_path / "sp" / "tokenizer.model").write_bytes(b"\x0a\x0b\x00sentencepiece")
    with pytest.raises(ConfigError, match="Fix: it is a SentencePiece model: convert it once"):
        prepare([src], tmp_path / "sp" / "tokenizer.model", tmp_path / "x.bin", progress=False)


def test_json_lines_named_json_are_read_as_jsonl(tmp_path):
    """Hugging Face's Dataset.to_json writes JSON Lines under .json: `prepare-data train.json` read
    it as ONE text document of braces, keys and escapes (35 tokens for two short documents), exit
    0. A JSON array or a pretty-printed object is refused with the command that converts it."""
    tok, tok_path = make_tokenizer(tmp_path)
    src = write_jsonl(tmp_path / "train.json", DOCS, field="text")
    index = prepare([src], tok_path, tmp_path / "tokens.bin", progress=False)
    assert index["sources"][0]["format"] == "jsonl" and index["sources"][0]["documents"] == len(DOCS)
    (tmp_path / "array.json").write_text(json.dumps([{"text": d} for d in DOCS]))
    (tmp_path / "pretty.json").write_text(json.dumps({"text": DOCS[0]}, indent=2))
    for name, shape in (("array", "a JSON array"), ("pretty", "JSON, but not one object per line")):
        with pytest.raises(ConfigError, match=f"INPUT = '.*{name}.json': is {shape}.*Fix: convert it to JSONL, e.g. "
                                              "jq -c"):
            prepare([tmp_path / f"{name}.json"], tok_path, tmp_path / "x.bin", progress=False)
    assert prepare([tmp_path / "array.json"], tok_path, tmp_path / "x.bin", fmt="text",
                   progress=False)["sources"][0]["documents"] == 1  # as asked


def test_an_eos_that_tokenizer_config_names_but_the_vocabulary_lacks_is_refused(tmp_path, capsys):
    """tokenizer_config.json's eos_token missing from tokenizer.json: the run fell back to a well-known
    name (</s> here) without a word, ending every document on a token the model was not trained to
    end on. Now the config key and value are named, with the way to name the token; --eos still wins."""
    make_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:2], field="text")
    args = ["prepare-data", str(src), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "t.bin"), "--no-progress"]
    assert main(args) == 2
    assert ("tokenizer_config.json: eos_token = '<|end_of_text|>': " in capsys.readouterr().err)
    assert not (tmp_path / "t.bin").exists()
    assert main(args + ["--eos", "</s>"]) == 0


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal (tqdm draws its bar there)."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream, progress, lines", [
    ("pipe", True, True),       # a pipe or a log file: plain lines (a bar there is a line of carriage returns)
    ("terminal", True, False),  # a terminal: the bar, no lines
    ("pipe", False, False),     # --no-progress: neither
])
def test_into_a_pipe_tokenizing_writes_plain_lines_now_and_then(tmp_path, monkeypatch, stream, progress, lines):
    _, tok_path = make_tokenizer(tmp_path)
    (tmp_path / "a.txt").write_text(" ".join(DOCS))
    err = io.StringIO() if stream == "pipe" else _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)  # in a notebook a pipe shows the bar too
    monkeypatch.setattr(tokenize.HEARTBEAT, "every_s", 1e-9)  # every beat after the first writes
    prepare([tmp_path / "a.txt"], tok_path, tmp_path / "t.bin", chunk_bytes=64, progress=progress)
    text = err.getvalue()
    said = [line for line in text.splitlines() if re.match(r"tokenizing: [\d.]+ \w*B of ", line)]
    if lines:
        assert said and "\r" not in text, text
        size = (tmp_path / "a.txt").stat().st_size
        assert said[-1].startswith(f"tokenizing: {size} B of {size} B (100 %), a.txt"), said[-1]
    else:
        assert not said, said
    if stream == "terminal":
        assert "tokenizing" in text and "\r" in text  # tqdm's bar


@pytest.mark.parametrize("line, words", [
    ("[1, 2]", r"INPUT = '.*c.jsonl:2': is an array, not a JSON object holding the text in a field \('text'\)\. "
               r"Fix: write one object per line, e\.g\. \{\"text\": \"\.\.\.\"\}"),
    ('"the cluster"', r"INPUT = '.*c.jsonl:2': is a string, not a JSON object"),
    ("null", r"INPUT = '.*c.jsonl:2': is null, not a JSON object"),
    ('{"text": 5}', r"--field = 'text': .*c.jsonl:2 has no string field 'text' \('text' holds int '5'\)"),
])
def test_a_line_that_is_no_object_or_holds_no_text_says_what_it_is(tmp_path, line, words):
    """A line that was a JSON array said "has no string field 'text' (keys: list)", as if a key were
    missing; one whose field holds a number listed that very field among the keys it lacked."""
    tok, tok_path = make_tokenizer(tmp_path)
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "the model"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=words):
        prepare([src], tok_path, tmp_path / "x.bin", progress=False)
    assert not (tmp_path / "x.bin").exists()


def test_a_hub_id_or_a_missing_path_as_the_tokenizer_says_which(tmp_path, monkeypatch, capsys):
    """--tokenizer meta-llama/Llama-3.2-1B said "no tokenizer.json found" (nothing is downloaded, and
    there was no directory to look in); a path to nothing said the same."""
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / "c.jsonl", DOCS, field="text")
    assert main(["prepare-data", str(src), "--tokenizer", "meta-llama/Llama-3.2-1B", "--out", "x.bin"]) == 2
    err = capsys.readouterr().err
    assert ("--tokenizer = 'meta-llama/Llama-3.2-1B': names nothing here; it looks like a Hugging Face model id, and "
            "nothing is downloaded. Fix: download it once (huggingface-cli download meta-llama/Llama-3.2-1B "
            "--local-dir DIR), then --tokenizer DIR") in err, err
    with pytest.raises(ConfigError, match=r"--tokenizer = '.*nowhere': no such file or directory\. Fix: give a "
                                          r"tokenizer\.json file or a Hugging Face model directory with one"):
        prepare([src], tmp_path / "nowhere", tmp_path / "x.bin", progress=False)
    assert not (tmp_path / "x.bin").exists()
