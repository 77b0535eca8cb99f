"""The world's missing-not-at-random dense values (``dense_missing``): off, the world is
byte-identical; on, the blanked rows follow the label drivers and the schema declares the option."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.data.validate import validate_dataset
from opengem.features.schema import FeatureSchema
from opengem.world.generate import generate
from opengem.world.latent import MISSING_FEATURES
from opengem.world.presets import world_config
from tests.unit.world.test_mismatched_objective import DEFAULT_DIGEST, _digest


def test_option_off_is_the_default_world_byte_for_byte(tmp_path):
    m = generate(world_config("tiny", seed=5,
                              overrides=["sizes.num_users=150", "dense_missing.rate=0.0"]),
                 tmp_path, progress=False, layout="v1")
    assert _digest(tmp_path, m) == DEFAULT_DIGEST and "dense_missing" not in m.source["config"]


def test_missing_values_follow_the_label_drivers_and_leave_the_labels_alone(tmp_path):
    over = ["sizes.num_users=400"]
    base = generate(world_config("tiny", seed=2, overrides=over), tmp_path / "a", progress=False)
    m = generate(world_config("tiny", seed=2, overrides=over + ["dense_missing.rate=0.3"]),
                 tmp_path / "b", progress=False)
    a, b = (pa.concat_tables([pq.read_table(p / f.path) for f in mm.files]) for p, mm in
            ((tmp_path / "a", base), (tmp_path / "b", m)))
    for c in ("p_click", "click", "conversion", "ad_age"):
        assert a.column(c).equals(b.column(c))
    schema = FeatureSchema.load(tmp_path / "b")
    assert [schema.dense[i].name for i in schema.dense_missing] == ["user_activity", "ad_quality"]
    p = b.column("p_click").to_numpy()
    for name in MISSING_FEATURES:
        miss = np.isnan(b.column(name).to_numpy())
        assert 0.2 < miss.mean() < 0.45
        assert p[miss].mean() > 1.3 * p[~miss].mean()  # label_beta = 1: missing rows click more
        kept = ~miss
        assert np.array_equal(b.column(name).to_numpy()[kept], a.column(name).to_numpy()[kept])
    report = validate_dataset(tmp_path / "b")
    assert not report.errors and not report.warnings and report.counts["missing.ad_quality"] > 0
    assert m.source["config"]["dense_missing"]["rate"] == 0.3
    with pytest.raises(ValueError, match="dense_missing.rate must be in"):
        world_config("tiny", 0, ["dense_missing.rate=1.0"]).validate()
