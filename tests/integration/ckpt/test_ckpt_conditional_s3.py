"""Conditional writes on a real S3 endpoint (moto server over HTTP, via s3fs): the commit and the
fence are compare-and-swaps there too (reliability review F1, F2), and the append log keeps
metrics.jsonl linear (F20).

The unit regressions of tests/unit/ckpt run here unchanged with `url` pointing at S3.
"""

from __future__ import annotations

import pytest

from checkpointing.appendlog import PARTS_SUFFIX, AppendLog, read_log
from checkpointing.storage import PreconditionFailed, Storage
from test_ckpt_lease import (  # noqa: F401 - collected here with the S3 `url`
    test_a_dead_runs_storage_is_taken_over_once_stale_and_the_old_run_is_then_fenced_out,
    test_a_second_run_on_a_live_runs_storage_is_refused_with_a_typed_error_naming_it,
    test_two_runs_starting_at_once_cannot_both_win,
)
from test_ckpt_reliability import (  # noqa: F401 - collected here with the S3 `url`
    test_f1_a_commit_whose_put_response_was_lost_and_retried_is_a_success,
    test_f1_a_fenced_writers_retention_does_not_delete_the_new_generations_save_in_progress,
    test_f1_fence_history_rejects_a_fenced_writers_commit_past_the_new_start_step,
    test_f1_fence_update_is_a_compare_and_swap,
    test_f1_late_commit_of_a_fenced_writer_cannot_replace_the_newer_generations_manifest,
    test_f1_newer_generation_and_same_generation_recommit_of_a_step_still_work,
    test_f2_two_controllers_cannot_take_the_same_generation,
    test_f3_a_manifest_naming_paths_outside_its_step_is_corrupt_and_never_read,
    test_f16_files_collected_during_a_load_because_a_newer_commit_appeared_is_retryable,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def url(s3_url):
    return s3_url


@pytest.mark.timeout(60)
def test_s3_put_if_is_a_real_compare_and_swap(s3_url):
    st = Storage(s3_url)
    assert st._s3_conditional_ok()  # moto honours If-None-Match / If-Match: no fallback
    path = st.path("checkpoints", "step_00000001", "COMMITTED")
    etag1 = st.put_if(path, b"first", if_token=None)
    with pytest.raises(PreconditionFailed):
        st.put_if(path, b"second", if_token=None)              # If-None-Match: * on an existing key
    data, token = st.read_versioned(path)
    assert data == b"first" and token == etag1
    etag2 = st.put_if(path, b"replaced", if_token=token)        # If-Match the version read
    with pytest.raises(PreconditionFailed):
        st.put_if(path, b"stale", if_token=token)               # that version is gone
    assert st.read_versioned(path) == (b"replaced", etag2)
    st.rm(path)
    with pytest.raises(PreconditionFailed):
        st.put_if(path, b"gone", if_token=etag2)                # If-Match on a deleted key
    assert not st.exists(path)


@pytest.mark.timeout(120)
def test_s3_append_log_writes_small_objects_and_reads_as_one_file(s3_url):
    st = Storage(s3_url)
    path = st.path("metrics.jsonl")
    log = AppendLog(st, path, min_compact_bytes=4 << 10)
    assert log.segmented
    want = b""
    for i in range(1, 121):
        chunk = b'{"step": %d, "loss": 0.5}\n' % i
        log.append(chunk)
        want += chunk
    assert read_log(Storage(s3_url), path) == want
    assert len(Storage(s3_url).listdir(path + PARTS_SUFFIX)) < 10
    log.rewrite(want[: want.index(b'{"step": 100,')])           # a resume at step 99
    log.append(b'{"step": 100, "loss": 0.4}\n')
    log.compact()
    final = Storage(s3_url).read_bytes(path)                    # the one file, after the run
    assert final.endswith(b'{"step": 99, "loss": 0.5}\n{"step": 100, "loss": 0.4}\n')
    assert final.count(b"\n") == 100 and read_log(Storage(s3_url), path) == final
