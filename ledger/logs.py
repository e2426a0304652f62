"""JSON log lines on stderr for the long-running commands, one event per line.

One configuration for ``consume``, ``publish``, ``bridge-serve`` and ``serve``. Libraries that log
through the standard library (uvicorn's server and access logs, Alembic, asyncpg) are rendered
through the same processors
(structlog's ``ProcessorFormatter``): every line on stderr is one JSON object with ``event``,
``level`` and an ISO UTC ``timestamp`` (plus ``logger`` for standard-library records).
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["LEVELS", "configure_json_logging"]

LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
"""Accepted level names (uvicorn's; ``trace`` is uvicorn's level 5, below ``debug``)."""
_TRACE = 5


def configure_json_logging(level: str = "info") -> None:
    """structlog and the standard library's root logger → JSON lines on stderr at ``level`` (other
    libraries' standard-library records from ``warning`` up).

    Raises:
        ValueError: ``level`` is not one of :data:`LEVELS`.
    """
    if level.lower() not in LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    number = _TRACE if level.lower() == "trace" else logging.getLevelNamesMapping()[level.upper()]
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level, stamp,
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        # Resolve sys.stderr per logger, not once: an embedding process (or pytest) may replace it.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, stamp],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
    ))
    root = logging.getLogger()
    root.handlers = [handler]
    # Libraries log through loggers without a level of their own: their INFO chatter (Alembic's
    # "Context impl SQLiteImpl.") is not the service's; loggers given a level (uvicorn sets its own
    # to the service's) are not held back by this.
    root.setLevel(max(number, logging.WARNING))
