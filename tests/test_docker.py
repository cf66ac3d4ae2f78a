"""docker/: no Docker engine here, so validate statically: the Dockerfile parses, every file it copies and
every script the launch examples reference exists, and every shell script passes `bash -n`."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
INSTRUCTIONS = {"FROM", "ARG", "ENV", "WORKDIR", "COPY", "ADD", "RUN", "ENTRYPOINT", "CMD", "LABEL", "USER",
                "EXPOSE", "VOLUME", "SHELL", "HEALTHCHECK", "STOPSIGNAL", "ONBUILD"}


def dockerfile_instructions(path: Path):
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").rstrip() + " "
        if not line.rstrip().endswith("\\"):
            logical.append(current.strip())
            current = ""
    assert not current, "dangling line continuation"
    return [tuple(item.split(None, 1)) for item in logical]


def test_dockerfile_parses_and_copies_existing_files():
    instrs = dockerfile_instructions(DOCKER / "Dockerfile")
    names = [i[0] for i in instrs]
    assert all(n in INSTRUCTIONS for n in names), names
    assert names[names.index("FROM") - 1] == "ARG" or names[0] == "FROM"
    base = next(args for name, args in instrs if name == "ARG" and args.startswith("BASE_IMAGE="))
    assert base.split("=", 1)[1].startswith("nvcr.io/nvidia/pytorch:")
    copies = [args.split()[:-1] for name, args in instrs if name == "COPY"]
    assert copies
    for sources in copies:
        for src in sources:
            assert (ROOT / src).exists(), f"COPY source {src} does not exist"
    assert any("pip install" in args and ".[deepspeed,megatron,hf,bench]" in args for n, args in instrs if n == "RUN")
    entry = next(args for name, args in instrs if name == "ENTRYPOINT")
    assert "moe-plugins-entrypoint" in entry


SCRIPTS = sorted(DOCKER.rglob("*.sh")) + [DOCKER / "launch" / "slurm.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_pass_bash_n(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed on this machine")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_pass_shellcheck(script):
    proc = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_launch_examples_reference_existing_files():
    text = "\n".join(p.read_text() for p in (DOCKER / "launch").iterdir())
    for ref in set(re.findall(r"(recipes/configs/[\w.]+\.json|docker/launch/[\w.]+)", text)):
        assert (ROOT / ref).exists(), ref
    assert "moe_plugins.recipes.train_deepspeed" in text
    hosts = [l for l in (DOCKER / "launch" / "hostfile").read_text().splitlines() if l and not l.startswith("#")]
    assert hosts and all(re.fullmatch(r"\S+ slots=\d+", h) for h in hosts)
