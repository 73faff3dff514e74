"""Chat templates other than the built-in one: from a file (``kimik3 serve --chat-template FILE``) or from the run's
``tokenizer_config.json``, what a template must satisfy, and the server rendering with one."""

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from kimik3.cli import main
from kimik3.serve import chat
from kimik3.serve.fake_engine import FakeEngine, tiny_tokenizer
from kimik3.tokenizer import IM_END, add_role_tokens, write_tokenizer_config

CHATML = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MARKDOWN = ("{% for m in messages %}### {{ m.role }}:\n{{ m.content }}[END]\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def role_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer.from_str(tiny_tokenizer().to_str())   # tiny_tokenizer() is shared: never mutate it
    add_role_tokens(tokenizer)
    return tokenizer


def test_a_custom_template_renders_and_encodes():
    template = chat.ChatTemplate(CHATML, "chatml.jinja")
    assert template.render_text(MESSAGES) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert template.render_text(MESSAGES) == template.render_jinja(MESSAGES)
    assert template.turn_end == IM_END
    tokenizer = role_tokenizer()
    encoder = chat.ChatEncoder(tokenizer, template)
    assert encoder.plain_markers == ["<|im_start|>"]          # not a token of K3's tokenizer: spelled as text
    assert encoder.stop_token_ids == [tokenizer.token_to_id(IM_END)]
    ids, hints = encoder.encode(MESSAGES)
    assert tokenizer.decode(ids, skip_special_tokens=False) == template.render_text(MESSAGES)
    assert ids[hints[0] - 2:hints[0]] == [tokenizer.token_to_id(IM_END), *tokenizer.encode("\n").ids]
    assert chat.render_ids(tokenizer, MESSAGES, template=template) == (ids, hints)


@pytest.mark.parametrize("source, needle", [
    ("{% for m in messages %}", "not a valid Jinja template"),
    ("", "empty"),
    ("{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}", "content exactly once"),
    ("{% for m in messages %}{{ m.role }}{% endfor %}", "content exactly once"),
    ("{{ bos_token }}" + CHATML, "differently within a conversation"),
    # a default system prompt before the first message (as Kimi's published template does)
    ("{% if messages and messages[0].role != 'system' %}<|im_system|>system<|im_middle|>You are Kimi.<|im_end|>"
     "{% endif %}" + CHATML, "differently within a conversation"),
    ("{% for m in messages %}{{ loop.index }}{{ m.content }}{% endfor %}", "differently within a conversation"),
    ("{{ ().__class__.__base__.__subclasses__() }}" + CHATML, "unsafe"),   # the sandbox
    ("{{ messages.append(1) }}" + CHATML, "unsafe"),
])
def test_a_template_that_cannot_be_rendered_one_message_at_a_time_is_refused(source, needle):
    with pytest.raises(ValueError, match="my.jinja") as info:
        chat.ChatTemplate(source, "my.jinja")
    assert needle in str(info.value)


def test_a_role_the_template_refuses_is_a_clear_error():
    template = chat.ChatTemplate("{% for m in messages %}{% if m.role == 'system' %}"
                                 "{{ raise_exception('no system messages') }}{% endif %}"
                                 "[{{ m.role }}]{{ m.content }}{% endfor %}")
    encoder = chat.ChatEncoder(role_tokenizer(), template)
    assert encoder.encode(MESSAGES[1:])[0]
    with pytest.raises(ValueError, match=r"messages\[0\]: the chat template refuses a system message "
                                         r"\(no system messages\)"):
        encoder.encode(MESSAGES)


def test_which_template_serve_uses(tmp_path):
    """--chat-template FILE, else the run's tokenizer_config.json, else the built-in template."""
    run = tmp_path / "run"
    run.mkdir()
    assert chat.load_chat_template(None, run) is chat.default_template()          # a run saved before the config
    write_tokenizer_config(run, role_tokenizer(), chat_template=MARKDOWN)
    assert chat.load_chat_template(None, run).source == MARKDOWN
    (tmp_path / "chatml.jinja").write_text(CHATML)
    assert chat.load_chat_template(tmp_path / "chatml.jinja", run).source == CHATML
    (tmp_path / "config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "x"}))
    assert chat.load_chat_template(tmp_path / "config.json").source == CHATML
    (tmp_path / "named.json").write_text(json.dumps({"chat_template": [{"name": "default", "template": CHATML}]}))
    assert chat.load_chat_template(tmp_path / "named.json").source == CHATML
    (tmp_path / "none.json").write_text(json.dumps({"eos_token": "x"}))
    with pytest.raises(ValueError, match="none.json: no chat_template"):
        chat.load_chat_template(tmp_path / "none.json")
    with pytest.raises(FileNotFoundError, match="missing.jinja: chat template file missing"):
        chat.load_chat_template(tmp_path / "missing.jinja")
    write_tokenizer_config(run, role_tokenizer())
    assert chat.load_chat_template(None, run).source == chat.DEFAULT_CHAT_TEMPLATE


def test_the_server_renders_with_the_template_it_was_given(serve):
    template = chat.ChatTemplate(MARKDOWN, "markdown.jinja")
    srv = serve(chat_template=template)
    resp = srv.client().chat.completions.create(model="fake-k3", messages=MESSAGES, max_tokens=3)
    request = srv.engine.requests[-1]
    assert (request.prompt_ids, request.boundary_hints) == chat.ChatEncoder(srv.engine.tokenizer,
                                                                            template).encode(MESSAGES)
    assert srv.engine.tokenizer.decode(request.prompt_ids) == \
        "### system:\nBe brief.[END]\n### user:\nHi[END]\n### assistant:\n"
    assert "[END]" in request.params.stop and IM_END not in request.params.stop
    assert resp.usage.prompt_tokens == len(request.prompt_ids)


class StubEngine(FakeEngine):
    core = SimpleNamespace(describe=lambda: "a stub")


def test_kimik3_serve_chat_template_option(tmp_path, monkeypatch, capsys):
    import kimik3.serve.engine
    import kimik3.serve.server

    run = tmp_path / "run"
    run.mkdir()
    loaded, served = [], []
    monkeypatch.setattr(kimik3.serve.engine.LLMEngine, "from_run",
                        classmethod(lambda cls, *a, **kw: loaded.append(a) or StubEngine()))
    monkeypatch.setattr(kimik3.serve.server, "serve", lambda engine, **kw: served.append(kw) or 0)
    (tmp_path / "chatml.jinja").write_text(CHATML)
    assert main(["serve", "--run", str(run), "--chat-template", str(tmp_path / "chatml.jinja")]) == 0
    assert served[-1]["chat_template"].source == CHATML
    assert main(["serve", "--run", str(run)]) == 0
    assert served[-1]["chat_template"] is chat.default_template()
    # a bad template is one clear error, before the model is loaded
    loaded.clear()
    (tmp_path / "bad.jinja").write_text("{% if %}")
    assert main(["serve", "--run", str(run), "--chat-template", str(tmp_path / "bad.jinja")]) == 2
    err = capsys.readouterr().err
    assert f"kimik3 serve: error: {tmp_path / 'bad.jinja'}: not a valid Jinja template" in err and not loaded
