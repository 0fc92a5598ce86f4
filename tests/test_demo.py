"""`make demo` end to end (the same command the Makefile runs), on the sample shipped in demo/."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_runs_the_whole_pipeline_and_learns(tmp_path):
    out = tmp_path / "demo-output"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nystromformer.cli", "demo", "--output", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO / "code")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()

    rows = {m.group(1) + "/" + m.group(2): (float(m.group(3)), float(m.group(4))) for m in re.finditer(
        r"\| (tiny-\d+) \| (cp-\d+\.model) \| [0-9.]+ \| ([0-9.]+) \| ([0-9.]+) \|", summary)}
    accuracy, baseline = rows["tiny-128/cp-0009.model"]  # baseline: always the commonest token of the same masks
    assert accuracy > 2 * baseline
    accuracy, baseline = rows["tiny-512/cp-0001.model"]
    assert accuracy > 2 * baseline  # the warm start kept what 128 learnt
    score, majority = map(float, re.search(r"\| SST-2 \(demo sample\) \| accuracy \| ([0-9.]+) \| ([0-9.]+) \|",
                                           summary).groups())
    assert score > majority + 0.1

    log = [json.loads(line) for line in (out / "tiny-128" / "model" / "pretrain_output.log").read_text().splitlines()]
    kinds = [e["type"] for e in log]
    assert "preempted" in kinds and "resume" in kinds
    assert [e["step"] for e in log if e["type"] == "train"] == list(range(1, 401))
    warm = [e for e in map(json.loads, (out / "tiny-512" / "model" / "pretrain_output.log").read_text().splitlines())
            if e["type"] == "warm_start"]
    assert warm and warm[0]["checkpoint"].endswith("cp-0009.model")
    assert (out / "loss-curves.png").stat().st_size > 10_000
    assert (out / "tiny-128" / "model" / "glue").is_dir()
    check_summary_against_its_sources(out, summary, majority)


def check_summary_against_its_sources(out, summary, majority):
    """Each figure of summary.md is the one its source holds, computed again here."""
    import csv
    from collections import Counter

    for name in ("tiny-128", "tiny-512"):
        for e in map(json.loads, (out / name / "model" / "validation_output.log").read_text().splitlines()):
            assert (f"| {name} | {e['checkpoint']} | {e['loss']:.3f} | {e['mlm_accu']:.3f} | "
                    f"{e['commonest_token_accu']:.3f} |") in summary, e
    with open(out / "glue" / "SST-2" / "dev.tsv", newline="") as f:
        labels = [row["label"] for row in csv.DictReader(f, delimiter="\t")]
    assert majority == pytest.approx(Counter(labels).most_common(1)[0][1] / len(labels), abs=5e-4)
    # The folder is marked as the demo's, so the next `make demo` may replace it (and only such a folder).
    from nystromformer import demo
    assert (out / demo.MARKER).is_file()
    demo.check_output(out)


def test_demo_refuses_to_delete_a_folder_it_did_not_write(tmp_path):
    precious = tmp_path / "results"
    precious.mkdir()
    (precious / "keep.txt").write_text("important")
    proc = subprocess.run([sys.executable, "-m", "nystromformer.cli", "demo", "--output", str(precious)],
                          capture_output=True, text=True, cwd=REPO / "code")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "is not a demo output folder" in proc.stderr
    assert (precious / "keep.txt").read_text() == "important"


def test_demo_output_under_a_file_is_one_error_line(tmp_path):
    (tmp_path / "notes.txt").write_text("a file")
    proc = subprocess.run([sys.executable, "-m", "nystromformer.cli", "demo", "--output",
                           str(tmp_path / "notes.txt" / "demo")], capture_output=True, text=True, cwd=REPO / "code")
    assert proc.returncode == 2 and proc.stderr == (f"error: --output {tmp_path / 'notes.txt' / 'demo'}: "
                                                    f"{tmp_path / 'notes.txt'} is a file, not a folder\n")


def test_a_second_demo_into_the_folder_of_a_running_one_is_refused_and_deletes_nothing(tmp_path):
    import fcntl

    from nystromformer import demo
    out = tmp_path / "demo-output"
    out.mkdir()
    (out / "tiny-128").mkdir()
    (out / "tiny-128" / "config.json").write_text("{}")  # a running demo's files
    with open(out / demo.MARKER, "a") as held:  # held as a running demo holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.run([sys.executable, "-m", "nystromformer.cli", "demo", "--output", str(out)],
                              capture_output=True, text=True, cwd=REPO / "code")
    assert proc.returncode == 2 and "another demo is running in this folder" in proc.stderr
    assert (out / "tiny-128" / "config.json").read_text() == "{}"


def test_a_demo_folder_is_emptied_before_a_new_run(tmp_path):
    from nystromformer import demo
    out = tmp_path / "demo-output"
    out.mkdir()
    (out / demo.MARKER).write_text("old")
    (out / "stale").mkdir()
    (out / "stale" / "x.txt").write_text("from the last run")
    (out / "summary.md").write_text("old summary")
    with demo.claimed_output(out):
        assert [p.name for p in out.iterdir()] == [demo.MARKER]
        assert "written by `nystromformer demo`" in (out / demo.MARKER).read_text()


def test_on_a_file_system_without_locks_the_demo_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    import errno

    from nystromformer import demo

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(demo.atomic.fcntl, "flock", no_locks)
    with demo.claimed_output(tmp_path / "demo-output"):
        assert (tmp_path / "demo-output" / demo.MARKER).is_file()
    assert "does not support locks" in capsys.readouterr().err


def test_emptying_a_demo_folder_unlinks_a_symlink_in_it_and_leaves_what_it_points_to(tmp_path):
    from nystromformer import demo
    out = tmp_path / "demo-output"
    out.mkdir()
    (out / demo.MARKER).write_text("old")
    elsewhere = tmp_path / "corpus"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the demo's")
    (out / "corpus").symlink_to(elsewhere, target_is_directory=True)
    with demo.claimed_output(out):
        assert [p.name for p in out.iterdir()] == [demo.MARKER]
    assert (elsewhere / "keep.txt").read_text() == "not the demo's"
