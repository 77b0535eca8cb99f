"""``torchrun`` training (2 gloo processes) on the tiny world written in layout v1 and in layout v2
(event logs joined at read time, per rank): the same losses and the same final parameters."""

import _torchrun as T
import pytest

from opengem.cli import main

pytestmark = pytest.mark.distributed

TRAIN = ("train.max_steps=8", "data.batch_size=64", "train.log_every=1", "optim.warmup_steps=2",
         "parallel.default_sharding=table_wise")


def test_two_ranks_train_the_same_on_v1_and_v2(tmp_path):
    runs = []
    for layout in ("v1", "v2"):
        data = tmp_path / f"data-{layout}"
        assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(data), "--seed", "1",
                     "--no-oracle", "--layout", layout]) == 0
        run = tmp_path / f"run-{layout}"
        T.run(2, "train", "--recipe", "tiny", "--data", str(data), "--out", str(run), *TRAIN,
              log=tmp_path / "log")
        runs.append(run)
    a, b = T.final(runs[0]), T.final(runs[1])
    assert a["world_size"] == b["world_size"] == 2 and a["steps"] == b["steps"] == 8
    assert a["examples"] == b["examples"]
    assert T.losses(runs[0]) == T.losses(runs[1])
    assert a["params_sha256"] == b["params_sha256"]
