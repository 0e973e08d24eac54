"""Schemathesis hooks for tests/test_server_schema.py (loaded by the schemathesis CLI through
SCHEMATHESIS_HOOKS, not collected by pytest).

One rule of the API compares two fields, which JSON Schema cannot say: min_tokens <= max_tokens (the server
refuses the rest with a 400, as vLLM does; the schema states it in the field's description). Positive cases
that break it are left out; negative cases all run.
"""

from __future__ import annotations

import schemathesis


def _max_tokens(body: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@schemathesis.hook
def filter_case(context, case) -> bool:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return True
    min_tokens, max_tokens = case.body.get("min_tokens"), _max_tokens(case.body)
    return not (isinstance(min_tokens, int) and max_tokens is not None and min_tokens > max_tokens)
