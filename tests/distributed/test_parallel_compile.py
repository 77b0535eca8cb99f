"""Per-block ``torch.compile`` (+ activation checkpointing) under FSDP2 and TorchRec, 2
gloo processes.

Slow: a cold inductor compile of every block takes about two minutes on 2 CPU cores (set
``TORCHINDUCTOR_CACHE_DIR`` to reuse it). Checks that graphs were really compiled (compiling an
FSDP root silently falls back to eager) and that training still equals one process.
"""

import _workers as W
import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_compiled_blocks_train_like_one_process(tmp_path):
    import torch

    steps = 2
    case = {"parallel": {"default_sharding": "row_wise", "compile": True,
                         "activation_checkpoint": "full"}}
    wall = W.spawn("equivalence", 2, tmp_path, {"cases": {"compiled": case}, "steps": steps})
    r = torch.load(tmp_path / "equivalence-w2.pt", weights_only=False)["compiled"]
    assert r["graphs"] > 0, "nothing was compiled"
    ref_losses, ref_final = W.reference_run(steps)
    assert all(abs(a - b) <= 1e-6 * abs(b) for a,
               b in zip(r["losses"], ref_losses)), (r["losses"], ref_losses)
    rel = W.rel_diff(r["final"], ref_final)
    assert max(rel.values()) <= 1e-4, max(rel, key=rel.get)
    print(f"\ncompiled: {r['graphs']} graphs, params rel {max(rel.values()):.1e}, {wall:.1f} "
          f"s wall")
