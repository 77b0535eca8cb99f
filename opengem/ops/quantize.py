"""Embedding-table compression: fp16 or int8 row-wise (scale + bias) storage, through TorchRec.

What TorchRec 1.8.0 / fbgemm-gpu-cpu 1.8.0 offer on CPU (each probed by running it):

- fp16 *training*: ``EmbeddingBagConfig`` / ``EmbeddingConfig(data_type=DataType.FP16)``. Unsharded
  modules then hold fp16 weights (outputs stay fp32, gradients are fp16), and the fused CPU TBE that
  sharding uses trains fp16 weights (``weights_precision=FP16``, EXACT_ROWWISE_ADAGRAD). Half the
  bytes, no code here: it is a table config field (see ``SparseArchConfig``).
- int8 *training*: no. Unsharded modules silently build ``DataType.INT8`` tables as fp16, and the
  fused CPU TBE's backward raises ``NotImplementedError:
  "split_embedding_backward_exact_cpu_kernel_3" not implemented for 'Byte'``.
- int8 / fp16 *serving*: ``torchrec.quant.EmbeddingBagCollection`` / ``EmbeddingCollection`` (fbgemm
  IntNBit TBE) run on CPU. An int8 row stores D bytes + an fp16 scale and bias (D + 4 bytes vs 4·D).

So int8 is an eval/serving-time compression: train fp32 (or fp16) tables, then
``quantize_tables(model, "int8")`` swaps every TorchRec table module of a trained model for
TorchRec's quantized one, in place. Its NE cost is measured in ``benchmarks/jagged.py``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.ao.quantization import PlaceholderObserver, QConfig
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.quant import embedding_modules as quant

_DTYPES = {"int8": torch.qint8, "fp16": torch.float16}
_FLOAT_TO_QUANT = {EmbeddingBagCollection: quant.EmbeddingBagCollection,
                   EmbeddingCollection: quant.EmbeddingCollection}
_TABLE_MODULES = (EmbeddingBagCollection, EmbeddingCollection, quant.EmbeddingBagCollection,
                  quant.EmbeddingCollection)


def _quantized(module: nn.Module, dtype: torch.dtype, row_alignment: int) -> nn.Module:
    module.qconfig = QConfig(activation=PlaceholderObserver.with_args(dtype=torch.float),
                             weight=PlaceholderObserver.with_args(dtype=dtype))
    quant.quant_prep_customize_row_alignment(module, [type(module)], row_alignment)
    try:
        return _FLOAT_TO_QUANT[type(module)].from_float(module)
    finally:
        del module.qconfig


@torch.no_grad()
def quantize_tables(model: nn.Module, dtype: str = "int8", row_alignment: int = 4) -> nn.Module:
    """Replace every (unsharded, CPU) TorchRec EBC / EC inside ``model`` by its quantized twin;
    in place.

    ``dtype``: int8 (row-wise: each row's min and step as fp16 scale + bias) or fp16. The swapped
    model is for eval and serving only: quantized tables have no gradients. ``row_alignment`` pads
    each stored row to a multiple of this many bytes (TorchRec's default, 16, suits GPU kernels; 4
    keeps int8 rows at D + 4 bytes).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"table dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    swaps = [(name, m) for name, m in model.named_modules() if type(m) in _FLOAT_TO_QUANT]
    for name, m in swaps:
        q = _quantized(m, _DTYPES[dtype], row_alignment)
        if not name:
            return q
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, q)
    return model


def table_bytes(model: nn.Module) -> int:
    """Bytes held by the embedding tables of ``model`` (float or quantized TorchRec modules)."""
    seen, total = set(), 0
    for m in model.modules():
        if isinstance(m, _TABLE_MODULES):
            for t in m.state_dict().values():
                key = (t.data_ptr(), tuple(t.shape)) if isinstance(t, torch.Tensor) else None
                if key is not None and key not in seen:  # tables may be views of one fused buffer
                    seen.add(key)
                    total += t.numel() * t.element_size()
    return total
