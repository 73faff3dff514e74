"""Supervised fine-tuning (``kimik3 sft``): a run's model trained on chat conversations, loss on the
assistant's tokens only, through the same ``Trainer`` as ``kimik3 train`` (checkpoints, ``--resume``,
metrics, plot).

**Data.** OpenAI-style ``{"messages": [...]}`` JSONL (``read_conversations``), or by default
instruction data generated from the verifiable tasks (``task_conversations``: the reference solutions
of train-split tasks of every domain and effort level; validation on test-split tasks).

**Encoding.** Each conversation is rendered with the run's chat template one message at a time
(``kimik3.serve.chat.ChatEncoder``: exactly the tokens ``kimik3 serve`` builds for a prompt). The loss
mask covers each assistant message's content and the template's turn end (``<|im_end|>``: the model
learns to stop), not the assistant header, which is the generation prompt the server appends itself.

**Packing.** Conversations, each followed by EOS (which pre-training put between documents), are
packed first-fit into rows of ``seq_len + 1`` tokens, in a seeded order per epoch; what is left of a
row is EOS padding without loss. A conversation longer than a row is cut to it
(dropped when that leaves no assistant token). The batch of step s
is rows ``s*B .. s*B+B-1`` of the epochs' concatenation: a pure function of (seed, s), so resuming is
exact. Conversations packed in one row can attend to each other across the EOS, as documents do in
pre-training windows.

**The run.** ``run_sft`` writes a new run directory (default ``<run>-sft``; an existing non-empty one is
refused unless resumed) holding what ``kimik3 train`` writes, so ``kimik3 serve``/``generate`` load it,
plus ``sft.json`` (the base run and the data) that ``--resume`` reads back.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kimik3.files import write_text_atomic
from kimik3.model.k3 import IGNORE_INDEX
from kimik3.serve.chat import ChatEncoder, ChatTemplate, load_chat_template, parse_messages
from kimik3.tokenizer import EOS, load_tokenizer
from kimik3.train.source import unigram_loss

SFT_FILE = "sft.json"
RECIPE = "sft-pack-v1"
TASKS_PER_CELL = 150       # default dataset: train tasks per (domain, effort)
VAL_TASKS_PER_CELL = 4     # and test tasks per (domain, effort) for the validation loss
VAL_EVERY = 20             # a --data file: one conversation in VAL_EVERY (by hash) is held out

Conversation = list[dict[str, str]]


# -- data ---------------------------------------------------------------------------------------------
def check_conversation(messages: Any, where: str) -> Conversation:
    """A conversation's messages, validated: chat roles, text content, at least one assistant message."""
    try:
        parsed = parse_messages(messages)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if not any(m.role == "assistant" for m in parsed):
        raise ValueError(f"{where}: no assistant message (nothing to learn from)")
    return [{"role": m.role, "content": m.content} for m in parsed]


def read_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of a JSONL file of ``{"messages": [...]}`` objects; errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file")
    conversations = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: malformed JSON ({err.msg})") from None
            if not isinstance(record, dict) or "messages" not in record:
                raise ValueError(f"{path}:{number}: each line must be an object with a 'messages' list")
            conversations.append(check_conversation(record["messages"], f"{path}:{number}"))
    if len(conversations) < 2:
        raise ValueError(f"{path}: {len(conversations)} conversation(s): need at least 2 (one is held out)")
    return conversations


def task_conversations(split: str, per_cell: int, seed: int = 0, difficulty: str = "standard", domain: str = "all",
                       effort: str = "all") -> list[Conversation]:
    """The reference solutions of ``per_cell`` ``split`` tasks of every (domain, effort) at ``difficulty`` (or of
    one ``domain`` / ``effort``), as conversations."""
    from kimik3.posttrain.evaluate import expand
    from kimik3.posttrain.tasks import DOMAINS, EFFORTS, make_tasks

    efforts = expand(effort, EFFORTS, "effort")
    return [task.sft_messages() for cell_domain in expand(domain, DOMAINS, "domain") for cell_effort in efforts
            for task in make_tasks(cell_domain, split, per_cell, seed, cell_effort, difficulty)]


def write_conversations(path: str | Path, conversations: Sequence[Conversation]) -> None:
    write_text_atomic(Path(path), "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n"
                                          for c in conversations))


