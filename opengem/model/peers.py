"""Peer baselines: TorchRec's DLRM and DLRM-DCN, and DIN, on our batches, trained by our
trainer unchanged.

Legend: B rows, n sparse tokens (n_f sparse features + S streams + 1 domain), F dense features,
D dim, T tasks, N events of one stream (jagged).

    batch.sparse    ─► SparseArch (EBC, ours)          ─► [B, n_f, D] ┐
    batch.sequences ─► SparseArch (EC, ours) ─► pool/row ─► [B, S, D]  ├─ sparse [B, n, D] ┐
    batch.domain    ─► domain embedding                 ─► [B, 1, D]  ┘                   ├─►
    batch.dense ─► DenseNormalizer ─► DenseArch (torchrec)   ─► [B, D] ───────────────────────┘
        ─► InteractionArch (dlrm: dot products)  | InteractionDCNArch (dlrm_dcn: low-rank DCN-v2)
           | ConcatInteraction (din: the concatenation)
        ─► OverArch (torchrec) + out_b[domain] ─► [B, T] raw logits ─► chaining ─► logits [B, T]

pool/row is the mean of a row's events (dlrm, dlrm_dcn) or DIN's candidate-weighted sum (din,
``opengem.model.din``). ``model.arch`` = ``dlrm`` | ``dlrm_dcn`` | ``din`` selects one
(``build_gem`` dispatches; ``gem`` is GEM). The parts are torchrec.models.dlrm's own ``DenseArch``,
``InteractionArch``, ``InteractionDCNArch`` and ``OverArch``; only the inputs and outputs
are adapted:

- Tables: our ``SparseArch``, so sharding plans, the row-wise Adagrad table optimizer, table
  init and id hashing are the same as GEM's.
- Sequences: DLRM has no sequence model. Each behaviour stream enters as ONE token: the mean over
  the row's events of their embeddings (item + event type + attributes + the Linear of the
  per-event values, the same event model GEM's towers start from; an empty history gives zeros) —
  how DLRM users feed a history (a mean-pooled embedding bag). The history cap is GEM's
  (``max_seq_len``). ``model.use_sequences=false`` drops them.
- DIN: the same event tokens, pooled per stream by a local activation unit against the candidate
  (``opengem.model.din``: the query is GEM's target-match rule), then every token and the dense
  vector concatenated into the OverArch, as DIN feeds its MLP.
- Domain: one more sparse token (GEM's ``heads.domain_mode=shared`` reading of the surface).
- Dense: torchrec's ``DenseArch`` [F + E → 4D → D] on GEM's ``DenseNormalizer`` of the values, the
  schema's embedding features (E floats, e.g. an ad's content vector) concatenated raw after them,
  so the peers read what GEM reads; with neither it reads a constant 1 (a learned vector), since
  DLRM's interaction needs one.
- Tasks: one ``OverArch`` [in → heads.trunk_dims → heads.task_dims → T] (GEM's head widths) with
  one output per task; a task that ``requires`` another is chained as GEM's heads chain it
  (``heads.chain_required``): p(conversion) = p(click) · σ(own logit) ≤ p(click), trained on all
  impressions. Output biases start at the base rates, as GEM's do.
- Corrections: ``out_b`` [G, T] (G domains), a per-(domain, task) bias added to each row's own
  logits, 0 as trained (the OverArch's bias is per task: the architecture is DLRM's). The
  down-sampling correction and ``opengem recalibrate``'s offsets are folded into it, the Platt
  slopes into the OverArch's output layer (``scale_``), as GEM's are into its heads
  (``opengem.model.logit_shift.LogitOutput``): every stage compares the models corrected alike. A
  buffer, not a parameter (nothing trains it), but in the state dict, so a model's weights carry
  its corrections wherever they go.
- DLRM-DCN: torchrec's ``LowRankCrossNet`` with ``DCN_LAYERS`` layers of rank
  ``DCN_RANK_PER_DIM × D`` over the (n + 1)·D concatenation.

Single process only: ``opengem.parallel`` shards and wraps GEM's blocks by name (InterFormer,
heads), so a peer under torchrun stops with a clear error at the first such access (see
``interformer`` below). Export (``ServingGEM``) handles GEM only, too.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn
from torchrec.models.dlrm import DenseArch, InteractionArch, InteractionDCNArch, OverArch, choose
from torchrec.modules.crossnet import LowRankCrossNet

from opengem.data.batch import Batch
from opengem.features.schema import FeatureSchema
from opengem.model.dense_norm import DenseNormalizer
from opengem.model.din import ConcatInteraction, DINPooling
from opengem.model.foundation import GEMConfig, TableModel, event_values
from opengem.model.heads import base_rate_logits, chained_logit
from opengem.model.sparse_arch import SparseArch
from opengem.ops.jagged import row_ids

PEER_ARCHS = ("dlrm", "dlrm_dcn", "din")
DCN_LAYERS = 3  # torchrec's DLRM-DCN reference setting (torchrec/examples dlrm_main: 3 layers)
DCN_RANK_PER_DIM = 2  # low rank = 2·D


def mean_pool(values_ND: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """[B, D] mean of each row's jagged values; rows without events give zeros.

    lengths [2, 0, 1], values [v0 v1 | | v2] → [(v0+v1)/2, 0, v2].
    """
    B = lengths_B.numel()
    sums = values_ND.new_zeros(B, values_ND.shape[1]).index_add_(0, row_ids(lengths_B), values_ND)
    return sums / lengths_B.clamp(min=1).unsqueeze(1).to(values_ND.dtype)


class PeerModel(TableModel):
    """DLRM, DLRM-DCN or DIN (``cfg.arch``) with GEM's interface: ``forward(batch)`` → logits
    [B, T].

    Args:
        schema: the data's features and tasks.  cfg: the same ``GEMConfig`` a GEM run uses
            (``arch``, ``embedding_dim``, ``sparse``, ``heads``, ``use_sequences``, ``max_seq_len``).
        device: where to build (``meta`` for the trainer's build → materialise → init path).
    """

    def __init__(self, schema: FeatureSchema, cfg: GEMConfig,
                 device: torch.device | str | None = None):
        super().__init__()
        cfg.validate()
        if cfg.arch not in PEER_ARCHS:
            raise ValueError(f"PeerModel builds {PEER_ARCHS}, got model.arch={cfg.arch!r}")
        self.schema, self.cfg = schema, cfg
        D = cfg.embedding_dim
        device = torch.device(device) if device is not None else None
        self.streams = [s.name for s in schema.sequences] if cfg.use_sequences else []
        n = len(schema.sparse) + len(self.streams) + 1
        with torch.device(device) if device is not None else nullcontext():
            self.sparse_arch = SparseArch(schema, cfg.sparse, D, device)
            self.domain_emb = nn.Embedding(schema.num_domains, D)
            norm = DenseNormalizer(len(schema.dense), cfg.dense_norm, missing=schema.dense_missing)
            self.dense_arch = DenseArch(max(norm.out_features + schema.embedding_dim, 1),
                                        [4 * D, D])
            self.dense_norm = norm  # GEM's, so peers see the same inputs
            self.pool = (DINPooling(schema, self.streams, D, cfg.target_match_items)
                         if cfg.arch == "din" and self.streams else None)
            self.inter_arch, self.feature_dim = self._interaction(cfg.arch, n, D)
            hidden = [*cfg.heads.trunk_dims, *cfg.heads.task_dims] or [4 * D]
            self.over_arch = OverArch(self.feature_dim, [*hidden, len(schema.tasks)])
            self.register_buffer("out_b", torch.zeros(schema.num_domains, len(schema.tasks)))
            # last, and only when a stream has per-event values: GEM's event model (the values'
            # Linear added to each event token), so the peers read what GEM reads
            self.event_values = event_values(schema, self.streams, D)
        self.parent = [schema.task_names.index(t.requires)
                       if (t.requires and cfg.heads.chain_required) else -1
                       for t in schema.tasks]

    @staticmethod
    def _interaction(arch: str, n: int, D: int) -> tuple[nn.Module, int]:
        """The interaction over the dense vector and n tokens, and its output width."""
        if arch == "dlrm":
            return InteractionArch(num_sparse_features=n), D + choose(n + 1, 2)
        if arch == "dlrm_dcn":
            cross = LowRankCrossNet((n + 1) * D, DCN_LAYERS, DCN_RANK_PER_DIM * D)
            return InteractionDCNArch(num_sparse_features=n, crossnet=cross), (n + 1) * D
        return ConcatInteraction(), (n + 1) * D

    @property
    def interformer(self) -> nn.Module:
        # opengem.parallel (FSDP units, activation checkpointing, compile) and export start here
        raise NotImplementedError(
            f"model.arch={self.cfg.arch} is a single-process peer baseline: opengem.parallel "
            f"and export "
            "handle GEM's blocks (InterFormer, heads) only; train it without torchrun, or "
            "use model.arch=gem")

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, base_rates: list[float] | None = None, seed: int = 0) -> None:
        """(Re)initialise every parameter (and the dot interaction's index buffer, which
        ``to_empty`` leaves undefined); call after ``to_empty`` when built on meta."""
        tables = {id(m) for m in self.sparse_arch.modules()}
        for m in self.modules():
            if m is self or id(m) in tables:
                continue
            if isinstance(m, LowRankCrossNet):  # torchrec initialises it in __init__ only
                for w in [*m.W_kernels, *m.V_kernels]:
                    nn.init.xavier_normal_(w)
                for b in m.bias:
                    nn.init.zeros_(b)
            elif hasattr(m, "reset_parameters"):
                m.reset_parameters()
        if isinstance(self.inter_arch, InteractionArch):
            F = self.inter_arch.F
            self.inter_arch.triu_indices = torch.triu_indices(F + 1, F + 1, offset=1,
                                                              device=self.domain_emb.weight.device)
        self.sparse_arch.init_weights(seed)
        self.out_b.zero_()  # no correction: the model as trained
        if base_rates is not None:
            self._init_bias(base_rates)

    def _init_bias(self, base_rates: list[float]) -> None:
        """Output biases at each task's base rate (conditional rate for chained tasks),
        as ``Heads``."""
        bias = self.over_arch.model[-1].bias
        for t, b in enumerate(base_rate_logits(base_rates, self.parent, self.schema.task_names)):
            bias[t] = b

    # ------------------------------------------------------------------ forward
    def features(self, batch: Batch) -> torch.Tensor:
        """[B, feature_dim]: the interaction output the OverArch reads."""
        B = batch.batch_size
        tokens = [self.sparse_arch.forward_sparse(batch.sparse, B)]
        if self.streams:
            emb = self.sparse_arch.forward_sequences(batch.sequences)
            if self.event_values is not None:
                emb = self.event_values.add(emb, batch)
            if self.pool is not None:
                tokens.append(self.pool(batch, emb, tokens[0], self.sparse_arch))
            else:
                tokens += [mean_pool(*emb[name]).unsqueeze(1) for name in self.streams]
        tokens.append(self.domain_emb(batch.domain).unsqueeze(1))
        parts = [self.dense_norm(batch.dense)] if self.schema.dense else []
        if self.schema.embeddings:
            parts.append(batch.embeddings.to(batch.dense.dtype))
        dense = torch.cat(parts, dim=1) if parts else batch.dense.new_ones(B, 1)
        return self.inter_arch(self.dense_arch(dense), torch.cat(tokens, dim=1))

    def raw_logits(self, batch: Batch) -> torch.Tensor:
        """[B, T] each task's own logit before chaining, its row's ``out_b`` added."""
        raw = self.over_arch(self.features(batch))
        return raw + self.out_b[self.output_group(batch.domain)].to(raw.dtype)

    def output_group(self, domain_B: torch.Tensor) -> torch.Tensor:
        """Which row of ``out_b`` each row uses: its domain."""
        return domain_B

    def chain(self, raw_BT: torch.Tensor) -> torch.Tensor:
        """[B, T] final logits: a chained task's is logit(p(parent) · p(task | parent))."""
        out: list[torch.Tensor] = []
        for t, p in enumerate(self.parent):
            out.append(raw_BT[:, t] if p < 0 else chained_logit(out[p], raw_BT[:, t]))
        return torch.stack(out, dim=1)

    @torch.no_grad()
    def scale_(self, a_T: torch.Tensor) -> None:
        """Each task's own logit times ``a_T`` [T], in place: the OverArch's output row and bias of
        that task, and its ``out_b`` (a Platt slope, ``opengem.model.logit_shift.fold_offsets``)."""
        last = self.over_arch.model[-1]
        last.weight.mul_(a_T.to(last.weight.dtype)[:, None])
        last.bias.mul_(a_T.to(last.bias.dtype))
        self.out_b.mul_(a_T.to(self.out_b.dtype)[None, :])

    def forward(self, batch: Batch) -> torch.Tensor:
        """logits [B, T] in schema task order."""
        return self.chain(self.raw_logits(batch))
