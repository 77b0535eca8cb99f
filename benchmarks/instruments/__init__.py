"""The instruments: research and benchmarking code beside the library, imported by the scripts in
``benchmarks/`` (run as ``python benchmarks/X.py``, so this folder is on ``sys.path``) and by
``opengem bench``. The dependency runs one way: these import ``opengem``, nothing in ``opengem``
imports them.

    levers.py          where a training step's time goes, each speed/memory lever on/off, the loader alone
    ops.py             the ops alone: GEM's attention jagged vs padded, FP8 saved activations, compressed tables
    race.py            GEM against TorchRec's DLRM-DCN: time to quality, on the trainer's own loop
    tune.py            the learning-rate search every model gets alike (valid only)
    gbdt.py            the LightGBM peer on GEM's rows and evaluator (needs the ``bench`` extra)
    linear.py          the logistic-regression peer (one-hot ids, crosses, history counters)
    stack.py           a trained run blended with the regression, the weight chosen on valid
    transfer_sweep.py  the transfer sweep behind ``benchmarks/transfer.py``
    layout.py          bytes of a dataset's layouts
    quick.py           ``opengem bench --quick``: the headline figures
"""
