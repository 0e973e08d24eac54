"""The Ray deployment's settings are odma-serve's `--ray` flags, parsed by the server's CLI: they are defined in
`odma.server.ray_settings` (odma.serve_ray depends on odma.server, never the reverse) and importable from here."""

from odma.server.ray_settings import DEFAULT_MAX_SKIPS, INGRESS, PREDICT_AT, ROUTERS, RaySettings  # noqa: F401
