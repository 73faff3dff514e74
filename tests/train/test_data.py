import json

import numpy as np
import pytest

from kimik3.train.data import DataError, load_corpus
from kimik3.train.loader import batch_at, eval_windows
from kimik3.tokenizer import EOS, ROLE_TOKENS, has_role_tokens
from kimik3.train.tokenizer import tokenize_corpus


def test_default_corpus_is_the_stdlib_without_tests():
    corpus = load_corpus()
    names = [d.name for d in corpus.train + corpus.val]
    assert len(corpus.train) > 300 and corpus.val
    assert "os.py" in names
    assert not any(part in ("test", "tests", "site-packages") for n in names for part in n.split("/"))
    assert not {d.name for d in corpus.val} & {d.name for d in corpus.train}
    assert load_corpus().fingerprint == corpus.fingerprint


def test_folder_of_txt_jsonl_and_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    body = "the quick brown fox jumps over the lazy dog. " * 200
    (tmp_path / "a.txt").write_text(body)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": f"{i} {body}"}) for i in range(3)) + "\n")
    pq.write_table(pa.table({"text": [f"parquet {i} {body}" for i in range(2)]}), tmp_path / "c.parquet")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    corpus = load_corpus(tmp_path)
    names = sorted(d.name for d in corpus.train + corpus.val)
    assert names == ["a.txt", "b.jsonl:1", "b.jsonl:2", "b.jsonl:3", "c.parquet:0", "c.parquet:1"]


@pytest.mark.parametrize("setup, message", [
    (lambda p: None, "no readable documents"),
    (lambda p: (p / "small.txt").write_text("too small"), "too small"),
    (lambda p: (p / "bad.jsonl").write_text('{"text": "x"}\n{broken\n'), "bad.jsonl:2: malformed JSON"),
    (lambda p: (p / "bad.jsonl").write_text('{"body": "x"}\n'), "string 'text' field"),
])
def test_bad_data_paths_fail_clearly(tmp_path, setup, message):
    setup(tmp_path)
    with pytest.raises(DataError, match=message):
        load_corpus(tmp_path)


def test_missing_path():
    with pytest.raises(DataError, match="does not exist"):
        load_corpus("/nonexistent/kimik3-data")


def test_tokenizer_round_trips_and_is_cached(code_corpus):
    corpus = load_corpus(code_corpus)
    first = tokenize_corpus(corpus, 512)
    again = tokenize_corpus(corpus, 512)
    assert not first.from_cache and again.from_cache
    assert np.array_equal(first.train_ids, again.train_ids)
    assert 256 < first.tokenizer.get_vocab_size() <= 512 and first.tokenizer.token_to_id(EOS) == 0
    text = corpus.train[0].text
    assert first.tokenizer.decode(first.tokenizer.encode(text).ids) == text
    assert (first.train_ids == 0).sum() == len(corpus.train)  # one EOS per document
    # The role markers are special tokens right after EOS, and the text never produces them.
    assert [first.tokenizer.token_to_id(t) for t in ROLE_TOKENS] == [1, 2, 3, 4, 5]
    assert has_role_tokens(first.tokenizer) and not np.isin(first.train_ids, [1, 2, 3, 4, 5]).any()
    with pytest.raises(ValueError, match="special tokens"):
        tokenize_corpus(corpus, 261, use_cache=False)


def test_batches_are_a_pure_function_of_seed_and_step():
    stream = np.arange(1000, dtype=np.uint16)
    a, la = batch_at(stream, 5, 0, 4, 16)
    b, lb = batch_at(stream, 5, 0, 4, 16)
    assert a.equal(b) and la.equal(lb) and la[:, :-1].equal(a[:, 1:])
    assert not a.equal(batch_at(stream, 6, 0, 4, 16)[0])
    assert not a.equal(batch_at(stream, 5, 1, 4, 16)[0])
    w, lw = eval_windows(stream, 10, 5)
    assert w.shape == (5, 10) and lw.equal(w + 1)
