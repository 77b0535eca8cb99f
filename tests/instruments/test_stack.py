"""A trained run stacked with the logistic regression: the weight is chosen on valid alone, its ends
are the two models alone, the stack is no worse on valid than either, and mismatches are named."""

import pytest
from instruments.linear import run_linear
from instruments.stack import WEIGHTS, blend, run_stack
from instruments.tune import train_point

from opengem.config import apply_overrides
from opengem.discipline import DisciplineError
from opengem.evaluation.evaluate import evaluate_run
from opengem.features.schema import SchemaError
from opengem.recipes import recipe


@pytest.fixture(scope="module")
def gem_run(world, tmp_path_factory):
    cfg = apply_overrides(recipe("tiny"), ["train.threads=1"])
    cfg.train.progress = False
    run = tmp_path_factory.mktemp("stack") / "gem"
    train_point(cfg, world, run, (6e-3, 0.1), max_epochs=1)
    return run


def test_the_weight_is_chosen_on_valid_between_the_two_models(world, gem_run):
    (r,) = run_stack(world, [gem_run])
    ne = {float(w): v for w, v in r["trials"][0]["w"].items()}
    assert set(ne) == set(WEIGHTS) and r["chosen"]["w"] in WEIGHTS
    assert (
        ne[r["chosen"]["w"]]
        == min(ne.values())
        == pytest.approx(r["valid"]["all/click"]["ne"], abs=1e-12)
    )
    # w = 1 is the run alone, w = 0 the regression alone, each scored as its own path scores it
    alone = evaluate_run(gem_run, world, "valid", progress=False,
                         best=True)["metrics"]["all/click"]["ne"]
    assert ne[1.0] == pytest.approx(alone, abs=1e-6)
    assert ne[0.0] == pytest.approx(run_linear(world, score_test=False)["valid"]["all/click"]["ne"],
                                    abs=1e-9)
    # Measured at this world (dev world 0, 1,500 users; GEM one epoch): valid click NE GEM ~0.81,
    # the regression 0.7775, the stack below both; test read once, beating the base rate
    assert ne[r["chosen"]["w"]] < min(ne[1.0], ne[0.0])
    assert r["metrics"]["all/click"]["ne"] < 0.85 and r["metrics"]["all/click"]["auc"] > 0.83
    assert blend(1.0, 0.0, 0.25) == 0.25


def test_it_refuses_test_and_names_a_run_of_another_schema(world, gem_run, tmp_path):
    with pytest.raises(DisciplineError, match="test"):
        run_stack(world, [gem_run], tune_split="test")
    with pytest.raises(ValueError, match="weights"):
        run_stack(world, [gem_run], weights=(0.5, 1.5))
    from opengem.world.generate import generate
    from opengem.world.presets import world_config

    other = tmp_path / "other"
    cfg = world_config("tiny", seed=0,
                       overrides=["sizes.num_users=200", "surface_task.enabled=true"])
    generate(cfg, other, progress=False)
    with pytest.raises(SchemaError, match="another schema"):
        run_stack(other, [gem_run])


def test_rows_in_another_order_than_the_regressions_are_named(world, gem_run, monkeypatch):
    # The blend is row by row: a scorer that read the split in another order must fail, not blend
    # one row's run probability with another row's regression probability.
    import instruments.stack as stack

    score = stack.score_rows

    def reversed_rows(*args, **kwargs):
        return {k: None if v is None else v.flip(0) for k, v in score(*args, **kwargs).items()}

    monkeypatch.setattr(stack, "score_rows", reversed_rows)
    with pytest.raises(ValueError, match="not in the same order"):
        run_stack(world, [gem_run])
