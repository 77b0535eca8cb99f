"""Progress bars: redrawn live on a terminal, a few lines per stage when written to a file.

    bar = progress_bar(loader, desc="evaluate test", unit="batch", disable=not progress)

On a terminal a tqdm bar redraws itself in place, several times a second. In a file (a CI log,
``2> log``, a job scheduler's output) every redraw is one more line: a pass of ~2,000 steps would
write hundreds. So when the bar's stream (stderr unless ``file=`` says otherwise) is not a terminal,
it redraws at most every ``FILE_INTERVAL_S`` seconds, and ``set_postfix`` waits for the next redraw
instead of forcing one: a stage prints its first line, one a minute, and its last.

It sits at the top of the house (it imports nothing of ``opengem``), so every stage can use it.
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm
from tqdm.std import tqdm as std_tqdm

FILE_INTERVAL_S = 60.0  # at most one line a minute in a file


class FileBar(std_tqdm):
    """A tqdm bar for a stream that is not a terminal (``progress_bar``)."""

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)  # shown at the next timed redraw


def is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def file_kwargs() -> dict:
    """tqdm's arguments for a stream that is not a terminal. ``maxinterval`` is tqdm's monitor's
    deadline for a forced redraw: below ``mininterval`` it would redraw every 10 s (its default)."""
    return {"mininterval": FILE_INTERVAL_S, "maxinterval": 2 * FILE_INTERVAL_S}


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """``tqdm(iterable, **kwargs)``; a ``FileBar`` that redraws once a minute at most when its
    stream (``kwargs["file"]``, else stderr) is not a terminal."""
    if is_terminal(kwargs.get("file") or sys.stderr):
        return tqdm(iterable, **kwargs)
    return FileBar(iterable, **{**file_kwargs(), **kwargs})
