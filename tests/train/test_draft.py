"""Draft training (kimik3.train.draft, draft_ttt): the training-time-test attention against step-by-step
decoding, training, its files and errors, and `kimik3 train-draft` end to end."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import numpy as np
import pytest
import torch

from kimik3.config import K3Config
from kimik3.model.cache import MLAState
from kimik3.model.draft import DRAFT_META, DRAFT_WEIGHTS, EagleDraft
from kimik3.model.k3 import K3ForCausalLM
from kimik3.train.data import Document
from kimik3.train.draft import (DRAFT_METRICS, DRAFT_PLOT, DraftArgs, DraftData, draft_vocab_for, frequent_ids,
                                load_target, train_draft)
from kimik3.train.draft_ttt import (ChainCache, ChainMetrics, against_target, chain_mask, chain_metrics, target_pass,
                                    ttt_loss, unroll)
from kimik3.train.lk_loss import acceptance_rate
from kimik3.train.loader import batch_at
from kimik3.train.tokenizer import encode_documents, train_tokenizer
from tests.train.small_run import small_config


def _model(config: K3Config | None = None, seed: int = 0) -> K3ForCausalLM:
    model = K3ForCausalLM(config or small_config(), device="cpu", dtype=torch.float32, seed=seed).eval()
    model.requires_grad_(False)
    return model


def _random_draft(model: K3ForCausalLM, seed: int = 1) -> EagleDraft:
    """A draft whose weights are all random (not the MTP copy with a pass-through fuse), so every input counts."""
    draft = EagleDraft.from_mtp(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return draft.eval()


def test_chain_mask_shape():
    mask = chain_mask(3, 3)
    assert mask.shape == (3, 9)
    assert mask[:, :3].equal(torch.ones(3, 3, dtype=torch.bool).tril())
    assert mask[:, 3:6].equal(torch.eye(3, dtype=torch.bool)) and mask[:, 6:].equal(torch.eye(3, dtype=torch.bool))


@torch.no_grad()
def test_ttt_attention_matches_step_by_step_decoding():
    """All chains unrolled at once through ChainCache == each chain decoded alone: its step-1 latents of the true
    positions 0..t prefilled into a plain MLAState, then its own steps 2..K one token at a time."""
    model = _model()
    draft = _random_draft(model)
    batch, length, steps, dim = 2, 9, 4, model.config.dim
    generator = torch.Generator().manual_seed(2)
    g = torch.randn(batch, length, dim, generator=generator)
    embeds = [torch.randn(batch, length, dim, generator=generator) for _ in range(steps)]

    cache, feature, outputs = ChainCache(), g, []
    for k in range(steps):
        feature, normed = draft(feature, embeds[k], cache)
        outputs.append((feature, normed))

    width = model.config.mla.cache_width
    for t in range(length):
        state = MLAState(torch.zeros(batch, length + steps, width))
        a, n = draft(g[:, :t + 1], embeds[0][:, :t + 1], state)
        torch.testing.assert_close(n[:, t], outputs[0][1][:, t], rtol=1e-4, atol=1e-5)
        feature = a[:, t:t + 1]
        for k in range(1, steps):
            feature, n = draft(feature, embeds[k][:, t:t + 1], state)
            torch.testing.assert_close(feature[:, 0], outputs[k][0][:, t], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(n[:, 0], outputs[k][1][:, t], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_unroll_shifts_tokens_and_targets():
    """unroll's step k at chain start t reads emb(x_{t+k}) and the draft's own step k-1 at t: the same logits as
    decoding that chain alone from the target's features."""
    model = _model()
    draft = _random_draft(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(3))
    target = target_pass(model, draft, ids)
    chains = unroll(model, draft, target, ids, 3)
    assert [tuple(c.shape[:2]) for c in chains] == [(2, 7), (2, 6), (2, 5)]
    g = draft.fuse_features(target.features)
    for t in range(5):
        state = MLAState(torch.zeros(2, 16, model.config.mla.cache_width))
        a, n = draft(g[:, :t + 1], model.embed(ids[:, 1:t + 2]), state)
        torch.testing.assert_close(model.head(n[:, t]), chains[0][:, t], rtol=1e-4, atol=1e-5)
        feature = a[:, t:t + 1]
        for k in (2, 3):
            feature, n = draft(feature, model.embed(ids[:, t + k:t + k + 1]), state)
            torch.testing.assert_close(model.head(n[:, 0]), chains[k - 1][:, t], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_untrained_first_step_is_the_mtp_module():
    """A draft fresh from ``from_mtp`` predicts at step 1 what the model's MTP module predicts."""
    model = _model()
    draft = EagleDraft.from_mtp(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    target = target_pass(model, draft, ids)
    expected = model.head(model.mtp(target.features[-1][:, :-1], model.embed(ids[:, 1:])))
    torch.testing.assert_close(unroll(model, draft, target, ids, 1)[0], expected, rtol=1e-4, atol=1e-5)


def test_expected_accepted_tokens():
    assert ChainMetrics.expected_accepted([0.5, 0.5, 0.5]) == pytest.approx(0.5 + 0.25 + 0.125)
    assert ChainMetrics([1.0, 1.0], [0.0, 1.0], 10).tau_greedy == 0.0


@pytest.mark.parametrize("loss", ["lk", "kl"])
def test_a_few_steps_reduce_the_loss(loss):
    """Repeated steps on one batch lower the TTT loss; the target's weights (embedding and head included) stay
    untouched and only the draft's get gradients."""
    model = _model()
    draft = EagleDraft.from_mtp(model)
    draft.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    head_before = model.head_weight.clone()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-2)
    target = target_pass(model, draft, ids)
    losses = []
    for _ in range(6):
        total, per_step, rates = ttt_loss(model, draft, target, ids, 3, loss)
        assert len(per_step) == len(rates) == 3 and all(0 <= r <= 1 for r in rates)
        total.backward()
        assert model.head_weight.grad is None and model.embed.weight.grad is None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total.detach()))
    assert losses[-1] < losses[0] * 0.93
    assert model.head_weight.equal(head_before)


