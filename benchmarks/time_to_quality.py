"""Time to DLRM-DCN's quality: GEM against TorchRec's DLRM-DCN on the same batches, in one run.

    python benchmarks/time_to_quality.py --quick       budgeted reading on the demo world (~3 min on 2 cores),
                                                       the figure of ``opengem bench --quick``
    python benchmarks/time_to_quality.py               both readings on the demo world (~15 min)
    python benchmarks/time_to_quality.py --users 12000 a smaller world (the speed-up grows with the data)
    python benchmarks/time_to_quality.py --data DIR    a prepared data set with a ``valid`` split

The target is the NE on ``all/click`` of ``valid`` that DLRM-DCN ends one pass of the demo recipe with;
the headline is DLRM-DCN's one-pass time over the time GEM needs to reach it (see
``opengem.bench.race``; each side's learning rate is its own, ``race.PEER`` and ``race.BUDGET_GEM``):

- budgeted (``speedup``): GEM trains 1/32, 1/16, … of the pass, each budget its own run with warm-up
  and cosine decay fitted to it, until one ends at or below the target; interpolated in log-seconds.
- mid-run (``midrun_speedup``, ``midrun_speedup_sustained``): one full GEM pass evaluated along the
  way; the first crossing, and the crossing after which it stays below the target. Mid-run
  evaluations fall at full learning rate, where calibration follows the last batches' click rate.

Evaluations score every 4th file of ``valid`` on worlds of more than 400 steps (about 21k rows on
the demo world), the same files for every run. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the budgeted reading only")
    p.add_argument("--data", default=None, help="prepared data (default: generate the demo world)")
    p.add_argument("--users", type=int, default=None, help="users of the generated demo world (default 36,000)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", default=None, help="also write the full result here")
    p.add_argument("gem_overrides", nargs="*", help="overrides for GEM only, key=value (the peer keeps the recipe)")
    return p.parse_args()


def main() -> None:
    a = _args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from opengem.bench.race import BUDGET_GEM, budget_race, dcn_race, eval_schedule, ne_at, race_steps
    from opengem.data.synthetic import generate
    from opengem.recipes import world_config

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(a.data) if a.data else Path(tmp) / "data"
        if not a.data:
            generate(world_config("demo", seed=0, overrides=[f"sizes.num_users={a.users}"] if a.users else []), data,
                     progress=True)
        steps = race_steps(data)
        kth = 1 if steps <= 400 else 4
        budget = budget_race(data, eval_every_kth_file=kth, gem_overrides=[*BUDGET_GEM, *a.gem_overrides])
        midrun = None
        if not a.quick:
            at = eval_schedule(steps, steps, 20, 20) if steps <= 400 else eval_schedule(steps, steps // 4, 25, 100)
            midrun = dcn_race(data, eval_at=at, eval_every_kth_file=kth, gem_overrides=a.gem_overrides)
    ttq, dcn = budget["ttq"], budget["runs"]["dlrm_dcn"]
    out = {"time_to_dcn_quality_speedup": ttq["speedup"], "bound": ttq["bound"], "gem_s_to_target": ttq["gem_s_to_target"],
           "dcn_s": dcn["train_s"], "dcn_final_ne": round(dcn["final_ne"], 4),
           "budgets": [[b["pass_fraction"], b["train_s"], round(b["final_ne"], 4)] for b in ttq["budgets"]],
           "dcn_examples_per_s": dcn["examples_per_s"], "gem_examples_per_s": budget["runs"]["gem"][-1]["examples_per_s"],
           "steps": steps, "eval_every_kth_file": kth, "gem_overrides": a.gem_overrides}
    if midrun:
        m, gem = midrun["ttq"], midrun["runs"]["gem"]
        at_dcn = ne_at(gem["curve"], midrun["runs"]["dlrm_dcn"]["train_s"])
        out.update({"midrun_speedup": m["speedup"], "midrun_speedup_sustained": m["speedup_sustained"],
                    "midrun_dcn_final_ne": round(m["target_ne"], 4), "midrun_gem_s_to_target": m["gem_s_to_target"],
                    "midrun_gem_s_to_target_sustained": m["gem_s_to_target_sustained"],
                    "gem_pass_s": gem["train_s"], "gem_pass_final_ne": round(gem["final_ne"], 4),
                    "gem_ne_at_dcn_s": round(at_dcn, 4) if at_dcn is not None else None})
    if a.json:
        full = {**out, "budget_runs": budget["runs"]}
        if midrun:
            full["midrun_curves"] = {k: r["curve"] for k, r in midrun["runs"].items()}
        Path(a.json).write_text(json.dumps(full, indent=1))
    print(f"dlrm_dcn  one pass {dcn['train_s']:8.1f} s  {dcn['examples_per_s']:9,.0f} examples/s  NE {dcn['final_ne']:.4f}")
    for b in ttq["budgets"]:
        print(f"gem       {b['pass_fraction']:8.4f} of the pass {b['train_s']:8.1f} s  NE {b['final_ne']:.4f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
