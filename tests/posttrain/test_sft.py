"""Supervised fine-tuning: the loss mask, packing, the data file, and runs through the Trainer."""

import json

import numpy as np
import pytest
import torch

from kimik3.posttrain.sft import (ConversationEncoder, SFTSource, pack, read_conversations, run_sft,
                                  split_conversations, task_conversations)
from kimik3.tokenizer import IM_END, load_tokenizer

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\n2+2=4\n</think>\nAnswer: 4"},
                {"role": "user", "content": "And <|im_end|> 3+3?"}, {"role": "assistant", "content": "Answer: 6"}]


def _tokenizer(base_run):
    return load_tokenizer(base_run / "tokenizer.json", vocab_size=640)


def _small(**changes):
    options = dict(steps=4, seq_len=128, batch_size=2, lr=3e-3, tasks_per_cell=2, progress=False,
                   checkpoint_every="2", log=lambda _: None)
    options.update(changes)
    return options


def test_the_loss_mask_covers_exactly_the_assistant_tokens(base_run):
    tokenizer = _tokenizer(base_run)
    encoder = ConversationEncoder(tokenizer)
    ids, mask = encoder.encode(CONVERSATION)
    assert len(ids) == len(mask)
    # The masked tokens are, in order, each assistant message's content and its turn end; nothing else.
    pieces, current = [], []
    for token, on in zip(ids, mask):
        if on:
            current.append(token)
        elif current:
            pieces.append(current)
            current = []
    if current:
        pieces.append(current)
    end = tokenizer.token_to_id(IM_END)
    assert [p[-1] for p in pieces] == [end, end]
    assert [tokenizer.decode(p[:-1]) for p in pieces] == [CONVERSATION[2]["content"], CONVERSATION[4]["content"]]
    # What is left is the prompt the server would build: the whole conversation rendered up to each reply.
    prompt, _ = encoder.chat.encode(CONVERSATION[:2], add_generation_prompt=True)
    first = mask.index(True)
    assert ids[:first] == prompt


def test_labels_are_the_next_assistant_token_or_ignored(base_run):
    tokenizer = _tokenizer(base_run)
    conversations = task_conversations("train", 1)
    source = SFTSource(conversations[:6], conversations[6:], tokenizer, 640, "test")
    inputs, labels = source.batch_at(0, seed=0, batch_size=3, seq_len=96)
    again = source.batch_at(0, seed=0, batch_size=3, seq_len=96)
    assert inputs.shape == labels.shape == (3, 96)
    assert torch.equal(inputs, again[0]) and torch.equal(labels, again[1])
    kept = labels != -100
    assert kept.any() and (~kept).any()
    assert torch.equal(labels[:, :-1][kept[:, :-1]], inputs[:, 1:][kept[:, :-1]])   # shifted by one
    assert not torch.equal(source.batch_at(1, 0, 3, 96)[0], inputs)
    # Steps run through epochs one after another, each packed in its own order.
    rows = len(source._groups(0, 0, 97))
    for step in range(2 * rows):
        x, y = source.batch_at(step, 0, 1, 96)
        assert x.shape == (1, 96)
    eval_inputs, eval_labels = source.eval_windows(96, 4)
    assert eval_inputs.shape[1] == 96 and (eval_labels != -100).any()


def test_packing_places_every_conversation_once_within_the_rows():
    lengths = [5, 9, 3, 7, 2, 8, 1, 6, 30]
    rows = pack(lengths, range(len(lengths)), 10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(min(lengths[i], 10) for i in row) <= 10 for row in rows)
    assert len(rows) <= 9


