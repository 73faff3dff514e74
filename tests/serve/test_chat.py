"""The chat template: exact text, boundary hints, validation, and token-prefix stability across turns."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kimik3.serve import chat
from kimik3.serve.fake_engine import tiny_tokenizer

TOK = tiny_tokenizer()
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": " Hello."},     # as generated: the model wrote the space
    {"role": "user", "content": "Bye? ünïcødé 🙂"},
]


def test_render_text_is_the_documented_template():
    assert chat.render_text(CONVERSATION) == (
        "System: You are terse.\n\nUser: Hi!\n\nAssistant: Hello.\n\nUser: Bye? ünïcødé 🙂\n\nAssistant:")
    assert chat.render_text(CONVERSATION[:2], add_generation_prompt=False) == "System: You are terse.\n\nUser: Hi!\n\n"
    # Empty content and content starting with whitespace get no extra space.
    assert chat.render_text([{"role": "user", "content": ""}], False) == "User:\n\n"
    assert chat.render_text([{"role": "user", "content": "\tx"}], False) == "User:\tx\n\n"


def test_ids_decode_to_the_text():
    ids, _ = chat.render_ids(TOK, CONVERSATION)
    assert TOK.decode(ids) == chat.render_text(CONVERSATION)


def test_boundary_hints_are_message_ends():
    ids, hints = chat.render_ids(TOK, CONVERSATION)
    assert len(hints) == len(CONVERSATION)
    assert hints == sorted(hints) and hints[-1] < len(ids)
    for k, end in enumerate(hints):
        assert TOK.decode(ids[:end]) == chat.render_text(CONVERSATION[:k + 1], add_generation_prompt=False)
        assert chat.render_ids(TOK, CONVERSATION[:k + 1], add_generation_prompt=False) == (ids[:end], hints[:k + 1])
    assert TOK.decode(ids[hints[-1]:]) == chat.GENERATION_PROMPT


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    assert chat.render_text([{"role": "user", "content": parts}]) == "User: Hello\n\nAssistant:"


@pytest.mark.parametrize("messages, needle", [
    ("hello", "list"),
    ([], "at least one"),
    (["hi"], "messages[0] must be an object"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content is required"),
    ([{"role": "user", "content": None}], "messages[0].content is required"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], "messages[1].content must be"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text parts"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}], "tool calls"),
])
def test_invalid_messages_raise_clear_errors(messages, needle):
    with pytest.raises(ValueError) as info:
        chat.render_ids(TOK, messages)
    assert needle in str(info.value)


def test_next_turn_extends_the_previous_prompt_and_reply():
    """Turn n+1's prompt = turn n's prompt + the reply's tokens + the new user turn, token for token."""
    turn1 = CONVERSATION[:2]
    prompt1, _ = chat.render_ids(TOK, turn1)
    reply = " Hello, how are you?"
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Fine."}]
    prompt2, hints2 = chat.render_ids(TOK, turn2)
    reply_ids = TOK.encode(reply).ids
    assert prompt2[:len(prompt1)] == prompt1
    assert prompt2[len(prompt1):len(prompt1) + len(reply_ids)] == reply_ids
    assert hints2[2] == len(prompt1) + len(reply_ids) + len(TOK.encode(chat.TURN_END).ids)


text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text})


@settings(max_examples=60, deadline=None)
@given(st.lists(message, min_size=1, max_size=5), text, text)
def test_prefix_stability_property(history, reply, follow_up):
    prompt, hints = chat.render_ids(TOK, history)
    longer = history + [{"role": "assistant", "content": reply}, {"role": "user", "content": follow_up}]
    prompt2, hints2 = chat.render_ids(TOK, longer)
    assert prompt2[:len(prompt)] == prompt
    assert hints2[:len(hints)] == hints
    assert TOK.decode(prompt2) == chat.render_text(longer)
