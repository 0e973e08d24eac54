"""odma-analyze: offline replay of traces through the real pool, and bucket-boundary analysis."""