# ------------------------------------------------------------------------------------------- reduced vocabulary
def test_a_reduced_vocabulary_head_starts_as_the_target_heads_rows():
    """A draft over N ids: its logits are the target head's logits at those ids (index i is id vocab_ids[i]), and
    its acceptance is sum over those ids of min(p, q) with p the target's full softmax: the full-vocabulary draft's
    figure when q puts the same mass on the ids and none elsewhere."""
    model = _model()
    ids = torch.tensor([0, 3, 4, 9, 17, 60])
    full, small = EagleDraft.from_mtp(model), EagleDraft.from_mtp(model, vocab_ids=ids)
    tokens = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    target = target_pass(model, full, tokens)
    logits_full = unroll(model, full, target, tokens, 2)
    logits_small = unroll(model, small, target, tokens, 2)
    for a, b in zip(logits_full, logits_small):
        assert b.shape[-1] == len(ids)
        torch.testing.assert_close(b, a[..., ids], rtol=1e-5, atol=1e-5)
    assert small.target_ids(torch.tensor([0, 5])).tolist() == [0, 60]
    reference = target.logits[:, 1:]
    rate, _ = against_target(small, logits_small[0], reference)
    masked = torch.full_like(logits_full[0], float("-inf"))
    masked[..., ids] = logits_full[0][..., ids]
    torch.testing.assert_close(rate, acceptance_rate(masked, reference), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss", ["lk", "kl"])
def test_a_reduced_vocabulary_draft_trains_and_its_metrics_count_target_ids(loss, monkeypatch):
    """TTT steps lower the loss of a reduced-vocabulary draft (finite for KL: p renormalised over the ids), its
    own head gets gradients and the target's does not; greedy match compares target ids."""
    model = _model()
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    draft = EagleDraft.from_mtp(model, vocab_ids=torch.arange(64) * 2)   # index i is id 2i
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-2)
    target = target_pass(model, draft, tokens)
    losses = []
    for _ in range(6):
        total, _, rates = ttt_loss(model, draft, target, tokens, 3, loss)
        assert torch.isfinite(total) and all(0 <= r <= 1 for r in rates)
        total.backward()
        assert draft.head.weight.grad is not None and model.head_weight.grad is None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total.detach()))
    # LK cannot go below -log of the target's mass on the ids (the acceptance's ceiling); KL's floor is 0.
    mass = torch.softmax(target.logits, -1)[..., draft.vocab_ids].sum(-1)
    floor = float(-mass.log().mean()) if loss == "lk" else 0.0
    assert losses[-1] - floor < 0.8 * (losses[0] - floor), (losses, floor)
    # A draft whose logits are the target's own on its ids: its greedy guess is right exactly where the target's
    # argmax is one of its (even) ids, which only a comparison of target ids (not of indices) counts.
    monkeypatch.setattr("kimik3.train.draft_ttt.unroll", lambda m, d, t, i, k: [
        t.logits[:, j:][..., d.vocab_ids] for j in range(1, k + 1)])
    evens = EagleDraft.from_mtp(model, vocab_ids=torch.arange(model.config.vocab_size // 2) * 2)
    metrics = chain_metrics(model, evens, tokens, 1)
    expected = (target.logits[:, 1:].argmax(-1) % 2 == 0).double().mean()
    assert metrics.greedy[0] == pytest.approx(float(expected)) and 0 < float(expected) < 1


def test_reduced_vocabulary_files_and_errors(tmp_path):
    model = _model()
    draft = EagleDraft.from_mtp(model, vocab_ids=torch.tensor([2, 5, 7]))
    draft.save(tmp_path, {"loss": "lk"})
    assert json.loads((tmp_path / DRAFT_META).read_text())["vocab"] == 3
    loaded = EagleDraft.load(tmp_path, model)
    assert loaded.vocab_ids.tolist() == [2, 5, 7] and loaded.head.weight.equal(draft.head.weight)
    for bad, match in ((torch.tensor([5, 2]), "ascending"), (torch.tensor([1, 1]), "ascending"),
                       (torch.tensor([-1, 3]), "0.."), (torch.tensor([model.config.vocab_size]), "0.."),
                       (torch.tensor([0.5]), "integer")):
        with pytest.raises(ValueError, match=match):
            EagleDraft.from_mtp(model, vocab_ids=bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / DRAFT_WEIGHTS))
    tensors["vocab_ids"] = torch.tensor([7, 5, 2])
    save_file(tensors, str(tmp_path / DRAFT_WEIGHTS))
    with pytest.raises(ValueError, match="ascending"):
        EagleDraft.load(tmp_path, model)


def test_frequent_ids_pick_the_most_frequent_and_cover_their_share():
    ids = np.array([5, 5, 5, 1, 1, 9, 9, 9, 9, 2])
    chosen, coverage = frequent_ids(ids, 2, 16)
    assert chosen.tolist() == [5, 9] and coverage == pytest.approx(0.7)
    chosen, _ = frequent_ids(ids, 5, 16)
    assert chosen.tolist() == [0, 1, 2, 5, 9]   # ties (count 0): the lower ids
    with pytest.raises(ValueError, match="exceeds"):
        frequent_ids(ids, 17, 16)


def test_the_automatic_draft_head_is_reduced_only_for_a_large_vocabulary():
    assert draft_vocab_for("auto", 163_840) == 32_768     # the debug and full presets
    assert draft_vocab_for("auto", 65_536) is None         # at most twice the reduced head: the target's own
    assert draft_vocab_for("auto", 4_096) is None          # the tiny preset
    assert draft_vocab_for(None, 163_840) is None and draft_vocab_for(1_000, 4_096) == 1_000
    DraftArgs(run="r", draft_vocab="auto").validate()
    with pytest.raises(ValueError, match="'auto' or an integer"):
        DraftArgs(run="r", draft_vocab="many").validate()


# ---------------------------------------------------------------------------------------------------- runs
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, code_corpus):
    """A run directory as `kimik3 train` leaves it, made directly: the small model (tests/train/small_run.py),
    config.json + model.safetensors, a tokenizer trained on the test corpus, run.json naming that corpus."""
    run = tmp_path_factory.mktemp("runs") / "tiny"
    model = _model()
    model.save_pretrained(run)
    docs = [Document(p.name, p.read_text()) for p in sorted(code_corpus.glob("*.py"))]
    train_tokenizer(docs, model.config.vocab_size).save(str(run / "tokenizer.json"))
    (run / "run.json").write_text(json.dumps({"args": {"data": str(code_corpus)}}))
    return run


