"""The checkpoint mirror against a real S3 server (``rclone serve s3``, started here) under 2-process ZeRO-3 and FSDP2,
full SFT: every committed checkpoint arrives matching its manifest while the server is stopped mid-upload and started
again (training never waits, the mirror catches up); ``kill -9`` of every rank while checkpoint-4 uploads leaves
checkpoint-2 the mirror's newest complete one, and a new output directory resumes from it and ends with the
uninterrupted run's weights; bad credentials and a missing bucket are refused before training on every rank.

Per engine, one launch of ``train.py`` (``run_many.py``) makes the outage run, then the killed run (which ends the
launch); the resume joins the engine's shared launch, whose full SFT run (checkpoints 2 and 4) is the reference.
The resume reaches the server through ``mirror_storage_options`` (the shared launch has no environment of its own);
the other runs through the standard AWS variables.
"""

import json
import threading
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import ENGINE_CASES, ZERO3_CASES, engine_args
from tests.distributed.test_reliability import assert_resumed_equals_uninterrupted
from tests.harness import REPO, SCRIPTS, accelerate_launch, write_accelerate_config
from tests.s3_server import S3Server
from trl_ext.files import manifest
from trl_ext.mirror.outbox import DIR as OUTBOX

# the first test of an engine makes its two launches (and, run alone, the engine's shared launch): beyond the suite's
# 900 s on a loaded machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ENGINES = ["zero3", "fsdp2"]
OUTAGE_SECONDS = 6.0


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def _store(s3, url, monkeypatch=None):
    import os

    from trl_ext.mirror.store import Store

    os.environ.update(s3.env)  # the conftest restores the environment after each test
    return Store(url)


def _outage_when(path: Path, s3: S3Server, times: dict, ended: threading.Event) -> threading.Thread:
    """Stop the server as soon as ``path`` exists (an upload has started), start it again OUTAGE_SECONDS later;
    nothing if the launch ``ended`` first."""

    def run():
        while not path.exists():
            if ended.wait(0.02):
                return
        s3.stop()
        times["stopped"] = time.time()
        time.sleep(OUTAGE_SECONDS)
        times["started"] = time.time()
        s3.start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory, shared_runs, s3):
    """``engine_runs(engine)``: the runs of one engine (made once): the outage run, the killed run and the resume."""
    made = {}

    def runs(engine: str):
        if engine not in made:
            try:
                made[engine] = make(engine)
            except BaseException as exc:  # said once; the engine's other tests fail without launching again
                made[engine] = exc
                raise
        if isinstance(made[engine], BaseException):
            pytest.fail(f"the {engine} runs failed: {str(made[engine])[:2000]}")
        return made[engine]

    def make(engine: str) -> dict:
        tmp = tmp_path_factory.mktemp(f"mirror-{engine}")
        reference_args = engine_args(engine, "sft", False)
        urls = {case: f"s3://{s3.bucket()}/{engine}-{case}" for case in ("outage", "killed")}
        outage = [*reference_args[:-2], "--max_steps", "8", "--save_steps", "2", "--slow_steps", "0.4",
                  "--slow_uploads", "0.3", "--save_model", "final", "--output_dir", str(tmp / "outage"),
                  "--config_json", json.dumps({"checkpoint_mirror": urls["outage"]})]
        killed = [*reference_args, "--kill_during_upload", "4", "--output_dir", str(tmp / "killed"),
                  "--config_json", json.dumps({"checkpoint_mirror": urls["killed"]})]
        times, ended = {}, threading.Event()
        watcher = _outage_when(tmp / "outage" / OUTBOX / "checkpoint-2", s3, times, ended)
        config = write_accelerate_config(tmp / "configs", engine)
        launch = accelerate_launch(SCRIPTS / "run_many.py", ["train.py", json.dumps([outage, killed])], config,
                                   timeout=600, env=s3.env)
        ended.set()
        watcher.join(60)
        (tmp / "launch.log").write_text(launch.output)
        store = _store(s3, urls["killed"])
        left = store.checkpoints()
        # the resume: a new output directory, the killed run's mirror, credentials as storage options
        options = {"key": s3.key, "secret": s3.secret, "endpoint_url": s3.endpoint}
        resume = [*reference_args, "--resume", "--output_dir", str(tmp / "resumed"), "--config_json",
                  json.dumps({"checkpoint_mirror": urls["killed"], "mirror_storage_options": options,
                              "save_total_limit": 1})]
        shared = [engine_args(engine, *case) for case in (ENGINE_CASES if engine != "zero3" else ZERO3_CASES)]
        shared_runs.many("train.py", engine, [*shared, resume], timeout=900)
        reference = shared_runs.get("train.py", engine, reference_args)
        shared_runs.get("train.py", engine, resume)
        return {"tmp": tmp, "urls": urls, "launch": launch, "times": times, "left": left,
                "reference": reference, "resumed_output": shared_runs.outputs[tmp / "resumed"]}

    return runs


