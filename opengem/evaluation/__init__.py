"""Offline evaluation: exact metrics (NE, AUC, gAUC, calibration) per (domain, task)."""

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

__all__ = [
    "ALL_DOMAIN",
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
