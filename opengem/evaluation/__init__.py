"""Offline evaluation: exact metrics (NE, AUC, gAUC, calibration) per (domain, task).

The modules, lowest first: ``metrics`` (pure functions), ``accumulator`` (streaming state),
``segments`` (per-segment figures of the same rows), then the ones that run a model over a split:
``logistic`` (the L2 solver), ``platt``, ``recalibrate`` (fits ``RUN/recalibration.json``),
``evaluate`` (``opengem evaluate``), ``explain`` (occlusion explanations, ``opengem explain``).
This file imports only the first two, so the others can read ``EVAL_BATCH`` from it.
"""

from opengem.evaluation.accumulator import ALL_DOMAIN, MetricAccumulator
from opengem.evaluation.metrics import (
    auc,
    calibration,
    captured,
    entropy,
    gauc,
    logloss,
    ne,
    ne_bayes,
    summarize,
)

# Rows per forward when scoring. On CPU the demo model scores 4,474 rows/s at 1,024 and 3,168 at
# 4,096 (two threads): the bigger batch's sequence buffers outgrow the caches.
EVAL_BATCH = 1024

__all__ = [
    "ALL_DOMAIN",
    "EVAL_BATCH",
    "MetricAccumulator",
    "auc",
    "calibration",
    "captured",
    "entropy",
    "gauc",
    "logloss",
    "ne",
    "ne_bayes",
    "summarize",
]