def _args(run, **changes) -> DraftArgs:
    base = {"run": str(run), "steps": 3, "ttt": 2, "batch": 2, "seq_len": 24, "held_out": 2, "progress": False}
    base.update(changes)
    return DraftArgs(**base)


def test_train_draft_writes_a_loadable_draft(tiny_run, monkeypatch):
    monkeypatch.setattr("kimik3.train.draft.plot_draft", lambda *_: None)   # drawn in the CLI test
    lines: list[str] = []
    result = train_draft(_args(tiny_run, loss="kl"), log=lines.append)
    meta = json.loads((tiny_run / DRAFT_META).read_text())
    assert meta["loss"] == "kl" and meta["steps"] == 3 and meta["ttt"] == 2 and meta["seed"] == 0
    assert len(meta["held_out"]["acceptance"]) == 2 and meta["held_out"]["tau"] == pytest.approx(result.held_out.tau,
                                                                                                 abs=1e-4)
    assert len((tiny_run / DRAFT_METRICS).read_text().splitlines()) == 3
    model, _ = load_target(tiny_run)
    loaded = EagleDraft.load(tiny_run, model)
    for name, tensor in result.draft.state_dict().items():
        assert loaded.state_dict()[name].equal(tensor), name
    assert any("held-out after 3 steps" in line for line in lines)