def test_data_files_are_checked_line_by_line(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(3)) + "\n\n")
    assert len(read_conversations(good)) == 3
    cases = {"not json\n": "malformed JSON", '{"text": "x"}\n': "'messages' list",
             json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n": "no assistant message",
             json.dumps({"messages": [{"role": "robot", "content": "hi"}]}) + "\n": "role must be"}
    for text, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + text)
        with pytest.raises(ValueError, match=message) as err:
            read_conversations(bad)
        assert "bad.jsonl:2" in str(err.value)
    with pytest.raises(FileNotFoundError):
        read_conversations(tmp_path / "missing.jsonl")
    train, val = split_conversations(task_conversations("train", 2))
    assert train and val and not {json.dumps(c) for c in train} & {json.dumps(c) for c in val}


def _masked_val_loss(run_dir, source) -> float:
    from kimik3.model.k3 import K3ForCausalLM

    model = K3ForCausalLM.from_pretrained(run_dir).eval()
    inputs, labels = source.eval_windows(128, 8)
    with torch.no_grad():
        return float(model(inputs, labels=labels).main_loss)


def test_sft_lowers_the_loss_and_writes_a_loadable_run(base_run, tmp_path):
    from kimik3.posttrain.evaluate import evaluate

    out = tmp_path / "sft"
    summary = run_sft(base_run, out=str(out), **_small(steps=30, batch_size=4, lr=5e-3))
    losses = [json.loads(line)["main_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "sft.json",
                 "metrics.jsonl"):
        assert (out / name).is_file(), name
    assert json.loads((out / "sft.json").read_text())["sft"]["base_run"] == str(base_run)
    source = SFTSource(*split_conversations(task_conversations("test", 2)), _tokenizer(base_run), 640, "val")
    assert _masked_val_loss(out, source) < _masked_val_loss(base_run, source) - 0.5
    assert summary.steps == 30
    # The serving engine loads it like any run.
    result = evaluate(out, "general", "low", n=2, max_tokens=4)
    assert result.n == 2 and 0.0 <= result.mean <= 1.0
    # A second SFT into the same directory is refused, not overwritten.
    with pytest.raises(ValueError, match="not empty"):
        run_sft(base_run, out=str(out), **_small())


class _Killed(Exception):
    pass


def test_sft_resumes_exactly(base_run, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_sft(base_run, out=str(whole), **_small(steps=6))

    def kill_after_step_3(record):
        if record["step"] == 3:
            raise _Killed
    with pytest.raises(_Killed):   # checkpointed at step 2; step 3 is lost
        run_sft(base_run, out=str(parts), on_step=kill_after_step_3, **_small(steps=6))
    run_sft(resume=parts, **_small(steps=6))

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses(whole)) == 6
    assert losses(parts) == losses(whole)


def test_sft_defaults_to_a_new_run_beside_the_base(base_run, tmp_path):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    run_sft(base, **_small(steps=1))
    assert (tmp_path / "base-sft" / "model.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="not a run with a saved model"):
        run_sft(tmp_path / "nothing", **_small())
    with pytest.raises(FileNotFoundError, match="sft.json"):
        run_sft(resume=base, **_small())


def test_the_default_dataset_takes_the_easy_level(base_run, tmp_path):
    from kimik3.posttrain.sft import SFTSpec, task_conversations

    easy = task_conversations("train", 2, 0, "easy")
    assert len(easy) == 18 and all("Compute " in c[1]["content"] for c in easy[:6])   # general: 3 efforts x 2
    assert any(c[1]["content"].count(".") == 2 for c in easy[6:12])   # agents: the store, one instruction
    agents_low = task_conversations("train", 3, 0, "easy", domain="agents", effort="low")
    assert len(agents_low) == 3 and all("effort: low" in c[0]["content"] and "store" in c[1]["content"]
                                        for c in agents_low)
    with pytest.raises(ValueError, match="unknown domain 'poetry'"):
        task_conversations("train", 1, domain="poetry")
    run_sft(base_run, out=tmp_path / "easy", difficulty="easy", **_small(steps=1))
    assert SFTSpec.read(tmp_path / "easy").difficulty == "easy"
    with pytest.raises(ValueError, match="drop them with --data"):
        run_sft(base_run, data=str(tmp_path / "x.jsonl"), difficulty="easy", out=tmp_path / "o", **_small())
