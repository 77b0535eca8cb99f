"""What a run records while it trains: ``RUN/metrics.jsonl`` and TensorBoard scalars, side by side.

    with RunLog(run, enabled=info.is_main, purge_step=step + 1) as mlog:
        mlog.log(step, {"loss": 0.41, "lr_factor": 1.0, "loss_by_domain_task": {"feed/click": 0.39}})

writes one JSON line ``{"step": step, "loss": 0.41, …}`` (the format ``metrics.jsonl`` always had)
and the scalars ``loss``, ``lr_factor``, ``loss_by_domain_task/feed/click`` (nested keys joined by
``/``) to event files in ``RUN/tensorboard/`` (``tensorboard --logdir RUN/tensorboard``).

Resume: the trainer truncates ``metrics.jsonl`` to the checkpoint's step
(``resume.truncate_metrics``); event files cannot be truncated, so the writer opened after a resume
at step S gets ``purge_step=S + 1``: TensorBoard then hides every earlier event of step > S, and the
redone steps appear once. Only rank 0 writes (``enabled=False`` elsewhere: every call is a no-op).
Without the ``tensorboard`` package only the JSON lines are written (one warning says so).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Self

from opengem.run import METRICS_FILE, TENSORBOARD_DIR

log = logging.getLogger(__name__)


def flatten_scalars(values: Mapping, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number in ``values``; nested mappings join their keys
    with ``/``."""
    for key, v in values.items():
        tag = f"{prefix}{key}"
        if isinstance(v, Mapping):
            yield from flatten_scalars(v, tag + "/")
        elif isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            yield tag, float(v)


class RunLog:
    """Appends ``metrics.jsonl`` lines and TensorBoard scalars of one run.

    Args:
        run: the run directory (exists).
        enabled: False on every rank but 0: nothing is opened or written.
        purge_step: the first step this writer will log; TensorBoard drops older events of this step
            and later ones (pass ``resumed step + 1``; harmless on a fresh run).
        tensorboard: False writes only the JSON lines.
        flush_secs: how often TensorBoard's writer flushes (the JSON lines flush every call).
    """

    def __init__(self, run: str | Path, enabled: bool = True, purge_step: int | None = None,
                 tensorboard: bool = True, flush_secs: int = 30) -> None:
        self.run = Path(run)
        self.enabled = enabled
        # Open for the log's lifetime (the training loop), closed by close() / the with-block.
        self._file = open(self.run / METRICS_FILE, "a") if enabled else None  # noqa: SIM115
        self._tb = self._writer(purge_step, flush_secs) if enabled and tensorboard else None

    def _writer(self, purge_step: int | None, flush_secs: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # the package is optional: metrics.jsonl is the record
            log.info("no TensorBoard event files (%s); pip install tensorboard to get them", e)
            return None
        return SummaryWriter(str(self.run / TENSORBOARD_DIR), purge_step=purge_step,
                             flush_secs=flush_secs)

    def log(self, step: int, scalars: Mapping) -> None:
        """One line ``{"step": step, **scalars}``; every finite number also as a
        TensorBoard scalar."""
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **scalars}) + "\n")
        self._file.flush()
        if self._tb is not None:
            for tag, value in flatten_scalars(scalars):
                self._tb.add_scalar(tag, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