# -- encoding -----------------------------------------------------------------------------------------
class ConversationEncoder:
    """Token ids and the loss mask of a conversation (see the module's notes)."""

    def __init__(self, tokenizer: Any, template: ChatTemplate | None = None):
        self.chat = ChatEncoder(tokenizer, template)
        probe = [{"role": "user", "content": "x"}]
        plain, _ = self.chat.encode(probe, add_generation_prompt=False)
        prompted, _ = self.chat.encode(probe, add_generation_prompt=True)
        self.header = prompted[len(plain):]   # the generation prompt: what opens an assistant turn
        self.eos = tokenizer.token_to_id(EOS)
        if self.eos is None:
            raise ValueError(f"the tokenizer has no {EOS} token")

    def encode(self, messages: Conversation) -> tuple[list[int], list[bool]]:
        """(ids, mask): mask[i] says whether token i is the assistant's (content and turn end)."""
        ids, ends = self.chat.encode(messages, add_generation_prompt=False)
        mask = [False] * len(ids)
        start = 0
        for message, end in zip(messages, ends):
            if message["role"] == "assistant":
                body = start + len(self.header)
                if ids[start:body] != self.header:
                    raise ValueError("the chat template opens an assistant message differently from its generation "
                                     "prompt: supervised tokens would not match what the server prompts with")
                mask[body:end] = [True] * (end - body)
            start = end
        return ids, mask


@dataclass(slots=True)
class _Encoded:
    ids: list[np.ndarray]      # per conversation, followed by EOS
    masks: list[np.ndarray]    # bool, same lengths


def _encode_all(encoder: ConversationEncoder, conversations: Sequence[Conversation]) -> _Encoded:
    ids, masks = [], []
    for conversation in conversations:
        tokens, mask = encoder.encode(conversation)
        ids.append(np.asarray(tokens + [encoder.eos], dtype=np.int64))
        masks.append(np.asarray(mask + [False], dtype=bool))
    return _Encoded(ids, masks)


