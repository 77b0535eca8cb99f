"""One config tree of plain dataclasses, dotted overrides from the command line, validation.

Module configs live beside their modules (``opengem.model.*.Config``); this file assembles the tree:

    Config
      recipe: str
      model: GEMConfig        (opengem.model.foundation)
      data:  DataConfig
      optim: OptimConfig
      train: TrainConfig
      parallel: ParallelConfig (opengem.parallel.dims; used only under torchrun)

``apply_overrides(cfg, ["optim.lr=3e-3", "model.wukong.num_layers=3"])`` returns a validated copy of
``cfg`` with them set; it parses values by the field's declared type and fails with the list of
valid keys when a key is unknown. It is the one override path for every dataclass tree: the training
``Config``, the synthetic ``WorldConfig`` (``opengem generate … sizes.num_users=3000``) and, through
``apply_prefixed_overrides``, a student ``Config`` and its ``TransferConfig`` on one command line
(``optim.lr=…`` and ``transfer.kd.weight=…``). Lists take commas (``model.wukong.mlp_dims=64,32``,
``transfer.domains=feed,video``) or JSON; dict fields take JSON:
``'parallel.sharding={"t_user_id": "row_wise"}'``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field

from opengem.data.downsampling import check_rate
from opengem.discipline import DisciplineError, require_tuning_split
from opengem.model.foundation import GEMConfig
from opengem.parallel.dims import ParallelConfig, ParallelConfigError


class ConfigError(ValueError):
    """A config key or value is invalid; the message names it."""


@dataclass
class DataConfig:
    """How the training loader reads a dataset directory.

    Args:
        batch_size: rows per training step (per rank under torchrun).
        shuffle: days stay in order; the shards of a day and the rows of a shard are permuted each epoch.
        seed: seed of those permutations.
        train_split / eval_split: manifest splits to train on and to evaluate on.
        prefetch: batches collated ahead in a background thread (0 = synchronous).
        negative_rate: negative down-sampling of the training split (``opengem.data.downsampling``):
            every row with a positive label is kept, a row without one with this rate; 1 = off.
            The run records it (``RUN/downsampling.json``) and every stage that reads the model
            corrects for it (logit + log r on the base task, ``opengem.model.logit_shift.downsampling_offsets``).
        negative_rate_by_domain: {domain name: rate} overriding ``negative_rate`` on those domains
            (JSON on the command line: ``'data.negative_rate_by_domain={"feed": 0.2}'``).
    """

    batch_size: int = 512
    shuffle: bool = True
    seed: int = 0
    train_split: str = "train"
    eval_split: str = "test"
    prefetch: int = 2  # batches collated ahead in a background thread (0 = synchronous)
    negative_rate: float = 1.0
    negative_rate_by_domain: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {self.batch_size}")
        try:  # the domain names are checked against the data's schema when the loader is built
            check_rate(self.negative_rate, "data.negative_rate")
            for name, r in self.negative_rate_by_domain.items():
                check_rate(r, f"data.negative_rate_by_domain[{name!r}]")
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class OptimConfig:
    """The two optimizers: AdamW on dense parameters, row-wise Adagrad fused into the
    embedding tables.

    Args:
        lr / weight_decay / betas: dense AdamW.
        warmup_steps: linear warm-up of the dense lr.
        schedule: after warm-up, ``cosine`` (decay to ``min_lr_ratio × lr`` at the last step) or ``constant``.
        min_lr_ratio: the cosine floor, as a share of ``lr``.
        grad_clip: global norm the dense gradients are clipped to (0 = no clipping).
        sparse_lr / sparse_eps: the tables' row-wise Adagrad.
    """

    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = 100
    schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    sparse_lr: float = 0.05
    sparse_eps: float = 1e-8

    def validate(self) -> None:
        if self.lr <= 0 or self.sparse_lr <= 0:
            raise ConfigError(f"optim.lr and optim.sparse_lr must be > 0 (got "
                              f"{self.lr}, {self.sparse_lr})")
        if self.schedule not in ("cosine", "constant"):
            raise ConfigError(f"optim.schedule must be cosine or constant, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass
class TrainConfig:
    """The training loop: how long, how often to log and checkpoint, determinism and speed levers.

    Each field's comment says what it does; ``resume_reshard`` applies to ``--resume`` at another
    world size.
    """

    epochs: int = 1
    max_steps: int = 0  # 0 = run the epochs through
    # end early after this step, checkpointed, as if preempted; --resume continues the same schedule
    stop_at: int = 0
    log_every: int = 50
    ckpt_every: int = 0  # 0 = only at the end
    seed: int = 0
    deterministic: bool = True
    progress: bool = True
    threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    fp8_activations: bool = False  # store saved activations >= 64 KiB as e4m3 (opengem.ops.fp8)
    # > 0: evaluate, keep and serve an EMA of the dense weights (opengem.train.ema)
    ema_decay: float = 0.0
    # the EMA's decay at update t is min(ema_decay, (1 + t) / (10 + t)) (opengem.train.ema)
    ema_warmup: bool = False
    # Runs whose mean predicted probability is mixed into the labels, the share
    # ``soft_label_weight``: one model distilled from an ensemble of trained runs
    # (opengem.train.soft_labels). () = the labels as they are.
    soft_label_runs: tuple[str, ...] = ()
    soft_label_weight: float = 1.0
    # --resume at another world size (docs/distributed.md): "exact" resumes only where the saved
    # per-rank data positions meet at a shard boundary and refuses otherwise; "rewind" restarts
    # the data at the last boundary all ranks had passed (no row lost, rows read after it repeated).
    resume_reshard: str = "exact"
    # Held-out evaluation while training (opengem.train.hooks; the caller passes the evaluator). All
    # off by default.
    eval_every: int = 0  # after every N-th step (0 = never)
    eval_each_epoch: bool = False  # after the step that finishes each epoch
    # after these steps; 0: the untrained model, before the first step
    eval_at: tuple[int, ...] = ()
    eval_split: str = "valid"
    eval_metric: str = "all/click:ne"  # slice:metric that early stopping and keep_best follow
    # stop after this many evaluations in a row without a better metric (0 = never)
    early_stop_patience: int = 0
    keep_best: bool = False  # RUN/checkpoints/best: the model of the best evaluation

    # Which way is better for each metric ``eval_metric`` may name (calibration has no direction: 1
    # is best).
    METRIC_GOALS: typing.ClassVar[dict[str, str]] = {"ne": "min", "logloss": "min", "auc": "max",
                                                     "gauc": "max",
                                                      "captured": "max"}

    @property
    def evaluates(self) -> bool:
        return bool(self.eval_every or self.eval_each_epoch or self.eval_at)

    def eval_goal(self) -> tuple[str, str, bool]:
        """(slice, metric, higher is better) of ``eval_metric``, e.g. ("all/click", "ne", False)."""
        where, _, metric = self.eval_metric.rpartition(":")
        if not where or metric not in self.METRIC_GOALS:
            raise ConfigError(f"train.eval_metric must be <domain|all>/<task>:<metric> with "
                              f"metric one of {sorted(self.METRIC_GOALS)}, "
                              f"got {self.eval_metric!r}")
        return where, metric, self.METRIC_GOALS[metric] == "max"

    def validate(self) -> None:
        if self.epochs < 1:
            raise ConfigError(f"train.epochs must be >= 1, got {self.epochs}")
        if self.max_steps < 0 or self.ckpt_every < 0 or self.stop_at < 0 or self.log_every < 1:
            raise ConfigError("train.max_steps/stop_at/ckpt_every must be >= 0 and "
                              "train.log_every >= 1")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"train.ema_decay must be in [0, 1) (0 = off), got {self.ema_decay}")
        if not 0.0 < self.soft_label_weight <= 1.0:
            raise ConfigError(f"train.soft_label_weight must be in (0, 1], "
                              f"got {self.soft_label_weight}")
        if any(not isinstance(r, str) or not r for r in self.soft_label_runs):
            raise ConfigError(f"train.soft_label_runs must be run directories, "
                              f"got {self.soft_label_runs!r}")
        if self.resume_reshard not in ("exact", "rewind"):
            raise ConfigError(f"train.resume_reshard must be exact or rewind, "
                              f"got {self.resume_reshard!r}")
        if self.eval_every < 0 or self.early_stop_patience < 0 or any(s < 0 for s in self.eval_at):
            raise ConfigError("train.eval_every/early_stop_patience must be >= 0 and "
                              "train.eval_at steps >= 0")
        self.eval_goal()
        if (self.early_stop_patience or self.keep_best) and not self.evaluates:
            raise ConfigError("train.early_stop_patience and train.keep_best follow "
                              "held-out evaluations: "
                              "set train.eval_every, train.eval_each_epoch or train.eval_at too")


@dataclass
class Config:
    """The whole training config: one tree, one ``validate()``, a dict form for ``config.json``.

    Args:
        recipe: the name of the preset it came from (``opengem.recipes``), or ``custom``.
        model: the model (``opengem.model.foundation.GEMConfig``; ``model.arch`` picks GEM or a peer).
        data / optim / train: see their classes.
        parallel: mesh degrees and table sharding (``opengem.parallel.dims``); used only under torchrun.
    """

    recipe: str = "custom"
    model: GEMConfig = field(default_factory=GEMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def validate(self) -> "Config":
        self.data.validate()
        self.optim.validate()
        self.train.validate()
        if (
            self.train.early_stop_patience or self.train.keep_best
        ) and self.train.eval_split == self.data.eval_split:
            # Choosing when to stop (or which checkpoint to keep) on the split a run is reported on
            # would tune on it: the choice belongs to a held-out split of its own.
            raise ConfigError(f"train.eval_split={self.train.eval_split!r} is data.eval_split, the "
                              f"split a run "
                              "reports on: early stopping and keep_best must choose on another "
                              "(e.g. valid)")
        if self.train.early_stop_patience or self.train.keep_best:
            # the best checkpoint is a choice: never made on test, whatever split the run reports on
            try:
                require_tuning_split(self.train.eval_split,
                                     "the checkpoint early stopping and keep_best "
                                     f"keep (train.eval_split={self.train.eval_split!r})")
            except DisciplineError as e:
                raise ConfigError(str(e)) from e
        if self.train.soft_label_runs and (self.data.negative_rate < 1
                                           or self.data.negative_rate_by_domain):
            # The teachers' probabilities are of all rows (load_run_model corrects for sampling); a
            # loss on the kept rows would need them in the sampled space, per teacher: not built.
            raise ConfigError("train.soft_label_runs cannot be combined with "
                              "negative down-sampling "
                              "(data.negative_rate / negative_rate_by_domain)")
        try:
            # module configs raise ValueError: one error type for the CLI and callers
            self.model.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(self.parallel.sharding, dict):
            raise ConfigError(f"parallel.sharding must map table → sharding type, "
                              f"got {self.parallel.sharding!r}")
        try:
            self.parallel.validate()
        except ParallelConfigError as e:
            raise ConfigError(str(e)) from None
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        return _from_dict(cls, d, "")


def _from_dict(kind, d: dict, where: str):
    if not isinstance(d, dict):
        raise ConfigError(f"{where or 'config'}: expected an object, got {d!r}")
    hints = typing.get_type_hints(kind)
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = set(d) - names
    if unknown:
        raise ConfigError(f"unknown config keys {sorted(where + k for k in unknown)}")
    kwargs = {}
    for k, v in d.items():
        t = hints[k]
        kwargs[k] = (
            _from_dict(t, v, f"{where}{k}.")
            if dataclasses.is_dataclass(t)
            else _coerce(v, t, where + k)
        )
    return kind(**kwargs)


def _coerce(v, t, key: str):
    """Convert a JSON value or a command-line string to the declared type ``t``."""
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if v is None or (isinstance(v, str) and v.lower() in ("none", "null")):
            return None
        return _coerce(v, args[0], key)
    if origin in (tuple, list):
        args = typing.get_args(t)
        inner = args[0] if args else str
        if isinstance(v, str) and not v.startswith("["):
            v = [x.strip() for x in v.split(",") if x.strip()]  # bare: 64,32 or feed,video
        elif isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}: cannot read {v!r} as a JSON list ({e})") from None
        out = [_coerce(x, inner, key) for x in v]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        try:
            v = json.loads(v) if isinstance(v, str) else v
        except json.JSONDecodeError as e:
            raise ConfigError(f"{key}: cannot read {v!r} as a JSON object ({e})") from None
        if not isinstance(v, dict):
            raise ConfigError(f"{key}: expected a JSON object, got {v!r}")
        return dict(v)
    try:
        if t is bool:
            if isinstance(v, str):
                if v.lower() in ("1", "true", "yes", "on"):
                    return True
                if v.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(v)
            return bool(v)
        if t is int:
            # 1e6 is an int
            x = float(v) if isinstance(v, str) and not v.strip().lstrip("+-").isdigit() else v
            if isinstance(x, float) and not x.is_integer():
                raise ValueError(v)
            return int(x)
        if t is float:
            return float(v)
        if t is str:
            return str(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: cannot read {v!r} as {t.__name__}") from None
    return v


def _keys(obj, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out += _keys(v, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


T = typing.TypeVar("T")


def apply_overrides(cfg: T, overrides: Iterable[str]) -> T:
    """A validated copy of the dataclass tree ``cfg`` with ``key=value`` strings (dotted keys)
    applied in order.

    ``cfg`` itself is left as it was: one base config can seed several runs (it once did not, and a
    shared base silently carried one run's ``model.arch`` into the next)."""
    return apply_prefixed_overrides({"": cfg}, overrides)[""]


def apply_prefixed_overrides(trees: dict[str, typing.Any],
                             overrides: Iterable[str]) -> dict[str, typing.Any]:
    """``apply_overrides`` over several trees on one command line, each addressed by its prefix
    (``""``: keys without one). ``opengem distill`` passes ``{"": student,
    "transfer": techniques}``:
    ``optim.lr=1e-3`` sets the student, ``transfer.kd.weight=1`` the techniques. Returns the
    validated copies by prefix."""
    trees = {p: copy.deepcopy(t) for p, t in trees.items()}
    valid = [f"{p}.{k}" if p else k for p, t in trees.items() for k in _keys(t)]
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, value = (x.strip() for x in item.split("=", 1))
        prefix, _, rest = key.partition(".")
        root, path = (prefix, rest) if prefix and rest and prefix in trees else ("", key)
        if root not in trees:
            raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid)}")
        _set(trees[root], path, value, key, valid)
    for t in trees.values():
        _validate(t)
    return trees


def _set(tree, path: str, value: str, key: str, valid: list[str]) -> None:
    parts = path.split(".")
    obj = tree
    for p in parts[:-1]:
        if not dataclasses.is_dataclass(obj) or not hasattr(obj, p):
            raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid)}")
        obj = getattr(obj, p)
    leaf = parts[-1]
    if not dataclasses.is_dataclass(obj) or leaf not in {f.name for f in dataclasses.fields(obj)}:
        raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid)}")
    if dataclasses.is_dataclass(getattr(obj, leaf)):
        raise ConfigError(f"{key!r} is a section, not a value; set one of its fields")
    t = typing.get_type_hints(type(obj))[leaf]
    setattr(obj, leaf, _coerce(value, t, key))


def _validate(tree) -> None:
    """``tree.validate()``, with a module's plain ``ValueError`` raised as the
    one ``ConfigError``."""
    try:
        tree.validate()
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
