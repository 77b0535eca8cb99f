"""Time to DLRM-DCN's quality: GEM against TorchRec's DLRM-DCN on the same batches.

    python benchmarks/time_to_quality.py --tune        each side's learning rates, on the valid day of a
                                                       development world (seed 0, 6,000 users, 4 × 4 grid
                                                       per side; ~20 min idle)
    python benchmarks/time_to_quality.py               the race: 3 runs on held-out world 2100 (its own
                                                       structure) at the demo's size (36,000 users; ~12-16 min)
    python benchmarks/time_to_quality.py --quick       the same race on a 12,000-user world (sized for 5 min)
    python benchmarks/time_to_quality.py --midrun      the race plus the mid-run reading
    python benchmarks/time_to_quality.py --data DIR    a prepared data set with ``valid`` and ``test`` splits
    ... --family 1                                     family-1 worlds (the old ruler; default: the
                                                       wider family 2, as benchmarks/quality.py)

Times are one thread (``--threads 1``) on the shared 2-core machine under other jobs' load; at
torch's default threads a loaded machine slows every run many-fold (docs/speed.md).

The race (``instruments.race.race``): the target is the NE on ``all/click`` of ``test`` that
DLRM-DCN ends one pass of the demo recipe with; GEM trains 1/32, 1/16, … of its pass, each budget
its own run with warm-up and cosine decay fitted to it, until one ends at or below the target on
``test`` (interpolated in log-seconds). The headline is DLRM-DCN's pass time over GEM's time to
the target:
the median of ``--runs`` runs (training seeds 0, 1, …; GEM trains first in odd runs, DLRM-DCN in
even ones) with its min-max, and each run's figures. Each side's rates are those of the data's world
family (``race.RATES_BY_FAMILY``), chosen by ``--tune`` on that family's development world's valid
day; ``--quick`` uses a smaller world so that its three runs fit in 5 minutes on 2 cores (its
figure is that world's, not the demo's: docs/speed.md has both).

Evaluations score every 4th file of the split on worlds of more than 400 steps (about 21k rows on
the demo world), the same files for every run. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from opengem.discipline import race_world_seeds

# Tuning on a development seed at a sixth of the demo's users: six GEM passes of the demo world cost
# ~25 min of the shared 2-core machine. The race on the first race seed, a world no rate saw, whose
# structure (features' effects, history effects) is drawn by its own seed, not the demo's.
TUNE_WORLD = {"seed": 0, "users": 6000}
RACE_WORLD = {"seed": race_world_seeds(1)[0], "users": 36000}
QUICK_WORLD = {"seed": race_world_seeds(1)[0], "users": 12000}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tune", action="store_true",
                      help="choose each side's learning rates on valid")
    mode.add_argument("--quick", action="store_true", help="the race on a 12,000-user world")
    p.add_argument("--midrun", action="store_true",
                   help="also one full GEM pass evaluated along the way")
    p.add_argument("--runs", type=int, default=3, help="race runs (default 3)")
    p.add_argument("--data", default=None,
                   help="prepared data (default: generate the mode's world)")
    p.add_argument("--world-seed", type=int, default=None, help="seed of the generated world")
    p.add_argument("--users", type=int, default=None, help="users of the generated world")
    p.add_argument("--family", type=int, choices=(1, 2), default=2,
                   help="world family of the generated worlds, tuning world included (default 2, "
                        "as benchmarks/quality.py)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default=None, help="also write the full result here")
    p.add_argument("gem_overrides", nargs="*",
                   help="overrides for GEM only, key=value (after the data's family's rates, "
                        "race.RATES_BY_FAMILY)")
    return p.parse_args()


def _kth(steps: int) -> int:
    return 1 if steps <= 400 else 4


def tune(data: Path) -> dict:
    from instruments.race import race_steps, tune_rates

    def show(r: dict) -> None:
        print(f"{r['arch']:9s} lr {r['lr']:<7g} table lr {r['sparse_lr']:<5g} valid "
              f"NE {r['ne']:.4f}  {r['train_s']:7.1f} s", flush=True)

    out = tune_rates(data, eval_every_kth_file=_kth(race_steps(data)), on_point=show)
    return {"best": {a: list(v) for a, v in out["best"].items()}, "split": out["split"],
            "world_seeds": out["world_seeds"], "steps": out["steps"],
            "grid": [[r["arch"], r["lr"], r["sparse_lr"], round(r["ne"], 4)] for r in out["grid"]]}


def race_line(data: Path, runs: int, gem_overrides: list[str]) -> tuple[dict, dict]:
    from instruments.race import race, race_rates, race_steps

    def show(t: dict) -> None:
        order = " > ".join(f"{a} {n}" for a, n in t["sequence"])
        budgets = ", ".join(f"{b['pass_fraction']:.4f}: {b['train_s']:.1f} s NE {b['final_ne']:.4f}"
                            for b in t["budgets"])
        print(f"seed {t['seed']}  dlrm_dcn {t['peer_s']:6.1f} s NE {t['target_ne']:.4f}  gem "
              f"{t['gem_s_to_target']} s ({t['bound']})  speed-up {t['speedup']}  [{budgets}]  "
              f"order: {order}", flush=True)

    kth, rates = _kth(race_steps(data)), race_rates(data)
    full = race(data, runs, eval_every_kth_file=kth, gem_overrides=[*rates["gem"], *gem_overrides],
                peer_overrides=rates["dlrm_dcn"], on_run=show)
    s = full["speedup"]
    out = {"time_to_dcn_quality_speedup": s["median"], "speedup_min": s["min"],
           "speedup_max": s["max"], "runs": s["runs"], "split": full["split"],
           "steps": full["runs"][0]["steps"], "eval_every_kth_file": kth,
           "per_run": [{"seed": t["seed"], "first": t["sequence"][0][0], "speedup": t["speedup"],
                        "bound": t["bound"], "dcn_s": t["peer_s"],
                        "dcn_ne": round(t["target_ne"], 4),
                        "gem_s_to_target": t["gem_s_to_target"],
                        "budgets": [[b["pass_fraction"], b["train_s"], round(b["final_ne"], 4)]
                                    for b in t["budgets"]]}
                       for t in full["runs"]],
           "rates": full["runs"][0]["overrides"], "gem_overrides": gem_overrides}
    return out, full


def midrun_line(data: Path, gem_overrides: list[str]) -> dict:
    from instruments.race import dcn_race, eval_schedule, ne_at, race_rates, race_steps

    steps = race_steps(data)
    at = (
        eval_schedule(steps, steps, 20, 20)
        if steps <= 400
        else eval_schedule(steps, steps // 4, 25, 100)
    )
    rates = race_rates(data)
    midrun = dcn_race(data, eval_at=at, eval_every_kth_file=_kth(steps),
                      gem_overrides=[*rates["gem"], *gem_overrides],
                      peer_overrides=rates["dlrm_dcn"])
    m, gem = midrun["ttq"], midrun["runs"]["gem"]
    at_dcn = ne_at(gem["curve"], midrun["runs"]["dlrm_dcn"]["train_s"])
    return {"midrun_speedup": m["speedup"], "midrun_speedup_sustained": m["speedup_sustained"],
            "midrun_dcn_final_ne": round(m["target_ne"], 4),
            "midrun_gem_s_to_target": m["gem_s_to_target"],
            "midrun_gem_s_to_target_sustained": m["gem_s_to_target_sustained"],
            "gem_pass_s": gem["train_s"], "gem_pass_final_ne": round(gem["final_ne"], 4),
            "gem_ne_at_dcn_s": round(at_dcn, 4) if at_dcn is not None else None,
            "midrun_curves": {k: r["curve"] for k, r in midrun["runs"].items()}}


def main() -> None:
    a = _args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    world = dict(TUNE_WORLD if a.tune else QUICK_WORLD if a.quick else RACE_WORLD)
    world.update({k: v for k, v in (("seed", a.world_seed), ("users", a.users)) if v is not None})
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(a.data) if a.data else Path(tmp) / "data"
        if not a.data:
            # the tuning world keeps the demo's structure (the rates are the demo's); a race
            # world's structure is its own
            own = [] if a.tune else [f"structure_seed={world['seed']}"]
            own += [f"family={a.family}"]
            generate(world_config("demo", seed=world["seed"],
                                  overrides=[f"sizes.num_users={world['users']}", *own]), data,
                     progress=False)
        full = None
        if a.tune:
            out = tune(data)
        else:
            out, full = race_line(data, a.runs, a.gem_overrides)
            if a.midrun:
                out.update(midrun_line(data, a.gem_overrides))
    out["world"] = {"data": a.data} if a.data else {**world, "family": a.family}
    if a.json:
        Path(a.json).write_text(json.dumps({**out, "race": full["results"]} if full else out,
                                           indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "midrun_curves"}))


if __name__ == "__main__":
    main()
