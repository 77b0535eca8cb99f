"""GEM's model choices where the public record is silent or our code differed from the paper, each
against the shipped recipe, on development worlds, valid split only (the choice is made here).

    python benchmarks/model_choices.py --out /tmp/choices            # worlds 0-2, 1,500 users, 2 epochs (~25 min, 2 cores)
    python benchmarks/model_choices.py --out /tmp/choices --users 6000 --worlds 0 1 2 3 4 --variants recency
    python benchmarks/model_choices.py --out /tmp/choices --quick    # world 0, 1,500 users, 1 epoch (< 5 min)

Variants (``tiny`` recipe overrides), one change each from ``shipped``:

- ``previous``: the choices before this benchmark (cross-layer span ``earlier``,
  PFFN ``transposed``):
  at two Wukong layers its cross-layer "attention" is a uniform mean.
- ``span_earlier`` / ``pffn_transposed``: one of the two alone.
- ``rope``: rotary positions in the towers instead of learned position vectors.
- ``table_init``: the domain and time-bucket embeddings start at the id tables' N(0, 0.05²).
- ``dense_standardize`` / ``dense_quantile``: the dense normaliser fitted on train instead of
  signed log.
- ``heads_independent``: p(conversion) from its own head instead of ESMM's
  p(click)·p(conversion | click).
- ``recency``: the history-counts token with the newest-event weights too (``model.count_recency``);
  ``tau6``: six decay times (1 h … 30 d) instead of four.
- ``input_rms*``: X_0 tokens (all, or the id tokens only) to unit RMS with learned gains starting at
  1 or 0.25 (``model.input_norm``, ``model.input_norm_gain``).
- ``fm_unit``: the Wukong FM block's Gram from tokens scaled to unit RMS (the other paths raw);
  ``shortcut_raw``: the shortcut's pairs from the raw tokens (the default
  before ``shortcut_pairs=unit``).
- ``fvfm`` / ``linear_shortcut`` / ``no_shortcut``: the low-order shortcut's form; ``init_02``: id
  tables start at N(0, 0.2²); ``wide``: 8 FM and 8 LC tokens of rank 8 instead of the recipe's 4.
- ``item_match``: the target match also compares each ads event's item with the candidate's
  ``ad_id`` (``model.target_match_items``); ``target_tokens``: one X_0 token per stream, the
  candidate in the stream's matched tables (``model.target_tokens``); ``item_tokens``: both.
- ``windows``: the history counts also count events in hard windows of the decay times
  (``model.count_windows``); ``windows_recency``: with ``count_recency`` too.
- ``pooled_only``: towers without self-attention layers (``model.interformer.tower_layers=false``).

``--family 2`` draws the worlds from the wider family (``opengem.world.wide``: item similarity,
fatigue, repeat engagement, last-k) instead of the first.

Each is one ``bench.tune.train_point`` at the recipe's learning rates (early stopping and the best
checkpoint on valid). Per variant: best valid NE (all/click, all/conversion),
``captured_over_oracle`` on valid, and the paired difference to ``shipped`` over worlds (mean ± std,
and how many worlds it is better on). Nothing reads the test split. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import warnings
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "shipped": [],
    "previous": ["model.wukong.cross_layer_span=earlier", "model.sequence.pffn=transposed"],
    "span_earlier": ["model.wukong.cross_layer_span=earlier"],
    "pffn_transposed": ["model.sequence.pffn=transposed"],
    "rope": ["model.sequence.position=rope"],
    "table_init": ["model.embedding_init=table"],
    "dense_standardize": ["model.dense_norm=standardize"],
    "dense_quantile": ["model.dense_norm=quantile"],
    "heads_independent": ["model.heads.chain_required=false"],
    "recency": ["model.count_recency=true"],
    "tau6": ["model.count_decay_hours=[1,4,24,72,168,720]"],
    "input_rms": ["model.input_norm=rms"],
    "input_rms_ids": ["model.input_norm=rms_ids"],
    "input_rms_g025": ["model.input_norm=rms", "model.input_norm_gain=0.25"],
    "input_rms_ids_g025": ["model.input_norm=rms_ids", "model.input_norm_gain=0.25"],
    "fm_unit": ["model.wukong.fm_input=unit"],
    "shortcut_raw": ["model.shortcut_pairs=raw"],
    "fvfm": ["model.shortcut=fvfm"],
    "fvfm_rms": ["model.shortcut=fvfm", "model.input_norm=rms"],
    "linear_shortcut": ["model.shortcut=linear"],
    "no_shortcut": ["model.shortcut=none"],
    "init_02": ["model.sparse.init_std=0.2"],
    "wide": ["model.wukong.num_fm=8", "model.wukong.num_lc=8", "model.wukong.fm_rank=8"],
    "item_match": ["model.target_match_items=true"],
    "target_tokens": ["model.target_tokens=true"],
    "item_tokens": ["model.target_match_items=true", "model.target_tokens=true"],
    "windows": ["model.count_windows=true"],
    "windows_recency": ["model.count_windows=true", "model.count_recency=true"],
    "pooled_only": ["model.interformer.tower_layers=false"],
}


def world(root: Path, w: int, users: int, family: int = 1) -> Path:
    from opengem.data.parquet import MANIFEST
    from opengem.discipline import require_dev_world
    from opengem.world.generate import generate
    from opengem.world.oracle import OracleCollector
    from opengem.world.presets import world_config

    require_dev_world(w, "the model choices")
    out = root / (f"w{w}-u{users}" + (f"-f{family}" if family != 1 else ""))
    if not (out / MANIFEST).exists():
        cfg = world_config("tiny", seed=w,
                           overrides=[f"sizes.num_users={users}", f"structure_seed={w}",
                                      # the item-match variants read the declaration
                                      "behaviour.declare_ad_items=true",
                                      *([f"family={family}"] if family != 1 else [])])
        generate(cfg, out, progress=False, observer=OracleCollector)
    return out


def run_variant(name: str, data: str, run: str, w: int, max_epochs: int) -> dict:
    import torch

    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from instruments.tune import best_evaluation, train_point

    from opengem.config import apply_overrides
    from opengem.evaluation.evaluate import evaluate_run
    from opengem.recipes import recipe
    from opengem.run import FINAL_FILE

    cfg = apply_overrides(recipe("tiny"),
                          ["train.threads=1", "train.progress=false", f"train.seed={w}",
                                           f"data.seed={w}", *VARIANTS[name]])
    base = recipe("tiny").optim
    if (Path(run) / FINAL_FILE).exists():  # reused from an earlier invocation with the same --out
        wall = None
        best_evaluation(run)
    else:
        wall = round(train_point(cfg, data, run, (base.lr, base.sparse_lr), split="valid",
                                 max_epochs=max_epochs).wall_s, 1)
    m = evaluate_run(run, data, "valid", progress=False, best=True)["metrics"]
    return {"world": w, "variant": name, "ne_click": m["all/click"]["ne"],
            "ne_conversion": m["all/conversion"]["ne"],
            "captured_over_oracle_click": m["all/click"].get("captured_over_oracle"),
            "wall_s": wall}


def mean_std(xs: list[float]) -> list[float]:
    return [round(statistics.fmean(xs), 4), round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="worlds and runs go here (reused when present)")
    p.add_argument("--worlds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--users", type=int, default=1500)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--family", type=int, default=1, help="the world family (1 or 2)")
    p.add_argument("--quick", action="store_true", help="world 0, 1,500 users, 1 epoch")
    args = p.parse_args()
    if args.quick:
        args.worlds, args.users, args.epochs = [0], 1500, 1
    if "shipped" not in args.variants:
        args.variants = ["shipped", *args.variants]
    root = Path(args.out)
    datas = {w: world(root / "data", w, args.users, args.family) for w in args.worlds}
    tag = f"w{{}}-u{args.users}-e{args.epochs}" + (f"-f{args.family}" if args.family != 1 else "")
    jobs = [(v, str(datas[w]), str(root / "runs" / tag.format(w) / v), w,
             args.epochs)
            for w in args.worlds for v in args.variants]
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        rows = list(pool.map(run_variant, *zip(*jobs)))
    for r in rows:
        print(json.dumps(r), flush=True)
    by = {(r["variant"], r["world"]): r for r in rows}
    table = {}
    for v in args.variants:
        ne = [by[v, w]["ne_click"] for w in args.worlds]
        d = [by[v, w]["ne_click"] - by["shipped", w]["ne_click"] for w in args.worlds]
        dc = [by[v, w]["ne_conversion"] - by["shipped", w]["ne_conversion"] for w in args.worlds]
        cap = [by[v, w]["captured_over_oracle_click"] for w in args.worlds
               if by[v, w]["captured_over_oracle_click"]]
        table[v] = {"valid_ne_click": mean_std(ne), "d_ne_click_vs_shipped": mean_std(d),
                    "d_ne_conversion_vs_shipped": mean_std(dc),
                    "better_worlds_click": sum(x < 0 for x in d),
                    "captured_over_oracle_click": mean_std(cap) if cap else None}
    print(f"{'variant':<18} {'valid NE click':>16} {'Δ vs shipped':>18} {'Δ conv':>18} "
          f"{'better':>6} {'cap/oracle':>14}")
    for v, t in table.items():
        print(f"{v:<18} {t['valid_ne_click'][0]:>9.4f}±{t['valid_ne_click'][1]:<6.4f} "
              f"{t['d_ne_click_vs_shipped'][0]:>+10.4f}±{t['d_ne_click_vs_shipped'][1]:<7.4f} "
              f"{t['d_ne_conversion_vs_shipped'][0]:>+10.4f}±{t['d_ne_conversion_vs_shipped'][1]:<7.4f} "
              f"{t['better_worlds_click']:>3}/{len(args.worlds)} "
              f"{(t['captured_over_oracle_click'] or [float('nan')])[0]:>10.3f}")
    print(json.dumps({"benchmark": "model_choices", "worlds": args.worlds, "family": args.family,
                      "users": args.users,
                      "epochs": args.epochs, "split": "valid", "variants": table}))


if __name__ == "__main__":
    main()
