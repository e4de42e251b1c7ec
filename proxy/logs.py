"""Logging set-up for ``kvkeeper serve``: text or JSON lines on stderr.

JSON lines carry ``ts``, ``level``, ``logger``, ``msg`` and, for the access log, the request's
fields at the top level (``request_id``, ``tenant``, ``engine``, ``route``, ``status`` ...).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Literal

LogFormat = Literal["text", "json"]
FIELDS = "kvk_fields"  # a record attribute: a dict of structured fields (``extra=``)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; structured fields merged in, tracebacks as ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, FIELDS, None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    """The usual text line, with a record's structured fields appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, FIELDS, None)
        if not isinstance(fields, dict):
            return line
        pairs = " ".join(f"{k}={_value(v)}" for k, v in fields.items() if v is not None)
        return f"{line} {pairs}"


def _value(value: object) -> str:
    """A field value for a text line: quoted (JSON) when it holds spaces, quotes or ``=``."""
    s = str(value)
    return json.dumps(s) if (not s or any(c in s for c in ' "=')) else s


def configure_logging(level: str, fmt: LogFormat = "text", *, access_log: bool = True) -> None:
    """Replace the root logger's handlers with one stderr handler in ``fmt``; without
    ``access_log`` the per-request lines are not even built."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("kvkeeper.access").setLevel(logging.NOTSET if access_log else logging.WARNING)
