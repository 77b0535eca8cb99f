"""The command line's surface, frozen: every command and its flags, so that one is added (or
dropped) on purpose, with this test edited beside it. ``bench`` takes none of its own: its
arguments, ``--help`` included, are benchmarks/speed.py's."""

import argparse

import pytest

from opengem.cli import _parse, _parser, main
from opengem.run import CHECKPOINTS

GLOBAL = ["--log-format", "--log-level", "--quiet"]
COMMANDS = {  # command -> sorted flags; a positional is written <dest>
    "generate": ["--layout", "--no-oracle", "--out", "--preset", "--seed", "--world-seed",
                 "<overrides>"],
    "train": ["--continue", "--data", "--days", "--out", "--recipe", "--resume", "<overrides>"],
    "evaluate": ["--batch-size", "--checkpoint", "--data", "--json", "--run", "--segments",
                 "--signal", "--split"],
    "explain": ["--background", "--checkpoint", "--data", "--json", "--k", "--rows", "--run",
                "--sample", "--seed", "--split"],
    "outcomes": ["--baseline", "--candidates", "--checkpoint", "--data", "--json", "--requests",
                 "--resamples", "--reserve-frac", "--run", "--seed", "--slots", "--split"],
    "recalibrate": ["--checkpoint", "--data", "--form", "--prior-std", "--run", "--segments",
                    "--split"],
    "distill": ["--checkpoint", "--data", "--out", "--student-recipe", "--teacher", "--via",
                "<overrides>"],
    "export": ["--checkpoint", "--data", "--force", "--no-compile", "--out", "--run", "--split",
               "--table-dtype"],
    "serve": ["--artifact", "--batch-window-ms", "--history", "--host", "--max-candidates",
              "--no-admin", "--port", "--runtime", "--threads"],
    "history-store": ["--data", "--out"],
    "forget": ["--data", "--history-store", "--key-file", "--raw-ids", "--users"],
    "bench": [],
    "demo": ["--no-distill", "--no-recalibrate", "--no-serve", "--out", "--preset", "--seed",
             "<overrides>"],
    "validate": ["--strict", "<data>"],
    "import": ["--in", "--key-file", "--out", "--seed", "--source", "--spec"],
    "report": ["--bench", "--data", "--eval", "--out", "--run", "--split"],
}


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices


def _flags(p: argparse.ArgumentParser) -> list[str]:
    names = [s for a in p._actions if not isinstance(a, argparse._SubParsersAction)
             for s in (a.option_strings or [f"<{a.dest}>"])]
    return sorted(n for n in names if n.startswith(("--", "<")) and n != "--help")


def test_the_commands_and_their_flags_are_the_frozen_ones():
    p = _parser()
    assert _flags(p) == GLOBAL
    got = {name: _flags(sub) for name, sub in _subcommands(p).items()}
    assert list(got) == list(COMMANDS)  # the order --help lists them in
    assert got == COMMANDS


def test_every_command_has_a_handler():
    for name, sub in _subcommands(_parser()).items():
        assert callable(sub.get_default("handler")), name


def test_checkpoint_choices_are_the_runs():
    """The CLI spells run.CHECKPOINTS itself (parsing imports no torch); they must stay the same."""
    for name in ("evaluate", "explain", "recalibrate", "distill", "export"):
        action = next(a for a in _subcommands(_parser())[name]._actions if a.dest == "checkpoint")
        assert tuple(action.choices) == CHECKPOINTS and action.default == "best", name


def test_bench_passes_its_arguments_to_speed_py(capsys):
    assert _parse(["--quiet", "bench", "--quick", "--recipe", "tiny", "a=b"]).bench_args == [
        "--quick", "--recipe", "tiny", "a=b"]
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: opengem bench") and "--quick" in out  # speed.py's parser answered


def test_other_commands_still_refuse_unknown_flags(capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["evaluate", "--run", "r", "--data", "d", "--quick"])
    assert e.value.code == 2 and "unrecognized arguments: --quick" in capsys.readouterr().err
