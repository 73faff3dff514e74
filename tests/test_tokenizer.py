"""The tokenizer's chat role tokens (added after every existing id, also to a run that predates them) and the
``tokenizer_config.json`` saved next to ``tokenizer.json``."""

import json

import pytest
from tokenizers import Tokenizer

from kimik3.serve.fake_engine import tiny_tokenizer
from kimik3.tokenizer import (DEFAULT_CHAT_TEMPLATE, EOS, IM_END, ROLE_TOKENS, SPECIAL_TOKENS, TOKENIZER_CONFIG_FILE,
                              add_role_tokens, has_role_tokens, load_tokenizer, read_tokenizer_config,
                              special_token_ids, tokenizer_config, write_tokenizer_config)

TEXT = "def hello(name):\n    return f'hello {name}' ünïcødé 🙂"


def fresh() -> Tokenizer:
    return Tokenizer.from_str(tiny_tokenizer().to_str())   # tiny_tokenizer() is shared: never mutate it


@pytest.fixture
def old_run(tmp_path):
    """A run's tokenizer.json from before the role tokens: a byte-level BPE whose only special token is EOS."""
    tokenizer = fresh()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    return tmp_path, tokenizer


def test_an_old_tokenizer_loads_as_it_was(old_run):
    run, old = old_run
    loaded = load_tokenizer(run / "tokenizer.json")
    assert loaded.to_str() == old.to_str() and not has_role_tokens(loaded)
    assert special_token_ids(loaded) == {EOS: 0}


def test_role_tokens_are_added_at_load_time_after_every_existing_id(old_run):
    run, old = old_run
    size = old.get_vocab_size()
    loaded = load_tokenizer(run / "tokenizer.json", vocab_size=size + 64)
    assert has_role_tokens(loaded)
    assert [loaded.token_to_id(t) for t in ROLE_TOKENS] == list(range(size, size + len(ROLE_TOKENS)))
    assert loaded.get_vocab_size() == size + len(ROLE_TOKENS)
    # no existing id moves, and text encodes as before
    assert loaded.get_vocab(with_added_tokens=False) == old.get_vocab(with_added_tokens=False)
    assert loaded.token_to_id(EOS) == 0 and loaded.encode(TEXT).ids == old.encode(TEXT).ids
    for token in SPECIAL_TOKENS:   # one id each, special: skipped when decoding text
        ids = loaded.encode(f"a{token}b").ids
        assert ids == [*old.encode("a").ids, loaded.token_to_id(token), *old.encode("b").ids]
        assert loaded.decode(ids, skip_special_tokens=False) == f"a{token}b" and loaded.decode(ids) == "ab"


def test_a_tokenizer_that_fills_the_vocabulary_keeps_its_ids(old_run):
    """No room below the model's vocabulary size: loading gives the tokenizer as it was (chat then spells the
    markers as plain text), and asking for the role tokens says why they cannot be had."""
    run, old = old_run
    size = old.get_vocab_size()
    for vocab_size in (size, size + len(ROLE_TOKENS) - 1):
        loaded = load_tokenizer(run / "tokenizer.json", vocab_size=vocab_size)
        assert loaded.to_str() == old.to_str()
        with pytest.raises(ValueError, match="no room for the chat role tokens .* predates them"):
            add_role_tokens(loaded, vocab_size)
        assert loaded.to_str() == old.to_str()
    assert has_role_tokens(load_tokenizer(run / "tokenizer.json", vocab_size=size + len(ROLE_TOKENS)))


def test_adding_is_idempotent_and_survives_saving(tmp_path):
    tokenizer = fresh()
    ids = add_role_tokens(tokenizer)
    assert add_role_tokens(tokenizer, vocab_size=len(ids) + tokenizer.get_vocab_size()) == ids
    # a tokenizer that has them needs no room
    assert add_role_tokens(tokenizer, vocab_size=tokenizer.get_vocab_size()) == ids
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    again = load_tokenizer(tmp_path / "tokenizer.json", vocab_size=tokenizer.get_vocab_size())
    assert again.to_str() == tokenizer.to_str() and has_role_tokens(again)
    assert special_token_ids(again) == {EOS: 0, **dict(zip(ROLE_TOKENS, ids, strict=True))}


def test_tokenizer_config_holds_the_template_and_the_special_tokens():
    tokenizer = fresh()
    ids = add_role_tokens(tokenizer)
    config = tokenizer_config(tokenizer)
    assert config["chat_template"] == DEFAULT_CHAT_TEMPLATE
    assert config["bos_token"] == config["eos_token"] == EOS
    assert config["additional_special_tokens"] == list(ROLE_TOKENS)
    assert config["added_tokens_decoder"]["0"]["content"] == EOS
    assert {int(i): entry["content"] for i, entry in config["added_tokens_decoder"].items()} == \
        {0: EOS, **dict(zip(ids, ROLE_TOKENS, strict=True))}
    assert all(entry["special"] for entry in config["added_tokens_decoder"].values())
    assert config["added_tokens_decoder"][str(tokenizer.token_to_id(IM_END))]["content"] == IM_END
    # from the tokenizer's JSON text (what a checkpoint holds) it is the same
    assert tokenizer_config(tokenizer.to_str()) == config
    assert tokenizer_config(tokenizer, chat_template="{{ x }}")["chat_template"] == "{{ x }}"
    # an old tokenizer lists only what it has
    assert tokenizer_config(fresh())["additional_special_tokens"] == []


def test_tokenizer_config_is_written_next_to_tokenizer_json(tmp_path):
    tokenizer = fresh()
    add_role_tokens(tokenizer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert read_tokenizer_config(tmp_path) is None                   # a run saved before it
    path = write_tokenizer_config(tmp_path, tokenizer)
    assert path == tmp_path / TOKENIZER_CONFIG_FILE
    assert read_tokenizer_config(tmp_path) == json.loads(path.read_text(encoding="utf-8")) == \
        tokenizer_config(tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", TOKENIZER_CONFIG_FILE]  # no temporaries
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{TOKENIZER_CONFIG_FILE}: not a valid tokenizer config"):
        read_tokenizer_config(tmp_path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="a JSON object is expected"):
        read_tokenizer_config(tmp_path)
