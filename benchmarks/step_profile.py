"""Where one training step's time goes, per part of the model, for GEM and DLRM-DCN.

    python benchmarks/step_profile.py --quick             development world 0, 2,000 users (< 3 min)
    python benchmarks/step_profile.py --data DIR [k=v …]  a prepared dataset, GEM overrides after

Each part's forward and backward time in one step of the trainer's path (``train.step``: forward,
loss, backward, clipping, both optimizers) at the ``demo`` recipe, one thread. Method: the CPU
profiler over ``--steps`` steps after warm-up, each part of the model wrapped in a named scope for
the profile only; an operator's own time counts for the innermost scope it ran in, and each
backward function counts for the scope its forward operator ran in (matched by autograd's sequence
number), so forward and backward of the Wukong stack, the towers, the history counts … are read
apart. What runs outside every part (autograd's bookkeeping, gradient accumulation, the loss) is
``other``. The profiler slows small operators, so the shares are read from the profiled steps and
the step time from unprofiled ones (``step_ms``), both medians per step.

Beside it, the step's time at several batch sizes (unprofiled): a step's fixed cost (Python and
operator dispatch, the same at any batch) against its per-example cost, read as the intercept and
slope of a least-squares line through (batch, ms).

``--forms NAME …`` (names of ``cheap_forms.VARIANTS``) instead times GEM's cheaper forms against
DLRM-DCN: rounds of one step of each in turn, so a shared machine's load falls on all alike; each
form's median step over DLRM-DCN's. With a form's share of its pass needed to reach DLRM-DCN's NE
(``cheap_forms.py``: NE values do not move with the load, seconds do), the race's speed-up is
(DLRM-DCN's step ÷ the form's) ÷ that share, free of the load that moved those runs' seconds.
The last line is ONE JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from instruments.race import timed_step

SCOPE = "part:"
BACKWARD = "autograd::engine::evaluate_function: "
# The parts of each model: (scope, owner path, method). The owner path is read from the model with
# getattr, "[i]" indexing a ModuleList; "*" repeats over every element.
GEM_PARTS = [
    ("embed.tables", "sparse_arch", "forward_sparse"),
    ("embed.tables", "sparse_arch", "forward_sequences"),
    ("embed.tables", "sparse_arch", "lookup_sequence_ids"),
    ("embed.dense", "dense_arch", "forward"),
    ("embed.dense", "dense_norm", "forward"),
    ("history_counts", "history_counts", "stream_counts"),
    ("history_counts", "history_counts", "forward"),
    ("seq.event_tokens", "interformer.towers.*", "embed"),
    ("seq.event_tokens", "", "_match_flags"),
    ("seq.event_tokens", "target_match.*", "forward"),
    ("seq.first_tokens", "interformer.towers.*", "first_tokens"),
    ("seq.tower_layers", "interformer.towers.*", "layer"),
    ("summaries", "interformer.cross.*", "summarize_x"),
    ("summaries", "interformer.cross.*", "summarize_s"),
    ("wukong", "interformer.interaction", "forward_layer"),
    ("wukong", "interformer.interaction", "finish"),
    ("heads", "heads", "forward"),
    ("shortcut", "shortcut", "forward"),
]
PEER_PARTS = [
    ("embed.tables", "sparse_arch", "forward_sparse"),
    ("embed.tables", "sparse_arch", "forward_sequences"),
    ("embed.dense", "dense_arch", "forward"),
    ("embed.dense", "dense_norm", "forward"),
    ("interaction", "inter_arch", "forward"),
    ("heads", "over_arch", "forward"),
]


def _owners(model: torch.nn.Module, path: str) -> list:
    objs = [model]
    for name in [p for p in path.split(".") if p]:
        nxt = []
        for o in objs:
            if name == "*":
                nxt += list(o.values()) if isinstance(o, torch.nn.ModuleDict) else list(o)
            else:
                child = getattr(o, name, None)
                if child is not None:
                    nxt.append(child)
        objs = nxt
    return objs


@contextlib.contextmanager
def scoped(model: torch.nn.Module, parts: list[tuple[str, str, str]]):
    """Each listed method of ``model`` runs inside ``record_function(part:<scope>)`` until exit
    (instance attributes shadow the class's methods; removed again on exit), and so do the step's
    loss and its clip-and-optimizer update (``train.step``'s module functions, restored on exit)."""
    from torch.profiler import record_function

    from opengem.train import step as step_mod

    def wrap(fn, scope):
        def wrapped(*a, **k):
            with record_function(SCOPE + scope):
                return fn(*a, **k)
        return wrapped

    patched, saved = [], {n: getattr(step_mod, n) for n in ("batch_loss", "update")}
    for scope, path, method in parts:
        for owner in _owners(model, path):
            fn = getattr(owner, method, None)
            if fn is not None:
                setattr(owner, method, wrap(fn, scope))
                patched.append((owner, method))
    step_mod.batch_loss = wrap(saved["batch_loss"], "loss")
    step_mod.update = wrap(saved["update"], "optim")
    try:
        yield
    finally:
        for owner, method in patched:
            delattr(owner, method)
        for n, fn in saved.items():
            setattr(step_mod, n, fn)


def _scope_of(event) -> str | None:
    e = event.cpu_parent
    while e is not None:
        if e.name.startswith(SCOPE):
            return e.name[len(SCOPE):]
        e = e.cpu_parent
    return None


def attribute(events) -> dict[str, dict[str, float]]:
    """Per scope, forward and backward CPU microseconds of the profiled events: forward = the own
    time of operators under the scope (innermost wins); backward = each backward function's total,
    credited to its forward operator's scope by sequence number."""
    fwd_scope: dict[int, str] = {}
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"fwd": 0.0, "bwd": 0.0})
    in_backward = set()
    for e in events:
        if e.name.startswith(BACKWARD):
            in_backward.add(e.id)
    for e in events:  # forward operators: not a scope, not inside a backward function
        if e.name.startswith(SCOPE) or e.name.startswith(BACKWARD):
            continue
        p, under_bwd = e.cpu_parent, False
        while p is not None:
            if p.id in in_backward:
                under_bwd = True
                break
            p = p.cpu_parent
        if under_bwd:
            continue
        scope = _scope_of(e) or "other"
        out[scope]["fwd"] += e.self_cpu_time_total
        if e.sequence_nr >= 0:
            fwd_scope.setdefault(e.sequence_nr, scope)
    for e in events:
        if e.name.startswith(BACKWARD):
            out[fwd_scope.get(e.sequence_nr, "other")]["bwd"] += e.cpu_time_total
    for e in events:  # the scopes' own time (the wrapper's Python) counts for the scope
        if e.name.startswith(SCOPE):
            out[e.name[len(SCOPE):]]["fwd"] += e.self_cpu_time_total
    return dict(out)


