"""odma-serve on Ray Serve: several engine replicas behind one OpenAI-compatible endpoint (odma-serve's own app),
placed by a memory-aware request router, reserving from one set of bucket bounds learned from every replica.

Files, in the order a request meets them: `app.py` (the Serve application, `odma-serve --ray`, `serve run
odma.serve_ray:build_app`), `front.py` (the ingress), `router.py` + `scoring.py` (the request router and its
score), `messages.py` (what travels), `replica.py` (one engine), `cluster.py` (the shared window and bounds),
`merge_metrics.py` (one /metrics); `engine_ingress.py` (`--ray-ingress engines`: each engine replica serves the
app itself, Ray's proxy routes to it). Ray is imported only by `router.py` and inside functions of `app.py` and
`replica.py`; nothing here is needed by single-process odma-serve, and `pip install 'odma[ray]'` adds Ray."""


def __getattr__(name: str):
    if name in ("build_app", "build_application"):  # `serve run odma.serve_ray:build_app` (imported lazily)
        from odma.serve_ray import app

        return getattr(app, name)
    raise AttributeError(f"module 'odma.serve_ray' has no attribute {name!r}")
