"""SparseArch: TorchRec embedding tables built from the schema.

Legend: B rows, n sparse features, N events of one stream (jagged), D embedding dim.

- Non-sequence id features → one ``EmbeddingBagCollection`` (sum pooling; multi-hot allowed) →
  ``[B, n, D]`` tokens, in schema order.
- Sequence streams → one ``EmbeddingCollection`` with an item table, an event-type table and one
  table per event attribute of each stream → jagged ``[N, D]`` (their sum: the event model of
  Meta's event-based features) per stream, lengths unchanged.

Every table has ``vocab + 1`` rows; the last is the OOV row that ``collate`` maps bad ids to.
The tables are the only sparse parameters of the model; ``sparse_parameters()`` names them for
the row-wise Adagrad optimizer (and for TorchRec sharding).

Frequency admission (``min_count`` k > 0, for the features ``min_count_features`` names, ``user_id``
by default): an id looks up its own row only once training has seen it k times; before that, and at
serving for ids training saw fewer than k times, it reads the shared OOV row. Why: on a world with
~5 training impressions per user a per-user table memorises the few labels of each row and the model
peaks after one epoch (docs/experiments.md, "Id admission"); the rare ids' labels train the OOV row
instead, which is also what a new user gets at serving. The counts are a buffer (``seen_<feature>``,
in the state dict), counted in training mode only, before each batch's own rows are added, so a
checkpoint, an evaluation and the exported predictor all map ids as the model was trained. It is the
streaming form of "count on the train split" (GEM trains online, one pass): over several epochs the
counts keep growing, so an id with n rows an epoch is admitted during epoch ⌈k/n⌉. One process
counts its own rows: under data parallelism each rank would admit on its own sightings (not used
there yet).
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
    # k: ids seen < k times in training read the OOV row (module docstring); 0 = off
    min_count: int = 0
    # the features admission applies to (absent ones skipped)
    min_count_features: tuple[str, ...] = ("user_id",)


_INIT_BLOCK = 4096


def table_init_slice(table: str, seed: int, std: float, r0: int, r1: int, c0: int, c1: int,
                     dim: int) -> torch.Tensor:
    """Rows [r0, r1) × columns [c0, c1) of table ``table``'s initial weights, N(0, std²).

    Values are drawn in blocks of 4,096 rows from generators seeded by (seed, table, block), so any
    shard (row-, column- or table-wise) computes its own slice without the whole table, and a
    sharded model starts bit-identical to a single-process one.
    """
    import zlib

    out = []
    for block in range(r0 // _INIT_BLOCK,
                       (r1 - 1) // _INIT_BLOCK + 1 if r1 > r0 else r0 // _INIT_BLOCK):
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(table.encode())) * 65_537
                                          + block)
        vals = torch.randn(_INIT_BLOCK, dim, generator=g) * std
        lo, hi = max(r0, block * _INIT_BLOCK), min(r1, (block + 1) * _INIT_BLOCK)
        out.append(vals[lo - block * _INIT_BLOCK : hi - block * _INIT_BLOCK, c0:c1])
    return torch.cat(out) if out else torch.zeros(0, c1 - c0)


class SparseArch(nn.Module):
    """The model's embedding tables, built from the schema (module docstring).

    Args:
        schema: one pooled table per sparse feature; per stream an item, an event-type and one
            table per event attribute.
        cfg: ``SparseArchConfig`` (``model.sparse.*``): init std, optional cap on rows per table.
        dim: D, every table's width.
        device: where the tables are built (``meta`` before sharding).

    Shapes: ``forward_sparse(kjt, B)`` → [B, n, D] (sum-pooled, schema order; a multi-hot feature
    sums its ids); ``forward_sequences(kjt)`` → stream → (values [N, D], lengths [B]), the sum of
    each event's item, event-type and attribute rows, jagged as it came::

        sequences["ads.item"]  lengths [2, 0, 1]  values [i0, i1, i2]
        → ads: values [3, D] = (item + event + attributes) of i0, i1, i2, lengths [2, 0, 1]
    """

    def __init__(self, schema: FeatureSchema, cfg: SparseArchConfig, dim: int,
                 device: torch.device | None = None):
        super().__init__()
        self.schema, self.cfg, self.dim = schema, cfg, dim
        D = dim
        self.rows = {f.name: self._rows(f.vocab_size) for f in schema.sparse}
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t_{f.name}", embedding_dim=D,
                                   num_embeddings=self.rows[f.name],
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
                EmbeddingConfig(name=f"t_{s.name}_item", embedding_dim=D,
                                num_embeddings=self.rows[s.item_column],
                                feature_names=[s.item_column]),
                EmbeddingConfig(name=f"t_{s.name}_event", embedding_dim=D,
                                num_embeddings=self.rows[s.event_column],
                                feature_names=[s.event_column]),
            ]
            for a in s.attributes:
                col = s.attribute_column(a)
                self.rows[col] = self._rows(a.vocab_size)
                seq_tables.append(EmbeddingConfig(name=f"t_{s.name}_{a.name}", embedding_dim=D,
                                                  num_embeddings=self.rows[col],
                                                  feature_names=[col]))
        self.ec = EmbeddingCollection(tables=seq_tables, device=device) if seq_tables else None
        self.admitted = self._admission_features(schema, cfg)
        # on the CPU even on meta: the parallel init copies a reference's values
        for f in self.admitted:
            self.register_buffer(f"seen_{f}", torch.zeros(self.rows[f], dtype=torch.int32))

    @staticmethod
    def _admission_features(schema: FeatureSchema, cfg: SparseArchConfig) -> list[str]:
        if cfg.min_count < 0:
            raise ValueError(f"model.sparse.min_count must be >= 0, got {cfg.min_count}")
        if not cfg.min_count:
            return []
        seq = {c for s in schema.sequences for c in (s.item_column, s.event_column)}
        bad = [f for f in cfg.min_count_features if f in seq or "." in f]
        if bad:
            raise ValueError(f"model.sparse.min_count_features names non-sequence sparse "
                             f"features; {bad} are "
                             "sequence columns")
        return [f.name for f in schema.sparse if f.name in cfg.min_count_features]

    def _rows(self, vocab: int) -> int:
        cap = self.cfg.max_rows_per_table
        return vocab + 1 if not cap or vocab + 1 <= cap else cap

    def tables(self) -> dict[str, torch.Tensor]:
        """table name → weight [rows, D] (unsharded modules only)."""
        out = {}
        if self.ebc is not None:
            out.update({n: m.weight for n, m in self.ebc.embedding_bags.items()})
        if self.ec is not None:
            out.update({n: m.weight for n, m in self.ec.embeddings.items()})
        return out

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic per-table init: the same values whatever the sharding
        (see ``table_init_slice``)."""
        for name, w in self.tables().items():
            w.copy_(table_init_slice(name, seed, self.cfg.init_std, 0, w.shape[0], 0, w.shape[1],
                                     w.shape[1]))
        for f in self.admitted:
            getattr(self, f"seen_{f}").zero_()

    def sparse_parameters(self) -> list[nn.Parameter]:
        return [p for m in (self.ebc, self.ec) if m is not None for p in m.parameters()]

    def _hash(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Fold ids into capped tables (only when ``max_rows_per_table`` is set)."""
        if not self.cfg.max_rows_per_table:
            return kjt
        mods = torch.tensor([self.rows[k] for k in kjt.keys()], device=kjt.values().device)  # noqa: SIM118 (a KJT, not a dict)
        per_value = torch.repeat_interleave(mods,
                                            torch.tensor(kjt.length_per_key(), device=mods.device))
        return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values() % per_value,
                                 lengths=kjt.lengths())

    def seen(self, feature: str) -> torch.Tensor:
        """How often training has seen each row of ``feature`` (an admitted feature), [rows]."""
        return getattr(self, f"seen_{feature}")

    def _admit(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Ids of admitted features that training saw < k times → the OOV (last) row; in training
        mode the batch's ids are then counted (module docstring). With ``max_rows_per_table`` the
        counts are per hashed row and the last row is also a hashed id's."""
        if not self.admitted:
            return kjt
        values, keys = kjt.values().clone(), kjt.keys()
        offsets = kjt.offset_per_key()
        for f in self.admitted:
            i = keys.index(f)
            ids = values[offsets[i]:offsets[i + 1]]
            seen = self.seen(f)
            rare = seen[ids.to(seen.device)].to(ids.device) < self.cfg.min_count
            if self.training:
                seen.index_add_(0, ids.to(seen.device),
                                torch.ones_like(ids, dtype=seen.dtype, device=seen.device))
            values[offsets[i]:offsets[i + 1]] = torch.where(rare,
                                                            torch.full_like(ids, self.rows[f] - 1),
                                                            ids)
        return KeyedJaggedTensor(keys=keys, values=values, lengths=kjt.lengths())

    def forward_sparse(self, sparse: KeyedJaggedTensor, batch_size: int) -> torch.Tensor:
        """[B, n, D] pooled embeddings of the non-sequence id features."""
        if self.ebc is None:
            return torch.zeros(batch_size, 0, self.dim)
        # by name: a sharded EBC may reorder features
        per_feature = self.ebc(self._admit(self._hash(sparse))).to_dict()
        return torch.stack([per_feature[f.name] for f in self.schema.sparse], dim=1)

    def lookup_sequence_ids(self, ids: KeyedJaggedTensor) -> dict:
        """column → JaggedTensor of ``ids``' rows in the sequence tables (``ids`` keyed as the
        batch's sequences)."""
        return self.ec(self._hash(ids))

    def forward_sequences(
        self, sequences: KeyedJaggedTensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """stream → (values [N, D] = item + event-type + attribute embeddings, lengths [B])."""
        if self.ec is None:
            return {}
        out = self.lookup_sequence_ids(sequences)
        res = {}
        for s in self.schema.sequences:
            item = out[s.item_column]
            values = item.values() + out[s.event_column].values()
            for a in s.attributes:
                values = values + out[s.attribute_column(a)].values()
            res[s.name] = (values, item.lengths())
        return res