def test_same_seed_same_batches_for_both_losses(tiny_run):
    """The LK and KL drafts of one seed train on the same windows: their first step (before any update) agrees."""
    model, tokenizer = load_target(tiny_run)
    ids = encode_documents(tokenizer, [Document("a", "def f(x):\n    return x + 1\n" * 200)])
    data = DraftData(ids, ids, "test")
    lk = train_draft(_args(tiny_run, steps=1), target=(model, tokenizer), data=data, save=False,
                     log=lambda _: None)
    kl = train_draft(_args(tiny_run, steps=1, loss="kl"), target=(model, tokenizer), data=data,
                     save=False, log=lambda _: None)
    assert lk.history[0]["acceptance"] == pytest.approx(kl.history[0]["acceptance"])
    assert lk.held_out_init.acceptance == pytest.approx(kl.held_out_init.acceptance)


def test_regenerate_keeps_the_prompt_and_writes_the_targets_greedy_text():
    from kimik3.train.draft_regen import regenerate

    model = _model()
    windows = torch.randint(0, model.config.vocab_size, (5, 12), generator=torch.Generator().manual_seed(3))
    seen = []
    out = regenerate(model, windows, 4, rows=2, advance=seen.append)
    assert seen == [2, 2, 1] and out.shape == windows.shape and torch.equal(out[:, :4], windows[:, :4])
    assert torch.equal(out, model.generate(windows[:, :4], 8))   # several calls of 2 rows: the same as one of 5
    assert not torch.equal(out, windows)
    for bad in (0, 12, True):
        with pytest.raises(ValueError, match="prompt tokens"):
            regenerate(model, windows, bad)
    with pytest.raises(ValueError, match="int64"):
        regenerate(model, windows.int(), 4)


