"""The files users copy (examples/kubernetes, examples/skypilot) run as written: every Kubernetes manifest validates
against its project's CRD as a strict API server validates it (unknown fields refused, required fields present), every
output directory is on a mounted volume (or mirrored), each manifest maps trl_ext's exit codes to its orchestrator's
restarts (a lost peer restarts, an error of the run's own does not), each pod gets its own machine index, and every
SkyPilot task passes SkyPilot's own parser (.ci/skypilot.sh installs it). The docs include these files, so the two
cannot drift.

The CRDs are read from ../shared/crds beside the repository (kubeflow/trainer, jobset, lws, kuberay; not part of the
project); without them the schema tests are skipped, saying so. What a schema cannot say is not checked here: the
CEL rules (x-kubernetes-validations) and the admission webhooks of each project.
"""

import copy
import functools
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
CRDS = Path(os.environ.get("TRL_EXT_CRDS", REPO.parent / "shared" / "crds"))  # another folder of CRDs: TRL_EXT_CRDS
KUBERNETES = sorted((REPO / "examples" / "kubernetes").glob("*.yaml"))
SKYPILOT = sorted((REPO / "examples" / "skypilot").glob("*.yaml"))
# trl_ext's exit codes (trl_ext/launching/restart.py, failure_limit.py, errors.UsageError), written here as the
# manifests must say them
LOST, ERROR, GAVE_UP, USAGE, TERMINATED = 200, 201, 202, 1, 143
ROOT_METADATA = {"name", "namespace", "labels", "annotations"}


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_documents() -> list[tuple[str, dict]]:
    return [(f"{path.name}:{doc['kind']}", doc) for path in KUBERNETES for doc in documents(path)]


def strict(schema):
    """An openAPIV3Schema as JSON Schema that a strict API server's rules match: an object refuses fields its schema
    does not name unless it says x-kubernetes-preserve-unknown-fields; int-or-string admits both; nullable admits
    null."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: strict(value) for key, value in schema.items() if key not in ("format", "default")}
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("type") == "object" and not schema.get("x-kubernetes-preserve-unknown-fields") \
            and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@functools.cache  # 4 MB of YAML: read once per session
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the version's strict schema, for every CRD in ../shared/crds."""
    found = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # libyaml: 10x
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked in validation_errors
            found[(f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])] = schema
    return found


def validation_errors(schema: dict, doc: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]
    extra = set(doc.get("metadata", {})) - ROOT_METADATA
    return errors + ([f"metadata: unexpected {sorted(extra)}"] if extra else [])


needs_crds = pytest.mark.skipif(not CRDS.is_dir(), reason=f"no CRDs at {CRDS} (a checkout of the project with shared/ "
                                                          "beside it has them)")


def test_every_orchestrator_has_an_example():
    kinds = {doc["kind"] for _, doc in all_documents()}
    assert {"TrainJob", "JobSet", "LeaderWorkerSet", "RayJob"} <= kinds, kinds
    assert SKYPILOT, "no SkyPilot task in examples/skypilot"


@needs_crds
def test_the_strict_validation_refuses_what_a_strict_api_server_refuses():
    # the defects issue 64 found in the docs' earlier manifests, each refused here
    schemas = crd_schemas()
    jobset = next(doc for _, doc in all_documents() if doc["kind"] == "JobSet")
    nameless = copy.deepcopy(jobset)
    del nameless["spec"]["failurePolicy"]["rules"][0]["name"]
    assert any("'name' is a required property" in e
               for e in validation_errors(schemas[("jobset.x-k8s.io/v1alpha2", "JobSet")], nameless))
    rayjob = copy.deepcopy(next(doc for _, doc in all_documents() if doc["kind"] == "RayJob"))
    rayjob["spec"]["submissionId"] = "dpo-run-1"
    assert any("'submissionId' was unexpected" in e
               for e in validation_errors(schemas[("ray.io/v1", "RayJob")], rayjob))
    container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")  # a typo deep inside the embedded PodTemplate
    assert any("'volumeMount' was unexpected" in e
               for e in validation_errors(schemas[("jobset.x-k8s.io/v1alpha2", "JobSet")], jobset))


