"""Logging for people (``text``) or for scripts (``json``: one object per line on stderr).

    configure_logging(logging.INFO, "json")
    log.info("trained %d steps", 40, extra={"steps": 40})
    → {"time": "2026-11-30T13:50:01.123Z", "level": "INFO", "logger": "opengem",
       "message": "trained 40 steps", "steps": 40}                                        (on one line)

Fields passed with ``extra=`` become keys of the object (values that JSON cannot hold are written
with ``str``); an exception adds ``exc_info`` (the formatted traceback).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")

# Attributes every LogRecord has: whatever else a record carries came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, then extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        t = time.gmtime(record.created)
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: int = logging.INFO, fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Route every logger to one handler on ``stream`` (stderr) in ``fmt``; replaces earlier handlers
    of the root logger (``logging.basicConfig(force=True)``). Returns the handler."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger("torch").setLevel(logging.ERROR)
    return handler
