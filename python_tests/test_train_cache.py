"""The offline target cache (DeepSpec's format version 2): written then read, it gives the
features the target gives online; training from it equals training online; its byte layout is
DeepSpec's; and every mismatch is refused before training starts."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from cases.training import (TARGET_LAYERS, read_metrics, save_target, train_args,  # noqa: E402
                            write_greedy_data)
from dspark_ops.models import load_state_dict_file  # noqa: E402
from dspark_ops.train.cache import (RECORD, FeatureStage, TargetCache,  # noqa: E402
                                    write_cache)
from dspark_ops.train.data import collate, read_training_data  # noqa: E402
from dspark_ops.train.target import OnlineTarget  # noqa: E402
from dspark_ops.train.trainer import main  # noqa: E402

LAYERS = [int(i) for i in TARGET_LAYERS]
HIDDEN = 64


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    target = save_target(str(root / "target"))
    data = write_greedy_data(target, str(root / "data.jsonl"), count=12, new_tokens=24)
    return root, target, data


@pytest.fixture(scope="module")
def online(setup):
    _, target, _ = setup
    model = transformers.AutoModelForCausalLM.from_pretrained(target,
                                                              attn_implementation="sdpa")
    hooks = OnlineTarget(model.eval(), LAYERS)
    yield hooks
    hooks.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_then_read_equals_online(setup, online, tmp_path, dtype):
    _, target, data = setup
    samples, _ = read_training_data(data, min_loss_tokens=4)
    path = str(tmp_path / "cache")
    seen = []
    write_cache(path, samples, online, target_layer_ids=LAYERS, hidden_size=HIDDEN,
                target_name=target, data_path=data, dtype=dtype, batch_tokens=120,
                progress=seen.append)
    assert sum(seen) == len(samples) and len(seen) > 1  # several batches
    assert not os.path.exists(path + ".tmp")
    cache = TargetCache(path, LAYERS, HIDDEN)
    for start in range(0, len(samples), 5):  # the trainer's micro-batches, other groupings
        chunk = samples[start:start + 5]
        batch = collate(chunk, "cpu")
        with torch.no_grad():
            feats, last = online(batch["input_ids"], batch["valid"])
        got_feats, got_last = cache.batch(chunk, torch.float32, "cpu")
        assert got_feats.shape == feats.shape and got_last.shape == last.shape
        # float32: the same numbers up to the batch shape's summation order
        tol = dict(rtol=1e-4, atol=1e-4)
        expect_feats = feats if dtype == torch.float32 else feats.to(dtype).float()
        expect_last = last if dtype == torch.float32 else last.to(dtype).float()
        if dtype == torch.bfloat16:  # one bf16 step where the float32 sums differ in the last bit
            tol = dict(rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(got_feats, expect_feats, **tol)
        torch.testing.assert_close(got_last, expect_last, **tol)
        ids, loss, _, _ = cache.read(chunk[0].index)
        assert ids.tolist() == chunk[0].input_ids
        assert loss.tolist() == [float(m) for m in chunk[0].loss_mask]


def test_layout_is_deepspecs(setup, online, tmp_path):
    """A cache written here has DeepSpec's bytes; a cache written by hand in DeepSpec's layout
    reads back."""
    _, target, data = setup
    samples, _ = read_training_data(data, min_loss_tokens=4)
    path = tmp_path / "ours"
    write_cache(str(path), samples[:3], online, target_layer_ids=LAYERS, hidden_size=HIDDEN,
                target_name=target, data_path=data)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["index_record_size"] == 56 == RECORD.size
    assert manifest["num_samples"] == 3 and manifest["num_shards"] == 1
    assert manifest["target_layer_ids"] == LAYERS and manifest["hidden_size"] == HIDDEN
    assert manifest["dtypes"]["target_hidden_states"] == "bfloat16"
    raw = (path / "samples.idx").read_bytes()
    shard = (path / "shard-00000.bin").read_bytes()
    assert len(raw) == 3 * 56 and len(shard) == manifest["shards"][0]["bytes"]
    for i in range(3):
        sample_id, shard_id, length, *offsets = struct.unpack_from("<QIIQQQQQ", raw, 56 * i)
        assert sample_id == samples[i].index and shard_id == 0
        assert length == len(samples[i].input_ids)
        sizes = [4 * length, length, length, 2 * length * len(LAYERS) * HIDDEN,
                 2 * length * HIDDEN]
        assert [b - a for a, b in zip(offsets, offsets[1:])] == sizes[:4]
        ids = np.frombuffer(shard, dtype="<i4", count=length, offset=offsets[0])
        assert ids.tolist() == samples[i].input_ids
        assert np.frombuffer(shard, np.uint8, length, offsets[1]).tolist() == [1] * length

    # By hand: two samples, float32 hidden states, in a second shard for the second.
    hand = tmp_path / "hand"
    hand.mkdir()
    rng = np.random.default_rng(0)
    records, shards, expected = [], [], {}
    for shard_id, (sample_id, length) in enumerate(((7, 5), (3, 9))):
        ids = rng.integers(0, 40, length).astype("<i4")
        loss = (rng.random(length) < 0.5).astype(np.uint8)
        feats = rng.standard_normal((length, len(LAYERS) * HIDDEN)).astype("<f4")
        last = rng.standard_normal((length, HIDDEN)).astype("<f4")
        blob, offsets = b"", []
        for part in (ids, np.ones(length, np.uint8), loss, feats, last):
            offsets.append(len(blob))
            blob += part.tobytes()
        (hand / f"shard-{shard_id:05d}.bin").write_bytes(blob)
        shards.append({"file": f"shard-{shard_id:05d}.bin", "bytes": len(blob)})
        records.append(struct.pack("<QIIQQQQQ", sample_id, shard_id, length, *offsets))
        expected[sample_id] = (ids, loss, feats, last)
    (hand / "samples.idx").write_bytes(b"".join(records))
    (hand / "manifest.json").write_text(json.dumps({
        "version": 2, "num_samples": 2, "num_shards": 2, "target_layer_ids": LAYERS,
        "hidden_size": HIDDEN, "index_record_size": 56, "shards": shards,
        "dtypes": {"input_ids": "int32", "attention_mask": "uint8", "loss_mask": "uint8",
                   "target_hidden_states": "float32", "target_last_hidden_states": "float32"},
        "target_model": "by hand"}))
    cache = TargetCache(str(hand), LAYERS, HIDDEN)
    for sample_id, (ids, loss, feats, last) in expected.items():
        got = cache.read(sample_id)
        assert got[0].tolist() == ids.tolist() and got[1].tolist() == loss.tolist()
        assert torch.equal(got[2], torch.from_numpy(feats))
        assert torch.equal(got[3], torch.from_numpy(last))


def test_training_from_the_cache_equals_training_online(setup, tmp_path, monkeypatch):
    """Same flags, features from a float32 cache: the same losses and parameters (up to the
    summation order of the target's batch shapes); a resumed run reading the cache never loads
    the target."""
    _, target, data = setup
    common = ("--max-steps", "6", "--lr", "3e-3", "--markov-rank", "8", "--checkpoint-every",
              "3", "--calibration-samples", "2")
    main(train_args(target, data, str(tmp_path / "online"), *common))
    cache = str(tmp_path / "cache")
    main(train_args(target, data, str(tmp_path / "cached"), *common, "--cache", cache,
                    "--write-cache", "--cache-dtype", "float32"))
    assert os.path.isfile(os.path.join(cache, "manifest.json"))
    a, b = read_metrics(str(tmp_path / "online")), read_metrics(str(tmp_path / "cached"))
    for x, y in zip(a, b):
        for key in ("loss", "ce", "l1", "confidence"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key
    pa = load_state_dict_file(str(tmp_path / "online" / "step_6" / "model.safetensors"))
    pb = load_state_dict_file(str(tmp_path / "cached" / "step_6" / "model.safetensors"))
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], rtol=1e-3, atol=1e-5)
    calib = json.load(open(tmp_path / "cached" / "step_6" / "calibration.json"))
    assert len(calib["calib_temperature"]) == 4

    # resumed from step 3 with the cache (the cache is not written again): no target load
    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    mtime = os.path.getmtime(os.path.join(cache, "manifest.json"))
    main(train_args(target, data, str(tmp_path / "cached"), *common, "--cache", cache,
                    "--resume", str(tmp_path / "cached" / "step_3")))
    assert os.path.getmtime(os.path.join(cache, "manifest.json")) == mtime
    pc = load_state_dict_file(str(tmp_path / "cached" / "step_6" / "model.safetensors"))
    for name in pb:
        assert torch.equal(pb[name], pc[name]), name


def _fails(argv, match):
    with pytest.raises(SystemExit) as error:
        main(argv)
    assert match in str(error.value.code), str(error.value.code)


def test_cache_errors(setup, online, tmp_path):
    _, target, data = setup
    base = train_args(target, data, str(tmp_path / "out"), "--max-steps", "1")
    _fails(base + ["--write-cache"], "--write-cache needs --cache DIR")
    _fails(base + ["--cache", str(tmp_path / "none")], "no manifest.json")
    samples, _ = read_training_data(data, min_loss_tokens=4)
    path = str(tmp_path / "cache")
    write_cache(path, samples[:-1], online, target_layer_ids=LAYERS, hidden_size=HIDDEN,
                target_name=target, data_path=data)
    _fails(base + ["--cache", path], "no features for 1 samples")
    _fails(base + ["--target-layers", "0", "1", "--cache", path], "made for target layers [0, 2]")
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    manifest["version"] = 1
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    _fails(base + ["--cache", path], "format version 1")
    # --write-cache completes a cache that lacks samples
    manifest["version"] = 2
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    main(base + ["--cache", path, "--write-cache", "--calibration-samples", "0"])
    assert TargetCache(path).manifest["num_samples"] == len(samples)
    # a cache of other tokens for the same rows
    other = str(tmp_path / "other")
    shifted = [type(s)(s.index, [(t + 1) % 40 for t in s.input_ids], s.loss_mask)
               for s in samples]
    write_cache(other, shifted, online, target_layer_ids=LAYERS, hidden_size=HIDDEN,
                target_name=target, data_path=data)
    _fails(base + ["--cache", other, "--calibration-samples", "0"], "holds other tokens")


def test_staged_features_fill_the_cache(setup, online, tmp_path):
    """Samples with staged features (or features in another cache) are written from them, the
    rest through features_of; the cache is the same either way. A stage keeps rows by their
    tokens: other tokens are not taken, a truncated sample takes its prefix; rows past a point
    are dropped; a stage made for other layers is emptied when opened."""
    _, target, data = setup
    samples, _ = read_training_data(data, min_loss_tokens=4)
    stage = FeatureStage(str(tmp_path / "stage"), target_layer_ids=LAYERS, hidden_size=HIDDEN,
                         dtype=torch.float32, target_name=target)
    for s in samples[::2]:
        feats, last = online(torch.tensor([s.input_ids]),
                             torch.ones(1, len(s.input_ids), dtype=torch.bool))
        stage.put(s.index, s.input_ids, feats[0], last[0])
    assert stage.rows() == [s.index for s in samples[::2]]
    computed = []

    def features_of(ids, valid):
        computed.extend(valid.sum(1).tolist())
        return online(ids, valid)

    path = str(tmp_path / "cache")
    count = write_cache(path, samples, features_of, target_layer_ids=LAYERS, hidden_size=HIDDEN,
                        target_name=target, data_path=data, dtype=torch.float32,
                        staged=stage.get)
    assert count == len(samples[1::2]) == len(computed)
    cache = TargetCache(path, LAYERS, HIDDEN)
    got = cache.batch(samples, torch.float32, "cpu")
    want = online(*[collate(samples, "cpu")[k] for k in ("input_ids", "valid")])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the cache as a source for the next one: every sample found, nothing computed
    again = write_cache(str(tmp_path / "again"), samples, None, target_layer_ids=LAYERS,
                        hidden_size=HIDDEN, target_name=target, data_path=data,
                        dtype=torch.float32, staged=cache.find)
    assert again == 0
    first = samples[0]
    short = type(first)(first.index, first.input_ids[:5], first.loss_mask[:5])
    assert stage.get(short)[0].shape == (5, len(LAYERS) * HIDDEN)
    assert cache.find(short)[1].shape == (5, HIDDEN)
    other = type(first)(first.index, [(t + 1) % 40 for t in first.input_ids], first.loss_mask)
    assert stage.get(other) is None and cache.find(other) is None
    assert stage.discard_from(samples[2].index) == len(samples[2::2])
    assert stage.rows() == [first.index]
    with pytest.raises(ValueError, match="features"):
        stage.put(99, [1, 2], torch.zeros(3, 128), torch.zeros(3, 64))
    reopened = FeatureStage(str(tmp_path / "stage"), target_layer_ids=[0], hidden_size=HIDDEN,
                            dtype=torch.float32, target_name=target)
    assert reopened.rows() == []
    with pytest.raises(ValueError, match="no staged features"):
        write_cache(str(tmp_path / "none"), samples, None, target_layer_ids=LAYERS,
                    hidden_size=HIDDEN, target_name=target, data_path=data, staged=stage.get)
