"""KD temperature τ on development worlds, scored on a valid day only: NE, calibration and R of
students distilled at τ ∈ {1, 2}, with and without the student adapter.

    python benchmarks/kd_temperature.py --out /tmp/kdt          # world seeds 0-2, ~6 min on 1 core
    python benchmarks/kd_temperature.py --quick --out /tmp/kdt  # world seed 0 only, ~2 min

Per world seed w: the ``tiny`` world (1,500 users, ``structure_seed=w``, drift ×3 as in
benchmarks/transfer.py) with days 0-2 for the GEM teacher (``train``), days 3-4 for the students
and day 5 to score them. ``opengem distill`` trains students on ``valid`` and scores them on
``test``; to choose τ without reading a test day, this script relabels the generated manifest's
days 3-4 as a ``distill`` split and day 5 as ``valid``, and never reads the last day (``test``).
All students train in one pass (one teacher call per batch) and are scored on the same rows:

    R = (NE_alone − NE_with) / (NE_alone − NE_teacher)           (all/click)

Prints one JSON line per world, a mean table, and last ONE JSON line of the means per variant.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import warnings
from pathlib import Path

import torch

from opengem.config import apply_overrides, apply_prefixed_overrides
from opengem.data.parquet import MANIFEST
from opengem.discipline import require_dev_world, require_tuning_split
from opengem.features.schema import FeatureSchema
from opengem.recipes import recipe, student_recipe
from opengem.run import FINAL_FILE
from opengem.train.trainer import train
from opengem.transfer.config import techniques_config
from opengem.transfer.distill import make_trainer
from opengem.transfer.stream import SliceStream, domain_ids, slice_rates
from opengem.transfer.teacher import TeacherService
from opengem.transfer.trainer import evaluate_students, train_students, transfer_ratio
from opengem.world.generate import generate
from opengem.world.presets import world_config

TEACHER_DAYS, STUDENT_DAYS = 3, 2
VARIANTS = [("alone", "", 1.0)] + [(f"{t} τ={tau:g}", t, tau) for t in ("kd", "kd+adapter")
                                   for tau in (1.0, 2.0)]


def world_dir(root: Path, w: int, users: int, drift: float) -> Path:
    """The world with days relabelled: train = teacher days, distill = student days, valid = the
    day scored."""
    data = root / f"w{w}"
    if (data / MANIFEST).exists():
        return data
    base = world_config("tiny", seed=w)
    n = TEACHER_DAYS + STUDENT_DAYS + 2
    cfg = world_config("tiny", seed=w, overrides=[
        f"sizes.num_users={users}", f"structure_seed={w}", f"sizes.num_days={n}",
        f"sizes.valid_days={STUDENT_DAYS + 1}", "sizes.test_days=1",
        f"behaviour.interest_drift={base.behaviour.interest_drift * drift}",
        f"click.ad_drift={base.click.ad_drift * drift}",
        f"click.advertiser_drift={base.click.advertiser_drift * drift}"])
    generate(cfg, data, progress=False)
    m = json.loads((data / MANIFEST).read_text())
    days = m["splits"]["valid"]
    m["splits"] = {"train": m["splits"]["train"], "distill": days[:STUDENT_DAYS],
                   "valid": days[STUDENT_DAYS:],
                   "test": m["splits"]["test"]}
    (data / MANIFEST).write_text(json.dumps(m, indent=2))
    return data


def run_world(root: Path, w: int, args) -> dict:
    data = world_dir(root, w, args.users, args.drift)
    run = root / f"gem{w}"
    if not (run / FINAL_FILE).exists():
        cfg = apply_overrides(recipe("tiny"),
                              [f"train.seed={w}", "train.progress=false", "train.threads=1"])
        train(cfg, data, run)
    schema = FeatureSchema.load(data)
    gem = TeacherService.from_run(run)
    doms = domain_ids(schema, ["feed"])
    rates, n_slice, n_all = slice_rates(data, schema, "distill", doms)
    bs = student_recipe(args.student).data.batch_size
    s1 = SliceStream(data, "distill", schema, doms, gem, bs, seed=w, slice_rows=n_slice,
                     all_rows=n_all)
    students = []
    for name, techniques, tau in VARIANTS:
        trees = apply_prefixed_overrides(
            {"": student_recipe(args.student),
             "transfer": techniques_config(techniques, domains=("feed",))},
            [f"train.seed={w}", f"data.seed={w}", f"transfer.kd.temperature={tau}"])
        students.append(make_trainer(name, trees[""], trees["transfer"], schema, gem, rates,
                                     s1.steps))
    train_students(students, s1)
    ev = evaluate_students(students,
                           SliceStream(data, require_tuning_split("valid", "the KD temperature"),
                                       schema,
                                                 doms, gem, 4096, shuffle=False,
                                       update_cache=False), schema, rates)
    key = "all/click"
    ne_alone, ne_t = ev["alone"][key]["ne"], ev["teacher@alone"][key]["ne"]
    rows = {n: {"ne": ev[n][key]["ne"], "calibration": ev[n][key]["calibration"],
                "r": transfer_ratio(ne_alone, ev[n][key]["ne"], ne_t)} for n, _, _ in VARIANTS}
    return {"world": w, "teacher_ne": ne_t, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--users", type=int, default=1500)
    p.add_argument("--drift", type=float, default=3.0)
    p.add_argument("--student", default="vm_s")
    p.add_argument("--out", required=True,
                   help="worlds and teacher runs go here (reused when present)")
    p.add_argument("--quick", action="store_true", help="world seed 0 only")
    args = p.parse_args()
    if args.quick:
        args.worlds = [0]
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    results = []
    for w in args.worlds:
        results.append(run_world(Path(args.out), require_dev_world(w, "the KD temperature"), args))
        print(json.dumps(results[-1]), flush=True)
    print(f"\n{'student (valid day, all/click)':<24}{'NE':>9}{'calib':>8}{'R':>8}   mean over "
          f"worlds {args.worlds}")
    print(f"{'teacher':<24}{statistics.fmean(r['teacher_ne'] for r in results):>9.4f}")
    summary = {}
    for name, _, _ in VARIANTS:
        m = {k: statistics.fmean(r["rows"][name][k] for r in results)
             for k in ("ne", "calibration", "r")}
        print(f"{name:<24}{m['ne']:>9.4f}{m['calibration']:>8.3f}{m['r']:>8.3f}")
        summary[name] = {k: round(v, 5) for k, v in m.items()}
    print(json.dumps({"worlds": args.worlds, "split": "valid", "mean": summary}))


if __name__ == "__main__":
    main()