def _local_manifest(checkpoint: Path) -> dict:
    files = {}
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        digest = manifest.hasher()
        digest.update(path.read_bytes())
        files[str(path.relative_to(checkpoint))] = {"size": path.stat().st_size, manifest.ALGORITHM: digest.hexdigest()}
    return files


@pytest.mark.parametrize("engine", ENGINES)
def test_every_checkpoint_arrives_while_the_server_stops_mid_upload_and_training_never_waits(engine_runs, engine,
                                                                                           s3):
    from trl_ext.mirror.verify import verify

    runs = engine_runs(engine)
    out, times = runs["tmp"] / "outage", runs["times"]
    output = runs["launch"].output
    assert "stopped" in times and "started" in times, "the outage never happened"
    report = json.loads((out / "report_rank0.json").read_text())
    during = [t for t in report["step_ends"] if times["stopped"] < t < times["started"]]
    assert len(during) >= 3, (during, times, report["step_ends"])  # training went on while the server was down
    said = [line for line in output.splitlines() if "[trl_ext] mirror " in line]
    assert any("the store has not answered" in line for line in said), said
    assert any("answers again" in line for line in said), said
    store = _store(s3, runs["urls"]["outage"])
    assert store.checkpoints() == {2: True, 4: True, 6: True, 8: True}
    for step in (2, 4, 6, 8):  # what arrived is what was committed, file for file
        assert store.read_manifest(f"checkpoint-{step}").files == _local_manifest(out / f"checkpoint-{step}")
        assert f"mirror: checkpoint-{step} complete at" in output
    for rel in ("checkpoint-8", "final"):
        checked = verify(f"{runs['urls']['outage']}/{rel}")
        assert checked.ok and checked.headers >= 1, checked.format()
    assert not (out / OUTBOX).exists() or not any((out / OUTBOX).iterdir())  # nothing left in the outbox


