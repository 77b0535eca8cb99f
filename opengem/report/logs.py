"""Logging for people (``text``) or for scripts (``json``: one object per line on stderr).

    configure_logging(logging.INFO, "json")
    log.info("trained %d steps", 40, extra={"steps": 40})
    → {"time": "2026-11-30T13:50:01.123Z", "level": "INFO", "logger": "opengem",
       "message": "trained 40 steps", "steps": 40}                                        (on one line)

Fields passed with ``extra=`` become keys of the object (values that JSON cannot hold are written
with ``str``); an exception adds ``exc_info`` (the formatted traceback).

Below ``debug`` the libraries' own chatter is hidden, so that the first lines a command prints are
ours: the INFO lines fbgemm_gpu and torchrec log on the root logger (``LibraryInfoFilter``), torch's
loggers below ERROR, and the warnings torch raises for what a single process does on purpose.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
import warnings
from typing import TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}

# fbgemm_gpu and torchrec log with the module-level ``logging.info``, i.e. on the root logger, from
# their own files: at import ("Successfully loaded: 'fbgemm_gpu_….so'", once per library) and per
# table built ("[TBE=…] Feature Gates: …"). Only the file a record comes from tells them apart.
QUIET_PACKAGES = ("fbgemm_gpu", "torchrec")
# Raised by torch.distributed.checkpoint on every save and load without a process group:
# expected here.
EXPECTED_WARNINGS = ("torch.distributed is disabled",)

# Attributes every LogRecord has: whatever else a record carries came from ``extra=``.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, then
    extra fields."""

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


class LibraryInfoFilter(logging.Filter):
    """Drops the records below WARNING that code inside ``packages`` logged, whatever the logger."""

    def __init__(self, packages: tuple[str, ...] = QUIET_PACKAGES):
        super().__init__()
        # finds the folder without importing it
        specs = [importlib.util.find_spec(p) for p in packages]
        self.dirs = tuple(os.path.join(d, "") for s in specs if s is not None
                          for d in (s.submodule_search_locations or ()))

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.pathname.startswith(self.dirs)


def configure_logging(level: int = logging.INFO, fmt: str = "text",
                      stream: TextIO | None = None) -> logging.Handler:
    """Route every logger to one handler on ``stream`` (stderr) in ``fmt``; replaces earlier
    handlers of the root logger (``logging.basicConfig(force=True)``). Above DEBUG, also hides the
    libraries' chatter (module docstring). Returns the handler."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    if level > logging.DEBUG:
        handler.addFilter(LibraryInfoFilter())
        for message in EXPECTED_WARNINGS:
            warnings.filterwarnings("ignore", message=message)
        logging.getLogger("torch").setLevel(logging.ERROR)
        # importing torch resets that level (torch._logging._init_logs) from TORCH_LOGS: a torch
        # that is imported later reads this ("-all": ERROR), unless the user set TORCH_LOGS
        os.environ.setdefault("TORCH_LOGS", "-all")
    logging.basicConfig(level=level, handlers=[handler], force=True)
    return handler
