"""Peer baselines (TorchRec DLRM, DLRM-DCN, DIN) and the InterFormer ablation switches."""

import dataclasses
import json
import math

import pytest
import torch

from opengem.cli import main
from opengem.data.batch import collate
from opengem.model.build import build_gem, materialize
from opengem.model.foundation import GEMConfig
from opengem.model.interaction_arch import WukongConfig
from opengem.model.interformer import InterFormer, InterFormerConfig
from opengem.model.peers import PeerModel, mean_pool
from opengem.model.sequence_arch import SequenceConfig
from opengem.recipes import recipe
from opengem.run import FINAL_FILE
from opengem.testing import random_table, tiny_schema

ARCHS = ["dlrm", "dlrm_dcn", "din"]


def _peer(arch, seed=0, **kw):
    cfg = recipe("tiny").model
    cfg.arch = arch
    for k, v in kw.items():
        setattr(cfg, k, v)
    return materialize(build_gem(tiny_schema(), cfg), seed=seed, base_rates=[0.1, 0.01])


def _batch(n=24, seed=0):
    return collate(random_table(tiny_schema(), n, seed=seed), tiny_schema())


@pytest.mark.parametrize("arch", ARCHS)
def test_peer_forward_shapes_chaining_and_every_parameter_learns(arch):
    model = _peer(arch)
    assert isinstance(model, PeerModel)
    b = _batch()
    logits = model(b)
    assert logits.shape == (24, 2) and torch.isfinite(logits).all()
    assert (logits[:, 1] <= logits[:, 0] + 1e-6).all()  # conversion is chained through click
    assert model.features(b).shape == (24, model.feature_dim)
    p = torch.sigmoid(logits).mean(0)
    # output biases start at the base rates
    assert abs(p[0].item() - 0.1) < 0.05 and p[1].item() < 0.03
    torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels).backward()
    dead = [n for n, q in model.named_parameters() if q.grad is None or q.grad.abs().sum() == 0]
    assert not dead, f"parameters without gradient: {dead}"
    sparse = {id(q) for q in model.sparse_parameters()}
    assert sparse and sparse.isdisjoint(id(q) for q in model.dense_parameters())
    assert model.max_seq_len() == build_gem(tiny_schema(), recipe("tiny").model).max_seq_len()


@pytest.mark.parametrize("arch", ARCHS)
def test_peer_init_is_deterministic_and_sequences_can_be_dropped(arch):
    a, b = _peer(arch, seed=3), _peer(arch, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(a(_batch()), b(_batch()))
    no_seq = _peer(arch, use_sequences=False)
    assert no_seq.streams == [] and no_seq(_batch()).shape == (24, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_peer_without_dense_features_or_streams(arch):
    schema = dataclasses.replace(tiny_schema(streams=0), dense=())
    cfg = recipe("tiny").model
    cfg.arch = arch
    model = materialize(build_gem(schema, cfg), base_rates=[0.1, 0.01])
    logits = model(collate(random_table(schema, 8), schema))
    assert logits.shape == (8, 2) and torch.isfinite(logits).all()


def test_mean_pool_of_a_jagged_example():
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = mean_pool(v, torch.tensor([2, 0, 1]))
    assert torch.equal(out, torch.tensor([[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]]))


def test_arch_is_validated_and_peers_refuse_the_gem_only_paths():
    with pytest.raises(ValueError, match="model.arch must be gem"):
        GEMConfig(arch="xgboost").validate()
    with pytest.raises(NotImplementedError, match="single-process"):
        # what opengem.parallel (FSDP, compile, checkpointing) reads first
        _ = _peer("dlrm").interformer


# ------------------------------------------------------------------------------- ablation switches
def _interformer(**kw):
    torch.manual_seed(0)
    seq = SequenceConfig(num_heads=2, recent_len=4, min_recent=2, num_pooled=2)
    return InterFormer(5, 8, 1,
                       WukongConfig(num_layers=2, num_fm=2, num_lc=2, fm_rank=2, mlp_dims=(8,)),
                       seq, InterFormerConfig(**kw)).eval()


def _seqs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 0, 5])
    return [(torch.randn(int(lengths.sum()), 8, generator=g), lengths)]


def test_no_wukong_keeps_the_non_sequence_tokens():
    inter = _interformer(wukong=False)
    assert len(inter.interaction.layers) == 0
    x = torch.randn(3, 5, 8)
    _, s_sum, x_last = inter(x, _seqs())
    assert torch.equal(x_last, x) and s_sum.shape == (3, 8, 8)


def test_no_interleave_makes_the_sequence_side_independent_of_the_rest():
    inter = _interformer(interleave=False)
    x1, x2 = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    _, s1, _ = inter(x1, _seqs())
    _, s2, _ = inter(x2, _seqs())
    assert torch.allclose(s1, s2)
    on = _interformer()
    assert not torch.allclose(on(x1, _seqs())[1], on(x2, _seqs())[1])


# ------------------------------------------------------------------------------- the CLI chain
@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "data"
    assert main(["--quiet", "generate", "--preset", "tiny", "--out", str(out), "--seed", "1"]) == 0
    return out


def test_dlrm_dcn_trains_and_evaluates_through_the_cli(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(tiny_data), "--out",
                 str(run), "model.arch=dlrm_dcn"]) == 0
    final = json.loads((run / FINAL_FILE).read_text())
    assert final["steps"] > 0 and final["parameters"]["dense"] > 0
    out = tmp_path / "eval.json"
    assert (
        main(
            ["--quiet", "evaluate", "--run", str(run), "--data", str(tiny_data), "--json", str(out)]
        )
        == 0
    )
    m = json.loads(out.read_text())["metrics"]
    for key in ("all/click", "all/conversion"):
        assert m[key]["n"] > 0 and all(math.isfinite(m[key][f])
                                       for f in ("auc", "ne", "logloss", "captured"))
    assert main(["--quiet", "train", "--recipe", "tiny", "--data", str(tiny_data), "--out",
                 str(tmp_path / "x"), "model.arch=xgboost"]) == 2
    assert "model.arch must be gem|dlrm|dlrm_dcn" in capsys.readouterr().err
    assert (
        main(
            ["--quiet", "export", "--run", str(run), "--out", str(tmp_path / "art"), "--no-compile"]
        )
        == 2
    )
    assert "peer baseline; only GEM runs" in capsys.readouterr().err
