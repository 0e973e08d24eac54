"""A streamed text chunk rendered from its template (`render.TextChunk`) is byte for byte the chunk json.dumps makes."""

import json

import pytest


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("null_usage", [True, False])
def test_a_text_chunk_is_byte_for_byte_the_chunk_json_dumps_renders(chat, null_usage):
    from odma.server.render import TextChunk, envelope

    render = TextChunk("chatcmpl-abc", chat, 1700000000, 'tiny "model"', null_usage=null_usage)
    for index, text in ((0, " hello"), (3, 'a "quoted"\nline\\'), (1, "é ✓ 😀 \u2028")):
        choice = {"index": index, "delta": {"content": text}} if chat else {"index": index, "text": text}
        body = envelope("chatcmpl-abc", chat, 1700000000, 'tiny "model"', [{**choice, "finish_reason": None,
                                                                           "logprobs": None}], chunk=True)
        if null_usage:
            body["usage"] = None
        assert render(index, text) == f"data: {json.dumps(body)}\n\n"
