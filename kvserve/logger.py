"""The ``kvserve`` logger: INFO to stderr unless the application configured logging."""
from __future__ import annotations

import logging


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger("kvserve")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            "%(levelname)s %(asctime)s %(name)s: %(message)s", "%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(name)