@needs_crds
@pytest.mark.parametrize("name,doc", all_documents(), ids=[name for name, _ in all_documents()])
def test_every_manifest_validates_against_its_crd(name, doc):
    schemas = crd_schemas()
    if doc["kind"] == "PersistentVolumeClaim":  # core Kubernetes: no CRD; what the runs need of it
        assert doc["apiVersion"] == "v1" and "ReadWriteMany" in doc["spec"]["accessModes"]
        return
    if doc["kind"] == "TrainingRuntime" and ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime") not in schemas:
        # Without TrainingRuntime's CRD (shared/crds has TrainJob's): its template is a JobSet's (JobSetTemplateSpec),
        # validated with JobSet's schema; the rest by hand, as Kubeflow Trainer's CRD (8c0f5059b) defines it.
        assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and set(doc) == {"apiVersion", "kind", "metadata",
                                                                                     "spec"}
        assert set(doc["spec"]) == {"mlPolicy", "template"} and set(doc["spec"]["template"]) == {"spec"}
        assert set(doc["spec"]["mlPolicy"]) <= {"numNodes", "torch"} and set(doc["spec"]["mlPolicy"]["torch"]) <= {
            "envInjection"}
        jobset = schemas[("jobset.x-k8s.io/v1alpha2", "JobSet")]
        as_jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "runtime"},
                     "spec": doc["spec"]["template"]["spec"]}
        assert validation_errors(jobset, as_jobset) == []
        return
    key = (doc["apiVersion"], doc["kind"])
    assert key in schemas, f"{name}: no CRD for {key} in {CRDS}"
    assert validation_errors(schemas[key], doc) == []


