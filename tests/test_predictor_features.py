"""Metadata is used when present and an all-zero block when absent; long prompts keep head and tail."""

from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from odma.errors import PredictorError
from predictor.encoder import resolve_backbone
from predictor.features import MetadataEncoder, drop_metadata
from predictor.text import encode_texts, head_tail


def req(**kw):
    base = dict(prompt="hi", prompt_tokens=10, type=None, temperature=None, system_prompt_id=None, depth=None,
                generator=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_metadata_present_and_absent():
    train = [req(type="chat"), req(type="code")] * 5 + [req(generator="a"), req(generator="b")] * 5
    enc = MetadataEncoder.fit(train)
    full = enc.encode([req(type="code", temperature=0.7, depth=3, generator="b")])[0]
    bare = enc.encode([req()])[0]
    assert enc.size == full.shape[0] == 1 + 8 + 2 + 2
    assert np.all(bare[1:] == 0)  # absent metadata is the all-zero block training also sees
    assert full[1] == 1.0 and np.isclose(full[2], 0.7) and full[3] == 1.0
    assert full[1:].sum() > 2
    unseen = enc.encode([req(type="never-seen")])[0]
    assert np.all(unseen[1:] == 0)
    assert MetadataEncoder.from_json(enc.to_json()) == enc
    later = enc.encode([req(depth=2, prior_output_tokens=300.0, last_output_tokens=100)])[0]
    assert later[5] == 1.0 and np.isclose(later[6], np.log1p(300.0))  # earlier replies' mean length, log units
    assert later[7] == 1.0 and np.isclose(later[8], np.log1p(100.0))  # and the latest one's


def test_old_predictors_keep_their_metadata_layout():
    """A predictor saved before `prior_output_tokens` existed has no "numeric" key: it gets the old, shorter
    vector and its log-length scale, so its trained heads still line up; a field this version does not know is
    a clear error."""
    enc = MetadataEncoder.from_json({"vocab": {"type": ["chat", "code"]}})
    assert enc.size == 1 + 4 + 2
    old = enc.encode([req(prior_output_tokens=300.0)])[0]
    assert np.all(old[1:] == 0) and np.isclose(old[0], np.log1p(10) / 8)
    assert np.isclose(MetadataEncoder.fit([req()]).encode([req()])[0][0], np.log1p(10))
    with pytest.raises(PredictorError, match="unknown numeric"):
        MetadataEncoder.from_json({"vocab": {}, "numeric": ["temperature", "mood"]})


def test_requests_without_attributes_still_encode():
    enc = MetadataEncoder.fit([req()])
    out = enc.encode([SimpleNamespace(prompt="abcd" * 10)])  # no prompt_tokens, nothing else
    assert out.shape == (1, enc.size) and out[0, 0] > 0


def test_metadata_dropout_keeps_prompt_length():
    meta = np.ones((1000, 6), np.float32)
    out = drop_metadata(meta, 0.3, np.random.default_rng(0))
    assert np.all(out[:, 0] == 1) and 0.2 < np.mean(out[:, 1] == 0) < 0.4


def test_head_tail_truncation():
    ids = list(range(100))
    kept = head_tail(ids, 20)
    assert len(kept) == 20 and kept[:15] == ids[:15] and kept[-5:] == ids[-5:]
    assert head_tail(ids[:10], 20) == ids[:10]


def test_encode_texts_pads_to_the_batch_not_max_len():
    tok = AutoTokenizer.from_pretrained(str(resolve_backbone("minilm")))
    batch = encode_texts(tok, ["short", "a somewhat longer prompt here", None, "word " * 500], 32)
    assert batch.input_ids.shape == (4, 32)
    assert batch.attention_mask[0].sum() < 32 and batch.attention_mask[3].sum() == 32
    assert batch.input_ids[0, 0] == tok.cls_token_id
    small = encode_texts(tok, ["short"], 32)
    assert small.input_ids.shape[1] == small.attention_mask.sum()
