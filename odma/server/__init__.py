"""OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn); `odma-serve` is `cli.main`."""
