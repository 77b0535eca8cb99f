import pytest

from opengem.config import Config, ConfigError, apply_overrides
from opengem.recipes import recipe, recipe_names


def test_overrides_parse_by_declared_type():
    cfg = apply_overrides(recipe("tiny"),
                          ["optim.lr=0.01", "model.wukong.num_layers=3", "data.shuffle=false",
                                           "model.wukong.mlp_dims=32,16",
                           "model.wukong.cross_layer=dense"])
    assert cfg.optim.lr == 0.01 and cfg.model.wukong.num_layers == 3 and cfg.data.shuffle is False
    assert cfg.model.wukong.mlp_dims == (32, 16) and cfg.model.wukong.cross_layer == "dense"


def test_overrides_leave_the_base_config_alone():
    """One base can seed several runs: overriding ``model.arch`` for one must not reach the next."""
    base = recipe("tiny")
    dcn = apply_overrides(base, ["model.arch=dlrm_dcn", "optim.warmup_steps=7"])
    fp8 = apply_overrides(base, ["train.fp8_activations=true"])
    assert dcn.model.arch == "dlrm_dcn" and dcn.optim.warmup_steps == 7
    assert (
        fp8.model.arch == base.model.arch == "gem"
        and fp8.optim.warmup_steps == base.optim.warmup_steps
    )
    assert fp8.train.fp8_activations and not base.train.fp8_activations
    assert base == recipe("tiny")


@pytest.mark.parametrize("item, message", [
    ("optim.lrr=1", "unknown config key 'optim.lrr'"),
    ("nonsense=1", "unknown config key 'nonsense'"),
    ("optim=1", "unknown config key|is a section"),
    ("model.wukong=3", "is a section"),
    ("optim.lr", "must look like key=value"),
    ("data.batch_size=ten", "cannot read 'ten' as int"),
    ("data.batch_size=0", "batch_size must be >= 1"),
    ("optim.lr=-1", "must be > 0"),
    ("model.wukong.cross_layer=magic", "cross_layer must be"),
    ("model.embedding_dim=15", "not divisible by"),
    ("train.epochs=0", "epochs must be >= 1"),
])
def test_bad_overrides_name_the_problem(item, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        apply_overrides(recipe("tiny"), [item])


def test_round_trip_through_dict():
    for name in recipe_names():
        cfg = recipe(name)
        assert Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown config keys"):
        Config.from_dict({**recipe("tiny").to_dict(), "extra": 1})


def test_unknown_recipe():
    with pytest.raises(ValueError, match="unknown recipe 'huge'"):
        recipe("huge")


@pytest.mark.parametrize("chooser", ["train.early_stop_patience=2", "train.keep_best=true"])
def test_the_best_checkpoint_is_never_chosen_on_test(chooser):
    """Even where the run reports on valid, the checkpoint early stopping or keep_best keeps is
    a choice:
    the discipline refuses to make it on test, and the error names the key."""
    from opengem.discipline import DisciplineError

    base = ["data.eval_split=valid", "train.eval_every=5", chooser]
    with pytest.raises(ConfigError,
                       match=r"train\.eval_split='test'.*split other than 'test'") as e:
        apply_overrides(recipe("tiny"), [*base, "train.eval_split=test"])
    assert isinstance(e.value.__cause__, DisciplineError)
    apply_overrides(recipe("tiny"), [*base, "train.eval_split=valid", "data.eval_split=test"])
    apply_overrides(recipe("tiny"),
                    ["data.eval_split=valid", "train.eval_every=5", "train.eval_split=test"])
