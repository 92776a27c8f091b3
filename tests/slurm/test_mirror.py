"""A Slurm job with a checkpoint mirror whose node-local output directory is gone when it is requeued (a new machine, a
wiped scratch disk): the requeued run finds that the mirror it was writing is this job's (its run marker names the
job), downloads the newest complete checkpoint, checked, resumes from it by itself and completes; the final model is
in the mirror and matches its manifest.

The S3 server is ``rclone serve s3`` started here (``tests/s3_server.py``); the job reaches it through the standard
AWS variables, passed in its environment.
"""

import os
import re
import shutil

import pytest

from tests.s3_server import S3Server
from tests.slurm.test_recipes import finished, slowed, submit, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, SAVE_STEPS = 20, 10
DPO = ["recipes/dpo.py", "--config", "accelerate_configs/zero3.yaml", "--config", "recipes/configs/dpo.yaml",
       "--num_processes", "2", "--max_steps", str(STEPS), "--save_steps", str(SAVE_STEPS), "--save_strategy", "steps",
       "--eval_strategy", "no", "--per_device_train_batch_size", "4", "--report_to", "none",
       "--mirror_grace_period", "5"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3")) as server:
        yield server


def test_a_requeued_job_whose_output_dir_is_gone_resumes_from_the_mirror(slurm_cluster, s3, tmp_path):
    from trl_ext.mirror.verify import verify

    bucket = s3.bucket()
    url = f"s3://{bucket}/slurm"
    out = tmp_path / "local-disk"
    args, env = slowed([*DPO, "--checkpoint_mirror", url], step_seconds=0.25)
    job = submit(slurm_cluster, out, args, env={**env, **s3.env})
    complete = s3.data / bucket / "slurm" / f"checkpoint-{SAVE_STEPS}" / "trl_ext-manifest.json"
    wait_for(complete.is_file, 300, f"checkpoint-{SAVE_STEPS} complete in the mirror", slurm_cluster, job)
    slurm_cluster.requeue(job, hold=True)
    slurm_cluster.wait_state(job, "PENDING", timeout=120, min_restarts=1)
    shutil.rmtree(out)  # the node-local directory is gone with its machine
    slurm_cluster.release(job)
    slurm_cluster.start_now(job)
    log = finished(slurm_cluster, job, out, min_restarts=1)
    assert re.search(r"node 0 \(n1\): stopped on SIGTERM, with checkpoint-\d+ saved \(exit 143\)", log), log[-6000:]
    assert "training from the start" not in log, log[-6000:]  # the local directory is gone, the mirror is not
    # within mirror_grace_period the stopping checkpoint reached the mirror, or the log says it is only local
    assert ("checkpoint_mirror: every committed checkpoint is in" in log or
            "the 5 s grace period (mirror_grace_period) ran out" in log), log[-6000:]
    assert f"this run's mirror {url} is the place to resume from" in log, log[-6000:]
    resumed = re.search(rf"downloaded {url}/checkpoint-(\d+) into {out}/checkpoint-\1", log)
    assert resumed and int(resumed.group(1)) >= SAVE_STEPS, log[-6000:]
    assert f"mirror: the model complete at {url}" in log, log[-6000:]
    os.environ.update(s3.env)  # the conftest restores the environment after the test
    report = verify(url)
    assert report.ok and report.headers >= 1, report.format()
