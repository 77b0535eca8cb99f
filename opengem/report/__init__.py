"""What a user sees of a run: an HTML report with figures (``build_report``), TensorBoard scalars
(``opengem.train.observe.RunLog``), JSON logs for scripts (``logs.configure_logging``) and the
tables and lines the commands print (``text``).

The names below load on first use, so that ``opengem.report.cli`` (imported by every ``opengem``
command to build its parser) does not import matplotlib."""

from importlib import import_module

__all__ = ["build_report", "make_report", "reliability_bins"]
_WHERE = {"build_report": "build", "make_report": "build", "reliability_bins": "calibration"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"opengem.report.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
