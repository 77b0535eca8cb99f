"""``opengem bench``: where a training step's time goes, what each speed/memory lever does, the
loader alone.

One process, the recipe's model on real batches of a dataset (the ``tiny`` synthetic world when no
``--data`` is given). Per lever, after warm-up steps (compilation happens there), the median over
timed steps of each phase of the step::

    data      next batch from the loader (Parquet → Batch, prefetched as in training)
    embed     GEM.inputs: TorchRec table lookups (EBC + EC), dense arch, event tokens
    dense     InterFormer (Wukong stack + sequence towers) + heads + loss
    backward  gradients cleared, loss.backward() (tables' and dense gradients)
    optim     dense gradients clipped (``optim.grad_clip``), dense AdamW + sparse row-wise Adagrad steps

and two memory figures: ``saved_activation_mb``, the bytes autograd's saved-tensor hook sees (what
FP8 storage compresses; a checkpointed block's own bookkeeping is invisible to it), and
``held_activation_mb``, every byte allocated during one extra, untimed forward and still alive when
it returns (the CPU profiler's allocation records, or ``torch.cuda.memory_allocated`` on a GPU):
what a step holds at its peak beyond parameters and optimizer state, whatever holds it (autograd, a
checkpoint's cache, an FP8 hook); plus peak RSS (CPU) or peak CUDA memory. Levers (``--levers``):
``eager`` (fp32, the reference), ``compile`` (torch.compile per block), ``ac`` (full activation
checkpointing of every Wukong / tower layer), ``sac`` (selective: keep matmul and attention outputs,
recompute the rest), ``bf16`` (autocast), ``fp8`` (saved activations stored as e4m3,
``opengem.ops.fp8``), and ``+``-joined combinations.
Each lever's examples/s is also given as a ratio to ``eager`` measured in the same process.

The loader alone: examples/s of iterating the same split with no model, against training
examples/s of ``eager`` (issue goal: ≥ 5, i.e. the input pipeline is never the bottleneck).
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from opengem.config import Config
from opengem.data.loader import ShardLoader
from opengem.features.schema import FeatureSchema
from opengem.model.build import build_gem, count_parameters, materialize
from opengem.ops.fp8 import fp8_saved_activations
from opengem.parallel.activation_checkpoint import apply_activation_checkpoint
from opengem.parallel.compile import apply_compile
from opengem.train.optim import build_optimizers
from opengem.train.step import backward, batch_loss, update

LEVERS = ("eager", "compile", "ac", "sac", "bf16", "fp8")
PHASES = ("data", "embed", "dense", "backward", "optim")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_for_lever(cfg: Config, schema: FeatureSchema, lever: str, device: torch.device):
    """The recipe's model with the lever's structural changes (compile,
    activation checkpointing)."""
    parts = set(lever.split("+"))
    unknown = parts - set(LEVERS)
    if unknown:
        raise ValueError(f"unknown lever(s) {sorted(unknown)}; choose from {LEVERS} joined by '+'")
    if {"ac", "sac"} <= parts:
        raise ValueError(f"lever {lever!r}: 'ac' (full) and 'sac' (selective) checkpointing "
                         f"exclude each other")
    model = materialize(build_gem(schema, cfg.model), device, seed=cfg.train.seed)
    ac = "full" if "ac" in parts else "selective" if "sac" in parts else "none"
    pcfg = dataclasses.replace(cfg.parallel, activation_checkpoint=ac, compile="compile" in parts)
    # the trainer's own functions
    return apply_compile(apply_activation_checkpoint(model, pcfg), pcfg).train()


class LeverRun:
    """One lever's model, optimizers and batches; ``step()`` times one training step by phase.

    Its step is the trainer's (``opengem.train.step``: the loss, clearing the gradients and
    backward, clipping and the optimizers) cut where the phases are timed; only the forward is split
    by hand (``GEM.inputs``, then the rest), which ``train_step`` cannot time, and the lr stays at
    the recipe's.
    """

    def __init__(self, cfg: Config, schema: FeatureSchema, data: Path, lever: str,
                 device: torch.device):
        self.lever, self.device, self.parts = lever, device, set(lever.split("+"))
        self.num_domains, self.grad_clip = schema.num_domains, cfg.optim.grad_clip
        torch.manual_seed(cfg.train.seed)
        self.model = build_for_lever(cfg, schema, lever, device)
        dense_opt, sparse_opt = build_optimizers(self.model.dense_parameters(),
                                                 self.model.sparse_parameters(),
                                                 cfg.optim)
        self.opts = [o for o in (dense_opt, sparse_opt) if o is not None]
        self.dense_params = list(self.model.dense_parameters())
        self.batches = iter(ShardLoader(data, "train", cfg.data.batch_size, shuffle=True,
                                        seed=cfg.train.seed, epochs=1000, drop_last=True,
                                        max_seq_len=self.model.max_seq_len()))
        # as the trainer's
        self.task_w = torch.tensor([t.weight for t in schema.tasks], device=device)
        self.dtype = torch.bfloat16 if "bf16" in self.parts else None
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}
        self.rows, self.saved, self.losses, self.peak = [], [], [], 0.0
        # includes compilation (compile lever): the start-up cost
        self.first_step_s: float | None = None
        self.held_mb: float | None = None

    def _hooks(self):
        """The saved-tensor hook (FP8 storage for ``fp8``, else only counting) and the
        autocast context."""
        fp8 = fp8_saved_activations(self.model,
                                    min_bytes=1 << 16 if "fp8" in self.parts else 1 << 62)
        return fp8, torch.autocast(self.device.type, dtype=self.dtype,
                                   enabled=self.dtype is not None)

    def _loss(self, x, seqs, batch) -> torch.Tensor:
        logits = self.model.heads(self.model._features(x, seqs), batch.domain,
                                  self.model.low_order(x))
        return batch_loss(logits.float(), batch, self.task_w, self.num_domains)[0]

    def measure_memory(self) -> None:
        """One untimed step whose forward runs under ``forward_held_bytes`` (no optimizer step)."""
        batch = next(self.batches).to(self.device)

        def forward() -> torch.Tensor:
            fp8, autocast = self._hooks()
            with fp8, autocast:
                return self._loss(*self.model.inputs(batch), batch)

        loss, held = forward_held_bytes(forward, self.device)
        loss.backward()
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        self.held_mb = held / 2**20

    def step(self, record: bool) -> None:
        model, dev = self.model, self.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        batch = next(self.batches).to(dev)
        _sync(dev)
        t1 = time.perf_counter()
        hook, autocast = self._hooks()  # the hook counts saved bytes
        with hook as stats, autocast:
            x, seqs = model.inputs(batch)
            _sync(dev)
            t2 = time.perf_counter()
            loss = self._loss(x, seqs, batch)
            _sync(dev)
        t3 = time.perf_counter()
        backward(loss, self.opts)
        _sync(dev)
        t4 = time.perf_counter()
        update(self.opts, self.dense_params, self.grad_clip)
        _sync(dev)
        t5 = time.perf_counter()
        if self.first_step_s is None:
            self.first_step_s = round(t5 - t0, 3)
        self.losses.append(loss.item())
        if record:
            for p, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                self.times[p].append(dt)
            self.rows.append(batch.batch_size)
            self.saved.append(stats.stored)
            if dev.type == "cuda":
                self.peak = max(self.peak, torch.cuda.max_memory_allocated() / 2**20)

    def summary(self) -> dict:
        """Per-phase medians, examples/s, saved-activation MB, the losses of every step."""
        n = len(self.rows)
        step = statistics.median([sum(v[i] for v in self.times.values()) for i in range(n)])
        out = {"phase_ms": {p: round(statistics.median(v) * 1e3, 2) for p, v in self.times.items()},
               "step_ms": round(step * 1e3, 2),
               "examples_per_s": round(statistics.median(self.rows) / step, 1),
               "saved_activation_mb": round(statistics.median(self.saved) / 2**20, 2),
               "losses": self.losses, "first_step_s": self.first_step_s}
        if self.held_mb is not None:
            out["held_activation_mb"] = round(self.held_mb, 2)
        if self.device.type == "cuda":
            out["peak_memory_mb"] = round(self.peak, 1)
        return out


def loader_throughput(data: Path, batch_size: int, max_seq_len: dict,
                      seconds: float = 5.0) -> float:
    """Examples/s of the loader alone (no model), over at most ``seconds``."""
    loader = ShardLoader(data, "train", batch_size, max_seq_len=max_seq_len, epochs=1000)
    it = iter(loader)
    next(it)  # open files, start the prefetch thread
    rows, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        rows += next(it).batch_size
    return rows / (time.perf_counter() - t0)


def forward_held_bytes(fn, device: torch.device) -> tuple[object, int]:
    """(fn(), bytes allocated while ``fn`` ran and still alive when it returned).

    Run on a forward, that is what the step holds for backward, whoever holds it. On CPU the
    profiler's allocation records give it (the sum of every op's self allocations minus frees); on
    a GPU the caching allocator's counter.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, int(sum(e.self_cpu_memory_usage for e in prof.key_averages()))


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_bench(cfg: Config, data: str | Path | None = None, levers: tuple[str, ...] = LEVERS,
              warmup: int = 3, steps: int = 10, device: str | None = None,
              loader_seconds: float = 5.0) -> dict:
    """Every lever on the same batches; ratios against ``eager``. Returns a JSON-ready dict."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with contextlib.ExitStack() as stack:
        if data is None:
            from opengem.world.generate import generate
            from opengem.world.presets import world_config

            data = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "data"
            generate(world_config("tiny", seed=0), data, progress=False)
        data = Path(data)
        schema = FeatureSchema.load(data)
        bs = cfg.data.batch_size
        probe = build_gem(schema, cfg.model)
        out = {"recipe": cfg.recipe, "device": str(dev), "batch_size": bs,
               "parameters": count_parameters(probe), "levers": {}}
        # Round robin: step i of every lever runs before step i + 1 of any, so a noisy (shared)
        # machine slows all levers alike and the ratios to eager stay meaningful.
        runs = [LeverRun(cfg, schema, data, lever, dev) for lever in levers]
        for i in range(warmup + steps):
            for run in runs:
                run.step(record=i >= warmup)
        for run in runs:
            run.measure_memory()
        out["levers"] = {run.lever: run.summary() for run in runs}
        # the whole process, every lever
        out["peak_rss_mb"] = round(peak_memory_mb(torch.device("cpu")), 1)
        ref = out["levers"].get("eager")
        if ref:
            for r in out["levers"].values():
                r["speedup_vs_eager"] = round(r["examples_per_s"] / ref["examples_per_s"], 3)
                r["saved_activation_ratio_vs_eager"] = round(
                    ref["saved_activation_mb"] / max(r["saved_activation_mb"], 1e-9), 3
                )
                r["held_activation_ratio_vs_eager"] = round(ref["held_activation_mb"]
                                                            / max(r["held_activation_mb"], 1e-9), 3)
        loader_eps = loader_throughput(data, bs, probe.max_seq_len(), loader_seconds)
        out["loader_examples_per_s"] = round(loader_eps, 1)
        if ref:
            out["loader_over_training"] = round(loader_eps / ref["examples_per_s"], 2)
    return out


def format_bench(out: dict) -> str:
    lines = [f"{'lever':<16}" + "".join(f"{p + ' ms':>12}" for p in PHASES)
             + f"{'ex/s':>10}{'× eager':>9}{'saved MB':>10}{'held MB':>9}{'1st step s':>12}"]
    for name, r in out["levers"].items():
        lines.append(
            f"{name:<16}"
            + "".join(f"{r['phase_ms'][p]:>12.1f}" for p in PHASES)
            + f"{r['examples_per_s']:>10.0f}{r.get('speedup_vs_eager', float('nan')):>9.2f}"
            + f"{r['saved_activation_mb']:>10.1f}{r.get('held_activation_mb', float('nan')):>9.1f}"
            + f"{r['first_step_s']:>12.2f}"
        )
    lines.append(f"loader alone: {out['loader_examples_per_s']:,.0f} examples/s"
                 + (f" = {out['loader_over_training']:.1f}× eager training"
                    if "loader_over_training" in out else ""))
    return "\n".join(lines)
