"""The checkpoint mirror's parts in one process, on fsspec's in-memory store: secrets kept out of configs, the manifest
and the checksummed transfers, the run lease's rules (on a local file system, where it is atomic), the uploader
(manifest last, retention after a newer checkpoint is complete, a checkpoint sent again while the store does not
answer, the lag it reports), the downloader refusing a mismatching file for the next older checkpoint, and ``trl-ext
verify URL``. The lease's race and botocore's retries against real S3 servers are in tests/unit/test_mirror_s3.py;
the 2-process runs in tests/distributed/test_mirror.py."""

import json
import os
import pickle
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import trl_ext
from trl_ext.errors import ConfigError, MirrorError
from trl_ext.files import manifest
from trl_ext.mirror import downloader, lease, options, outbox, uploader
from trl_ext.mirror.store import Store
from trl_ext.mirror.verify import verify


@pytest.fixture
def url():
    return f"memory://trl-ext-tests-{uuid.uuid4().hex[:8]}/run"


def _checkpoint(root: Path, step: int, size: int = 1000) -> Path:
    path = root / f"checkpoint-{step}"
    (path / "global_step").mkdir(parents=True)
    save_file({"w": torch.full((size // 4,), float(step))}, path / "model.safetensors")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (path / "global_step" / "optim_states.pt").write_bytes(os.urandom(size))
    return path


class Lines(list):
    def __call__(self, line: str) -> None:
        self.append(line)


def _uploader(url, tmp_path, keep=None, store=None):
    store = store or Store(url)
    holder = lease.Holder(output_dir=str(tmp_path))
    lease.claim(store, holder, resuming=False, say=Lines())
    said = Lines()
    return uploader.Uploader(store, holder, tmp_path / outbox.DIR, keep, set, said), store, said


def _submit(up, run_dir: Path, step: int):
    name = f"checkpoint-{step}"
    up.submit(outbox.put(run_dir / name, up.outbox_root / name, name, step))


# --------------------------------------------------------------------------------------------------- options


def test_secrets_stay_out_of_the_config_its_logs_and_its_pickle(tmp_path):
    args = trl_ext.SFTConfig(output_dir=str(tmp_path), report_to="none", checkpoint_mirror="s3://bucket/run/",
                             mirror_storage_options=json.dumps({"key": "AKIDEXAMPLE", "secret": "s3cr3t-value",
                                                                "client_kwargs": {"endpoint_url": "http://h:9000"}}))
    assert args.checkpoint_mirror == "s3://bucket/run"
    for shown in (json.dumps(args.to_dict()), str(args), pickle.dumps(args).decode("latin-1")):
        assert "s3cr3t-value" not in shown and "AKIDEXAMPLE" not in shown
    assert "http://h:9000" in json.dumps(args.to_dict())
    real = options.reveal(args.mirror_storage_options)
    assert real == {"key": "AKIDEXAMPLE", "secret": "s3cr3t-value", "client_kwargs": {"endpoint_url": "http://h:9000"}}
    copy = pickle.loads(pickle.dumps(args))  # a copy in this process reveals the same
    assert options.reveal(copy.mirror_storage_options) == real
    assert options.shown("s3://KEY:SECRET@bucket/run") == "s3://bucket/run"


@pytest.mark.parametrize("value, problem", [("{not json", "not JSON"), ("[1, 2]", "must be a mapping")])
def test_bad_storage_options_are_refused_in_one_line(tmp_path, value, problem):
    with pytest.raises(ConfigError, match=problem):
        trl_ext.DPOConfig(output_dir=str(tmp_path), report_to="none", checkpoint_mirror="s3://b/r",
                          mirror_storage_options=value)


def test_every_config_has_the_mirror_options(tmp_path):
    for config in (trl_ext.SFTConfig, trl_ext.RewardConfig, trl_ext.DPOConfig, trl_ext.KTOConfig,
                   trl_ext.GRPOConfig, trl_ext.RLOOConfig):
        fields = config.__dataclass_fields__
        assert {"checkpoint_mirror", "mirror_storage_options", "mirror_grace_period",
                "mirror_exit_grace_period"} <= set(fields), config
    with pytest.raises(ConfigError, match="names no bucket"):
        trl_ext.SFTConfig(output_dir=str(tmp_path), report_to="none", checkpoint_mirror="s3://")


# ------------------------------------------------------------------------------------------ store and manifest


def test_transfers_checksum_what_passes_and_the_manifest_round_trips(url, tmp_path):
    store = Store(url)
    store.check_access()
    data = os.urandom(3 * 2**20 + 17)
    (tmp_path / "f.bin").write_bytes(data)
    size, digest = store.upload(tmp_path / "f.bin", "a/f.bin")
    expected = manifest.hasher()
    expected.update(data)
    assert (size, digest) == (len(data), expected.hexdigest())
    assert store.download("a/f.bin", tmp_path / "back.bin") == (size, digest)
    assert (tmp_path / "back.bin").read_bytes() == data
    made = manifest.Manifest(step=3, run="r")
    made.add("f.bin", size, digest)
    store.write_manifest("a", made)
    read = store.read_manifest("a")
    assert read.files == made.files and read.step == 3
    assert read.mismatch("f.bin", size, digest) is None
    assert "checksum" in read.mismatch("f.bin", size, "0" * 32) and "bytes" in read.mismatch("f.bin", 1, digest)


# --------------------------------------------------------------------------------------------------- the lease


def test_a_new_run_cannot_take_a_mirror_that_another_run_writes_or_wrote(tmp_path, monkeypatch):
    store = Store(f"file://{tmp_path}/mirror")  # a file system: an atomic create, nothing said about it
    first = lease.Holder(output_dir="a", host="elsewhere")
    said = Lines()
    lease.claim(store, first, resuming=False, say=said)
    assert said == [] and first.number == 1
    with pytest.raises(MirrorError, match="belongs to another run .*resume that run"):
        lease.claim(store, lease.Holder(output_dir="b"), resuming=False, say=Lines())
    # a resuming run waits for a live lease of another host, and takes it once it has expired
    monkeypatch.setattr(lease, "LEASE_SECONDS", 0.6)
    said = Lines()
    second = lease.Holder(output_dir="b")
    lease.claim(store, second, resuming=True, say=said)
    assert any("waiting up to" in line for line in said) and "took it over" in said[-1], said
    assert lease.holds(store, second) and not lease.renew(store, first)  # the first run learns it lost the mirror
    assert store.names(lease.MARKERS) == ["000000000002.json"]  # the markers before the holder's are deleted


def test_a_resuming_run_takes_over_at_once_from_an_ended_or_dead_run(tmp_path):
    store = Store(f"file://{tmp_path}/mirror")
    dead = lease.Holder(pid=2**22 + 12345)  # no such process on this host
    lease.claim(store, dead, resuming=False, say=Lines())
    said = Lines()
    alive = lease.Holder()
    lease.claim(store, alive, resuming=True, say=said)
    assert "has ended" in said[-1], said
    lease.release(store, alive)
    ended = lease.Holder(output_dir="c", host="elsewhere")
    lease.claim(store, ended, resuming=True, say=Lines())
    lease.release(store, ended)
    said = Lines()
    lease.claim(store, lease.Holder(), resuming=True, say=said)
    assert "it ended" in said[-1], said


def test_a_restarted_run_takes_its_own_lease_and_finds_its_mirror(tmp_path, monkeypatch):
    from trl_ext.placement import ownership

    store = Store(f"file://{tmp_path}/mirror")
    monkeypatch.setattr(ownership, "current_run", lambda: "slurm-7")
    lease.claim(store, lease.Holder(host="elsewhere"), resuming=False, say=Lines())  # the job's first run, lost
    assert lease.held_by_this_job(store)
    said = Lines()
    lease.claim(store, lease.Holder(), resuming=False, say=said)  # requeued: the same job, a new run
    assert "an earlier attempt of this run (slurm-7)" in said[-1], said
    monkeypatch.setattr(lease, "LEASE_SECONDS", -1.0)  # a recovery slower than the lease: still the surer reason
    said = Lines()
    lease.claim(store, lease.Holder(), resuming=False, say=said)
    assert "an earlier attempt of this run (slurm-7)" in said[-1], said
    monkeypatch.setattr(ownership, "current_run", lambda: None)
    assert not lease.held_by_this_job(store)


def test_a_store_without_an_atomic_create_says_so_at_start(url, monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    said = Lines()
    lease.claim(Store(url), lease.Holder(), resuming=False, say=said)
    assert said == [f"checkpoint_mirror {url}: memory:// has no atomic create-if-absent, so two runs that start at the "
                    "same moment could both take its lease (docs/cloud.md)"], said


# ------------------------------------------------------------------------------------------------ the uploader


def test_checkpoints_upload_with_the_manifest_last_and_retention_after_a_newer_one_is_complete(url, tmp_path,
                                                                                                monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    up, store, said = _uploader(url, tmp_path, keep=2)
    order = []
    write_manifest, delete = store.write_manifest, store.delete
    monkeypatch.setattr(store, "write_manifest", lambda rel, m: (order.append(("manifest", rel, sorted(
        store.files(rel)))), write_manifest(rel, m)))
    monkeypatch.setattr(store, "delete", lambda rel, recursive=True: (order.append(("delete", rel, store.complete())),
                                                                      delete(rel, recursive)))
    for step in (1, 2, 3):
        path = _checkpoint(tmp_path, step)
        _submit(up, tmp_path, step)
        shutil.rmtree(path)  # local rotation removes it at once: the hard links keep it whole for the upload
        assert up.wait(30)
    assert store.complete() == [3, 2]
    # each manifest came after every file of its checkpoint
    for kind, rel, files in (o for o in order if o[0] == "manifest"):
        assert files == ["global_step/optim_states.pt", "model.safetensors", "trainer_state.json"], (rel, files)
    # checkpoint-1 was deleted (manifest first) only once checkpoint-3 was complete
    completed = order.index(next(o for o in order if o[:2] == ("manifest", "checkpoint-1")))
    first_delete = next(o for o in order[completed:] if o[0] == "delete" and o[1].startswith("checkpoint-1"))
    assert first_delete[1] == f"checkpoint-1/{manifest.NAME}" and 3 in first_delete[2]
    assert not (tmp_path / outbox.DIR / "checkpoint-1").exists()  # the outbox's hard links removed once uploaded
    assert [line for line in said if "complete at" in line][0].startswith("mirror: checkpoint-1 complete at memory://")


def test_training_never_waits_for_a_silent_store_and_the_mirror_catches_up(url, tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(uploader, "WARN_EVERY_SECONDS", 0.0)
    monkeypatch.setattr(uploader, "RESEND_SECONDS", 0.05)
    up, store, said = _uploader(url, tmp_path)
    down = threading.Event()
    down.set()
    upload = store.upload

    def flaky(local, rel, cancelled=lambda: False):
        if down.is_set():
            raise ConnectionError("Could not connect to the endpoint URL")
        return upload(local, rel, cancelled)

    monkeypatch.setattr(store, "upload", flaky)
    for step in (1, 2):
        _checkpoint(tmp_path, step)
        started = time.monotonic()
        _submit(up, tmp_path, step)
        # hard links and a queue: training goes on. Waiting for the store (down) would never end; the bound leaves
        # a loaded machine room
        assert time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while not any("has not answered" in line for line in said) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert up.status()["behind_checkpoints"] == 2 and up.status()["behind_steps"] == 2
    assert any("2 checkpoint(s), 2 step(s) behind" in line and "has not answered" in line for line in said), said
    down.clear()
    assert up.wait(30)
    assert store.complete() == [2, 1] and up.status()["behind_checkpoints"] == 0
    assert any("answers again" in line for line in said), said


def test_a_grace_period_that_runs_out_leaves_the_previous_checkpoint_complete(url, tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    up, store, _ = _uploader(url, tmp_path)
    _checkpoint(tmp_path, 1)
    _submit(up, tmp_path, 1)
    assert up.wait(30)
    upload = store.upload
    monkeypatch.setattr(store, "upload", lambda local, rel, cancelled=lambda: False: (time.sleep(0.5), upload(
        local, rel, cancelled))[1])
    _checkpoint(tmp_path, 2)
    _submit(up, tmp_path, 2)
    assert not up.wait(0.2)
    assert up.abandon() == ["checkpoint-2"]
    assert store.complete() == [1]
    assert (tmp_path / outbox.DIR / "checkpoint-2" / "job.json").is_file()  # a later run finishes it
    assert [j.rel for j in outbox.pending(tmp_path / outbox.DIR)] == ["checkpoint-2"]


def test_an_error_of_our_own_is_said_once_never_sent_again_and_stops_training_at_its_next_step(url, tmp_path,
                                                                                               monkeypatch):
    """The issue's hang: a RuntimeError (an executor refusing work at interpreter shutdown) had been taken for a store
    outage and sent again forever. Only the store's failures are sent again."""
    from trl_ext.mirror.store import is_store_failure

    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(uploader, "RESEND_SECONDS", 0.05)
    up, store, said = _uploader(url, tmp_path)
    calls = []

    def broken(local, rel, cancelled=lambda: False):
        calls.append(rel)
        raise RuntimeError("cannot schedule new futures after interpreter shutdown\nsecond line")

    monkeypatch.setattr(store, "upload", broken)
    _checkpoint(tmp_path, 1)
    _submit(up, tmp_path, 1)
    assert up.wait(10)  # given up at once, not queued again
    time.sleep(0.3)
    assert len(calls) <= uploader.FILES_IN_PARALLEL  # each file tried once, in the one attempt
    lines = [line for line in said if "error of trl_ext's own" in line]
    assert len(lines) == 1 and "RuntimeError: cannot schedule new futures after interpreter shutdown" in lines[0]
    assert "second line" not in lines[0] and "checkpoint-1" in lines[0] and str(up.outbox_root) in lines[0]
    assert (tmp_path / outbox.DIR / "checkpoint-1" / "job.json").is_file()  # the next run finishes it
    assert not any("has not answered" in line for line in said)  # never taken for an outage
    _checkpoint(tmp_path, 2)
    _submit(up, tmp_path, 2)  # in the outbox, not sent
    assert up.failed == ["checkpoint-1", "checkpoint-2"] and up.idle()
    with pytest.raises(MirrorError, match="error of trl_ext's own, not the store's .RuntimeError: cannot schedule"):
        up.raise_if_broken()
    up.raise_if_broken()  # raised once
    assert [is_store_failure(e) for e in (ConnectionError("refused"), TimeoutError(), PermissionError("403"),
                                          OSError(5, "Internal Error"), RuntimeError("x"), KeyError("k"),
                                          AttributeError("a"))] == [True] * 4 + [False] * 3
    botocore = pytest.importorskip("botocore.exceptions")
    assert is_store_failure(botocore.EndpointConnectionError(endpoint_url="http://x"))
    assert is_store_failure(botocore.ClientError({"Error": {"Code": "SlowDown"}}, "PutObject"))


def test_at_exit_the_queue_is_finished_within_the_grace_period_or_left_in_the_outbox_and_said(url, tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    monkeypatch.setattr(uploader, "EXIT_JOIN_SECONDS", 0.5)
    up, store, said = _uploader(url, tmp_path)
    upload, hold = store.upload, threading.Event()
    monkeypatch.setattr(store, "upload", lambda local, rel, cancelled=lambda: False: (
        time.sleep(0.3) if "checkpoint-1" in rel else hold.wait(60), upload(local, rel, cancelled))[1])
    _checkpoint(tmp_path, 1)
    _submit(up, tmp_path, 1)
    up.exit_grace = 30.0
    started = time.monotonic()
    up.finish_at_exit()
    assert time.monotonic() - started < 10 and store.complete() == [1]
    assert any("finishing the upload of checkpoint-1" in line and "mirror_exit_grace_period" in line
               for line in said), said
    assert lease.newest(store).released  # a resuming run takes over at once
    # a store that stops answering: the exit waits out the grace period, then says what is only local
    up, store, said = _uploader(url + "-silent", tmp_path)
    monkeypatch.setattr(store, "upload", lambda local, rel, cancelled=lambda: False: (
        hold.wait(60), upload(local, rel, cancelled))[1])
    _checkpoint(tmp_path, 2)
    _submit(up, tmp_path, 2)
    up.exit_grace = 0.5
    started = time.monotonic()
    up.finish_at_exit()
    assert time.monotonic() - started < 0.5 + uploader.EXIT_JOIN_SECONDS + 20  # not the upload's 60 s
    hold.set()
    line = [line for line in said if "only local" in line]
    assert len(line) == 1 and "checkpoint-2" in line[0] and "0 s mirror_exit_grace_period ran out" in line[0]
    assert str(up.outbox_root) in line[0] and "the next run with this output_dir uploads them" in line[0]
    assert [j.rel for j in outbox.pending(tmp_path / outbox.DIR)] == ["checkpoint-2"]


_EXITING_SCRIPT = """
import os, signal, sys, threading, time
from pathlib import Path
from trl_ext.mirror import lease, outbox, uploader
from trl_ext.mirror.store import Store

root, url, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lease.SETTLE_SECONDS = 0.0
store = Store(url)
upload = store.upload
def slow(local, rel, cancelled=lambda: False):
    time.sleep(3600 if "silent" in mode else 0.5)  # a slow store, or one that never answers
    return upload(local, rel, cancelled)
store.upload = slow
holder = lease.Holder(output_dir=str(root))
lease.claim(store, holder, resuming=False, say=print)
grace = {"sigterm": (30.0, 30.0), "sigterm-silent": (30.0, 1.0)}.get(mode, (3.0, 20.0))
up = uploader.Uploader(store, holder, root / outbox.DIR, None, set, lambda line: print(line, flush=True),
                       exit_grace=grace[0], signal_grace=grace[1])
if mode.startswith("sigterm"):  # 0.3 s after the script returns: SIGTERM while the process finishes the upload
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.daemon = True
checkpoint = root / "checkpoint-1"
checkpoint.mkdir(parents=True)
for i in range(6):
    (checkpoint / f"part-{i}.bin").write_bytes(bytes(1000))
up.submit(outbox.put(checkpoint, up.outbox_root / "checkpoint-1", "checkpoint-1", 1))
print("SCRIPT END", time.time(), flush=True)  # the bound runs from here: start-up under load is not the exit's
if mode.startswith("sigterm"):
    timer.start()
if mode == "raise":
    raise SystemExit("the script failed after committing checkpoint-1")
"""


# Beyond the waits a silent store is given, what the interpreter's teardown may take: a hang would run into the
# subprocess's 300 s; 15 s was exceeded beside CI's other legs (38.7 s of which the waits were 8 s, 2026-12-02).
HANG = 120


@pytest.mark.slow  # five interpreters, the silent stores' waits (about 10 s on an idle machine)
@pytest.mark.parametrize("mode", ["return", "raise", "silent", "sigterm", "sigterm-silent"])
def test_a_process_that_returns_with_uploads_queued_finishes_them_and_ends(mode, tmp_path):
    """A real interpreter exit (the file uploads run on a thread pool, which the interpreter shuts at exit): the
    upload queued when the script returns is finished and the process ends with the script's code; a store that never
    answers ends it after the grace period, the checkpoint said to be only local and left in the outbox. A SIGTERM
    while it finishes (torchrun's, once another rank failed) is held back for at most mirror_grace_period, then
    ends it."""
    import subprocess
    import sys

    store_dir = tmp_path / "store"
    script = tmp_path / "script.py"
    script.write_text(_EXITING_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), f"file://{store_dir}", mode],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    ended = time.time()
    out = done.stdout + done.stderr
    assert done.returncode == {"raise": 1, "sigterm": -15, "sigterm-silent": -15}.get(mode, 0), out
    assert "SCRIPT END" in out and "cannot schedule new futures" not in out, out
    seconds = ended - float(re.search(r"SCRIPT END (\S+)", out).group(1))  # from the script's return to its end
    if mode.startswith("sigterm"):  # held back, then delivered: the process ends by it
        assert "SIGTERM while this process exits: the uploads get at most" in out, out
    if mode == "sigterm-silent":
        assert 1.0 <= seconds < 0.3 + 1.0 + uploader.EXIT_JOIN_SECONDS + HANG, seconds
        assert "checkpoint-1 only local: the 1 s mirror_grace_period after SIGTERM ran out" in out, out
        assert (tmp_path / "out" / outbox.DIR / "checkpoint-1" / "job.json").is_file()
    elif mode == "silent":
        assert 3.0 <= seconds < 3.0 + uploader.EXIT_JOIN_SECONDS + HANG, seconds
        assert "checkpoint-1 only local" in out and "mirror_exit_grace_period ran out" in out, out
        assert (tmp_path / "out" / outbox.DIR / "checkpoint-1" / "job.json").is_file()
    else:
        assert "mirror: checkpoint-1 complete at" in out, out
        assert Store(f"file://{store_dir}").complete() == [1]
        assert not (tmp_path / "out" / outbox.DIR / "checkpoint-1").exists()


# ---------------------------------------------------------------------------------------- downloads and verify


def test_a_mismatching_file_is_refused_and_the_next_older_checkpoint_used(url, tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    up, store, _ = _uploader(url, tmp_path / "first")
    for step in (1, 2):
        _checkpoint(tmp_path / "first", step)
        _submit(up, tmp_path / "first", step)
    assert up.wait(30)
    store.fs.pipe_file(store.path("checkpoint-2/trainer_state.json"), b'{"global_step": 9}')  # bit rot
    said = Lines()
    got = downloader.newest(store, tmp_path / "fresh", said)
    assert got == tmp_path / "fresh" / "checkpoint-1"
    assert "refused" in said[0] and "trainer_state.json: checksum" in said[0], said
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == ["checkpoint-1"]  # nothing half-written
    assert (got / "model.safetensors").read_bytes() == (tmp_path / "first" / "checkpoint-1" /
                                                        "model.safetensors").read_bytes()
    report = verify(f"{url}/checkpoint-2")
    assert not report.ok and "trainer_state.json: checksum" in report.format()
    report = verify(f"{url}/checkpoint-1")
    assert report.ok and report.headers == 1 and report.tensors == 1, report.format()


def test_verify_reads_the_safetensors_headers(url, tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    up, store, _ = _uploader(url, tmp_path)
    path = _checkpoint(tmp_path, 1)
    raw = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(raw[:-4])  # truncated before the upload: the manifest agrees with it
    _submit(up, tmp_path, 1)
    assert up.wait(30)
    report = verify(f"{url}/checkpoint-1")
    assert not report.ok and "safetensors header is invalid" in report.format(), report.format()
    listing = verify(url)
    assert "checkpoint-1: complete" in listing.format() and not listing.ok


def test_the_next_run_finishes_an_upload_in_the_outbox_and_abandons_a_partial_one_it_cannot_finish(url, tmp_path,
                                                                                           monkeypatch):
    """What a killed run left: checkpoint-2 committed and in the outbox but not uploaded (it is finished),
    checkpoint-3's upload begun in the mirror with no local copy to finish it from (it is deleted); a resuming run
    does both."""
    from types import SimpleNamespace

    from trl_ext.mirror.mirror import Mirror

    monkeypatch.setattr(lease, "SETTLE_SECONDS", 0.0)
    store = Store(url)
    _checkpoint(tmp_path, 1)
    up, _, _ = _uploader(url, tmp_path)
    _submit(up, tmp_path, 1)
    assert up.wait(30)
    lease.release(store, up.holder)  # that run has ended (killed)
    _checkpoint(tmp_path, 2)
    outbox.put(tmp_path / "checkpoint-2", tmp_path / outbox.DIR / "checkpoint-2", "checkpoint-2", 2)
    (tmp_path / "part.bin").write_bytes(b"x" * 100)
    store.upload(tmp_path / "part.bin", "checkpoint-3/model.safetensors")
    args = SimpleNamespace(checkpoint_mirror=url, output_dir=str(tmp_path), save_total_limit=None,
                           mirror_grace_period=5.0, process_index=0)
    mirror = Mirror(args, Store(url))
    mirror.begin(SimpleNamespace(storage=None), resuming=True)
    assert mirror.wait(30)
    assert store.checkpoints() == {1: True, 2: True}
    assert not (tmp_path / outbox.DIR / "checkpoint-2").exists()


@pytest.mark.parametrize("path", ["resume_from_checkpoint=True", "restarted run"])
def test_a_rank_that_finds_the_checkpoint_rank_0_just_downloaded_still_joins_rank_0s_broadcast(path, tmp_path,
                                                                                              monkeypatch):
    """Rank 1 looks at the output directory after rank 0's download has committed a checkpoint there: it must still
    take part in the broadcast rank 0 waits in, never skip it (a collective mismatch, seen in a 2-process FSDP2 run)."""
    import torch.distributed as dist

    from trl_ext.placement import orchestrators
    from trl_ext.resuming import mirrored

    (tmp_path / "checkpoint-2").mkdir()  # what rank 0 downloaded and committed a moment ago
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    trainer = type("T", (), {"mirror": object(), "args": type("A", (), {"output_dir": str(tmp_path)})()})()
    broadcasts = []

    def broadcast_object_list(answer, src, group=None):
        broadcasts.append(src)
        answer[:] = ["/from/rank0/checkpoint-2", None]

    monkeypatch.setattr("trl_ext.process.collectives.distributed", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    if path == "restarted run":
        monkeypatch.setattr(orchestrators, "current",
                            lambda: orchestrators.Job("Slurm", False, run="slurm-7", restart=1))
        got = mirrored.restarted(trainer)
    else:
        got = mirrored.download_if_missing(trainer)
    assert broadcasts == [0] and got == "/from/rank0/checkpoint-2"
