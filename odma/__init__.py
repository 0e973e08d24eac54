"""odma: LLM serving with one contiguous KV block per request, sized from a predicted length."""

__version__ = "0.1.0"