def pack(lengths: Sequence[int], order: Sequence[int], row: int, open_rows: int = 16) -> list[list[int]]:
    """First-fit packing of items (``lengths`` capped at ``row``) taken in ``order`` into rows of ``row``
    tokens, looking back over the last ``open_rows`` rows; returns each row's item indices."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index in order:
        size = min(lengths[index], row)
        for r in range(max(0, len(rows) - open_rows), len(rows)):
            if free[r] >= size:
                rows[r].append(index)
                free[r] -= size
                break
        else:
            rows.append([index])
            free.append(row - size)
    return rows


def _fitting(encoded: _Encoded, row: int) -> list[int]:
    """The conversations that keep an assistant token within a row of ``row`` tokens (a longer one is cut to
    the row; one cut before its first reply teaches nothing, and a row without a loss token would make a
    step's loss 0/0)."""
    kept = [i for i, mask in enumerate(encoded.masks) if mask[:row].any()]
    if not kept:
        raise ValueError(f"no conversation has an assistant token within {row - 1} tokens: raise --seq-len")
    return kept


def _rows(encoded: _Encoded, groups: list[list[int]], row: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """The packed rows as (ids [R, row], mask [R, row]), EOS-padded without loss."""
    ids = np.full((len(groups), row), eos, dtype=np.int64)
    mask = np.zeros((len(groups), row), dtype=bool)
    for r, group in enumerate(groups):
        at = 0
        for index in group:
            piece = encoded.ids[index][: row - at]
            ids[r, at: at + len(piece)] = piece
            mask[r, at: at + len(piece)] = encoded.masks[index][: len(piece)]
            at += len(piece)
    return ids, mask


def _inputs_labels(ids: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of T+1 tokens -> (inputs [R, T], labels [R, T]): the next token where it is the assistant's, else -100."""
    labels = np.where(mask[:, 1:], ids[:, 1:], IGNORE_INDEX)
    return torch.from_numpy(ids[:, :-1].copy()), torch.from_numpy(labels)


class SFTSource:
    """A ``DataSource`` (``kimik3.train.source``) of packed, loss-masked conversations."""

    def __init__(self, train: Sequence[Conversation], val: Sequence[Conversation], tokenizer: Any,
                 vocab_size: int, description: str, template: ChatTemplate | None = None,
                 sample_messages: Conversation | None = None):
        if not train or not val:
            raise ValueError(f"SFT data needs train and validation conversations, got {len(train)} and {len(val)}")
        self.train, self.val = list(train), list(val)
        self.tokenizer, self.vocab_size, self.description = tokenizer, vocab_size, description
        self.template = template
        self.encoder = ConversationEncoder(tokenizer, template)
        self.encoded_train = _encode_all(self.encoder, self.train)
        self.encoded_val = _encode_all(self.encoder, self.val)
        hasher = hashlib.sha256(RECIPE.encode())
        hasher.update(self.encoder.chat.template.source.encode())
        for conversation in (*self.train, None, *self.val):
            hasher.update(json.dumps(conversation, sort_keys=True).encode() + b"\n")
        self.fingerprint = hasher.hexdigest()
        targets = np.concatenate([i[m] for i, m in zip(self.encoded_train.ids, self.encoded_train.masks)])
        val_targets = np.concatenate([i[m] for i, m in zip(self.encoded_val.ids, self.encoded_val.masks)])
        self.unigram = unigram_loss(targets, val_targets, vocab_size)
        self.assistant_tokens = int(len(targets))
        first_reply = next(i for i, m in enumerate(self.val[0]) if m["role"] == "assistant")
        self.sample_messages = sample_messages or self.val[0][:first_reply] or [{"role": "user", "content": "Hi"}]
        self.sample_prompt = self.encoder.chat.template.render_text(self.sample_messages, add_generation_prompt=True)
        self._packed: dict[tuple[int, int, int], list[list[int]]] = {}

    def describe(self) -> str:
        tokens = sum(len(i) for i in self.encoded_train.ids)
        return (f"{self.description}: {len(self.train)} train / {len(self.val)} val conversations, {tokens:,} train "
                f"tokens of which {self.assistant_tokens:,} the assistant's (the loss's)")

    def _groups(self, seed: int, epoch: int, row: int) -> list[list[int]]:
        """The packing of ``epoch``: each row's conversation indices (cached: a few ints per conversation)."""
        key = (seed, epoch, row)
        if key not in self._packed:
            order = _fitting(self.encoded_train, row)
            random.Random(f"kimik3-sft|{seed}|{epoch}").shuffle(order)
            self._packed[key] = pack([len(i) for i in self.encoded_train.ids], order, row)
        return self._packed[key]

    def batch_at(self, step: int, seed: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        row, at = seq_len + 1, step * batch_size   # rows at..at+B-1 of the epochs one after another
        epoch = 0
        while at >= len(self._groups(seed, epoch, row)):
            at -= len(self._groups(seed, epoch, row))
            epoch += 1
        groups: list[list[int]] = []
        while len(groups) < batch_size:
            rows = self._groups(seed, epoch, row)
            groups.extend(rows[at: at + batch_size - len(groups)])
            epoch, at = epoch + 1, 0
        return _inputs_labels(*_rows(self.encoded_train, groups, row, self.encoder.eos))

    def eval_windows(self, seq_len: int, max_windows: int) -> tuple[torch.Tensor, torch.Tensor]:
        groups = pack([len(i) for i in self.encoded_val.ids], _fitting(self.encoded_val, seq_len + 1), seq_len + 1)
        ids, mask = _rows(self.encoded_val, groups[:max_windows], seq_len + 1, self.encoder.eos)
        return _inputs_labels(ids, mask)

    def with_tokenizer(self, tokenizer: Any) -> "SFTSource":
        return SFTSource(self.train, self.val, tokenizer, self.vocab_size, self.description, self.template,
                         self.sample_messages)


def split_conversations(conversations: Sequence[Conversation]) -> tuple[list[Conversation], list[Conversation]]:
    """(train, val) of a data file: a conversation is held out by a stable hash of its JSON (one in
    ``VAL_EVERY``; at least one)."""
    def held(c: Conversation) -> bool:
        digest = hashlib.sha256(json.dumps(c, sort_keys=True).encode()).digest()
        return int.from_bytes(digest[:4], "little") % VAL_EVERY == 0
    val = [c for c in conversations if held(c)]
    train = [c for c in conversations if not held(c)]
    if not val:
        val, train = train[-1:], train[:-1]
    if not train:
        train, val = val[:-1], val[-1:]
    return train, val


# -- the command --------------------------------------------------------------------------------------
@dataclass(slots=True)
class SFTSpec:
    """What ``sft.json`` records: the base run and the data (a file, or the tasks' seed and sizes)."""

    base_run: str
    data: str | None = None
    task_seed: int = 0
    tasks_per_cell: int = TASKS_PER_CELL
    val_tasks_per_cell: int = VAL_TASKS_PER_CELL
    difficulty: str = "standard"
    domain: str = "all"
    effort: str = "all"

    def write(self, run_dir: Path) -> None:
        write_text_atomic(run_dir / SFT_FILE, json.dumps({"sft": {k: getattr(self, k) for k in self.__slots__}},
                                                         indent=1))

    @classmethod
    def read(cls, run_dir: Path) -> "SFTSpec":
        path = run_dir / SFT_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {run_dir} is not a run written by `kimik3 sft`")
        try:
            return cls(**json.loads(path.read_text())["sft"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: unreadable ({err!r})") from None


def build_source(spec: SFTSpec, tokenizer: Any, vocab_size: int, template: ChatTemplate | None) -> SFTSource:
    if spec.data is not None:
        train, val = split_conversations(read_conversations(spec.data))
        description = f"conversations of {spec.data}"
    else:
        if spec.tasks_per_cell < 1 or spec.val_tasks_per_cell < 1:
            raise ValueError("the task dataset needs at least 1 train and 1 test task per domain and effort")
        cells = (spec.difficulty, spec.domain, spec.effort)
        train = task_conversations("train", spec.tasks_per_cell, spec.task_seed, *cells)
        val = task_conversations("test", spec.val_tasks_per_cell, spec.task_seed, *cells)
        level = "" if spec.difficulty == "standard" else f"{spec.difficulty} level, "
        level += "" if spec.domain == spec.effort == "all" else f"domain {spec.domain}, effort {spec.effort}, "
        description = (f"reference solutions of the verifiable tasks ({level}seed {spec.task_seed}, "
                       f"{spec.tasks_per_cell} train tasks per domain and effort; test tasks for validation)")
    return SFTSource(train, val, tokenizer, vocab_size, description, template)


def run_sft(run: str | Path | None = None, *, data: str | None = None, out: str | None = None,
            resume: str | Path | None = None, steps: int | None = None, time_budget_s: float = 180.0,
            seq_len: int = 512, batch_size: int = 8, lr: float = 2e-3, seed: int = 0, device: str = "cpu",
            checkpoint_every: str | None = None, tasks_per_cell: int = TASKS_PER_CELL, difficulty: str = "standard",
            domain: str = "all", effort: str = "all", progress: bool = True, log: Callable[[str], None] = print,
            on_step: Callable[[dict[str, Any]], None] | None = None):
    """Fine-tune ``run``'s model (new run ``out``, default ``<run>-sft``), or continue the SFT run ``resume``.
    Returns the Trainer's ``RunSummary``; ``on_step`` sees each step's record."""
    from kimik3.config.schema import K3Config
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.model.pretrained import has_weights
    from kimik3.train.trainer import TrainArgs, Trainer

    if resume is not None:
        resume = Path(resume)
        if not resume.is_dir():
            raise FileNotFoundError(f"--resume {resume}: no such run directory")
        spec = SFTSpec.read(resume)
        base = Path(spec.base_run)
    else:
        if run is None:
            raise ValueError("which run to fine-tune? pass --run DIR")
        base = Path(run)
        if data is not None and (difficulty, domain, effort) != ("standard", "all", "all"):
            raise ValueError("--difficulty, --domain and --effort pick the default task dataset: drop them with --data")
        spec = SFTSpec(str(base), data=str(Path(data)) if data is not None else None, task_seed=seed,
                       tasks_per_cell=tasks_per_cell, difficulty=difficulty, domain=domain, effort=effort)
    if not (base / "config.json").is_file() or not has_weights(base):
        raise FileNotFoundError(f"{base}: not a run with a saved model (config.json and weights): train one with "
                                "`kimik3 train`")
    config = K3Config.from_json(base / "config.json")
    tokenizer = load_tokenizer(base / "tokenizer.json", vocab_size=config.vocab_size)
    template = load_chat_template(None, base)
    source = build_source(spec, tokenizer, config.vocab_size, template)
    if seq_len + 1 > config.max_seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len {config.max_seq_len}")
    args = TrainArgs(config_path=str(base / "config.json"), data=spec.data, steps=steps, time_budget_s=time_budget_s,
                     out=str(out if out is not None else f"{str(base).rstrip('/')}-sft"), seed=seed, seq_len=seq_len,
                     batch_size=batch_size, lr=lr, device=device, checkpoint_every=checkpoint_every,
                     qat=config.moe.expert_quant, progress=progress)

    def from_base(cfg: K3Config, dev: torch.device, _seed: int) -> torch.nn.Module:
        return K3ForCausalLM.from_pretrained(base, device=dev, dtype=torch.float32)

    trainer = Trainer(args, resume=resume, model_factory=from_base, log=log, source=source)
    if resume is None:
        spec.write(trainer.run_dir)
        log(f"fine-tuning {base} into {trainer.run_dir}")
    return trainer.run(on_step)


__all__ = ["ConversationEncoder", "SFTSource", "SFTSpec", "build_source", "pack", "read_conversations",
           "run_sft", "split_conversations", "task_conversations", "write_conversations"]