def profile_arch(cfg, data: Path, parts, steps: int, warmup: int) -> dict:
    """One model: the unprofiled median step, then per scope the share of the profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    model, step = timed_step(cfg, data)
    for _ in range(warmup):
        step()
    step_ms = statistics.median(step() for _ in range(steps)) * 1e3
    with scoped(model, parts), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    per = attribute(prof.events())
    total = sum(v["fwd"] + v["bwd"] for v in per.values())
    parts_out = {k: {"fwd_share": round(v["fwd"] / total, 4),
                     "bwd_share": round(v["bwd"] / total, 4),
                     "share": round((v["fwd"] + v["bwd"]) / total, 4),
                     "ms": round((v["fwd"] + v["bwd"]) / total * step_ms, 2)}
                 for k, v in sorted(per.items(), key=lambda kv: -(kv[1]["fwd"] + kv[1]["bwd"]))}
    return {"batch_size": cfg.data.batch_size, "step_ms": round(step_ms, 2),
            "examples_per_s": round(cfg.data.batch_size / step_ms * 1e3, 1),
            "profiled_step_ms": round(total / steps / 1e3, 2), "parts": parts_out}


def batch_curve(cfg_of, data: Path, sizes: list[int], steps: int, warmup: int) -> dict:
    """Unprofiled median step ms at each batch size and the least-squares line ms = a + b·batch:
    ``fixed_ms`` a (the per-step cost at any batch), ``per_1k_examples_ms`` 1000·b."""
    ms = []
    for b in sizes:
        _, step = timed_step(cfg_of(b), data)
        for _ in range(warmup):
            step()
        ms.append(statistics.median(step() for _ in range(steps)) * 1e3)
    n, mx, my = len(sizes), statistics.fmean(sizes), statistics.fmean(ms)
    slope = (sum((x - mx) * (y - my) for x, y in zip(sizes, ms))
             / sum((x - mx) ** 2 for x in sizes)) if n > 1 else 0.0
    return {"batch_sizes": sizes, "step_ms": [round(x, 2) for x in ms],
            "fixed_ms": round(my - slope * mx, 2), "per_1k_examples_ms": round(slope * 1e3, 2)}


def forms_race(cfg_of, data: Path, forms: list[str], rounds: int, warmup: int) -> dict:
    """Median step ms of DLRM-DCN and of each GEM form, timed in interleaved rounds, and each
    form's median over DLRM-DCN's (``step_over_dcn``)."""
    from cheap_forms import VARIANTS

    steps = {"dlrm_dcn": timed_step(cfg_of("dlrm_dcn", []), data)[1]}
    steps |= {f: timed_step(cfg_of("gem", VARIANTS[f]), data)[1] for f in forms}
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for k, fn in steps.items():
            times[k].append(fn() * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {k: {"step_ms": round(m, 2), "step_over_dcn": round(m / med["dlrm_dcn"], 3)}
            for k, m in med.items()}


def _world(work: Path, users: int) -> Path:
    from opengem.data.parquet import MANIFEST
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    out = work / f"world-0-u{users}"
    if not (out / MANIFEST).exists():
        generate(world_config("demo", seed=0, overrides=[f"sizes.num_users={users}"]), out,
                 progress=False)
    return out


def _print(name: str, r: dict) -> None:
    print(f"\n{name}: batch {r['batch_size']}, step {r['step_ms']:.1f} ms "
          f"({r['examples_per_s']:.0f} examples/s; profiled {r['profiled_step_ms']:.1f} ms)")
    print(f"  {'part':<18} {'share':>6} {'fwd':>6} {'bwd':>6} {'ms':>7}")
    for k, v in r["parts"].items():
        print(f"  {k:<18} {v['share']:>6.1%} {v['fwd_share']:>6.1%} {v['bwd_share']:>6.1%} "
              f"{v['ms']:>7.1f}")


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and batch sizes")
    ap.add_argument("--data", default=None, help="a dataset (default: development world 0)")
    ap.add_argument("--users", type=int, default=2000, help="users of the generated world")
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default=None, help="where the generated world goes")
    ap.add_argument("--forms", nargs="*", default=None,
                    help="time these cheap_forms.VARIANTS against DLRM-DCN instead")
    ap.add_argument("overrides", nargs="*", help="GEM overrides key=value")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from instruments.race import race_rates

    from opengem.config import apply_overrides
    from opengem.recipes import recipe

    steps, warmup = (8, 3) if args.quick else (20, 5)
    sizes = [64, 256, 1024] if args.quick else [64, 128, 256, 512, 1024]
    work = Path(args.work or tempfile.mkdtemp(prefix="opengem-profile-"))
    data = Path(args.data) if args.data else _world(work, args.users)
    rates = race_rates(data)

    def cfg(arch: str, batch: int | None = None):
        ov = [f"model.arch={arch}", *rates[arch], "train.progress=false"]
        ov += [f"data.batch_size={batch}"] if batch else []
        return apply_overrides(recipe(args.recipe), ov + (args.overrides if arch == "gem" else []))

    t0 = time.perf_counter()
    out: dict = {"benchmark": "step_profile", "recipe": args.recipe, "threads": args.threads,
                 "data": str(data) if args.data else f"development world 0, {args.users} users"}
    if args.forms is not None:
        def form_cfg(arch: str, extra: list[str]):
            return apply_overrides(recipe(args.recipe), [f"model.arch={arch}", *rates[arch],
                                                         "train.progress=false", *extra])

        out["forms"] = forms_race(form_cfg, data, ["shipped", *(f for f in args.forms
                                                                if f != "shipped")],
                                  steps * 2, warmup)
        for k, v in out["forms"].items():
            print(f"{k:<26} {v['step_ms']:>8.1f} ms  {v['step_over_dcn']:>6.2f}x DLRM-DCN's step")
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(out))
        return out
    for arch, parts in (("gem", GEM_PARTS), ("dlrm_dcn", PEER_PARTS)):
        out[arch] = profile_arch(cfg(arch), data, parts, steps, warmup)
        _print(arch, out[arch])
        out[arch]["batch_curve"] = batch_curve(lambda b, a=arch: cfg(a, b), data, sizes, steps,
                                               warmup)
        c = out[arch]["batch_curve"]
        print(f"  batch {c['batch_sizes']}: {c['step_ms']} ms; fixed {c['fixed_ms']} ms + "
              f"{c['per_1k_examples_ms']} ms per 1,000 examples")
    out["gem_over_dcn_step"] = round(out["gem"]["step_ms"] / out["dlrm_dcn"]["step_ms"], 2)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
