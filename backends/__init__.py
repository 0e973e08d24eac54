"""Device backends: the only code that allocates or copies device memory."""

from backends.base import Arena, Backend, KVLayout
from backends.cpu import CPUBackend

__all__ = ["Arena", "Backend", "CPUBackend", "KVLayout", "get_backend"]


def get_backend(device: str = "cpu") -> Backend:
    from odma.errors import ConfigError

    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return CPUBackend()
    raise ConfigError(f"backend {device!r} is not available yet: only 'cpu' is implemented (CUDA and MLU come later)")
