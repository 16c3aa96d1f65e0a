"""The draft vocabulary (dspark_ops.models.vocab): the subset itself, its file, drafting in it
(against drafting over the whole vocabulary with the rest masked), and exact decoding with it:
greedy identical to plain decoding, sampled following the target (chi-square), and a broken
variant (the draft given mass outside its subset) caught."""

from __future__ import annotations

import json

import pytest
import torch

from dspark_ops import costs as costs_module
from dspark_ops.costs import CostTable
from dspark_ops.decoder import SpeculativeDecoder, generate_target_only
from dspark_ops.demo import tiny_pair
from dspark_ops.models import DSparkConfig, DSparkDraft
from dspark_ops.models.vocab import (
    DRAFT_VOCAB_FILE, DraftVocabulary, VocabularyHeads, count_response_tokens,
)
from dspark_ops.ops.draft import DraftOutput
from dspark_ops.proposers import BlockDraftProposer
from dspark_ops.steps import prefill
from stats import chi_square_of_tokens, chi_square_passes

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]


# --------------------------------------------------------------------------------------------
# The subset and its file


def test_most_frequent_keeps_always_and_breaks_ties_by_id():
    counts = torch.tensor([0, 5, 5, 9, 0, 1, 0, 0])
    vocab = DraftVocabulary.most_frequent(counts, 4, always=[7])
    assert vocab.d2t.tolist() == [1, 2, 3, 7]  # 3, then 1 and 2 (tie: lower id), and 7
    vocab = DraftVocabulary.most_frequent(counts, 6, always=[7])
    assert vocab.d2t.tolist() == [0, 1, 2, 3, 5, 7]  # zeros: the lowest id first
    assert vocab.coverage(torch.tensor([[1, 4], [7, 6]])) == 0.5
    assert DraftVocabulary.most_frequent(counts, 8).d2t.tolist() == list(range(8))


@pytest.mark.parametrize("call, message", [
    (lambda: DraftVocabulary(torch.tensor([2, 1]), 8), "strictly increasing"),
    (lambda: DraftVocabulary(torch.tensor([1, 8]), 8), r"'d2t' must hold ids in \[0, 8\)"),
    (lambda: DraftVocabulary(torch.tensor([], dtype=torch.int64), 8), "non-empty"),
    (lambda: DraftVocabulary(torch.tensor([0.5]), 8), "integer"),
    (lambda: DraftVocabulary.most_frequent(torch.ones(8), 9), r"'size' must be in \[1, 8\]"),
    (lambda: DraftVocabulary.most_frequent(torch.ones(8), 1, always=[1, 2]), "do not fit"),
    (lambda: DraftVocabulary.most_frequent(torch.ones(8), 2, always=[9]), "'always' ids"),
])
def test_vocabulary_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_count_response_tokens_reads_only_the_answer():
    rows = [{"input_ids": [1, 2, 3, 3], "loss_mask": [0, 0, 1, 1]},
            {"input_ids": [4, 5], "loss_mask": [1, 0]}]
    assert count_response_tokens(rows, 6).tolist() == [0, 0, 0, 2, 1, 0]
    with pytest.raises(ValueError, match="row 0: 'input_ids' and 'loss_mask' differ"):
        count_response_tokens([{"input_ids": [1], "loss_mask": [1, 1]}], 6)
    with pytest.raises(ValueError, match=r"row 0: token ids outside \[0, 6\)"):
        count_response_tokens([{"input_ids": [6], "loss_mask": [1]}], 6)


def test_a_checkpoint_keeps_its_vocabulary(tmp_path):
    _, draft = tiny_pair(vocab=32, block_size=4)
    draft.save_pretrained(str(tmp_path / "full"))
    assert not (tmp_path / "full" / DRAFT_VOCAB_FILE).exists()
    assert DSparkDraft.from_pretrained(str(tmp_path / "full")).draft_vocabulary is None
    draft.draft_vocabulary = DraftVocabulary(torch.tensor([0, 3, 9, 31]), 32)
    draft.save_pretrained(str(tmp_path / "sub"))
    loaded = DSparkDraft.from_pretrained(str(tmp_path / "sub"))
    assert loaded.draft_vocabulary.d2t.tolist() == [0, 3, 9, 31]
    # the weights and config stay those a loader without vocabularies reads
    assert json.loads((tmp_path / "sub" / "config.json").read_text()) == \
        json.loads((tmp_path / "full" / "config.json").read_text())


