"""Benchmarks of the library, run by hand or by ``opengem bench``; nothing in the pipeline imports them.

    levers.py   where a training step's time goes, each speed/memory lever on/off, the loader alone
    ops.py      the ops alone: jagged vs padded attention, FP8 saved activations, compressed tables
    race.py     GEM against TorchRec's DLRM-DCN: time to quality, on the trainer's own loop
    gbdt.py     the LightGBM peer on GEM's rows and evaluator (``run_gbdt``; needs the ``bench`` extra)
    quick.py    ``opengem bench --quick``: the headline figures of the three
"""
