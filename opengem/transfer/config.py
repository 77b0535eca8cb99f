"""The knowledge-transfer config tree: which surfaces, which days, which techniques.

Every technique is a switch and they combine freely (ExFM, Li et al. 2025; GEM's transfer)::

    transfer.kd        standard KD: the student's serving head also fits the teacher's soft label
    transfer.aux       ExFM auxiliary head: the soft label goes to a separate head instead, with label
                       scaling α, loss weight w and gradient scaling β into the backbone
    transfer.adapter   ExFM student adapter: the soft label is the adapter's recalibration of the
                       stale teacher, fitted on the freshest labels each step before the student
    transfer.rep       representation transfer: the teacher's embedding as student input features
                       (source=days: the user's daily published representations over time, LoopFM)
    transfer.share     parameter sharing: the student's tables start from (or reuse) the teacher's

Staleness is a knob too: ``transfer.snapshot_lag=k`` makes a student of day d read the teacher run's
newest published snapshot (``opengem.train.continual``) that has seen only days up to d − 1 − k, so
0 is a fresh FM and k the k days of delay GEM's students suffer; unset, the teacher is the run's
newest snapshot, or its latest checkpoint when it has none (a plain run), as before.

``aux`` and ``adapter`` shape the distillation loss, so they need ``kd``; ``rep`` and ``share`` do
not. Overrides are dotted ``transfer.<section>.<field>=value`` strings, parsed like
``opengem train``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from opengem.config import ConfigError


@dataclass
class KDConfig:
    enabled: bool = True
    # loss weight of the soft-label term (3 beat 1 by a third of R, benchmarks/transfer.py)
    weight: float = 3.0
    temperature: float = 1.0  # τ: τ² BCE(s/τ, σ(t/τ)), t the teacher's or adapter's logit
    # "student_task:teacher_task" for a task the FM lacks (default: its first head)
    heads: tuple[str, ...] = ()


@dataclass
class AuxHeadConfig:
    enabled: bool = False
    # α: the head fits min(α·p_teacher, 1)   (α, w, β: the values of ExFM's
    label_scale: float = 5.0
    weight: float = 10.0  # w                                            usage example;
    # β: the head's gradient into the backbone × β   better than 1, 1, 1 here)
    grad_scale: float = 20.0
    trunk_dims: tuple[int, ...] = (32,)
    task_dims: tuple[int, ...] = (16,)


@dataclass
class AdapterConfig:
    enabled: bool = True
    # 0: per-(domain, task) Platt scaling; > 0: plus an MLP of this width on the teacher logits
    hidden: int = 0
    # sparse features given a learned scalar correction each
    ids: tuple[str, ...] = ("ad_id", "advertiser_id")
    lr: float = 0.003  # Adam; at 0.05 the bias random-walks on batches with a handful of clicks
    steps: int = 1  # adapter updates per batch, before the student's step
    # the Platt part: newton (online Newton step, opengem.transfer.adapter) | adam (at lr)
    fit: str = "newton"
    # newton: the identity's weight, in units of the rows' curvature Σ w·p(1 − p)
    prior: float = 10.0
    # the id corrections: newton (diagonal, per id, opengem.transfer.adapter) | adam (at lr)
    ids_fit: str = "newton"
    # the tasks given id corrections: borrowed (read from another task's head) | all
    ids_tasks: str = "borrowed"
    ids_prior: float = 4.0  # ids newton: prior precision of each id's correction (std 0.5 logits)


@dataclass
class RepConfig:
    enabled: bool = False
    # user: the user's cached teacher embedding (free at serving) | row: this row's
    source: str = "user"
    # | days: the user's teacher representations of the last ``days`` published days, PCA'd to ``dim`` each
    days: int = 3
    dim: int = 16


@dataclass
class ShareConfig:
    enabled: bool = True
    tables: tuple[str, ...] = ()  # table names (t_ad_id …); empty = every table both models have
    freeze: bool = False  # reuse the teacher's tables as they are instead of fine-tuning them
    rescale: bool = True  # scale each shared table to the std of the student's own initialisation
    domain_emb: bool = True  # also the domain embedding


@dataclass
class TransferConfig:
    domains: tuple[str, ...] = ("feed",)  # the surfaces the student serves
    train_split: str = "valid"  # the student's days: after the teacher's ("train") days
    eval_split: str = "test"  # held out, after the student's days
    baseline: bool = True  # also train the same student without transfer, for the transfer ratio
    # days of teacher delay: read the snapshot that has seen up to d - 1 - lag
    snapshot_lag: int | None = None
    kd: KDConfig = field(default_factory=KDConfig)
    aux: AuxHeadConfig = field(default_factory=AuxHeadConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    rep: RepConfig = field(default_factory=RepConfig)
    share: ShareConfig = field(default_factory=ShareConfig)

    def validate(self) -> TransferConfig:
        if not self.domains:
            raise ConfigError("transfer.domains must name at least one surface")
        if self.snapshot_lag is not None and self.snapshot_lag < 0:
            raise ConfigError(f"transfer.snapshot_lag is days of teacher delay: it must be >= 0, "
                              f"got {self.snapshot_lag}")
        if (self.aux.enabled or self.adapter.enabled) and not self.kd.enabled:
            raise ConfigError("transfer.aux and transfer.adapter shape the distillation loss: "
                              "they need transfer.kd.enabled=true")
        if (
            self.kd.temperature <= 0
            or self.kd.weight < 0
            or self.aux.weight < 0
            or self.aux.label_scale <= 0
        ):
            raise ConfigError("transfer.kd.temperature and aux.label_scale must be > 0, weights "
                              ">= 0")
        if self.aux.enabled and self.kd.temperature != 1.0:
            raise ConfigError("transfer.kd.temperature tempers the serving head's KD term; with "
                              "transfer.aux the soft label goes to the auxiliary head untempered: "
                              "set transfer.kd.temperature=1")
        if self.rep.source not in ("user", "row", "days"):
            raise ConfigError(f"transfer.rep.source must be user|row|days, got {self.rep.source!r}")
        if self.rep.days < 1 or self.rep.dim < 1:
            raise ConfigError("transfer.rep.days and transfer.rep.dim must be >= 1")
        if (
            self.adapter.hidden < 0
            or self.adapter.steps < 1
            or self.adapter.lr <= 0
            or self.adapter.prior <= 0
        ):
            raise ConfigError("transfer.adapter.hidden must be >= 0, steps >= 1, lr > 0, prior > 0")
        for k in ("fit", "ids_fit"):
            if getattr(self.adapter, k) not in ("newton", "adam"):
                raise ConfigError(f"transfer.adapter.{k} must be newton|adam, got "
                                  f"{getattr(self.adapter, k)!r}")
        if self.adapter.ids_tasks not in ("borrowed", "all"):
            raise ConfigError(f"transfer.adapter.ids_tasks must be borrowed|all, "
                              f"got {self.adapter.ids_tasks!r}")
        if self.adapter.ids_prior <= 0:
            raise ConfigError("transfer.adapter.ids_prior must be > 0")
        return self

    def techniques(self) -> list[str]:
        """The switched-on techniques, in the order of the module docstring."""
        on = [("kd", self.kd.enabled), ("aux", self.aux.enabled), ("adapter", self.adapter.enabled),
              ("rep", self.rep.enabled), ("share", self.share.enabled)]
        return [n for n, e in on if e]


TECHNIQUES = ("kd", "aux", "adapter", "rep", "share")


def techniques_config(names: str | list[str] | tuple[str, ...], **fields) -> TransferConfig:
    """A ``TransferConfig`` with exactly ``names`` switched on ("kd+aux+adapter", [] = the
    student alone)."""
    if isinstance(names, str):
        names = [n for n in names.replace(",", "+").split("+") if n and n != "alone"]
    unknown = set(names) - set(TECHNIQUES)
    if unknown:
        raise ConfigError(f"unknown transfer techniques {sorted(unknown)}; choose "
                          f"from {list(TECHNIQUES)}")
    cfg = TransferConfig(**fields)
    for n in TECHNIQUES:
        getattr(cfg, n).enabled = n in names
    return cfg.validate()
