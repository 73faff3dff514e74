"""The media tokens: appended after a text tokenizer's ids, the placeholder at the vocabulary's last id."""

import pytest

from kimik3.tokenizer import MEDIA_PAD, SPECIAL_TOKENS, add_media_tokens, image_prompt, tokenizers_module


def _bpe(size: int):
    tk = tokenizers_module()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tk.trainers.BpeTrainer(vocab_size=size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["what colour is the circle? red. how many shapes? 3"] * 20, trainer=trainer)
    return tokenizer


def test_media_tokens_take_the_last_ids_and_encode_as_one_id_each():
    tokenizer = _bpe(300)
    size = tokenizer.get_vocab_size()
    ids = add_media_tokens(tokenizer, size + 3)
    assert ids[MEDIA_PAD] == size + 2
    encoded = tokenizer.encode("Q " + image_prompt(4) + " red").ids
    assert encoded.count(ids[MEDIA_PAD]) == 4
    assert add_media_tokens(tokenizer, size + 3) == ids            # idempotent
    with pytest.raises(ValueError, match="no room"):
        add_media_tokens(_bpe(300), size + 2)
    with pytest.raises(ValueError):
        image_prompt(0)
