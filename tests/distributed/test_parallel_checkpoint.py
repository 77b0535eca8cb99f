"""DCP checkpoints reshard: 4 processes → 2 → 1 (the plain single-process model and optimizers)
→ 4, each with another layout, reproducing parameters and optimizer state bit for bit.

    A  4 procs  2-D tables (2 copies × group 2; row-, table-, column-, table-row-wise) + HSDP 2×2
    B  2 procs  every table row-wise, FSDP 2                          (then one more step)
    C  1 proc   materialize(build_gem) + build_optimizers: AdamW + torchrec RowWiseAdagrad
                                                                   (then the same step: equals B's)
    D  4 procs  table-wise + one column-wise table, FSDP 4, activation checkpointing

Saved and loaded with ``opengem.checkpoint`` unchanged (``get_state_dict`` + ``dcp``).
"""

import _workers as W
import pytest
import torch

pytestmark = pytest.mark.distributed

A = {"sparse_group": 2, "dp_replicate": 2, "default_sharding": "table_wise", "column_wise_dim": 4,
     "sharding": {"t_user_id": "row_wise", "t_category": "column_wise", "t_tags": "table_row_wise",
                  "t_s0_item": "row_wise"}}
B = {"default_sharding": "row_wise"}
D = {"default_sharding": "table_wise", "sharding": {"t_user_id": "column_wise"},
     "column_wise_dim": 4, "activation_checkpoint": "full"}
TRAIN_STEPS = 3


def _plain_stage(load_from, save_to):
    """Stage C: the trainer's single-process model and optimizers, loaded with the
    trainer's loader."""
    from opengem.checkpoint import load_checkpoint, save_checkpoint
    from opengem.testing import tiny_schema
    from opengem.train.optim import Schedule

    model = W.plain_model(seed=0)  # another seed: everything must come from the checkpoint
    opts = W.plain_optimizers(model, trainer_adam=True)
    schedule = Schedule(opts, W.TOTAL_STEPS, W.optim_cfg())
    step = load_checkpoint(load_from, model, opts)["step"]
    state = W.full_state(model, opts)
    save_checkpoint(save_to, step, model, opts, {"step": step})
    W.well_conditioned_adam(opts[0])
    loss = W.run_steps(tiny_schema(), model, opts, schedule, [step], False)[0]
    return state, loss, W.full_state(model, opts)


def test_checkpoint_reshards_4_2_1_4(tmp_path):
    from opengem.checkpoint import latest_checkpoint

    walls = {}
    walls["A"] = W.spawn("checkpoint", 4, tmp_path,
                         {"parallel": A, "steps": TRAIN_STEPS, "save": str(tmp_path / "A"),
                                                     "record": "A.pt", "local_world_size": 2})
    a = torch.load(tmp_path / "A.pt", weights_only=False)
    with W.one_thread():
        fresh = W.plain_model().state_dict()
    moved = [k for k, v in fresh.items() if not torch.equal(a["state"][f"model.{k}"], v)]
    assert len(moved) > len(fresh) // 2, "stage A did not train"
    sums = [k for k in a["state"] if k.endswith(".sum")]
    assert len(sums) == 9 and all(a["state"][k].abs().sum() > 0 for k in sums), sums

    walls["B"] = W.spawn("checkpoint", 2, tmp_path,
                         {"parallel": B, "load": str(latest_checkpoint(tmp_path / "A")),
                                                     "save": str(tmp_path / "B"), "record": "B.pt",
                          "resume_step": True})
    b = torch.load(tmp_path / "B.pt", weights_only=False)
    assert b["step"] == TRAIN_STEPS
    assert W.mismatches(b["state"], a["state"]) == {}

    with W.one_thread():
        c_state, c_loss, c_resumed = _plain_stage(latest_checkpoint(tmp_path / "B"), tmp_path / "C")
    assert W.mismatches(c_state, a["state"]) == {}
    # the resumed step continues exactly like one process (within the equivalence tolerances)
    assert abs(b["resume_loss"] - c_loss) <= 1e-6 * abs(c_loss)
    tensors = {k: v for k,
               v in c_resumed.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    rel = W.rel_diff(b["resumed"], tensors)
    worst = max(rel, key=rel.get)
    assert rel[worst] <= 1e-4, f"{worst}: {rel[worst]:.2e}"

    walls["D"] = W.spawn("checkpoint", 4, tmp_path,
                         {"parallel": D, "load": str(latest_checkpoint(tmp_path / "C")),
                                                     "save": str(tmp_path / "D"), "record": "D.pt"})
    d = torch.load(tmp_path / "D.pt", weights_only=False)
    assert W.mismatches(d["state"], a["state"]) == {}
    assert "column_wise" in d["plan"] and "2 table copies" in a["plan"]
    print(f"\nstage walls: {', '.join(f'{k} {v:.1f} s' for k, v in walls.items())}; "
          f"resumed step: loss rel {abs(b['resume_loss'] - c_loss) / c_loss:.1e}, params "
          f"rel {rel[worst]:.1e}")
