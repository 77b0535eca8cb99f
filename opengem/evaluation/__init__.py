"""Offline evaluation: exact metrics (NE, AUC, gAUC, calibration) per (domain, task)."""

from opengem.evaluation.accumulator import ALL_DOMAIN, MetricAccumulator, RateCounter
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
    "RateCounter",
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
