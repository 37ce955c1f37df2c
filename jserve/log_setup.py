"""Logging for jserve's commands: jserve's own messages at the level asked for, other
libraries' (JAX's platform probing, e.g. "Unable to initialize backend 'tpu'", orbax's
checkpoint chatter) only from WARNING up unless that level is DEBUG."""
from __future__ import annotations

import logging
import sys

_OWN = ("jserve", "sharding")


def configure_logging(level: str = "INFO") -> None:
    level = level.upper()
    logging.basicConfig(level=logging.DEBUG if level == "DEBUG" else logging.WARNING,
                        stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in _OWN:
        logging.getLogger(name).setLevel(level)
