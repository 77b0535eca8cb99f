"""The synthetic ads world in one place: the ruler models are measured against, not the input
pipeline (that is ``opengem.data``).

    structure.py   a world's functional form, drawn from a structure seed (the family of worlds)
    latent.py      the latent side: entities, users, behaviour streams, the true click/conversion models
    generate.py    impressions and Parquet shards with their true probabilities (``WorldConfig``)
    presets.py     named world sizes (tiny, demo, small, large): ``world_config("demo", seed=1)``
    wide.py        family 2's history effects (similarity, fatigue, repeat, last-k)
    oracle.py      a world's exact-structure logistic fit: what a model's captured is divided by
    signal.py      which of a world's true terms a model has learned (per-term slopes)

What may be tuned on which world seed is ``opengem.discipline``'s, at the bottom of the house:
config, evaluation and transfer call it too, and this package sits above them.
"""
