"""Release files (dspark_ops.models.release): a draft without the target's embedding and LM head,
in bfloat16, rebuilt with its target, and refused with another."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from dspark_ops import SpeculativeDecoder
from dspark_ops.demo import tiny_pair
from dspark_ops.models import load_draft, save_safetensors
from dspark_ops.models.release import read_release, release_metadata, save_release
from dspark_ops.models.vocab import DraftVocabulary

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[3, 17, 5], [40, 2, 9, 11, 30, 7, 21], [12]]


def _rounded(draft):
    """``draft`` with every tensor it stores in a release rounded to bfloat16, as the release
    rebuilds it (the embedding and LM head stay the target's)."""
    state = {n: (t if n in ("embed_tokens.weight", "lm_head.weight") or not t.is_floating_point()
                 else t.to(torch.bfloat16).float()) for n, t in draft.state_dict().items()}
    copy = type(draft)(draft.config)
    copy.load_state_dict(state)
    copy.draft_vocabulary = draft.draft_vocabulary
    return copy.eval()


@pytest.fixture
def pair():
    target, draft = tiny_pair(context=0.1, noise=0.3)
    return target.eval(), draft.eval()


def test_release_rebuilds_the_draft(pair, tmp_path):
    target, draft = pair
    draft.draft_vocabulary = DraftVocabulary(torch.arange(0, 64, 2), 64)
    path = str(tmp_path / "draft.safetensors")
    summary = save_release(draft, target, path, calibration=[1.0, 1.5, 2.0])
    assert sorted(summary["left_out"]) == ["embed_tokens.weight", "lm_head.weight"]
    assert summary["w2_rows"] == 32
    meta = release_metadata(path)
    assert meta["calibration"] == [1.0, 1.5, 2.0] and meta["config"]["vocab_size"] == 64

    rebuilt = load_draft(path, target=target)
    expected = _rounded(draft).state_dict()
    inside = draft.draft_vocabulary.d2t
    for name, tensor in rebuilt.state_dict().items():
        if name == "markov_head.markov_w2.weight":  # only the vocabulary's rows are kept
            outside = torch.ones(64, dtype=torch.bool)
            outside[inside] = False
            assert torch.equal(tensor[inside], expected[name][inside])
            assert not tensor[outside].any()
        else:
            assert torch.equal(tensor, expected[name]), name
    assert torch.equal(rebuilt.draft_vocabulary.d2t, inside)
    assert rebuilt.fc.weight.dtype == torch.float32


@pytest.mark.parametrize("vocabulary", [False, True])
def test_release_decodes_as_the_rounded_checkpoint(pair, tmp_path, vocabulary):
    """Greedy decoding with the release equals decoding with the checkpoint rounded to bfloat16,
    round by round (drafts, acceptances), and plain decoding's tokens."""
    target, draft = pair
    if vocabulary:
        draft.draft_vocabulary = DraftVocabulary(torch.arange(0, 64, 3), 64)
    path = str(tmp_path / "draft.safetensors")
    save_release(draft, target, path)
    outputs = []
    for model in (_rounded(draft), load_draft(path, target=target).eval()):
        decoder = SpeculativeDecoder(target, model, scheduler="fixed")
        outputs.append(decoder.generate(PROMPTS, 24, 0.0, torch.arange(len(PROMPTS))))
    ours, theirs = outputs
    assert ours.tokens == theirs.tokens
    assert [r.accepted for r in ours.rounds] == [r.accepted for r in theirs.rounds]
    assert sum(sum(r.accepted) for r in ours.rounds) > 0  # the drafts are not all rejected


def test_release_refuses_another_target(pair, tmp_path):
    target, draft = pair
    path = str(tmp_path / "draft.safetensors")
    save_release(draft, target, path)
    other, _ = tiny_pair(seed=1)
    with pytest.raises(ValueError, match="'target' is not the model"):
        load_draft(path, target=other)
    with pytest.raises(ValueError, match="pass 'target'"):
        load_draft(path)


def test_release_keeps_a_trained_head(pair, tmp_path):
    """A draft tensor that is not the target's (a trained LM head) stays in the file."""
    target, draft = pair
    with torch.no_grad():
        draft.lm_head.weight.add_(0.5)
    path = str(tmp_path / "draft.safetensors")
    summary = save_release(draft, target, path)
    assert list(summary["left_out"]) == ["embed_tokens.weight"]
    rebuilt = load_draft(path, target=target)
    assert torch.equal(rebuilt.lm_head.weight, draft.lm_head.weight.to(torch.bfloat16).float())


def test_release_of_a_dflash_draft(tmp_path):
    from dspark_ops.models import DSparkDraft

    target, draft = tiny_pair()
    config = draft.config
    config.markov_rank, config.enable_confidence_head = 0, False
    dflash = DSparkDraft(config)
    dflash.share_target_embeddings(target)
    path = str(tmp_path / "dflash.safetensors")
    summary = save_release(dflash, target, path)
    assert summary["w2_rows"] is None
    rebuilt = load_draft(path, target=target)
    assert rebuilt.markov_head is None and rebuilt.confidence_head is None
    assert torch.equal(rebuilt.fc.weight, dflash.fc.weight.to(torch.bfloat16).float())


def test_not_a_release(pair, tmp_path):
    target, _ = pair
    path = str(tmp_path / "plain.safetensors")
    save_safetensors({"x": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="not a draft release"):
        read_release(path, target)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x05")
    with pytest.raises(ValueError, match="not a .safetensors file"):
        release_metadata(str(junk))
    with pytest.raises(FileNotFoundError, match="neither a draft checkpoint directory"):
        load_draft(str(tmp_path), target=target)


RELEASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "releases")
RELEASED = sorted(glob.glob(os.path.join(RELEASES, "*", "*.safetensors")))


@pytest.mark.parametrize("path", RELEASED, ids=[os.path.relpath(p, RELEASES) for p in RELEASED])
def test_committed_releases_are_whole(path):
    """Each committed release reads (its header, its tensors) and names a config this library
    builds, within the 25 MB a release may take; its README gives the command that made it."""
    from dspark_ops.models.checkpoint import load_state_dict_file
    from dspark_ops.models.registry import family_of_config

    assert os.path.getsize(path) <= 25_000_000
    meta = release_metadata(path)
    family = family_of_config(meta["config"])
    config = family.config_class.from_dict(meta["config"])
    tensors = load_state_dict_file(path)
    assert set(meta["left_out"]) <= {"embed_tokens.weight", "lm_head.weight"}
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items()
               if t.is_floating_point() and not n.startswith("target_check."))
    if getattr(config, "enable_confidence_head", False):
        assert len(meta["calibration"]) >= config.block_size
    with open(os.path.join(os.path.dirname(path), "README.md")) as f:
        assert os.path.basename(path) in f.read()
