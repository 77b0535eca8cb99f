"""Row selection and history caps on jagged batches."""

import torch
from _transfer import make_batch
from torchrec import KeyedJaggedTensor

from opengem.transfer.stream import cap_history, select_kjt, select_rows


def test_select_kjt_by_hand():
    # key a: rows [0 1 | - | 2 3 4], key b: rows [5 | 6 | -]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["a", "b"], values=torch.arange(7),
                                              lengths=torch.tensor([2, 0, 3, 1, 1, 0]))
    out = select_kjt(kjt, torch.tensor([2, 0]))
    assert out.lengths().tolist() == [3, 2, 0, 1]
    assert out.values().tolist() == [2, 3, 4, 0, 1, 5]


def test_select_rows_matches_collating_those_rows(schema):
    b = make_batch(schema, 10)
    rows = torch.tensor([1, 4, 7])
    s = select_rows(b, rows)
    assert (
        s.batch_size == 3
        and torch.equal(s.dense, b.dense[rows])
        and torch.equal(s.user_id, b.user_id[rows])
    )
    full, part = b.sequences.to_dict(), s.sequences.to_dict()
    for k in full:
        want = [full[k].to_dense()[i].tolist() for i in rows.tolist()]
        assert [x.tolist() for x in part[k].to_dense()] == want


def test_cap_history_keeps_the_newest_events(schema):
    b = make_batch(schema, 6)
    c = cap_history(b, schema, {"s0": 3})
    full, cut = b.sequences.to_dict(), c.sequences.to_dict()
    for k in ("s0.item", "s0.event", "s0.category"):
        for x, y in zip(full[k].to_dense(), cut[k].to_dense()):
            assert y.tolist() == x.tolist()[-3:]
    assert torch.equal(full["s1.item"].values(), cut["s1.item"].values())  # other streams untouched
    assert c.seq_age.to_dict()["s0"].lengths().max() <= 3
