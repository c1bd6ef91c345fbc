"""`estimated_completion` reads the store's queue and throughput at most once per `TTL_S` per
gateway: a client creating or polling simple batches in a loop cannot make every call a pair of
store reads. A real SQLite batch store; the estimator's clock is the test's."""

from __future__ import annotations

from pathlib import Path

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.config import BatchConfig
from gateway.batch.estimate import TTL_S, Estimator
from gateway.batch.rows import NewRequest
from tests.batch.test_store import batch


async def test_the_figures_are_reused_for_their_ttl(tmp_path: Path) -> None:
    store = SqliteBatchStore(tmp_path / "batch.sqlite3")
    clock = [0.0]
    config = BatchConfig(data_dir=tmp_path, concurrency=1, default_request_s=2.0)
    est = Estimator(store, config, clock=lambda: clock[0])
    try:
        assert await est.completion(1, 100.0) == 102.0  # nothing queued: its own line
        reqs = [NewRequest(line=i + 1, custom_id=f"c{i}", body="{}") for i in range(5)]
        await store.create_batch(batch("batch_1", 0.0), reqs)
        clock[0] = TTL_S / 2
        assert await est.completion(1, 100.0) == 102.0  # within the TTL: the store not asked
        clock[0] = TTL_S
        assert await est.completion(1, 100.0) == 112.0  # 5 queued ahead, then its own
    finally:
        store.close()
