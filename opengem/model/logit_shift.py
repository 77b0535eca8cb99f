"""Logit corrections on a model's output: per-(group, task) offsets (and per-task slopes) folded
into the output biases, and the same shift applied from outside a model whose parameters stay
untouched.

Legend: B rows, T tasks, G output groups (the domains, or one with GEM's shared heads).

Any model whose output is a logit per task for each row's domain takes them, through the small
interface ``LogitOutput``: GEM's ``Heads`` (``out_b``, the output layer's bias per (group, task)),
and the peer baselines themselves (``PeerModel.out_b``, a per-(domain, task) bias that is 0 as
trained), so every model the trainer trains is corrected and recalibrated alike (``gem_heads``
finds it; a model without one is a ``RecalibrationError``).

Two corrections use them, both read from a run's files by ``opengem.run``: the recalibration fitted
on held-out days (``evaluation.recalibrate``) and the negative down-sampling correction.

The down-sampling correction (``downsampling_offsets``). Negatives (rows with no positive label,
``data.downsampling``) kept at rate r multiply the odds the model learns by 1/r (each kept negative
stands for 1/r of them: its weight), so the calibrated probability is He et al.'s q = p / (p + (1 −
p)/w) with w the rate r itself (not 1/r: that would shift the other way), i.e. logit(q) = logit(p) +
log r, an offset on the output bias. Which heads get it, with the ESMM chain p(conv) = p(click) ·
p(conv | click) (``Heads.chain``):
a row with conv = 1 has click = 1, so the rows kept with click = 1 are all of them and p(conv |
click) is learnt unbiased; p(click) alone is inflated. So the offset is log r on each task's *own*
logit when the task is not chained (the base task, click) and 0 on a chained one (its logit is the
conditional); chaining the corrected click gives the corrected conversion
(tests/unit/evaluation/test_downsampling_correction.py checks it numerically). An unchained second
task (``model.heads.chain_required=false``) also gets log r, which is exact only as its rate → 0;
the run's record says ``exact: false`` then, and a recalibration fitted on top corrects the mean.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from opengem.features.schema import FeatureSchema
from opengem.model.heads import Heads, chained_logit, log1mexp

__all__ = ["LogitOutput", "LogitShift", "RecalibrationError", "downsampling_offsets",
           "fold_offsets", "gem_heads", "offset_groups", "offsets_tensor", "own_logits",
           "shift_logits", "slopes_tensor"]


class RecalibrationError(ValueError):
    """The run or split cannot be recalibrated, or its offsets do not fit the model; the message
    says why."""


@runtime_checkable
class LogitOutput(Protocol):
    """What the corrections need of a model's output layer: ``out_b`` [G, T], added to each row's
    own (pre-chain) logits at its output group; ``parent`` (the task each task is chained below, or
    −1); ``output_group(domain_B)`` → [B]; ``chain(raw_BT)`` → final logits [B, T]; ``scale_(a_T)``,
    each task's own logit times a_T, in place. A model that is its own ``LogitOutput`` (a peer) also
    gives ``raw_logits(batch)`` → [B, T], its own logits with ``out_b`` added."""

    parent: list[int]
    out_b: torch.Tensor

    def output_group(self, domain_B: torch.Tensor) -> torch.Tensor: ...

    def chain(self, raw_BT: torch.Tensor) -> torch.Tensor: ...

    def scale_(self, a_T: torch.Tensor) -> None: ...


def gem_heads(model: torch.nn.Module) -> LogitOutput:
    """The output a correction is added to: the GEM heads (GEM and a student's backbone have them),
    else the model itself when it is a ``LogitOutput`` (the peer baselines)."""
    heads = getattr(model, "heads", None)
    if isinstance(heads, Heads):
        return heads
    if isinstance(model, LogitOutput):
        return model
    raise RecalibrationError(f"{type(model).__name__} has no GEM heads and no per-(domain, task) "
                             "output bias (LogitOutput): nothing to add a logit correction to")


def own_logits(model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's own (pre-chain) logits [B, T], the folded corrections included, and its output
    group [B]; GEM's are read through a forward hook on its heads."""
    heads = gem_heads(model)
    if heads is model:
        return model.raw_logits(batch), model.output_group(batch.domain)
    seen: list[tuple] = []
    hook = heads.register_forward_hook(lambda m, args, out: seen.append(args))
    try:
        model(batch)
    finally:
        hook.remove()
    feats, domain, *rest = seen[0]
    return heads.raw_logits(feats, domain, *rest), heads.output_group(domain)


def offset_groups(heads: LogitOutput, schema: FeatureSchema) -> list[str]:
    """The names of the heads' output groups, the first half of an offset's key: the domains, or
    ``["all"]`` with shared heads."""
    return list(schema.domains.names) if heads.out_b.shape[0] == schema.num_domains else ["all"]


def offsets_tensor(heads: LogitOutput, offsets: dict[str, float],
                   schema: FeatureSchema) -> torch.Tensor:
    """{"<group>/<task>": δ} → [G, T] in the heads' layout (``offset_groups``)."""
    groups = offset_groups(heads, schema)
    out = torch.zeros(len(groups), len(schema.task_names), dtype=torch.float64)
    for key, value in offsets.items():
        g, _, t = key.partition("/")
        if g not in groups or t not in schema.task_names:
            raise RecalibrationError(f"offsets: unknown slice {key!r} (groups {groups}, "
                                     f"tasks {schema.task_names})")
        out[groups.index(g), schema.task_names.index(t)] = float(value)
    return out


def slopes_tensor(slopes: dict[str, float], schema: FeatureSchema) -> torch.Tensor:
    """{task: a} → [T] in schema order (1 for a task not named); an unknown task or a ≤ 0
    is refused."""
    out = torch.ones(len(schema.task_names), dtype=torch.float64)
    for task, a in slopes.items():
        if task not in schema.task_names or not float(a) > 0:
            raise RecalibrationError(f"slopes: slope {task!r}: {a!r} (tasks {schema.task_names}, "
                                     "a slope must be > 0)")
        out[schema.task_names.index(task)] = float(a)
    return out


def fold_offsets(model: torch.nn.Module, record: dict | None, schema: FeatureSchema) -> dict | None:
    """Fold a record into the model: each task's own logit scaled by ``slopes`` (if the record has
    them: ``LogitOutput.scale_``, and GEM's shortcut weights for that task, which add to the heads'
    logits), then the per-(group, task) ``offsets`` added to the output biases; returns
    the record."""
    if record is None:
        return None
    heads = gem_heads(model)
    with torch.no_grad():
        if record.get("slopes"):
            a_T = slopes_tensor(record["slopes"], schema).to(heads.out_b.dtype)
            heads.scale_(a_T)
            shortcut = getattr(model, "shortcut", None)
            for lin in (shortcut.linear, shortcut.pairs) if shortcut is not None else ():
                if lin is not None:
                    lin.weight.mul_(a_T[:, None].to(lin.weight.dtype))
        heads.out_b.add_(offsets_tensor(heads, record["offsets"], schema).to(heads.out_b.dtype))
    return record


def downsampling_offsets(heads: LogitOutput, schema: FeatureSchema,
                         rates: dict[str, float]) -> torch.Tensor:
    """[G, T] logit offsets that undo negative down-sampling at ``rates`` ({domain: r};
    module docstring):
    log r_g on each unchained task, 0 on a chained one. With shared heads (one output group) the
    domains' rates must be equal: one bias cannot carry two corrections."""
    groups = offset_groups(heads, schema)
    r_G = torch.tensor([float(rates[d]) for d in schema.domains.names], dtype=torch.float64)
    if groups == ["all"] and schema.num_domains > 1:
        if not bool((r_G == r_G[0]).all()):
            raise RecalibrationError(f"per-domain negative rates {rates} need per-domain "
                                     f"output heads "
                                     "(model.heads.domain_mode=output): shared heads have one "
                                     "bias per task")
        r_G = r_G[:1]
    root = torch.tensor([p < 0 for p in heads.parent])
    return torch.where(root[None, :], torch.log(r_G)[:, None], torch.zeros((), dtype=torch.float64))


def shift_logits(logits_BT: torch.Tensor, delta_BT: torch.Tensor,
                 parent: list[int]) -> torch.Tensor:
    """The chained logits the heads would give with ``delta_BT`` added to each task's own logit,
    from the chained logits alone: a chained task's own log σ is recovered as log σ(z_t) −
    log σ(z_parent)."""
    out: list[torch.Tensor] = []
    for t, p in enumerate(parent):
        if p < 0:
            out.append(logits_BT[:, t] + delta_BT[:, t])
            continue
        own = F.logsigmoid(logits_BT[:, t]) - F.logsigmoid(logits_BT[:, p])  # log σ(raw_t)
        raw = own - log1mexp(own)
        out.append(chained_logit(out[p], raw + delta_BT[:, t]))
    return torch.stack(out, dim=1)


class LogitShift(torch.nn.Module):
    """``model`` with per-(group, task) offsets on its own logits (``LogitOutput``), without
    touching its parameters (sharded ones included): what the trainer's held-out evaluations score
    when negatives are down-sampled, so they read the corrected model as every later stage does."""

    def __init__(self, model: torch.nn.Module, delta_GT: torch.Tensor):
        super().__init__()
        heads = gem_heads(model)
        # a bound method, not the module: registering it would list the model's modules twice
        self.model, self.parent, self.output_group = model, list(heads.parent), heads.output_group
        self.register_buffer("delta_GT", delta_GT.double(), persistent=False)

    def max_seq_len(self):
        return self.model.max_seq_len()

    def forward(self, batch) -> torch.Tensor:
        z = self.model(batch)
        g = self.output_group(batch.domain)
        delta = self.delta_GT.to(z.device)[g.to(z.device)]
        return shift_logits(z.double(), delta, self.parent).to(z.dtype)
