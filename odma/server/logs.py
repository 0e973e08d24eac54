"""Logging for odma-serve's processes (the server, and its engine process with --engine-process)."""

from __future__ import annotations

import logging

# Libraries that log at INFO on the root logger (onnxruntime's quantizer printed ~40 lines while the default
# predictor was built): the server's own loggers follow --log-level, the rest only say warnings unless debugging.
OWN_LOGGERS = ("odma", "predictor", "backends", "training", "uvicorn")


def configure_logging(level: str) -> None:
    level = level.upper()
    root = level if level == "DEBUG" else "WARNING"
    logging.basicConfig(level=root, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level)
