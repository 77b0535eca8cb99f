"""Time to DLRM-DCN's quality: GEM against TorchRec's DLRM-DCN, one pass each, in one run.

    python benchmarks/time_to_quality.py --quick      the 3,000-user demo world of ``opengem bench --quick`` (~2 min)
    python benchmarks/time_to_quality.py              the demo world itself: 36,000 users, ~500k training rows
                                                      (~15 min on 2 cores)
    python benchmarks/time_to_quality.py --data DIR   a prepared data set with a ``valid`` split

Both models train one pass of the demo recipe over the same batches (warm-up 10 % of the pass for
each) with the clock paused for evaluations of ``all/click`` NE on ``valid``. The headline is the
issue's: DLRM-DCN's one-pass time over the time GEM needs to reach the NE DLRM-DCN ends with
(interpolated between evaluations); ``speedup_sustained`` counts GEM's time only from the crossing after
which it stays below that NE (a curve that dips and comes back counts from its last return).
``gem_ne_at_dcn_s`` is the other reading of the same curves: GEM's
NE after training as long as DLRM-DCN's whole pass. On the full world the evaluations score every 4th
file of ``valid`` (about 21k rows), the same files for both models, so that 30-odd evaluations stay
affordable. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 3,000-user world, evaluations every 20 steps")
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
    from opengem.data.synthetic import generate, world_config
    from opengem.train.bench import dcn_race, eval_schedule, ne_at, race_steps

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(a.data) if a.data else Path(tmp) / "data"
        if not a.data:
            users = a.users or (3000 if a.quick else None)
            generate(world_config("demo", seed=0, **({"num_users": users} if users else {})), data, progress=True)
        steps = race_steps(data)
        if a.quick or steps <= 400:
            at, kth = eval_schedule(steps, steps, 20, 20), 1
        else:
            at, kth = eval_schedule(steps, steps // 4, 25, 100), 4
        race = dcn_race(data, eval_at=at, eval_every_kth_file=kth, gem_overrides=a.gem_overrides)
    ttq, gem, dcn = race["ttq"], race["runs"]["gem"], race["runs"]["dlrm_dcn"]
    at_dcn = ne_at(gem["curve"], dcn["train_s"])
    out = {"time_to_dcn_quality_speedup": ttq["speedup"], "speedup_sustained": ttq["speedup_sustained"],
           "gem_s_to_target_sustained": ttq["gem_s_to_target_sustained"], "dcn_final_ne": round(dcn["final_ne"], 4),
           "gem_final_ne": round(gem["final_ne"], 4), "gem_pass_fraction_to_target": ttq["gem_pass_fraction_to_target"],
           "gem_s_to_target": ttq["gem_s_to_target"], "dcn_s": dcn["train_s"], "gem_s": gem["train_s"],
           "gem_ne_at_dcn_s": round(at_dcn, 4) if at_dcn is not None else None,
           "gem_examples_per_s": gem["examples_per_s"], "dcn_examples_per_s": dcn["examples_per_s"],
           "steps": steps, "evaluations": len(at), "eval_every_kth_file": kth, "gem_overrides": a.gem_overrides}
    if a.json:
        Path(a.json).write_text(json.dumps({**out, "curves": {k: r["curve"] for k, r in race["runs"].items()},
                                            "parameters": {k: r["parameters"] for k, r in race["runs"].items()}},
                                           indent=1))
    for arch, r in race["runs"].items():
        print(f"{arch:9s} {r['train_s']:8.1f} s  {r['examples_per_s']:9,.0f} examples/s  final NE {r['final_ne']:.4f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
