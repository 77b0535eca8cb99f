"""SparseArch: TorchRec embedding tables built from the schema.

Legend: B rows, n sparse features, N events of one stream (jagged), D embedding dim.

- Non-sequence id features → one ``EmbeddingBagCollection`` (sum pooling; multi-hot allowed) →
  ``[B, n, D]`` tokens, in schema order.
- Sequence streams → one ``EmbeddingCollection`` with an item table and an event-type table per
  stream → jagged ``[N, D]`` (item + event type) per stream, lengths unchanged.

Every table has ``vocab + 1`` rows; the last is the OOV row that ``collate`` maps bad ids to.
The tables are the only sparse parameters of the model; ``sparse_parameters()`` names them for
the row-wise Adagrad optimizer (and for TorchRec sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection, KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType

from opengem.features.schema import FeatureSchema


@dataclass
class SparseArchConfig:
    init_std: float = 0.05
    max_rows_per_table: int = 0  # 0 = no cap; otherwise ids are hashed (mod) into this many rows


class SparseArch(nn.Module):
    def __init__(self, schema: FeatureSchema, cfg: SparseArchConfig, dim: int, device: torch.device | None = None):
        super().__init__()
        self.schema, self.cfg, self.dim = schema, cfg, dim
        D = dim
        self.rows = {f.name: self._rows(f.vocab_size) for f in schema.sparse}
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t_{f.name}", embedding_dim=D, num_embeddings=self.rows[f.name],
                                   feature_names=[f.name], pooling=PoolingType.SUM)
                for f in schema.sparse
            ],
            device=device,
        ) if schema.sparse else None
        seq_tables = []
        for s in schema.sequences:
            self.rows[s.item_column] = self._rows(s.item_vocab_size)
            self.rows[s.event_column] = s.num_event_types + 1
            seq_tables += [
                EmbeddingConfig(name=f"t_{s.name}_item", embedding_dim=D, num_embeddings=self.rows[s.item_column],
                                feature_names=[s.item_column]),
                EmbeddingConfig(name=f"t_{s.name}_event", embedding_dim=D, num_embeddings=self.rows[s.event_column],
                                feature_names=[s.event_column]),
            ]
        self.ec = EmbeddingCollection(tables=seq_tables, device=device) if seq_tables else None

    def _rows(self, vocab: int) -> int:
        cap = self.cfg.max_rows_per_table
        return vocab + 1 if not cap or vocab + 1 <= cap else cap

    @property
    def num_sparse(self) -> int:
        return len(self.schema.sparse)

    def init_weights(self) -> None:
        for p in self.sparse_parameters():
            nn.init.normal_(p, std=self.cfg.init_std)

    def sparse_parameters(self) -> list[nn.Parameter]:
        return [p for m in (self.ebc, self.ec) if m is not None for p in m.parameters()]

    def _hash(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Fold ids into capped tables (only when ``max_rows_per_table`` is set)."""
        if not self.cfg.max_rows_per_table:
            return kjt
        mods = torch.tensor([self.rows[k] for k in kjt.keys()], device=kjt.values().device)
        per_value = torch.repeat_interleave(mods, torch.tensor(kjt.length_per_key(), device=mods.device))
        return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % per_value, lengths=kjt.lengths())

    def forward_sparse(self, sparse: KeyedJaggedTensor, batch_size: int) -> torch.Tensor:
        """[B, n, D] pooled embeddings of the non-sequence id features."""
        if self.ebc is None:
            return torch.zeros(batch_size, 0, self.dim)
        kt = self.ebc(self._hash(sparse))
        return kt.values().view(batch_size, self.num_sparse, self.dim)

    def forward_sequences(self, sequences: KeyedJaggedTensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """stream → (values [N, D] = item + event-type embedding, lengths [B])."""
        if self.ec is None:
            return {}
        out = self.ec(self._hash(sequences))
        res = {}
        for s in self.schema.sequences:
            item, event = out[s.item_column], out[s.event_column]
            res[s.name] = (item.values() + event.values(), item.lengths())
        return res
