"""``kimik3 train-draft``: the run's MTP module fine-tuned into its speculative-decoding draft (seed section 8).

Legend: B = batch, T = tokens, K = draft steps unrolled (``--ttt``).

One run: the target (``K3ForCausalLM.from_pretrained``, frozen, eval) and its tokenizer -> the draft grown from
its MTP module (``EagleDraft.from_mtp``) -> windows of the corpus the run trained on (its ``run.json``; the
embedded stdlib corpus when it names none) -> per step, one target forward for the features and the soft targets,
K draft steps unrolled (``kimik3.train.draft_ttt``), the mean of their ``lk`` or ``kl`` loss, AdamW on the draft
alone (the embedding and the head stay the target's, frozen; with ``--draft-vocab N`` the draft has a head of its
own over the N most frequent ids of its training data, trained with it) -> the held-out acceptance per chain
position -> ``draft.safetensors`` + ``draft.json`` (``EagleDraft.save``), ``draft_metrics.jsonl`` and
``draft_loss.png`` in the run directory. With ``--regenerate P`` the windows (training and held-out) keep their
first P tokens and the target writes the rest greedily before training starts (``draft_regen``).

The batch of step s is a pure function of (seed, s) (``loader.batch_at``), so two drafts trained with the same
seed and steps, one per loss, see the same windows (``benchmarks/draft_lk_vs_kl.py``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kimik3.files import write_text_atomic
from kimik3.model.draft import DRAFT_META, DRAFT_WEIGHTS, EagleDraft
from kimik3.optim.schedule import cosine_lr
from kimik3.train.draft_regen import regenerate
from kimik3.train.draft_ttt import LOSSES, ChainMetrics, chain_metrics, target_pass, ttt_loss
from kimik3.train.loader import batch_at, eval_windows

DRAFT_METRICS = "draft_metrics.jsonl"
DRAFT_PLOT = "draft_loss.png"
HELD_OUT_SPREAD = 100  # held-out tokens encoded per token evaluated (the whole split of the stdlib corpus)
TRAIN_SPREAD = 2       # training tokens encoded per token the steps read (random windows: fewer repeats)
CHARS_PER_TOKEN = 3   # below the byte-level BPE's ratio on code: what is encoded holds the tokens asked for


@dataclass(slots=True)
class DraftArgs:
    """Everything that defines one draft training (``kimik3 train-draft``'s options)."""

    run: str
    loss: str = "lk"
    steps: int = 200
    ttt: int = 3                 # draft steps unrolled per chain
    lr: float = 1e-3             # AdamW peak, linear warmup then cosine down to a tenth
    batch: int = 8
    seq_len: int = 128
    device: str = "cpu"
    seed: int = 0
    held_out: int = 32           # held-out sequences of seq_len tokens for the final acceptance figures
    data: str | None = None      # None: the corpus the run trained on (run.json), else the embedded stdlib one
    draft_vocab: int | str | None = "auto"   # the draft's own head over this many ids (None: the target's head)
    regenerate: int = 0          # keep this many tokens of each window, the target writes the rest (0: the corpus)
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    grad_clip: float = 1.0
    progress: bool = True

    def validate(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(sorted(LOSSES))}, got {self.loss!r}")
        for name in ("steps", "ttt", "batch", "held_out"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.seq_len <= self.ttt:
            raise ValueError(f"--seq-len ({self.seq_len}) must exceed --ttt ({self.ttt}): a chain of {self.ttt} "
                             "steps needs that many tokens after its start")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        if isinstance(self.regenerate, bool) or not isinstance(self.regenerate, int) or not (
                0 <= self.regenerate < self.seq_len):
            raise ValueError(f"--regenerate must keep 0 (off) to {self.seq_len - 1} tokens of each --seq-len "
                             f"{self.seq_len} window, got {self.regenerate!r}")
        if self.draft_vocab not in (None, "auto") and (
                isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab < 1):
            raise ValueError(f"--draft-vocab must be 'auto' or an integer >= 1 (0 on the command line: the whole "
                             f"vocabulary), got {self.draft_vocab!r}")


@dataclass(slots=True)
class DraftData:
    """Token streams for draft training and its held-out evaluation (the run's own train / validation split)."""

    train_ids: np.ndarray
    val_ids: np.ndarray
    description: str


@dataclass(slots=True)
class DraftResult:
    draft: EagleDraft
    held_out: ChainMetrics
    held_out_init: ChainMetrics        # the draft as grown from the MTP module, before training
    history: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- inputs
def check_run(run_dir: str | Path) -> Path:
    """The run directory, after checking it holds what draft training reads (else FileNotFoundError naming it)."""
    from kimik3.model.pretrained import has_weights

    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist (train one with `kimik3 train`)")
    missing = [name for name in ("config.json", "tokenizer.json") if not (run / name).is_file()]
    if not has_weights(run):
        missing.append("model.safetensors")
    if missing:
        # A run's files are links into its newest checkpoint: deleting checkpoints/ leaves them dangling.
        gone = [f"{name} -> {(run / name).readlink()}" for name in missing if (run / name).is_symlink()]
        raise FileNotFoundError(f"{run} is not a complete run: {', '.join(missing)} missing (a run written by "
                                "`kimik3 train` holds config.json, model.safetensors and tokenizer.json)"
                                + (f"; links to files that are gone: {', '.join(gone)}" if gone else ""))
    return run


def load_target(run_dir: str | Path, device: str = "cpu") -> tuple[torch.nn.Module, Any]:
    """(the run's model, frozen and in eval mode, fp32 weights; its tokenizer). ValueError when it has no MTP
    module, before its weights are read."""
    from kimik3.model.k3 import K3ForCausalLM
    from kimik3.model.pretrained import read_config
    from kimik3.tokenizer import load_tokenizer

    run = check_run(run_dir)
    config, _ = read_config(run)
    if not config.mtp.num_modules:
        raise ValueError(f"{run}: the model has no MTP module (mtp.num_modules = 0), which the draft is grown "
                         "from: train the run with the MTP module on (every preset has one)")
    tokenizer = load_tokenizer(run / "tokenizer.json")
    model = K3ForCausalLM.from_pretrained(run, device=device, dtype=torch.float32).eval()
    model.requires_grad_(False)
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise ValueError(f"{run / 'tokenizer.json'}: vocabulary of {tokenizer.get_vocab_size()} exceeds the "
                         f"model's {model.config.vocab_size}")
    return model, tokenizer


def run_data_path(run_dir: Path) -> str | None:
    """The ``--data`` the run trained on (its ``run.json``), None for the embedded corpus or without the file."""
    path = run_dir / "run.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())["args"].get("data")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: unreadable run arguments ({err!r})") from None
    return data if isinstance(data, str) else None


def load_draft_data(run_dir: Path, tokenizer: Any, args: DraftArgs) -> DraftData:
    """Encode as much of the corpus as the training and held-out windows need: training documents in a seeded
    order, the held-out ones from the run's validation split (never trained on, by the run nor the draft)."""
    from kimik3.train.data import load_corpus
    from kimik3.train.tokenizer import encode_documents

    data = args.data if args.data is not None else run_data_path(Path(run_dir))
    corpus = load_corpus(data)
    order = np.random.default_rng(args.seed).permutation(len(corpus.train))
    train_docs = _enough([corpus.train[i] for i in order], TRAIN_SPREAD * args.steps * args.batch * (args.seq_len + 1))
    # The held-out windows are spread evenly over the encoded split: encode enough of it that they come from many
    # documents, not from the first one.
    val_docs = _enough(corpus.val, HELD_OUT_SPREAD * args.held_out * (args.seq_len + 1))
    train_ids, val_ids = encode_documents(tokenizer, train_docs), encode_documents(tokenizer, val_docs)
    for name, ids, need in (("training", train_ids, args.seq_len + 2),
                            ("held-out", val_ids, args.held_out * args.seq_len + 1)):
        if ids.shape[0] < need:
            raise ValueError(f"{corpus.description}: the {name} split has {ids.shape[0]:,} tokens, fewer than the "
                             f"{need:,} that --seq-len {args.seq_len} and --held-out {args.held_out} need")
    return DraftData(train_ids, val_ids, f"{corpus.description}: {len(train_docs)} training documents "
                                         f"({train_ids.shape[0]:,} tokens), {len(val_docs)} held-out")


REDUCED_DRAFT_VOCAB = 32_768


def draft_vocab_for(requested: int | str | None, vocab_size: int) -> int | None:
    """The draft head's size: ``requested`` as given (None: the target's whole vocabulary); for "auto", 32,768 ids
    when the target's vocabulary is more than twice that (the debug and full presets' 163,840: the head read for
    every drafted token shrinks 5x, and on the debug target the reduced head served faster, NOTES-spec.md), else
    the target's whole vocabulary (the tiny preset's 4,096)."""
    if requested != "auto":
        return requested
    return REDUCED_DRAFT_VOCAB if vocab_size > 2 * REDUCED_DRAFT_VOCAB else None


def frequent_ids(ids: np.ndarray, count: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """(the ``count`` most frequent token ids of ``ids``, ascending (ties: the lower id); the share of ``ids``'s
    tokens they cover). ValueError when ``count`` exceeds ``vocab_size``."""
    if count > vocab_size:
        raise ValueError(f"--draft-vocab {count} exceeds the model's vocabulary of {vocab_size}")
    counts = np.bincount(ids, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))[:count]
    chosen = np.sort(order)
    return torch.from_numpy(chosen.astype(np.int64)), float(counts[chosen].sum() / max(1, ids.shape[0]))


def _enough(docs: list, tokens: int) -> list:
    """The first documents of ``docs`` that hold about ``tokens`` tokens (all of them if they hold fewer)."""
    kept, chars = [], 0
    for doc in docs:
        if chars >= tokens * CHARS_PER_TOKEN:
            break
        kept.append(doc)
        chars += len(doc.text)
    return kept


# ---------------------------------------------------------------------------------------------------- training
def _autocast(device: torch.device) -> Callable[[], Any]:
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return lambda: torch.autocast("cpu", enabled=False)


def train_draft(args: DraftArgs, *, target: tuple[torch.nn.Module, Any] | None = None,
                data: DraftData | None = None, save: bool = True,
                log: Callable[[str], None] = print) -> DraftResult:
    """Train a draft as ``args`` says and (``save``) write it into the run directory. ``target`` / ``data``: the
    loaded model and tokenizer / token streams, to share them between several trainings (the benchmark)."""
    args.validate()
    run = check_run(args.run)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} was asked for but torch sees no CUDA GPU")
    if device.type == "cpu":
        torch.set_flush_denormal(True)   # subnormal floats take a slow path on x86 (as in kimik3 train)
    model, tokenizer = target if target is not None else load_target(run, args.device)
    torch.manual_seed(args.seed)
    data = data if data is not None else load_draft_data(run, tokenizer, args)
    held_ids, _ = eval_windows(data.val_ids, args.seq_len, args.held_out)
    windows = None   # the steps' batches, when the target writes them
    if args.regenerate:
        windows, held_ids = _regenerated(model, data.train_ids, held_ids, args, log)
    vocab_source = windows.numpy().ravel() if windows is not None else data.train_ids
    head_ids = draft_vocab_for(args.draft_vocab, model.config.vocab_size)
    vocab_ids, coverage = (None, 1.0) if head_ids is None else frequent_ids(
        vocab_source, head_ids, model.config.vocab_size)
    draft = EagleDraft.from_mtp(model, vocab_ids=vocab_ids)
    draft.train()
    vocab = ("the target's head" if vocab_ids is None else f"a head over the {len(vocab_ids):,} most frequent ids "
             f"({coverage:.1%} of the training tokens)")
    written = f", continued by the target after {args.regenerate} tokens" if args.regenerate else ""
    log(f"draft: {sum(p.numel() for p in draft.parameters()):,} parameters grown from the MTP module of {run}, "
        f"features of layers {list(draft.feature_layers)} + the final hidden state, {vocab}; data: "
        f"{data.description}{written}")
    autocast = _autocast(device)
    held_ids = held_ids.to(device)
    before = chain_metrics(model, draft, held_ids, args.ttt, args.batch, autocast)
    log(f"held-out before training: {before.describe()}")

    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    warmup = max(1, round(args.warmup_fraction * args.steps))
    metrics_path = run / DRAFT_METRICS
    history: list[dict[str, Any]] = []
    started = time.monotonic()
    if save:
        write_text_atomic(metrics_path, "")   # this training's records only
    progress = _progress(args.steps, args.progress)
    try:
        with open(metrics_path, "a") if save else _Discard() as metrics_file:
            for step in range(args.steps):
                inputs = (windows[step * args.batch:(step + 1) * args.batch] if windows is not None
                          else batch_at(data.train_ids, step, args.seed, args.batch, args.seq_len)[0])
                record = _train_step(model, draft, optimizer, inputs, step, args, warmup, autocast, device)
                record["elapsed_s"] = time.monotonic() - started
                history.append(record)
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                progress.update(1)
                progress.set_postfix({"loss": f"{record['loss']:.3f}",
                                      "accept": "/".join(f"{x:.2f}" for x in record["acceptance"])}, refresh=False)
                if not math.isfinite(record["loss"]):
                    raise RuntimeError(f"draft training: non-finite loss at step {step}; try a lower --lr")
    finally:
        progress.close()
    train_s = time.monotonic() - started
    after = chain_metrics(model, draft, held_ids, args.ttt, args.batch, autocast)
    log(f"held-out after {args.steps} steps ({args.loss} loss, {train_s:.0f} s): {after.describe()}")
    tail = history[-10:]
    meta = {"loss": args.loss, "steps": args.steps, "ttt": args.ttt, "lr": args.lr, "batch": args.batch,
            "seq_len": args.seq_len, "seed": args.seed, "data": data.description + written,
            "regenerate": args.regenerate,
            "vocab_coverage": round(coverage, 5),
            "final_train_loss": round(float(np.mean([r["loss"] for r in tail])), 5), "train_time_s": round(train_s, 1),
            "held_out": after.as_dict(), "held_out_init": before.as_dict()}
    if save:
        draft.save(run, meta)
        plot = plot_draft(metrics_path, run / DRAFT_PLOT)
        log(f"draft written to {run}/: {DRAFT_WEIGHTS} {DRAFT_META} {DRAFT_METRICS}"
            + (f" {plot.name}" if plot is not None else ""))
    return DraftResult(draft, after, before, history, meta)