def test_a_vocabulary_of_another_size_is_refused():
    _, draft = tiny_pair(vocab=32, block_size=4)
    with pytest.raises(ValueError, match="over 16 ids, the draft's over 32"):
        VocabularyHeads(draft, DraftVocabulary(torch.tensor([1, 2]), 16))


# --------------------------------------------------------------------------------------------
# Drafting in the subset


def _draft(head):
    target, draft = tiny_pair(vocab=64, block_size=5, context=0.2, noise=0.5,
                              markov_head_type="rnn" if head == "rnn" else "vanilla")
    if head == "dflash":
        config = DSparkConfig(**{**draft.config.__dict__, "markov_rank": 0,
                                 "enable_confidence_head": False})
        dflash = DSparkDraft(config)
        dflash.load_state_dict({k: v for k, v in draft.state_dict().items()
                                if not k.startswith(("markov_head", "confidence_head"))})
        with torch.no_grad():
            dflash.lm_head.weight.copy_(draft.markov_head.markov_w2.weight)
        draft = dflash
    return target, draft


def _propose(target, draft, k, temperature):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [40]]
    last, features, cache, cache_len = prefill(target, prompts, 32, "cpu")
    anchor = last.argmax(-1)
    proposer = BlockDraftProposer(draft)
    proposer.start(prompts, features, cache_len, anchor, 32)
    return proposer.propose(k, anchor, cache_len.long(), torch.full((3,), temperature),
                            torch.tensor([5, 6, 7]), {}, None), proposer