def test_a_draft_trains_on_its_targets_regenerated_text(tiny_run, monkeypatch):
    """--regenerate P: every step's batch is the corpus window with its tokens after P written by the target, as
    are the held-out windows, and the reduced vocabulary is counted over that text."""
    import kimik3.train.draft as draft_module

    model, tokenizer = load_target(tiny_run)
    ids = encode_documents(tokenizer, [Document("a", "def f(x):\n    return x + 1\n" * 200)])
    seen = []
    step = draft_module._train_step
    monkeypatch.setattr(draft_module, "_train_step", lambda m, d, o, inputs, *a: seen.append(inputs) or step(
        m, d, o, inputs, *a))
    lines = []
    result = train_draft(_args(tiny_run, steps=2, regenerate=5, draft_vocab=40), target=(model, tokenizer),
                         data=DraftData(ids, ids, "test"), save=False, log=lines.append)
    for s, inputs in enumerate(seen):
        corpus = batch_at(ids, s, 0, 2, 24)[0]
        assert torch.equal(inputs[:, :5], corpus[:, :5])
        assert torch.equal(inputs, model.generate(corpus[:, :5], 19))
    assert result.meta["regenerate"] == 5 and "continued by the target after 5 tokens" in result.meta["data"]
    assert any("regenerated 4 training and 2 held-out windows" in line for line in lines)
    counted, _ = frequent_ids(torch.cat(seen).numpy().ravel(), 40, model.config.vocab_size)
    assert torch.equal(result.draft.vocab_ids.cpu(), counted)
    with pytest.raises(ValueError, match="--regenerate"):
        train_draft(_args(tiny_run, regenerate=24))


def test_errors_for_missing_files_and_no_mtp(tmp_path, tiny_run):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        train_draft(_args(tmp_path / "nowhere"))
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((tiny_run / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="tokenizer.json, model.safetensors missing"):
        train_draft(_args(partial))
    (partial / "tokenizer.json").symlink_to("checkpoint/tokenizer.json")   # its checkpoint deleted
    with pytest.raises(FileNotFoundError, match="links to files that are gone: tokenizer.json -> checkpoint/"):
        train_draft(_args(partial))

    no_mtp = tmp_path / "no-mtp"
    config = dataclasses.replace(small_config(), mtp=dataclasses.replace(small_config().mtp, num_modules=0))
    _model(config).save_pretrained(no_mtp)
    (no_mtp / "tokenizer.json").write_text((tiny_run / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="no MTP module"):
        train_draft(_args(no_mtp))
    with pytest.raises(ValueError, match="--seq-len"):
        train_draft(_args(tiny_run, seq_len=3, ttt=3))
    with pytest.raises(ValueError, match="--loss"):
        train_draft(_args(tiny_run, loss="ce"))


def test_cli_train_draft_end_to_end(tiny_run, capsys):
    from kimik3.cli import main

    code = main(["train-draft", "--run", str(tiny_run), "--steps", "3", "--ttt", "2", "--batch", "2",
                 "--seq-len", "20", "--held-out", "2", "--seed", "1", "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "held-out after 3 steps" in out.out
    meta = json.loads((tiny_run / DRAFT_META).read_text())
    assert meta["loss"] == "lk" and meta["seed"] == 1 and (tiny_run / DRAFT_WEIGHTS).is_file()
    assert len((tiny_run / DRAFT_METRICS).read_text().splitlines()) == 3
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tiny_run / DRAFT_PLOT).is_file()

    assert main(["train-draft", "--run", str(tiny_run), "--steps", "2", "--ttt", "2", "--batch", "2",
                 "--seq-len", "20", "--held-out", "2", "--draft-vocab", "50", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "a head over the 50 most frequent ids" in out
    meta = json.loads((tiny_run / DRAFT_META).read_text())
    assert meta["vocab"] == 50 and 0 < meta["vocab_coverage"] <= 1
    model, _ = load_target(tiny_run)
    assert len(EagleDraft.load(tiny_run, model).vocab_ids) == 50

    assert main(["train-draft", "--run", str(tiny_run / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    for bad in ("-3", "many"):   # refused while parsing, as argparse refuses a bad value (exit status 2)
        with pytest.raises(SystemExit) as refused:
            main(["train-draft", "--run", str(tiny_run), "--draft-vocab", bad])
        assert refused.value.code == 2 and "--draft-vocab" in capsys.readouterr().err
