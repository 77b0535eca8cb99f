"""The serving program's embedding tables: fp32, or compressed (``opengem export
--table-dtype fp16|int8``).

Legend: R rows of a table, D dim, V ids looked up, B bags (rows of a pooled feature).

Every table of the program is a ``PackedTable``: its rows as a buffer, gathered by id and, for a
pooled feature, summed per bag with ``index_add`` (TorchRec's SUM pooling). fp32 rows are the
trained model's own. Compressed rows are quantised by TorchRec
(``opengem.ops.quantize.quantize_tables``: fbgemm's int8 row-wise format, one fp16 scale and bias
per row, or fp16), and the program reads those bytes as they are, dequantising only the rows a
request looks up (``q · scale + bias`` in float32, fbgemm's own arithmetic). So the program, the
AOTInductor package and ``weights.pt`` all carry the compressed rows.

Why a gather rather than the modules' own kernels: ``nn.EmbeddingBag`` stays an ATen call in the
AOTInductor library (about 30 µs each on one core for the VM's dozen tables, benchmarks/serving.py),
while a gather and a sum compile into the graph's own loops. The ``torchrec.quant`` modules take a
KeyedJaggedTensor (the data-dependent path the program avoids, see ``opengem.export.program``) and
call fbgemm's IntNBit TBE, a custom op AOTInductor would have to call back into (not tried). The
eager model with the ``torchrec.quant`` modules stays the reference the export checks the program
against (``opengem.export.artifact.parity``), and ``tests/unit/export/test_quantized_export.py``
checks the packed rows against those modules.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.embedding_configs import PoolingType
from torchrec.quant import embedding_modules as quant

from opengem.ops.quantize import quantize_tables, table_bytes

TABLE_DTYPES = ("fp32", "fp16", "int8")


class PackedTable(nn.Module):
    """One table's quantised rows; dequantises the rows it gathers.

    Args:
        rows: uint8 [R, D] (int8 row-wise) or float16 [R, D].
        scale_bias: float16 [R, 2] per-row (scale, bias) for int8; None for fp16.

    ``bag`` sums rows per bag given offsets [B + 1] (TorchRec's SUM pooling)::

        values = [4 9 2]  offsets = [0 2 2 3]   →   [row4 + row9, 0, row2]
    """

    def __init__(self, rows: torch.Tensor, scale_bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("rows", rows)
        self.register_buffer("scale_bias", scale_bias)

    def forward(self, ids_V: torch.Tensor) -> torch.Tensor:
        """[V, D] float32."""
        r_VD = self.rows[ids_V].float()
        if self.scale_bias is None:
            return r_VD
        sb_V2 = self.scale_bias[ids_V].float()
        return r_VD * sb_V2[:, :1] + sb_V2[:, 1:]

    def bag(self, values_V: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """[B, D] float32: the sum of each bag's rows (an empty bag is zeros)."""
        bag_of_V = torch.searchsorted(offsets[1:],
                                      torch.arange(values_V.shape[0], device=values_V.device),
                                      right=True)
        out_BD = torch.zeros(offsets.shape[0] - 1, self.rows.shape[1], dtype=torch.float32,
                             device=values_V.device)
        return out_BD.index_add_(0, bag_of_V, self(values_V))


def packed_tables(sparse_arch: nn.Module) -> nn.ModuleDict:
    """The tables of a SparseArch (float TorchRec modules, or ``torchrec.quant`` ones) as
    ``PackedTable``s; float rows are shared with the model, not copied."""
    out = nn.ModuleDict()
    for qm in (sparse_arch.ebc, sparse_arch.ec):
        if qm is None:
            continue
        if isinstance(qm, (EmbeddingBagCollection, EmbeddingCollection)):
            if isinstance(qm, EmbeddingBagCollection) and any(c.pooling != PoolingType.SUM
                                                              for c in qm.embedding_bag_configs()):
                raise ValueError("packed tables implement SUM pooling only (SparseArch's)")
            mods = qm.embedding_bags if isinstance(qm, EmbeddingBagCollection) else qm.embeddings
            out.update({name: PackedTable(m.weight.detach()) for name, m in mods.items()})
            continue
        bags = isinstance(qm, quant.EmbeddingBagCollection)
        configs = qm.embedding_bag_configs() if bags else qm.embedding_configs()
        if bags and any(c.pooling != PoolingType.SUM for c in configs):
            raise ValueError("packed tables implement SUM pooling only (SparseArch's)")
        weights = [w for tbe in qm._emb_modules
                   for w in tbe.split_embedding_weights(split_scale_shifts=True)]
        if len(weights) != len(configs):
            raise ValueError(f"{len(configs)} table configs but {len(weights)} fbgemm tables")
        for cfg, (w, sb) in zip(configs, weights):
            rows = w.contiguous() if sb is not None else w.contiguous().view(torch.float16)
            scale_bias = sb.contiguous().view(torch.float16).clone() if sb is not None else None
            out[cfg.name] = PackedTable(rows[:, :cfg.embedding_dim].clone(), scale_bias)
    return out


def compress(model: nn.Module, dtype: str) -> nn.Module:
    """``model`` with its TorchRec tables quantised to ``dtype`` by TorchRec, in place
    (fp32: unchanged)."""
    if dtype not in TABLE_DTYPES:
        raise ValueError(f"table dtype must be one of {TABLE_DTYPES}, got {dtype!r}")
    return model if dtype == "fp32" else quantize_tables(model, dtype)


def without_tables(gem: nn.Module) -> nn.Module:
    """A copy of ``gem`` without its TorchRec table modules (so the program does not carry
    them twice).

    The memo maps the two table modules to None: deepcopy then neither copies them nor keeps them.
    """
    sa = gem.sparse_arch
    return copy.deepcopy(gem, memo={id(sa.ebc): None, id(sa.ec): None})


def tables_info(model: nn.Module, dtype: str, fp32_bytes: int) -> dict:
    return {"dtype": dtype, "bytes": table_bytes(model), "fp32_bytes": fp32_bytes}
