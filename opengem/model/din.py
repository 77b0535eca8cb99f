"""DIN's parts for the ``din`` peer (Zhou et al., KDD 2018, "Deep Interest Network"): a local
activation unit per behaviour stream that weighs each history event against the candidate ad, and
the plain concatenation DIN feeds its MLP. ``opengem.model.peers.PeerModel`` assembles them with
the tables, dense arch and OverArch it shares with DLRM and DLRM-DCN.

Legend: B rows, N events of one stream in the batch (jagged), D dim, n sparse tokens, A matched
attributes of a stream.

How one stream is pooled (lengths [2, 0, 1])::

    events e [e00 e01 | . | e20]   (item + event type + attributes, the peers' event model)
    query  q [q0 | q1 | q2]        the candidate in the stream's event space, one per row
    a_j = MLP([e_j, q, e_j − q, e_j ⊙ q])   scalar, no softmax (DIN keeps the intensity)
    out  [a00·e00 + a01·e01 | 0 | a20·e20]   → [B, D]

The query follows GEM's target match (``opengem.model.foundation.match_attributes``): each event
attribute named after a single-valued sparse feature of the same vocabulary (``organic.category``
↔ ``category``, ``ads.advertiser_id`` ↔ ``advertiser_id``) is where the candidate lives in the
stream; q is the sum of the stream's own attribute rows at the candidate's ids, the space the event
tokens are summed in. A stream with no such attribute has no shared table, so q there is a learned
projection of the candidate-side (``group="ad"``) sparse tokens; with none of those either, q = 0.
Where the schema declares a stream's items an impression feature's ids (``SequenceStream.matches``:
the ads stream's items are ad ids) and ``model.target_match_items`` is on, q also holds the item
table's row at the candidate's id: DIN's own query (the candidate goods id in the behaviours'
table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from opengem.data.batch import Batch
from opengem.features.schema import FeatureSchema
from opengem.model.foundation import match_attributes
from opengem.model.sparse_arch import SparseArch
from opengem.ops.jagged import row_ids

# the activation unit's widths in the DIN authors' code (zhougr1993/DeepInterestNetwork)
ATTENTION_HIDDEN = (80, 40)


def din_pool(unit: nn.Module, e_ND: torch.Tensor, q_BD: torch.Tensor,
             lengths_B: torch.Tensor) -> torch.Tensor:
    """[B, D] = Σ_{j in row b} unit(e_j, q_b) · e_j over jagged events; rows without events
    give zeros.

    The query is gathered per event by row id, so the cost is O(N) and no row sees another's events.
    """
    row = row_ids(lengths_B)
    a_N = unit(e_ND, q_BD[row])
    return e_ND.new_zeros(q_BD.shape).index_add_(0, row, a_N.unsqueeze(1) * e_ND)


class LocalActivationUnit(nn.Module):
    """a = MLP([e, q, e − q, e ⊙ q]) → [N] raw weights (PReLU hidden layers, scalar out,
    no softmax).

    Args: dim (D), hidden (widths, ``ATTENTION_HIDDEN``). ``forward(e_ND, q_ND)`` → [N].
    """

    def __init__(self, dim: int, hidden: tuple[int, ...] = ATTENTION_HIDDEN):
        super().__init__()
        layers: list[nn.Module] = []
        width = 4 * dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.PReLU(h)]
            width = h
        layers.append(nn.Linear(width, 1))
        self.mlp = nn.Sequential(*layers)

    def forward(self, e_ND: torch.Tensor, q_ND: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([e_ND, q_ND, e_ND - q_ND, e_ND * q_ND], dim=1)).squeeze(1)


class DINPooling(nn.Module):
    """One activation unit per stream over its jagged events, queried by the candidate
    (module docstring).

    Args:
        schema: streams, their attributes and the sparse features (which are candidate-side).
        streams: the stream names to pool, in order.  dim: D.

    ``forward(batch, events, x_BnD, sparse_arch)`` → [B, S, D]; ``events`` is
    ``SparseArch.forward_sequences``'s output, ``x_BnD`` its ``forward_sparse`` tokens.
    """

    def __init__(self, schema: FeatureSchema, streams: list[str], dim: int, items: bool = False):
        super().__init__()
        self.streams = streams
        self.match = {s: match_attributes(schema, s, items) for s in streams}
        self.ad_tokens = [i for i, f in enumerate(schema.sparse) if f.group == "ad"]
        self.units = nn.ModuleDict({s: LocalActivationUnit(dim) for s in streams})
        self.project = nn.ModuleDict({s: nn.Linear(len(self.ad_tokens) * dim, dim, bias=False)
                                      for s in streams if not self.match[s] and self.ad_tokens})

    def query(self, stream: str, batch: Batch, x_BnD: torch.Tensor,
              sparse_arch: SparseArch) -> torch.Tensor:
        """[B, D]: the candidate in ``stream``'s event space."""
        if self.match[stream]:
            tables, cand = sparse_arch.tables(), batch.sparse.to_dict()
            q = 0
            for col, feat, _ in self.match[stream]:
                # the stream's own hashing, if capped
                ids = cand[feat].values() % sparse_arch.rows[col]
                q = q + F.embedding(ids, tables[f"t_{stream}_{col.split('.', 1)[1]}"])
            return q
        if stream in self.project:
            return self.project[stream](x_BnD[:, self.ad_tokens].flatten(1))
        return x_BnD.new_zeros(x_BnD.shape[0], x_BnD.shape[2])

    def forward(self, batch: Batch, events: dict[str, tuple[torch.Tensor, torch.Tensor]],
                x_BnD: torch.Tensor, sparse_arch: SparseArch) -> torch.Tensor:
        pooled = []
        for s in self.streams:
            e_ND, lengths_B = events[s]
            pooled.append(din_pool(self.units[s], e_ND, self.query(s, batch, x_BnD, sparse_arch),
                                   lengths_B))
        return torch.stack(pooled, dim=1)


class ConcatInteraction(nn.Module):
    """DIN's "interaction": the dense vector and every token side by side, [B, (n + 1)·D], for
    the MLP.

    Same call as torchrec's ``InteractionArch``: ``forward(dense_BD, sparse_BnD)``.
    """

    def forward(self, dense_BD: torch.Tensor, sparse_BnD: torch.Tensor) -> torch.Tensor:
        return torch.cat([dense_BD.unsqueeze(1), sparse_BnD], dim=1).flatten(1)