def pod_specs(node, path=""):
    """Every pod spec (a mapping with ``containers``) inside ``node``, with where it is."""
    if isinstance(node, dict):
        if "containers" in node and isinstance(node["containers"], list):
            yield path, node
        for key, value in node.items():
            yield from pod_specs(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from pod_specs(value, f"{path}[{index}]")


def trainjob_pod(doc: dict) -> dict:
    """The pod spec a TrainJob's runtime patch gives its trainer's pods."""
    patch = doc["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    return patch["template"]["spec"]["template"]["spec"]


def claimed(volumes: list[dict]) -> set[str]:
    """The persistent volume claims among ``volumes``."""
    return {v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}


def output_dir(words: list[str]) -> str | None:
    return words[words.index("--output_dir") + 1] if "--output_dir" in words else None


def command_words(container: dict) -> list[str]:
    words = [*container.get("command", []), *container.get("args", [])]
    if words[:2] == ["bash", "-c"]:
        words = shlex.split(words[2].replace("\\\n", " "), comments=True)
    return words


def mounted(path: str, mounts: list[dict], volumes: list[dict]) -> bool:
    claims = {v["name"] for v in volumes if "persistentVolumeClaim" in v}
    return any(m["name"] in claims and (path + "/").startswith(m["mountPath"].rstrip("/") + "/") for m in mounts)


@pytest.mark.parametrize("name,doc", all_documents(), ids=[name for name, _ in all_documents()])
def test_every_output_dir_is_on_a_mounted_shared_volume(name, doc):
    claims = {d["metadata"]["name"] for _, d in all_documents() if d["kind"] == "PersistentVolumeClaim"}
    if doc["kind"] == "TrainJob":
        out = output_dir(doc["spec"]["trainer"]["command"] + doc["spec"]["trainer"]["args"])
        spec = trainjob_pod(doc)
        container = next(c for c in spec["containers"] if c["name"] == "node")
        assert out and mounted(out, container["volumeMounts"], spec["volumes"]), out
        assert claimed(spec["volumes"]) <= claims
        return
    if doc["kind"] == "RayJob":
        out = output_dir(shlex.split(doc["spec"]["entrypoint"]))
        specs = list(pod_specs(doc["spec"]["rayClusterSpec"]))
        assert out and len(specs) == 2, (out, specs)  # the head and the worker group: the driver and every worker
        for where, spec in specs:
            for container in spec["containers"]:
                assert mounted(out, container.get("volumeMounts", []), spec.get("volumes", [])), where
        return
    for where, spec in pod_specs(doc.get("spec", {})):
        for container in spec["containers"]:
            out = output_dir(command_words(container)) if "command" in container else None
            if out:
                assert mounted(out, container.get("volumeMounts", []), spec.get("volumes", [])), (where, out)
                assert claimed(spec["volumes"]) <= claims


def jobset_layouts():
    docs = [doc for _, doc in all_documents() if doc["kind"] in ("JobSet", "TrainingRuntime")]
    return [(doc, doc["spec"]["template"]["spec"] if doc["kind"] == "TrainingRuntime" else doc["spec"]) for doc in docs]


def test_jobsets_restart_a_lost_peer_and_never_an_error_of_the_runs_own():
    assert jobset_layouts()
    for doc, spec in jobset_layouts():
        policy = spec["failurePolicy"]
        # 200 (a lost peer), 143 (preempted): no rule matches, JobSet restarts; trl_ext's rule (202) bounds the
        # restarts, since maxRestarts counts every restart, even one after new checkpoints
        assert policy["maxRestarts"] > 3 * 10
        # with the default Recreate a new pod can start while an old one still saves its SIGTERM checkpoint
        assert policy["restartStrategy"] == "BlockingRecreate"
        assert [r["action"] for r in policy["rules"]] == ["FailJobSet"]
        assert policy["rules"][0]["onJobFailureReasons"] == ["PodFailurePolicy"]
        # JobSet's validating webhook refuses other rule names (kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go,
        # ruleNameFmt); the CRD says so only in a description, and a TrainJob's JobSet is then never created
        for rule in policy["rules"]:
            assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule.get("name", "a")), rule
        for job in spec["replicatedJobs"]:
            job_spec = job["template"]["spec"]
            assert job_spec["backoffLimit"] == 0 and job_spec["template"]["spec"]["restartPolicy"] == "Never"
            rules = job_spec["podFailurePolicy"]["rules"]
            fail = [r for r in rules if r["action"] == "FailJob"]
            assert len(fail) == 1 and fail[0]["onExitCodes"]["operator"] == "In"
            assert set(fail[0]["onExitCodes"]["values"]) == {USAGE, ERROR, GAVE_UP}  # never LOST, TERMINATED


def test_leaderworkerset_restarts_only_what_a_restart_can_fix():
    doc = next(doc for _, doc in all_documents() if doc["kind"] == "LeaderWorkerSet")
    assert doc["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    script = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["command"][2]
    stays = re.search(r"^\s*([\d|]+)\) .*\n.*sleep infinity & wait", script, re.M)
    assert stays and set(map(int, stays.group(1).split("|"))) == {0, USAGE, ERROR, GAVE_UP}, script
    assert "trap 'kill -TERM $pid' TERM" in script  # SIGTERM reaches the recipe (its checkpoint) through the shell


def test_rayjob_has_an_identity_and_retries():
    doc = next(doc for _, doc in all_documents() if doc["kind"] == "RayJob")
    assert doc["spec"]["jobId"] and doc["spec"]["backoffLimit"] >= 1
    # without a declared Ray >= 2.53, KubeRay's liveness and readiness probes exec `wget` in the image
    # (ray-project/kuberay ray-operator/controllers/ray/common/pod.go)
    version = doc["spec"]["rayClusterSpec"]["rayVersion"]
    assert Version(version) >= Version("2.53"), version


def pod_env(container: dict, labels: dict) -> dict:
    """A container's environment as Kubernetes gives it, the downward API's labels resolved."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            label = re.fullmatch(r"metadata\.labels\['(.+)'\]", item["valueFrom"]["fieldRef"]["fieldPath"]).group(1)
            env[item["name"]] = labels[label]
    return env


@pytest.mark.parametrize("kind", ["TrainJob", "JobSet", "LeaderWorkerSet"])
def test_each_pod_gets_its_own_machine_index(kind, monkeypatch):
    from trl_ext.placement import orchestrators

    doc = next(doc for _, doc in all_documents() if doc["kind"] == kind)
    name = doc["metadata"]["name"]
    pods = []
    if kind == "JobSet":
        job = doc["spec"]["replicatedJobs"][0]
        container = job["template"]["spec"]["template"]["spec"]["containers"][0]
        for index in range(job["replicas"]):  # one pod per Job: every completion index is 0
            labels = {"jobset.sigs.k8s.io/job-index": str(index), "jobset.sigs.k8s.io/jobset-name": name}
            pods.append({**pod_env(container, labels), "JOB_COMPLETION_INDEX": "0",
                         "HOSTNAME": f"{name}-{job['name']}-{index}-0"})
        assert pods[0]["PET_MASTER_ADDR"] == f"{name}-{job['name']}-0-0.{name}"  # the first pod's host name
    elif kind == "TrainJob":  # what Kubeflow Trainer's torch plugin sets in each pod of replicated Job "node"
        nodes = doc["spec"]["trainer"]["numNodes"]
        for index in range(nodes):
            pods.append({"PET_NNODES": str(nodes), "PET_NODE_RANK": str(index), "PET_MASTER_PORT": "29400",
                         "PET_NPROC_PER_NODE": str(doc["spec"]["trainer"]["numProcPerNode"]),
                         "PET_MASTER_ADDR": f"{name}-node-0-0.{name}"})
    else:
        size = doc["spec"]["leaderWorkerTemplate"]["size"]
        container = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        for index in range(size):  # what LeaderWorkerSet sets in every pod of group 0
            pods.append({**pod_env(container, {}), "LWS_LEADER_ADDRESS": f"{name}-0.{name}.default",
                         "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)})
    seen = []
    for env in pods:
        with monkeypatch.context() as patched:
            for key in [k for k in os.environ if k.startswith(("PET_", "LWS_", "JOB", "SKYPILOT_",
                                                                            "SLURM_", "RANK", "WORLD_SIZE"))]:
                patched.delenv(key)
            for key, value in env.items():
                patched.setenv(key, value)
            job = orchestrators.current()
        assert job is not None and not job.per_rank and job.nodes == len(pods), job
        seen.append((job.node_rank, job.run))
    # each pod its own index; one identity for the run, the same when the orchestrator recreates the pods
    assert [rank for rank, _ in seen] == list(range(len(pods))) and len({run for _, run in seen}) == 1, seen
    assert seen[0][1] == {"TrainJob": f"trainjob-{name}", "JobSet": f"jobset-{name}",
                          "LeaderWorkerSet": f"lws-{name}-0"}[kind]


def sky_tasks():
    return [(path.name, yaml.safe_load(path.read_text())) for path in SKYPILOT]


@pytest.mark.parametrize("name,task", sky_tasks(), ids=[name for name, _ in sky_tasks()])
def test_skypilot_tasks_bring_the_code_keep_the_checkpoints_and_map_exit_codes(name, task):
    assert task["workdir"] == "." and "pip install -e" in task["setup"]  # the recipes and trl_ext, on a fresh VM
    words = shlex.split(task["run"].replace("\\\n", " "))
    out = output_dir(words)
    mounts = task.get("file_mounts") or {}
    bucket = next((m for path, m in mounts.items() if (out + "/").startswith(path.rstrip("/") + "/")), None)
    if bucket is not None:  # a bucket: only a mode that renames (MOUNT cannot)
        assert isinstance(bucket, dict) and bucket["mode"] == "MOUNT_CACHED", bucket
    else:  # a local disk: the checkpoints outlive the VM in a mirror, and one VM (a mirror needs a shared directory)
        assert "--checkpoint_mirror" in words and task.get("num_nodes", 1) == 1
        assert words[words.index("--resume_from_checkpoint") + 1] == "true"
    if "--checkpoint_mirror" in words:  # a bucket needs its cloud's role: a recovery elsewhere could not reach it
        assert task["resources"].get("infra") or task["resources"].get("cloud"), task["resources"]
    recovery = task["resources"]["job_recovery"]
    assert recovery["max_restarts_on_errors"] == 0  # 201, 202 and 1: not restarted (nor is any other code)
    assert set(recovery["recover_on_exit_codes"]) == {TERMINATED, LOST}


@pytest.mark.parametrize("path", SKYPILOT, ids=lambda p: p.name)
def test_skypilot_parses_every_task(path, monkeypatch):
    sky = pytest.importorskip("sky", reason="SkyPilot is not installed here; .ci/skypilot.sh installs it and runs this")
    monkeypatch.chdir(REPO)  # workdir: . is the repository, as `sky jobs launch` from its root
    task = sky.Task.from_yaml(str(path))
    assert task.name and task.run and task.workdir == "."


def test_the_docs_include_every_example():
    included = set()
    for page in (REPO / "docs").glob("*.md"):
        included |= set(re.findall(r'--8<-- "(examples/[^"]+)"', page.read_text()))
    expected = {str(p.relative_to(REPO)) for p in [*KUBERNETES, *SKYPILOT]}
    assert expected <= included, sorted(expected - included)


def _lws_script(stand_in: str) -> str:
    """The LeaderWorkerSet example's command, its recipe replaced by ``stand_in`` (a shell command)."""
    doc = next(doc for _, doc in all_documents() if doc["kind"] == "LeaderWorkerSet")
    script = doc["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["command"][2]
    recipe = re.search(r"^python recipes/.*?&$", script, re.M | re.S)
    assert recipe, script
    return script.replace(recipe.group(0), f"{stand_in} &")


@pytest.mark.parametrize("code,exits", [(200, True), (143, True), (0, False), (1, False), (201, False), (202, False)])
def test_the_leaderworkerset_command_passes_on_only_what_a_restart_can_fix(code, exits):
    import signal
    import subprocess
    import sys

    shell = subprocess.Popen(["bash", "-c", _lws_script(f"{sys.executable} -c 'import sys; sys.exit({code})'")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        if exits:
            assert shell.wait(timeout=20) == code  # Kubernetes sees it: the group is recreated
        else:
            line = shell.stdout.readline()  # said once the recipe has ended; then the pod stays
            assert line.startswith(f"[trl_ext] exit {code}: not restarted"), line
            with pytest.raises(subprocess.TimeoutExpired):
                shell.wait(timeout=0.5)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
        shell.communicate()


def test_the_leaderworkerset_command_passes_sigterm_on_to_the_recipe(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    mark = tmp_path / "signalled"
    recipe = (f"{sys.executable} -c \"import signal, sys, time, pathlib; signal.signal(signal.SIGTERM, lambda *a: "
              f"(pathlib.Path('{mark}').write_text('x'), sys.exit(143))); print('ready', flush=True); time.sleep(60)\"")
    shell = subprocess.Popen(["bash", "-c", _lws_script(recipe)], stdout=subprocess.PIPE, text=True)
    assert shell.stdout.readline().strip() == "ready"  # the recipe runs, and the shell has its trap
    time.sleep(0.5)
    shell.send_signal(signal.SIGTERM)  # the kubelet's SIGTERM goes to the container's first process: the shell
    assert shell.wait(timeout=20) == 143 and mark.read_text() == "x"  # the recipe got it (its checkpoint), and 143


def test_the_leaderworkerset_command_idles_as_pid_1_and_ends_at_once_on_sigterm():
    """After a run that is not restarted (0, 1, 201) the pod stays, idle; the shell is the container's PID 1, which
    the kernel gives no default signal handling: an idle ``exec sleep infinity`` ignored the kubelet's SIGTERM, and
    ``kubectl delete`` waited out the whole grace period (120 s). Run in a PID namespace of its own, as a container."""
    import shutil
    import signal
    import subprocess
    import sys
    import time

    if shutil.which("unshare") is None or subprocess.run(["unshare", "-U", "-r", "-p", "-f", "--mount-proc", "true"],
                                                         capture_output=True).returncode != 0:
        pytest.skip("no PID namespace here (unshare)")
    script = _lws_script(f"{sys.executable} -c 'import sys; sys.exit(201)'")
    shell = subprocess.Popen(["unshare", "-U", "-r", "-p", "-f", "--mount-proc", "--kill-child", "bash", "-c",
                              f"echo pid $$; {script}"], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert shell.stdout.readline().strip() == "pid 1"  # the shell is the namespace's init, as in a container
        assert shell.stdout.readline().startswith("[trl_ext] exit 201: not restarted")
        time.sleep(0.5)  # idle
        init = int(subprocess.run(["pgrep", "-P", str(shell.pid)], capture_output=True, text=True).stdout.split()[0])
        start = time.monotonic()
        os.kill(init, signal.SIGTERM)  # the kubelet's SIGTERM, to the container's PID 1
        # about 0.01 s alone; before, never (the kubelet's SIGKILL after 120 s). The bound leaves CI's load room.
        assert shell.wait(timeout=30) == 201 and time.monotonic() - start < 10
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
        shell.communicate()


def _trainer_pods():
    """(where, pod spec, the trainer's container resources) of every multi-GPU pod the examples start themselves
    (KubeRay mounts its own /dev/shm): a TrainJob's pods are its runtime patch's, with its resourcesPerNode."""
    for name, doc in all_documents():
        if doc["kind"] == "TrainJob":
            yield name, trainjob_pod(doc), doc["spec"]["trainer"]["resourcesPerNode"]
        elif doc["kind"] in ("JobSet", "LeaderWorkerSet"):
            for where, spec in pod_specs(doc["spec"]):
                yield f"{name}{where}", spec, spec["containers"][0].get("resources", {})


def test_multi_gpu_pods_have_memory_backed_shm_and_request_cpu_and_memory():
    pods = list(_trainer_pods())
    assert len(pods) == 3, [where for where, *_ in pods]  # the JobSet, the LeaderWorkerSet, the TrainJob
    for where, spec, resources in pods:
        shm = [v["name"] for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert len(shm) == 1 and mounts.get(shm[0]) == "/dev/shm", where  # 8 ranks' NCCL buffers, not 64 MiB
        assert {"cpu", "memory"} <= set(resources.get("requests", {})), where  # not BestEffort


def _memory_tier_pods():
    """(where, the trainer's words, its env, its pod spec) of every example pod that trains on several machines: a
    TrainJob's from its trainer and runtime patch, a RayJob's workers with the entrypoint's words."""
    for name, doc in all_documents():
        if doc["kind"] == "TrainJob":
            trainer = doc["spec"]["trainer"]
            yield name, [*trainer["command"], *trainer["args"]], trainer.get("env", []), trainjob_pod(doc)
        elif doc["kind"] in ("JobSet", "LeaderWorkerSet"):
            for where, spec in pod_specs(doc["spec"]):
                container = spec["containers"][0]
                yield f"{name}{where}", command_words(container), container.get("env", []), spec
        elif doc["kind"] == "RayJob":
            words = shlex.split(doc["spec"]["entrypoint"])
            for group in doc["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
                spec = group["template"]["spec"]
                yield f"{name}:{group['groupName']}", words, spec["containers"][0].get("env", []), spec


def test_every_multi_machine_example_keeps_memory_checkpoints_where_a_recreated_pod_on_its_node_finds_them():
    """A pod's own /dev/shm goes with the pod, and Kubeflow, JobSet, LeaderWorkerSet and KubeRay recreate pods when a
    machine is lost: the memory tier is the node's shared memory (a hostPath under /dev/shm), mounted where
    TRL_EXT_MEMORY_DIR says."""
    pods = list(_memory_tier_pods())
    assert len(pods) == 4, [where for where, *_ in pods]  # TrainJob, JobSet, LeaderWorkerSet, RayJob's workers
    for where, words, env, spec in pods:
        assert "--memory_checkpoint_steps" in words, where
        memory = {e["name"]: e.get("value") for e in env}.get("TRL_EXT_MEMORY_DIR")
        mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
        volume = next((v for v in spec["volumes"] if v["name"] == mounts.get(memory)), None)
        assert volume is not None and volume.get("hostPath", {}).get("path", "").startswith("/dev/shm/"), where
        assert volume["hostPath"].get("type") == "DirectoryOrCreate", where  # a new node has none yet
