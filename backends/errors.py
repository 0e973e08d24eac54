"""The one error backends raise on purpose: a device, layout or range this process cannot use. odma maps it to
its own `ConfigError` where it asks for a device (backends know nothing of odma)."""


class BackendError(ValueError):
    """A device is absent or unsupported, or a layout, range or copy is invalid; nothing was changed."""
