"""``export_run(table_dtype=fp16|int8)``: TorchRec-quantised tables in the serving program.

The artifact loads (exported program and eager rebuild), scores the same request as the fp32
artifact within a stated tolerance, records the dtype and the table bytes, and its packed
tables equal TorchRec's quantised modules row for row.
"""

import copy
import zipfile

import numpy as np
import pytest
import torch
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)

from opengem.export import Predictor
from opengem.export.artifact import export_run
from opengem.export.request import synthetic_request
from opengem.export.tables import packed_tables
from opengem.ops.quantize import quantize_tables
from opengem.recipes import recipe
from opengem.train.trainer import train
from opengem.world.generate import generate
from opengem.world.presets import world_config

# max |Δp| vs the fp32 artifact on the same request. Measured on this 4-step tiny run (tables still
# near their init): fp16 ~3e-8, int8 ~5e-7. The bounds leave room for trained tables, whose rows are
# wider: int8 keeps a row to ±(max − min)/510, fp16 to 2^-11 relative.
TOL = {"fp16": 1e-4, "int8": 5e-3}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized_export")
    generate(world_config("tiny", seed=1), root / "data", progress=False)
    cfg = recipe("tiny")
    cfg.train.max_steps, cfg.train.progress = 4, False
    train(cfg, root / "data", root / "run")
    return {d: (root / d, export_run(root / "run", root / d, compile=False, table_dtype=d))
            for d in ("fp32", "fp16", "int8")}


def _scores(p: Predictor, request: dict) -> np.ndarray:
    return np.array([p.predict(request)["predictions"][t] for t in p.tasks])


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_compressed_artifact_scores_close_to_fp32(artifacts, dtype):
    ref = Predictor(artifacts["fp32"][0], runtime="exported")
    schema = ref.schema
    request = synthetic_request(schema, 16, 40, seed=3, oov=True)
    want = _scores(ref, request)
    for runtime in ("exported", "eager"):
        p = Predictor(artifacts[dtype][0], runtime=runtime)
        assert p.table_dtype == dtype
        got = _scores(p, request)
        assert np.abs(got - want).max() <= TOL[dtype], (dtype, runtime, np.abs(got - want).max())
        assert np.abs(got - want).max() > 0  # the tables really are compressed


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "int8"])
def test_manifest_records_dtype_and_bytes(artifacts, dtype):
    _, m = artifacts[dtype]
    t = m["tables"]
    assert t["dtype"] == dtype and t["fp32_bytes"] == artifacts["fp32"][1]["tables"]["bytes"]
    ratio = {"fp32": 1.0, "fp16": 0.5, "int8": (16 + 4) / (4 * 16)}[dtype]  # tiny recipe: D = 16
    assert t["bytes"] == pytest.approx(ratio * t["fp32_bytes"], rel=0.01)
    if dtype != "fp32":
        assert m["parity"]["table_compression_max_abs_diff"] <= TOL[dtype]
        # the bytes are saved on disk too, not only counted
        saved = 0.9 * (t["fp32_bytes"] - t["bytes"])
        assert (
            m["files"]["weights.pt"]["bytes"]
            < artifacts["fp32"][1]["files"]["weights.pt"]["bytes"] - saved
        )
        assert (
            _program_weight_bytes(artifacts[dtype][0])
            < _program_weight_bytes(artifacts["fp32"][0]) - saved
        )


def _program_weight_bytes(artifact) -> int:
    """Bytes of the weights inside program.pt2 (its graph is stored beside them, and grows
    a little)."""
    with zipfile.ZipFile(artifact / "program.pt2") as z:
        return sum(i.file_size for i in z.infolist() if "/data/weights/weight_" in i.filename)


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_packed_tables_equal_torchrec_quant_modules(dtype):
    torch.manual_seed(0)

    class Arch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[
                EmbeddingBagConfig(name="t_a", embedding_dim=8, num_embeddings=50,
                                   feature_names=["a"]),
                EmbeddingBagConfig(name="t_b", embedding_dim=12, num_embeddings=30,
                                   feature_names=["b"])])
            self.ec = EmbeddingCollection(tables=[
                EmbeddingConfig(name="t_s", embedding_dim=8, num_embeddings=40,
                                feature_names=["s"])])

    q = quantize_tables(copy.deepcopy(Arch()), dtype)
    tables = packed_tables(q)
    lengths = torch.tensor([2, 0, 3, 1])
    values = torch.randint(0, 30, (6,))
    kjt = KeyedJaggedTensor.from_lengths_sync(["a", "b"], torch.cat([values, values]),
                                              torch.cat([lengths, lengths]))
    pooled = q.ebc(kjt).to_dict()
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    for f in ("a", "b"):
        torch.testing.assert_close(tables[f"t_{f}"].bag(values, offsets), pooled[f].float(), rtol=0,
                                   atol=1e-6)
    ids = torch.randint(0, 40, (7,))
    seq = q.ec(KeyedJaggedTensor.from_lengths_sync(["s"], ids, torch.tensor([7])))["s"].values()
    torch.testing.assert_close(tables["t_s"](ids), seq.float(), rtol=0, atol=1e-6)
