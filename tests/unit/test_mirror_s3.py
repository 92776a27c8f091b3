"""The mirror's lease and retries against real S3 servers, in one process: two runs that start together on a new
mirror never both hold its lease (moto's S3 server, which honours conditional writes as S3 does, and a local file
system); ``rclone serve s3``, which ignores them, is said at start; botocore's retries of a store that stopped
answering are told to the caller while they run, and a stopped upload ends them. The rest of the mirror against
rclone under 2-process runs is in tests/distributed/test_mirror.py."""

import os
import threading
import time

import pytest

from tests.s3_server import ConditionalS3Server, S3Server
from trl_ext.errors import ABANDONED, MirrorError
from trl_ext.mirror import lease
from trl_ext.mirror.store import S3_ATTEMPTS, Store

pytestmark = pytest.mark.newest_only  # s3fs, botocore and the servers are the same in the oldest versions' leg

ROUNDS = 20


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    with ConditionalS3Server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="module")
def rclone(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("rclone")) as server:
        yield server


@pytest.fixture
def aws(monkeypatch):
    """Point the standard AWS variables at a server: ``aws(server)``."""

    def use(server):
        for name, value in server.env.items():
            monkeypatch.setenv(name, value)

    return use


def _races(url: str) -> list[int]:
    """``ROUNDS`` races on new mirrors under ``url``; how many claimants won each."""
    stores = [Store(url), Store(url)]  # each claimant its own client, as two jobs have
    for store in stores:
        assert store.atomic_create is None  # asked before the races, so that both claims start alike
    root = stores[0].root
    winners = []
    for i in range(ROUNDS):
        for store in stores:
            store.root = f"{root}/race-{i}"
        winners.append(_race(stores, late=i % 2 == 1))
    return winners


def _race(stores: list[Store], late: bool) -> int:
    """Two claimants of a new mirror that have both found no holder, then write their markers at the same moment
    (``late``: the second once the first has taken the lease, past its read-back); the number that believe they hold
    the lease."""
    both_looked, first_done = threading.Barrier(2, timeout=30), threading.Event()
    won, refused = [], []

    def claimant(i: int):
        create = Store.create.__get__(stores[i])

        def gated(rel: str, content: bytes) -> bool:
            both_looked.wait()
            if late and i == 1:
                first_done.wait(30)
            return create(rel, content)

        stores[i].create = gated
        me = lease.Holder(output_dir=f"job-{i}")
        try:
            lease.claim(stores[i], me, resuming=False, say=lambda line: None)
            won.append(me)
        except MirrorError as exc:
            refused.append(str(exc))
        finally:
            if i == 0:
                first_done.set()

    threads = [threading.Thread(target=claimant, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(won) + len(refused) == 2, (won, refused)
    assert all("belongs to another run" in line for line in refused), refused
    if won:
        assert lease.holds(stores[0], won[0]) and lease.holds(stores[1], won[0])
    return len(won)


def test_two_runs_that_start_together_never_both_hold_the_lease_on_s3(moto, aws):
    aws(moto)
    bucket = moto.bucket()
    assert _races(f"s3://{bucket}/run") == [1] * ROUNDS


def test_two_runs_that_start_together_never_both_hold_the_lease_on_a_file_system(tmp_path):
    assert _races(f"file://{tmp_path}/run") == [1] * ROUNDS


def test_rclone_ignores_conditional_writes_and_the_lease_says_so_at_start(rclone, aws, monkeypatch):
    """If rclone starts honouring ``If-None-Match: *``, this fails: the lease tests may then use it."""
    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    aws(rclone)
    url = f"s3://{rclone.bucket()}/run"
    said = []
    lease.claim(Store(url), lease.Holder(), resuming=False, say=said.append)
    assert said[0] == (f"checkpoint_mirror {url}: the store ignores conditional writes (it let one file be created "
                       "twice), so two runs that start at the same moment could both take its lease "
                       "(docs/cloud.md)"), said


def test_botocore_retries_are_told_while_they_run_and_a_stop_ends_them(tmp_path, aws):
    server = S3Server(tmp_path / "s3").start()
    try:
        aws(server)
        store = Store(f"s3://{server.bucket()}/run")
        (tmp_path / "f.bin").write_bytes(os.urandom(1000))
        assert store.upload(tmp_path / "f.bin", "f.bin")[0] == 1000
        failures = []

        def stop_at_the_second(exc: BaseException) -> None:
            failures.append(exc)
            if len(failures) == 2:  # botocore retried the first failed attempt (of S3_ATTEMPTS)
                raise MirrorError("stopped", kind=ABANDONED)

        store.on_retry(stop_at_the_second)
        server.stop()  # connections refused from now on
        started = time.monotonic()
        with pytest.raises(MirrorError) as stopped:
            store.upload(tmp_path / "f.bin", "g.bin")
        assert stopped.value.kind == ABANDONED and len(failures) == 2 < S3_ATTEMPTS
        assert all("Could not connect" in str(exc) for exc in failures), failures
        assert time.monotonic() - started < 5  # one backoff (1 s at most), not botocore's whole sequence
    finally:
        server.stop()
