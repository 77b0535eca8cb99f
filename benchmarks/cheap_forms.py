"""Cheaper forms of GEM's sequence side at equal wall time, against DLRM-DCN, on development worlds'
valid days (the choice the race's quality-per-second gap asks for; nothing reads test).

    python benchmarks/cheap_forms.py --worlds 0 1 2 --users 12000  # ~25 min on 2 shared cores
    python benchmarks/cheap_forms.py --quick                       # world 0, 3,000 users (~4 min)

Each world (the demo's form, data and structure seed = the world seed, so three structures): one
DLRM-DCN pass of the demo recipe at the race's rates of its world family
(``instruments.race.race_rates``), then one GEM pass per variant with its valid click NE read
along the way (``instruments.race.train_with_evals``), and
``race.time_to_quality``: the seconds GEM needs to reach DLRM-DCN's end-of-pass NE, and GEM's NE at
DLRM-DCN's seconds. Variants (GEM overrides after the race's rates):

- ``shipped``: the demo recipe (recent window 16, 4 pooled queries, histories of 256 events);
- ``recent8``: a recent window of 8 events (each tower layer's attention is O(S²));
- ``pooled2``: 2 pooled queries instead of 4 (the pooling is O(N·M));
- ``hist128`` / ``hist64``: histories cut to the newest 128 / 64 events (``model.max_seq_len``);
- ``lean``: towers of 8 tokens instead of 24 (2 summary tokens, 2 pooled queries, 4 recent events):
  a step's time is mostly the towers' per-row tokens, not the events
  (``benchmarks/step_profile.py``);
- ``layers1``: one interleaved layer instead of two (Wukong and towers alike);
  ``lean_layers1``: both;
- ``pooled_only``: towers without self-attention layers (``model.interformer.tower_layers=false``:
  the pooled queries and the recent window go straight to the summaries); ``pooled_only_lean``:
  with ``lean``'s token counts; ``pooled_only_lean_layers1``: and one interleaved layer.

Recipe variants (``RECIPE_VARIANTS``) change both sides, so DLRM-DCN's pass is run again with them
and GEM races that pass: ``ema_warmup`` (``train.ema_warmup=true``: the EMA's decay warmed up, so a
short run's shadow is not mostly its initial weights); ``lean_layers1_ema_warmup``: with GEM's
``lean_layers1``.

Timings are one thread (``--threads 1``) on a shared machine: the seconds move with its load, the NE
values do not. ``--family 2`` draws the worlds from the wider family (``opengem.world.wide``).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import warnings
from pathlib import Path

import torch

# the towers' lean token counts: 2 summary tokens, 2 pooled queries, 4 recent events
LEAN = ["model.interformer.num_sum=2", "model.sequence.num_pooled=2",
        "model.sequence.recent_len=4", "model.sequence.min_recent=4"]
NO_TOWER_LAYERS = ["model.interformer.tower_layers=false"]
ONE_LAYER = ["model.wukong.num_layers=1"]
VARIANTS: dict[str, list[str]] = {
    "shipped": [],
    "recent8": ["model.sequence.recent_len=8", "model.sequence.min_recent=4"],
    "pooled2": ["model.sequence.num_pooled=2"],
    "hist128": ["model.max_seq_len=128"],
    "hist64": ["model.max_seq_len=64"],
    "lean": LEAN,
    "layers1": ONE_LAYER,
    "lean_layers1": [*LEAN, *ONE_LAYER],
    "pooled_only": NO_TOWER_LAYERS,
    "pooled_only_lean": [*NO_TOWER_LAYERS, *LEAN],
    "pooled_only_lean_layers1": [*NO_TOWER_LAYERS, *LEAN, *ONE_LAYER],
}

# name → (overrides of both sides, GEM's own overrides)
RECIPE_VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    "ema_warmup": (["train.ema_warmup=true"], []),
    "lean_layers1_ema_warmup": (["train.ema_warmup=true"], VARIANTS["lean_layers1"]),
}


def world(root: Path, w: int, users: int, family: int = 1) -> Path:
    from opengem.discipline import require_dev_world
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    require_dev_world(w, "the cheap forms")
    out = root / (f"w{w}-u{users}" + (f"-f{family}" if family != 1 else ""))
    if not (out / "dataset.json").exists():
        generate(world_config("demo", seed=w, overrides=[f"sizes.num_users={users}",
                                                         f"structure_seed={w}",
                                                         *([f"family={family}"] if family != 1
                                                           else [])]),
                 out, progress=False)
    return out


def measure(data: Path, variants: list[str]) -> dict:
    from instruments.race import ne_at, race_rates, race_steps, time_to_quality, train_with_evals

    from opengem.config import apply_overrides
    from opengem.recipes import recipe

    steps, rates = race_steps(data), race_rates(data)
    base = apply_overrides(recipe("demo"), [f"optim.warmup_steps={max(1, steps // 10)}"])
    every = max(steps // 20, 1)

    def run(arch: str, extra: list[str]) -> dict:
        cfg = apply_overrides(base, [f"model.arch={arch}", *rates[arch], *extra])
        return train_with_evals(cfg, data, every, split="valid", max_steps=steps)

    dcns = {(): run("dlrm_dcn", [])}
    dcn = dcns[()]
    out = {"steps": steps, "dcn_s": round(dcn["train_s"], 1), "dcn_ne": round(dcn["final_ne"], 4),
           "variants": {}}
    for v in variants:
        both, own = RECIPE_VARIANTS.get(v, ([], VARIANTS.get(v, [])))
        if tuple(both) not in dcns:
            dcns[tuple(both)] = run("dlrm_dcn", both)
        peer = dcns[tuple(both)]
        gem = run("gem", [*both, *own])
        t = time_to_quality(gem, peer)
        at = ne_at(gem["curve"], peer["train_s"])
        out["variants"][v] = {"gem_s": round(gem["train_s"], 1),
                              "gem_ne": round(gem["final_ne"], 4),
                              "gem_s_to_dcn_ne": t["gem_s_to_target"], "speedup": t["speedup"],
                              "gem_ne_at_dcn_s": round(at, 4) if at is not None else None}
        if both:
            out["variants"][v].update(dcn_s=round(peer["train_s"], 1),
                                      dcn_ne=round(peer["final_ne"], 4))
        print(json.dumps({"data": data.name, "variant": v, "dcn_s": round(peer["train_s"], 1),
                          "dcn_ne": round(peer["final_ne"], 4), **out["variants"][v]}),
              flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--users", type=int, default=12000)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS),
                   choices=[*VARIANTS, *RECIPE_VARIANTS])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--family", type=int, default=1, help="the world family (1 or 2)")
    p.add_argument("--work", default=None, help="worlds go here (reused); default: a temp dir")
    p.add_argument("--quick", action="store_true", help="world 0, 3,000 users")
    a = p.parse_args()
    if a.quick:
        a.worlds, a.users = [0], 3000
    if "shipped" not in a.variants:
        a.variants = ["shipped", *a.variants]
    torch.set_num_threads(a.threads)
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.work or tmp)
        per = {w: measure(world(root, w, a.users, a.family), a.variants) for w in a.worlds}
    summary = {}
    for v in a.variants:
        ne = [per[w]["variants"][v]["gem_ne_at_dcn_s"] for w in a.worlds]
        d = [x - per[w]["variants"]["shipped"]["gem_ne_at_dcn_s"]
             for w, x in zip(a.worlds, ne) if x is not None]
        sp = [per[w]["variants"][v]["speedup"] for w in a.worlds]
        summary[v] = {
            "gem_ne_at_dcn_s_minus_shipped": [round(statistics.fmean(d), 4),
                                              round(statistics.stdev(d), 4) if len(d) > 1 else 0.0],
            "speedup_median": statistics.median([s or 0.0 for s in sp]),
            "final_ne_minus_shipped": round(statistics.fmean(
                per[w]["variants"][v]["gem_ne"] - per[w]["variants"]["shipped"]["gem_ne"]
                for w in a.worlds), 4)}
    print(json.dumps({"benchmark": "cheap_forms", "worlds": a.worlds, "family": a.family,
                      "users": a.users,
                      "split": "valid", "per_world": per, "summary": summary}))


if __name__ == "__main__":
    main()