@pytest.mark.parametrize("engine", ENGINES)
def test_the_final_model_loads_from_the_mirror_with_plain_transformers(engine_runs, engine, s3, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    runs = engine_runs(engine)
    store = _store(s3, runs["urls"]["outage"])
    store.fs.get(store.path("final") + "/", str(tmp_path / "final"), recursive=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    local = AutoModelForCausalLM.from_pretrained(runs["tmp"] / "outage" / "final")
    for (name, got), (_, want) in zip(model.state_dict().items(), local.state_dict().items(), strict=True):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("engine", ENGINES)
def test_kill_9_mid_upload_leaves_the_previous_checkpoint_complete_and_a_new_machine_resumes_exactly(engine_runs,
                                                                                                      engine, s3):
    runs = engine_runs(engine)
    launch = runs["launch"]
    assert not launch.timed_out and launch.returncode != 0, launch.output[-4000:]
    assert "SIGKILLs every rank while checkpoint-4 is uploaded" in launch.output
    assert runs["left"] == {2: True, 4: False}, runs["left"]  # checkpoint-4 half uploaded, without its manifest
    out = runs["tmp"] / "resumed"
    said = runs["resumed_output"]
    assert f"downloaded {runs['urls']['killed']}/checkpoint-2 into {out}/checkpoint-2" in said, said[-6000:]
    assert f"deleted the incomplete upload of {runs['urls']['killed']}/checkpoint-4" in said
    assert_resumed_equals_uninterrupted(runs["reference"], out, f"mirror-{engine}", steps_run_here=2)
    # the resumed run's own checkpoint-4 completed there, and save_total_limit=1 then removed checkpoint-2
    store = _store(s3, runs["urls"]["killed"])
    assert store.checkpoints() == {4: True}


def test_bad_credentials_and_a_missing_bucket_are_refused_before_anything_loads_on_every_rank(s3, tmp_path):
    """One launch, each case in turn on both ranks: the refusal is raised on every rank before the model loads."""
    cases = [["credentials", {"checkpoint_mirror": f"s3://{s3.bucket()}/run",
                              "mirror_storage_options": {"key": s3.key, "secret": "wrong-secret"}}],
             ["bucket", {"checkpoint_mirror": "s3://no-such-bucket/run"}]]
    config = write_accelerate_config(tmp_path / "configs", "ddp")
    launch = accelerate_launch(SCRIPTS / "mirror_refusals.py", [str(tmp_path), json.dumps(cases)], config, 300, s3.env)
    assert not launch.timed_out and launch.returncode == 0, launch.output[-4000:]
    said = {"credentials": "cannot write to it (PermissionError: The request signature we calculated does not match",
            "bucket": "cannot write to it (FileNotFoundError: The specified bucket does not exist). Create the bucket"}
    for rank in (0, 1):
        found = json.loads((tmp_path / f"refusals_rank{rank}.json").read_text())
        assert not found["model_loaded"], found
        for case, line in said.items():
            assert line in (found["refusals"][case] or ""), (rank, case, found)
            assert "\n" not in found["refusals"][case] and "wrong-secret" not in found["refusals"][case]
    assert not any((tmp_path / case).exists() for case in said)  # nothing written


def test_a_recipe_refuses_a_missing_bucket_in_one_line_before_it_trains(s3, monkeypatch, tmp_path):
    # Each rank checks the input where it runs (a re-launch's ranks included: the test above);
    # here the recipe's own process, with nothing launched and nothing written.
    from trl_ext import ModelConfig, ScriptArguments, SFTConfig, TrlParser
    from trl_ext.launching import launch
    from trl_ext.launching.scripting import parse_recipe_args

    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    launched = []
    monkeypatch.setattr(launch, "_exec", lambda *a, **k: launched.append(a))
    parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig))
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exited:
        parse_recipe_args(parser, "sft", "sft", ["--config", str(REPO / "recipes/configs/sft.yaml"),
                                                  "--checkpoint_mirror", "s3://no-such-bucket/run", "--output_dir",
                                                  str(out)])
    message = str(exited.value.code)
    assert message.startswith("error: checkpoint_mirror s3://no-such-bucket/run: cannot write to it") and \
        "\n" not in message, message
    assert not launched and not out.exists()


def test_a_large_file_goes_up_in_parts_checksummed_and_a_stopped_upload_leaves_nothing(s3, tmp_path, monkeypatch):
    import os

    from trl_ext.errors import MirrorError
    from trl_ext.mirror import store as stores

    monkeypatch.setattr(stores, "UPLOAD_PART_BYTES", 5 * 2**20)  # S3's smallest part: 9 parts, 4 in flight
    store = _store(s3, f"s3://{s3.bucket()}/parts")
    data = os.urandom(42 * 2**20 + 3)
    (tmp_path / "big.bin").write_bytes(data)
    parts = []
    store.fs.s3.meta.events.register("after-call.s3.UploadPart", lambda **kwargs: parts.append(1))
    size, digest = store.upload(tmp_path / "big.bin", "big.bin")
    expected = manifest.hasher()
    expected.update(data)
    assert (size, digest) == (len(data), expected.hexdigest())
    assert len(parts) == 9, parts
    assert store.download("big.bin", tmp_path / "back.bin") == (size, digest)
    assert (tmp_path / "back.bin").read_bytes() == data
    parts.clear()
    with pytest.raises(MirrorError) as stopped:  # stopped once a part has gone up: the multipart upload is aborted
        store.upload(tmp_path / "big.bin", "stopped.bin", cancelled=lambda: bool(parts))
    assert stopped.value.kind == "abandoned" and 0 < len(parts) < 9, parts
    assert not store.exists("stopped.bin")
    bucket, _, prefix = store.path("stopped.bin").partition("/")
    assert not store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads")
