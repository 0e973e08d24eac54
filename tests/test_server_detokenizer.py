"""Incremental detokenisation (odma.server.detokenizer, TextStream) against decoding the whole output: the text of
every prefix of many outputs (random ids, multilingual and emoji text) over real tokenizers, stop strings found
across tokens, and decoders whose window decode differs from the whole."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from odma.server import detokenizer
from odma.server.detokenizer import IncrementalText, rewrites_text
from odma.server.streams import TextStream

TEXTS = [
    "a ' b , c . d ' e ! is n't f ' s",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "東京は日本の首都です。人口は約1400万人。",
    "Привет, как дела? Всё хорошо, спасибо!",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "emoji: 👩‍👩‍👧‍👦 🇯🇵 🏳️‍🌈 😀😃😄 👍🏽 — done",
    "  leading spaces, tabs\tand\nnew lines\n\n  indented\n",
    "मैं हिंदी बोलता हूँ। 한국어도 조금 해요. ελληνικά και עברית",
    "code: def f(x):\n    return x ** 2  # squared\n",
    "numbers 3.14159 2,718 1e-9 -42 0x1F",
    "Mixed 中文 English 日本語 한국어 🎉 end.",
]


def _smollm2():
    from odma.tokenizer import load_tokenizer

    return load_tokenizer("smollm2").hf


def _sentencepiece_like():
    """A SentencePiece-style tokenizer (Metaspace pieces, byte fallback, the leading space dropped at a decode's
    start), trained here on the texts: no download."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>", *bytes_],
                                  initial_alphabet=["▁"])
    tok.train_from_iterator(TEXTS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _wordpiece(clean_up: bool = False):
    """A BERT-style WordPiece tokenizer ("##" continuations joined, other pieces spaced, " ," -> "," by its decoder),
    trained here; `clean_up`: transformers' clean-up of spaces on top ("a ' b" -> "a'b")."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TEXTS * 3, trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[UNK]", "[SEP]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]",
                                   clean_up_tokenization_spaces=clean_up)


def _engine(tok):
    """What TextStream reads of a served engine: its tokenizer and its decode (EOS dropped, specials skipped)."""
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    return SimpleNamespace(tokenizer=tok,
                           decode=lambda ids: tok.decode([t for t in ids if t not in eos], skip_special_tokens=True))


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece", "wordpiece"])
def tok(request):
    return {"smollm2": _smollm2, "sentencepiece": _sentencepiece_like, "wordpiece": _wordpiece}[request.param]()


def _outputs(tok, seed: int = 0) -> list[list[int]]:
    """Encoded texts, random ids of the whole vocabulary (broken UTF-8, specials, EOS), and texts with random ids
    spliced in."""
    rng = random.Random(seed)
    encoded = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    vocab = len(tok)
    out = list(encoded)
    out += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(40)]
    for ids in encoded:
        mixed = list(ids)
        for _ in range(4):
            mixed.insert(rng.randrange(len(mixed) + 1), rng.randrange(vocab))
        out.append(mixed)
    return out


@pytest.mark.parametrize("stride", [1, 3, detokenizer.STRIDE])
def test_the_incremental_text_equals_the_whole_decode_at_every_token(tok, stride, monkeypatch):
    monkeypatch.setattr(detokenizer, "STRIDE", stride)
    engine = _engine(tok)
    windowed = 0
    for ids in _outputs(tok):
        text = IncrementalText(engine.decode)
        for k, t in enumerate(ids, 1):
            assert text.push(t) == engine.decode(ids[:k]), (ids[:k], tok.convert_ids_to_tokens(ids[:k]))
        windowed += not text.full_decode
    assert windowed >= 40  # the window, not the full-decode fallback, made these texts


def test_a_stream_sends_the_whole_decode(tok):
    """TextStream's pieces join to the whole decode less a trailing partial character, and a piece never carries
    U+FFFD that the whole decode does not have at that place."""
    engine = _engine(tok)
    for ids in _outputs(tok, seed=1):
        stream = TextStream(engine, stops=())
        pieces = [stream.push(t) for t in ids] + [stream.flush()]
        assert "".join(pieces) == engine.decode(ids).removesuffix("\ufffd")


def _whole_decode_stream(engine, stops, min_tokens) -> TextStream:
    """A TextStream that decodes the whole output at every token (as every stream did before): the reference the windowed stream must match piece by piece."""
    stream = TextStream(SimpleNamespace(decode=engine.decode), stops, min_tokens)
    stream._text.full_decode = True
    return stream


@pytest.mark.parametrize("min_tokens", [0, 3])
def test_stop_strings_cut_the_text_where_the_whole_decode_does(tok, min_tokens):
    engine = _engine(tok)
    rng = random.Random(2)
    checked = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        full = engine.decode(ids)
        for _ in range(6):  # stop strings taken from the text: many span tokens
            i = rng.randrange(len(full))
            stops = (full[i:i + rng.randrange(1, 6)], "never-in-the-text")
            stream, reference = TextStream(engine, stops, min_tokens), _whole_decode_stream(engine, stops, min_tokens)
            assert reference._text.full_decode and not stream._text.full_decode
            sent = ""
            for t in ids:
                piece = stream.push(t)
                assert piece == reference.push(t)
                sent += piece
                if stream.stopped:
                    break
                if not min_tokens:  # nothing past a stop string goes out (before min_tokens one may)
                    assert not any(s in sent for s in stops if s)
            assert stream.flush() == reference.flush() and stream.stopped == reference.stopped
            checked += stream.stopped
    assert checked > 20


def test_a_tokenizer_that_rewrites_its_text_decodes_in_full():
    """A clean-up of spaces rewrites text already written ("a '" then "a'b"): no window can follow it, so such a
    tokenizer's streams decode the whole output each time, as before; one whose clean-up flag transformers ignores
    (BPE) keeps the window."""
    cleaning, plain = _wordpiece(clean_up=True), _wordpiece()
    ids = cleaning.encode("a ' b is n't it , d said . Done !", add_special_tokens=False)
    assert cleaning.decode(ids) != plain.decode(ids)
    cleaning_engine = _engine(cleaning)
    assert rewrites_text(cleaning, cleaning_engine.decode) and not rewrites_text(plain, _engine(plain).decode)
    stream, reference = TextStream(cleaning_engine, stops=()), _whole_decode_stream(cleaning_engine, (), 0)
    assert stream._text.full_decode
    assert [stream.push(t) for t in ids] + [stream.flush()] == [reference.push(t) for t in ids] + [reference.flush()]

    bpe = _smollm2()
    bpe.clean_up_tokenization_spaces = True  # transformers 5 ignores it for BPE (it would corrupt the text)
    try:
        assert not rewrites_text(bpe, _engine(bpe).decode)
    finally:
        bpe.clean_up_tokenization_spaces = False


def test_a_decoder_whose_window_disagrees_falls_back_to_the_whole_decode():
    """A decode that depends on more than the window (here: on the count of ids before it) is caught by the
    window's check and decoded in full from then on, exactly."""
    def decode(ids):
        return "".join(f"{t}{'.' * (len(ids) % 2)}," for t in ids)

    text = IncrementalText(decode)
    ids = list(range(5, 5 + 3 * detokenizer.STRIDE))
    for k, t in enumerate(ids, 1):
        assert text.push(t) == decode(ids[:k])
    assert text.full_decode


@pytest.mark.parametrize("name", ["smollm2", "sentencepiece", "wordpiece", "wordpiece-clean-up", "smollm2-flagged"])
def test_the_output_decoder_decodes_as_the_tokenizer_does(name):
    """OutputDecoder (the engines' decode) calls the Rust tokenizer directly only where transformers' decode is
    exactly that; a clean-up of spaces keeps transformers' decode. Its text is the tokenizer's either way."""
    from odma.engine.output_text import OutputDecoder

    tok = {"smollm2": _smollm2, "sentencepiece": _sentencepiece_like, "wordpiece": _wordpiece,
           "wordpiece-clean-up": lambda: _wordpiece(clean_up=True), "smollm2-flagged": _smollm2}[name]()
    if name == "smollm2-flagged":
        tok.clean_up_tokenization_spaces = True  # transformers 5 ignores it for BPE: the direct path stays
    try:
        eos = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
        decoder = OutputDecoder(tok, eos)
        assert (decoder._decode.__qualname__.startswith("_direct_decode")) == (name != "wordpiece-clean-up")
        for ids in _outputs(tok, seed=3) + [[*tok.encode("a ' b , c .", add_special_tokens=False), *eos, 1, 2]]:
            assert decoder(ids) == tok.decode([t for t in ids if t not in eos], skip_special_tokens=True)
    finally:
        tok.clean_up_tokenization_spaces = False
    assert OutputDecoder(None, (0,))([1, 2]) == ""
