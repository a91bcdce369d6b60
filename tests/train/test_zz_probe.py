from tests.train.test_stages import *  # noqa
from tests.train.test_stages import _row_inputs

def test_probe(greedy_rollout):
    trainer, rows, out = greedy_rollout
    print("\nCOMPLETIONS", out["completion_ids"].tolist(), out["completion_mask"].tolist())
