from hypothesis import given, settings, strategies as st

from kimik3.serve.detokenize import StreamDetokenizer


class CharTokenizer:
    """Token i is chr(i); 0xFFFD-free; token 1 decodes to half of a character (U+FFFD) until 2 follows."""

    def decode(self, ids):
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 1:
                out.append("é" if i + 1 < len(ids) and ids[i + 1] == 2 else "\ufffd")
                i += 2
            else:
                out.append(chr(ids[i]))
                i += 1
        return "".join(out)


def stream(ids, stop):
    detok = StreamDetokenizer(CharTokenizer(), stop)
    text = ""
    for token in ids:
        text += detok.push(token)
        if detok.stopped:
            return text, True
    return text + detok.flush(), False


def test_incomplete_characters_wait_for_the_rest():
    detok = StreamDetokenizer(CharTokenizer(), [])
    assert detok.push(ord("a")) == "a"
    assert detok.push(1) == ""
    assert detok.push(2) == "é"


def test_stop_string_across_tokens_is_cut_and_not_sent():
    text, stopped = stream([ord(c) for c in "hello world"], ["o w"])
    assert stopped and text == "hell"
    text, stopped = stream([ord(c) for c in "hello"], ["lo!"])
    assert not stopped and text == "hello"     # the held-back "lo" is released at the end


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc", max_size=30), st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3))
def test_streamed_text_equals_the_text_up_to_the_first_stop(body, stops):
    text, stopped = stream([ord(c) for c in body], stops)
    cut = min((body.find(s) for s in stops if s in body), default=-1)
    # the stream stops at the first stop string that completes while generating
    if stopped:
        assert any(text + s == body[:len(text) + len(s)] for s in stops)
        assert cut != -1 and len(text) >= cut and text == body[:len(text)]
    else:
        assert cut == -1 and text == body


class CountingTokenizer:
    """A real byte-level BPE that records the length of every id list it decodes."""

    def __init__(self):
        from kimik3.serve.fake_engine import tiny_tokenizer

        self.inner, self.lengths = tiny_tokenizer(), []

    def encode(self, text):
        return self.inner.encode(text).ids

    def decode(self, ids):
        self.lengths.append(len(ids))
        return self.inner.decode(ids)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_byte_level_tokens_stream_back_to_the_decoded_text(body):
    """Real byte-level BPE ids of any text (multi-byte characters split across tokens included): the released
    pieces join to the tokenizer's own decode of the whole output."""
    tok = CountingTokenizer()
    ids = tok.encode(body)
    detok = StreamDetokenizer(tok, [])
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tok.inner.decode(ids)


def test_each_token_decodes_a_short_window_however_long_the_output():
    """Constant time per token: no decode call covers more than the tokens since the last complete character and
    the ones before them, even 2,000 tokens in (the previous form decoded the whole output every token)."""
    tok = CountingTokenizer()
    ids = tok.encode("def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n é漢🙂 " * 40)
    assert len(ids) > 1000
    detok = StreamDetokenizer(tok, ["never appears"])
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tok.inner.decode(ids)
    assert max(tok.lengths) <= 16, max(tok.lengths)