@pytest.mark.parametrize("head", ["vanilla", "rnn", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_whole_vocabulary_as_a_subset_drafts_as_without_one(head, temperature):
    """Same ids, same random streams (one per vocabulary index): bit for bit the same block."""
    target, draft = _draft(head)
    expected, _ = _propose(target, draft, 4, temperature)
    draft.draft_vocabulary = DraftVocabulary(torch.arange(64), 64)
    got, proposer = _propose(target, draft, 4, temperature)
    assert proposer.vocab_heads is not None
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head", ["vanilla", "rnn", "dflash"])
def test_a_subset_drafts_the_masked_argmax(head):
    """Greedy drafts in a subset are those of the whole vocabulary with the base logits of
    every id outside it at -inf (the anchor's W1 row is read even when it is outside)."""
    target, draft = _draft(head)
    keep = torch.tensor([0, 2, 3, 5, 8, 13, 21, 34, 55, 63])  # anchors fall outside it too
    draft.draft_vocabulary = DraftVocabulary(keep, 64)
    got, proposer = _propose(target, draft, 5, 0.0)
    assert torch.isin(got.tokens, keep).all()
    outside = torch.ones(64, dtype=torch.bool)
    outside[keep] = False
    assert torch.isneginf(got.logits[..., outside]).all()

    draft.draft_vocabulary = None
    masking = draft.base_logits
    draft.base_logits = lambda hidden: masking(hidden).masked_fill(outside, float("-inf"))
    expected, _ = _propose(target, draft, 5, 0.0)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logits[..., keep], expected.logits[..., keep])
    # the LM head: one row per id of the subset, then one -inf column per request
    assert proposer.vocab_heads.lm_rows.shape[0] == keep.numel()


# --------------------------------------------------------------------------------------------
# Exact decoding


def _costs(target, proposer, batch, target_s, draft_s):
    key = costs_module.cost_key(target, proposer, device="cpu", dtype=torch.float64)
    K = proposer.max_drafts
    return CostTable(key, {batch: [target_s(w) for w in range(1, K + 2)]},
                     [0.0] + [draft_s] * K)


@pytest.mark.parametrize("scheduler", ["fixed", "goodput"])
def test_greedy_decoding_with_a_subset_equals_plain(scheduler):
    target, draft = tiny_pair(vocab=64, block_size=5, context=0.2, noise=0.3,
                              target_dtype=torch.float64)
    expected = generate_target_only(target, PROMPTS, 24)
    draft.draft_vocabulary = DraftVocabulary(torch.arange(0, 64, 2), 64)  # half the ids
    proposer = BlockDraftProposer(draft)
    decoder = SpeculativeDecoder(target, proposer, scheduler=scheduler, costs=_costs(
        target, proposer, 1, lambda w: 0.010 + 0.001 * w, 0.0))
    out = decoder.generate(PROMPTS, 24)
    assert out.tokens == expected
    assert sum(a for r in out.rounds for a in r.accepted) > 0


class _MassOutside(VocabularyHeads):
    """A broken variant: verify is told the draft has (uniform-logit) mass outside its subset."""

    def propose(self, base_logits, anchor, hidden, temperature, seed, position, **filters):
        out = super().propose(base_logits, anchor, hidden, temperature, seed, position,
                              **filters)
        logits = torch.where(torch.isneginf(out.draft_logits), 0.0, out.draft_logits)
        return DraftOutput(out.tokens, logits)


@pytest.mark.parametrize("heads, passes", [(VocabularyHeads, True), (_MassOutside, False)])
def test_sampling_with_a_subset_follows_the_target(heads, passes):
    target, draft = tiny_pair(vocab=8, block_size=4, context=0.3, noise=0.4, num_layers=1,
                              target_dtype=torch.float64)
    trials, steps, prompt = 12000, 3, [1, 2, 3]
    draft.draft_vocabulary = DraftVocabulary(torch.tensor([0, 2, 3, 5, 6]), 8)
    proposer = BlockDraftProposer(draft)
    proposer.vocab_heads = heads(draft, draft.draft_vocabulary)
    decoder = SpeculativeDecoder(target, proposer, scheduler="fixed", costs=_costs(
        target, proposer, trials, lambda w: 1.0, 0.0))
    out = decoder.generate([prompt] * trials, steps, 1.0, torch.arange(trials))
    chi2, df = chi_square_of_tokens(out.tokens, target, prompt, steps, 1.0)
    assert chi_square_passes(chi2, df) == passes, (chi2, df)
    if passes:  # tokens outside the subset still come out, from the residual draws
        assert any(t in (1, 4, 7) for row in out.tokens for t in row[:steps])


# --------------------------------------------------------------------------------------------
# The command


def test_the_command_gives_a_trained_draft_a_vocabulary(tmp_path, capsys):
    from dspark_ops.draft_vocab import main

    _, draft = tiny_pair(vocab=32, block_size=4)
    draft.save_pretrained(str(tmp_path / "draft"))
    rows = [{"input_ids": [1, 2, 5, 5, 7], "loss_mask": [0, 0, 1, 1, 1]},
            {"input_ids": [3, 9, 9, 9], "loss_mask": [0, 1, 1, 1]}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(json.dumps({"input_ids": [9, 4], "loss_mask": [1, 1]}) + "\n")
    main([str(tmp_path / "draft"), "--data", str(data), "--size", "4", "--always", "0",
          "--heldout", str(heldout)])
    printed = capsys.readouterr().out
    assert "83.33% of them inside" in printed  # 7 left out and "held out: 50.00% of 2" in printed
    # 9 (3 times), 5 (twice), then 0 (--always) and the mask token (31)
    loaded = DSparkDraft.from_pretrained(str(tmp_path / "draft"))
    assert loaded.draft_vocabulary.d2t.tolist() == [0, 5, 9, 31]
    with pytest.raises(SystemExit):
        main([str(tmp_path / "draft"), "--data", str(data), "--size", "33"])
    assert "'--size' must be in [1, 32], got 33" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere"), "--data", str(data), "--size", "4"])
    assert "'draft': no config.json" in capsys.readouterr().err
