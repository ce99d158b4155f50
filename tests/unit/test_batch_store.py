"""The batch store on its own: files, batches, results written once, and what a restarted server resumes."""
from __future__ import annotations

from tokenloom.entrypoints.openai.batch.objects import CANCELLING, COMPLETED, IN_PROGRESS, BatchRecord, new_batch_id
from tokenloom.entrypoints.openai.batch.store import BatchStore


def _batch(store: BatchStore, status: str = IN_PROGRESS, total: int = 3) -> BatchRecord:
    f = store.add_file("batch", "in.jsonl", b"{}\n" * total)
    batch = BatchRecord(new_batch_id(), "/v1/chat/completions", f.id, "24h", {"k": "v"}, status=status, total=total)
    store.save_batch(batch)
    return batch


def test_a_file_round_trips(tmp_path):
    store = BatchStore(tmp_path)
    record = store.add_file("batch", "in.jsonl", b'{"a": 1}\r\n\xff')
    assert record.id.startswith("file-") and record.bytes == 11
    assert store.get_file(record.id) == record
    assert store.file_content(record.id) == b'{"a": 1}\r\n\xff'
    api = record.to_api()
    assert api["object"] == "file" and api["purpose"] == "batch" and api["filename"] == "in.jsonl"


def test_files_are_listed_newest_first_by_purpose_and_deleted(tmp_path):
    store = BatchStore(tmp_path)
    a = store.add_file("batch", "a", b"1")
    b = store.add_file("batch_output", "b", b"2")
    c = store.add_file("batch", "c", b"3")
    assert [f.id for f in store.list_files()] == [c.id, b.id, a.id]
    assert [f.id for f in store.list_files("batch")] == [c.id, a.id]
    assert [f.id for f in store.list_files(after=c.id, limit=1)] == [b.id]
    assert store.delete_file(b.id) and not store.delete_file(b.id)
    assert store.get_file(b.id) is None and store.file_content(b.id) is None


def test_a_batch_round_trips_with_its_api_shape(tmp_path):
    store = BatchStore(tmp_path)
    batch = _batch(store)
    again = store.get_batch(batch.id)
    assert again == batch
    api = again.to_api(completed=1, failed=1)
    assert api["object"] == "batch" and api["id"].startswith("batch_") and api["status"] == IN_PROGRESS
    assert api["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert api["metadata"] == {"k": "v"} and api["errors"] is None and api["expires_at"] > api["created_at"]


def test_a_result_is_recorded_once(tmp_path):
    store = BatchStore(tmp_path)
    batch = _batch(store)
    assert store.record_result(batch.id, 1, True, "first")
    assert not store.record_result(batch.id, 1, False, "second")
    store.record_result(batch.id, 0, False, "error")
    assert store.results(batch.id) == [(0, False, "error"), (1, True, "first")]
    assert store.result_counts(batch.id) == (1, 1)
    assert store.done_indexes(batch.id) == {0, 1}


def test_a_reopened_store_resumes_the_unfinished_batches_with_their_results(tmp_path):
    store = BatchStore(tmp_path)
    running = _batch(store)
    cancelling = _batch(store, status=CANCELLING)
    _batch(store, status=COMPLETED)
    store.record_result(running.id, 2, True, "done before the restart")
    store.close()

    reopened = BatchStore(tmp_path)
    assert [b.id for b in reopened.active_batches()] == [running.id, cancelling.id]
    assert reopened.done_indexes(running.id) == {2}
    assert reopened.results(running.id) == [(2, True, "done before the restart")]


def test_only_one_process_claims_the_store(tmp_path):
    first, second = BatchStore(tmp_path), BatchStore(tmp_path)
    assert first.claim() and first.claim()
    assert not second.claim()  # flock is per open file: a second opening in one process is refused too
    first.close()
    assert second.claim()