def _regenerated(model, stream: np.ndarray, held_ids: torch.Tensor, args: DraftArgs,
                 log: Callable[[str], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """(every step's batch [steps x batch, T], the held-out windows [N, T]) with their tokens after the first
    ``args.regenerate`` written by the target (``draft_regen``), the windows the corpus would have given."""
    from tqdm import tqdm

    windows = torch.cat([batch_at(stream, step, args.seed, args.batch, args.seq_len)[0] for step in range(args.steps)])
    started = time.monotonic()
    with tqdm(total=len(windows) + len(held_ids), disable=not args.progress, unit="window", dynamic_ncols=True,
              desc="regenerate") as bar:
        windows = regenerate(model, windows, args.regenerate, advance=bar.update)
        held_ids = regenerate(model, held_ids, args.regenerate, advance=bar.update)
    log(f"regenerated {len(windows):,} training and {len(held_ids)} held-out windows: the target's greedy "
        f"continuation after their first {args.regenerate} tokens ({time.monotonic() - started:.0f} s)")
    return windows, held_ids


def _train_step(model, draft: EagleDraft, optimizer, inputs: torch.Tensor, step: int, args: DraftArgs,
                warmup: int, autocast, device: torch.device) -> dict[str, Any]:
    inputs = inputs.to(device)
    lr = cosine_lr(step, args.steps, args.lr, warmup)
    for group in optimizer.param_groups:
        group["lr"] = lr
    start = time.monotonic()
    with autocast():
        target = target_pass(model, draft, inputs)
        loss, per_step, rates = ttt_loss(model, draft, target, inputs, args.ttt, args.loss)
    record: dict[str, Any] = {"step": step, "loss": float(loss.detach()), "step_losses": per_step,
                              "acceptance": rates, "lr": lr}
    if math.isfinite(record["loss"]):
        loss.backward()
        record["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(draft.parameters(), args.grad_clip))
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    record["step_time_s"] = time.monotonic() - start
    return record


class _Discard:
    """A metrics file that keeps nothing (a training that is not saved)."""

    def __enter__(self) -> "_Discard":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True, desc="draft")


def plot_draft(metrics_path: Path, out_path: Path) -> Path | None:
    """``draft_loss.png``: the TTT loss and each chain position's acceptance over the steps (atomically), or None
    without matplotlib (the [plot] extra)."""
    from kimik3.train.plot import draw_figure, smooth

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    if not records:
        return None
    steps = [r["step"] for r in records]

    def draw(axes) -> None:
        ax_loss, ax_rate = axes
        ax_loss.plot(steps, [r["loss"] for r in records], color="tab:blue", alpha=0.25, lw=0.8)
        ax_loss.plot(steps, smooth([r["loss"] for r in records]), color="tab:blue", label="TTT loss (smoothed)")
        ax_loss.set_ylabel("loss")
        ax_loss.legend()
        ax_loss.grid(alpha=0.3)
        for k in range(len(records[0]["acceptance"])):
            ax_rate.plot(steps, smooth([r["acceptance"][k] for r in records]), label=f"position {k + 1}")
        ax_rate.set_ylabel("training acceptance (smoothed)")
        ax_rate.set_xlabel("step")
        ax_rate.legend()
        ax_rate.grid(alpha=0.3)

    return draw_figure(out_path, "the draft's loss plot", 2, draw)


__all__ = ["DRAFT_METRICS", "DRAFT_PLOT", "DraftArgs", "DraftData", "DraftResult", "check_run", "frequent_ids",
           "load_draft_data", "load_target", "plot_draft", "run_data_path", "train_draft"]
