"""The benchmark tools triage_kernels, tokenize_throughput, launch_count, saved_memory and
glue_batch_dependence: a case or row that fails, hangs or is stopped loses none of the others, and their
arguments are checked before anything slow runs. Child processes and heavy steps are replaced by fakes where the
behaviour under test is the script's own, so each test takes seconds."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_bench import REPO, SIGTERM_AT_THIRD_CALL, run_injected, run_script, table_rows

BENCH = REPO / "bench"


def main_exit(monkeypatch, capsys, module_name: str, *argv: str) -> tuple[int, str]:
    """bench/<module_name>.py's main() run here with ``argv``: (its exit status, its stderr)."""
    monkeypatch.syspath_prepend(str(BENCH))
    module = __import__(module_name)
    monkeypatch.setattr(sys, "argv", [f"bench/{module_name}.py", *argv])
    with pytest.raises(SystemExit) as stop:
        module.main()
    return stop.value.code, capsys.readouterr().err


# --- triage_kernels: one process per case -------------------------------------------------------------------------

# Stands in for `triage_kernels.py --case SPEC` (the script's own file, which the table runs once per case): an
# "lk" case hangs, a "core" case faults, the others print their errors.
FAKE_CASE = """
import sys, time
spec = sys.argv[-1]
if spec.startswith("lk"):
    time.sleep(120)
if spec.startswith("core"):
    sys.exit("RuntimeError: CUDA error: an illegal memory access was encountered")
print("rel. errors vs fp64 reference (out, grads): 1.0e-07, 2.0e-07")
"""
# compute-sanitizer: hangs on the "lk" case, names a bad read on the others
FAKE_SANITIZER = """
import sys, time
print("========= COMPUTE-SANITIZER", flush=True)
if sys.argv[-1].startswith("lk"):
    time.sleep(120)
print("========= Invalid __global__ read of size 4 bytes")
"""


def run_triage(tmp_path, *args, path=None):
    fake = tmp_path / "fake_case.py"
    fake.write_text(FAKE_CASE)
    return run_injected("triage_kernels", f"module.__file__ = {str(fake)!r}", *args, TRITON_INTERPRET="1",
                        PATH=path or str(tmp_path / "empty"))


def test_triage_a_hung_case_is_a_timed_out_row_and_the_others_are_still_reported(tmp_path):
    sanitizer = tmp_path / "bin" / "compute-sanitizer"
    sanitizer.parent.mkdir()
    sanitizer.write_text(f"#!{sys.executable}\n{FAKE_SANITIZER}")
    sanitizer.chmod(0o755)
    proc = run_triage(tmp_path, "--cases", "lq:fp32:16:200", "lk:fp32:16:200", "core:fp32:16:200",
                      "--timeout", "3", "--sanitize", "2", "--sanitize-timeout", "3", path=str(sanitizer.parent))
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert table_rows(lines) == [
        ["lq:fp32:16:200", "ok rel. errors vs fp64 reference (out, grads): 1.0e-07, 2.0e-07"],
        ["lk:fp32:16:200", "timed out after 3 s"],
        ["core:fp32:16:200", "RuntimeError: CUDA error: an illegal memory access was encountered"]]
    # Both failing cases go to compute-sanitizer: the hung run is said so, and the next one still runs.
    assert "# compute-sanitizer timed out after 3 s" in lines
    assert lines.index("# compute-sanitizer timed out after 3 s") < lines.index(
        "========= Invalid __global__ read of size 4 bytes")
    assert lines[-1] == "2 of 3 cases failed or timed out: lk:fp32:16:200 core:fp32:16:200"


def test_triage_without_compute_sanitizer_says_so_after_the_table(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_triage(tmp_path, "--cases", "lq:fp32:16:200", "core:fp32:16:200", "--sanitize", "1")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert [r[0] for r in table_rows(proc.stdout.splitlines())] == ["lq:fp32:16:200", "core:fp32:16:200"]
    assert re.search(r"^# compute-sanitizer could not start: FileNotFoundError: .*\(is the CUDA toolkit's bin "
                     r"folder on PATH\?\)$", proc.stdout, re.M), proc.stdout


def test_triage_stopped_at_its_time_limit_kills_its_cases_and_keeps_the_rows_it_has(tmp_path):
    (tmp_path / "empty").mkdir()
    fake = tmp_path / "fake_case.py"
    fake.write_text(FAKE_CASE)
    # SIGTERM (gpu_session.sh's time limit) 3 s in: the lq case has finished, the lk case hangs
    patch = (f"module.__file__ = {str(fake)!r}\nimport threading\n"
             "threading.Timer(3, os.kill, (os.getpid(), signal.SIGTERM)).start()")
    started = time.monotonic()
    proc = run_injected("triage_kernels", patch, "--cases", "lq:fp32:16:200", "lk:fp32:16:200", "core:fp32:16:200",
                        TRITON_INTERPRET="1", PATH=str(tmp_path / "empty"))
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert time.monotonic() - started < 60  # the hung case was killed, not waited for (120 s)
    lines = proc.stdout.splitlines()
    assert [r[0] for r in table_rows(lines)] == ["lq:fp32:16:200"]
    assert lines[-1] == ("Stopped (a time limit or Ctrl-C) during the table of cases: the rows above are those "
                         "measured before it.")


@pytest.mark.parametrize("case, says", [
    ("lk:fp32:16:200:num_warps=4", "lk takes no override 'num_warps'"),
    ("layer-fused:bf16:64:512:BLOCK_K=32", "layer-fused takes no override 'BLOCK_K'"),
    ("core:fp32:16:200:BLOCK_K=32", "core takes no override 'BLOCK_K' (it takes num_warps)"),
    ("lq:fp32:16:200:BLOCK_K=x", "override 'BLOCK_K=x' is not BLOCK_K=INTEGER"),
    ("lq:fp64:16:200", "dtype 'fp64' is not one of bf16, fp32")])
def test_triage_refuses_a_case_it_would_not_run_as_written(monkeypatch, capsys, case, says):
    status, err = main_exit(monkeypatch, capsys, "triage_kernels", "--cases", case)
    assert status == 2 and f"--cases {case}: {says}" in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_triage_table_without_a_gpu_asks_for_one_or_the_interpreter(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    status, err = main_exit(monkeypatch, capsys, "triage_kernels", "--cases", "lq:fp32:16:200")
    assert status == 2
    assert "the table runs each case on a CUDA GPU, and none is available here" in err
    assert "TRITON_INTERPRET=1" in err


# --- tokenize_throughput: each mode's own memory and cores ---------------------------------------------------------

# build_shards replaced: the "library" mode holds 300 MB itself and 200 MB in a worker process for half a second;
# "word-cache" holds nothing. Each "encodes" 2M tokens in about a second. Partitions of 1 MB, a machine of 8 cores.
FAKE_BUILD = """
import subprocess, time
MB = 1 << 20
real_generate = module.generate_corpus
module.generate_corpus = lambda folder, words, size_mb, **kw: real_generate(folder, words, size_mb, part_mb=1)
os.cpu_count = lambda: 8
HOLD = "import sys, time; b = bytearray(200 << 20); b[::4096] = b'x' * (200 << 8); print(flush=True); time.sleep(60)"

def build_shards(datasets, output, tokenizer, seq_len=512, workers=1, **options):
    started = time.perf_counter()
    if os.environ["NYSTROMFORMER_NO_WORD_CACHE"] == "1":
        if os.environ.get("PLANT_FAILURE"):
            raise ValueError("planted")
        held = bytearray(300 * MB)
        held[::4096] = b"x" * (300 * MB // 4096)
        worker = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE)
        worker.stdout.readline()
        time.sleep(0.5)
        worker.kill()
        worker.wait()
        del held
    time.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))
    return {"datasets": {"bench": {"tokens": 2_000_000}}}
module.build_shards = build_shards
"""


def run_tokenize(tmp_path, **env):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    words = ["the", "of", "and", "cat", "dog", "house", "river", "stone", "green", "light", "water", "tree"]
    (tokenizer / "vocab.json").write_text(json.dumps({f"Ġ{w}": i for i, w in enumerate(words)}))
    return run_injected("tokenize_throughput", FAKE_BUILD, "--tokenizer", str(tokenizer), "--size-mb", "3",
                        "--workers", "2", **env)


def test_tokenize_throughput_reports_per_core_used_and_each_modes_own_peak_of_process_plus_workers(tmp_path):
    proc = run_tokenize(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r[1]: r for r in table_rows(proc.stdout.splitlines())}
    assert list(rows) == ["library", "word-cache"]
    peaks = {}
    for mode, row in rows.items():
        tokens_per_s = float(row[5].rstrip("M"))
        per_core, used = re.fullmatch(r"([\d.]+)M \((\d+) of 8 cores\)", row[6]).groups()
        # 2 workers on 3 partition files of 8 cores: 2 cores encode at once
        assert used == "2" and float(per_core) == pytest.approx(tokens_per_s / 2, rel=0.05), row
        peak, start = (int(x) for x in re.fullmatch(r"(\d+) MB \(at start: (\d+) MB\)", row[7]).groups())
        peaks[mode] = peak - start
    # library: its 300 MB and its worker's 200 MB, summed; word-cache: none of library's, though it ran after it
    assert peaks["library"] >= 480, peaks
    assert peaks["word-cache"] < 100, peaks


def test_tokenize_throughput_names_a_failing_mode_and_measures_the_others(tmp_path):
    proc = run_tokenize(tmp_path, PLANT_FAILURE="1")
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    rows = table_rows(lines)
    assert [(r[1], r[3]) for r in rows] == [("library", "n/a"), ("word-cache", "2.0M")]
    assert "Failed (its row is n/a): library: ModeFailed: ValueError: planted" in lines


@pytest.mark.parametrize("modes", ["bogus", "library,word_cache"])
def test_tokenize_throughput_refuses_an_unknown_mode_before_preparing_anything(monkeypatch, capsys, modes):
    status, err = main_exit(monkeypatch, capsys, "tokenize_throughput", "--modes", modes, "--tokenizer",
                            "/nonexistent")
    assert status == 2 and "--modes: unknown" in err and "the modes are library, word-cache" in err, err


# --- launch_count and saved_memory: a failing child is one n/a cell ------------------------------------------------

# subprocess.run replaced for the scripts' children: each prints its variant's `output`, or fails where that is
# None and in the NYSTROM_TRITON=1 (no overlap) nystrom variant with a padding mask (launch_count) / at all
# (saved_memory).
FAKE_CHILDREN = """
import subprocess
def run(cmd, env=None, **kwargs):
    variant, mask = (cmd[cmd.index("--child") + 1:] + ["-"])[:2]
    output = {output!r}[variant]
    if output is None or (variant == "nystrom" and env["NYSTROM_TRITON"] == "1" and env["NYSTROM_OVERLAP"] == "0"
                          and mask != "none"):
        return subprocess.CompletedProcess(cmd, 1, "", "Traceback (most recent call last):\\nValueError: planted\\n")
    return subprocess.CompletedProcess(cmd, 0, output + "\\n", "")
subprocess.run = run
"""


def test_launch_count_names_a_failing_count_and_counts_the_other_rows():
    proc = run_injected("launch_count", FAKE_CHILDREN.format(output={"softmax": "6 0", "nystrom": "20 3"}),
                        "--n", "128")
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    rows = table_rows(lines)
    assert len(rows) == 7 and rows[0][1:] == ["6 + 0 = 6", "6 + 0 = 6"]
    assert rows[2] == ["nystrom, NYSTROM_TRITON=1 (default)", "n/a", "20 + 3 = 23"]
    assert all(r[1:] == ["20 + 3 = 23"] * 2 for r in rows[3:])
    assert lines[-1] == ("Failed (its cell is n/a): nystrom, NYSTROM_TRITON=1 (default), padding mask: ChildFailed: "
                         "exit status 1: ValueError: planted")


def test_launch_count_stopped_at_its_time_limit_keeps_the_rows_it_counted():
    patch = (FAKE_CHILDREN.format(output={"softmax": "6 0", "nystrom": "20 3"})
             + SIGTERM_AT_THIRD_CALL.format(name="run_child"))
    proc = run_injected("launch_count", patch, "--n", "128")
    assert proc.returncode == 130, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert [r[0] for r in table_rows(lines)] == ["softmax (SDPA)"]
    assert lines[-1] == ("Stopped (a time limit or Ctrl-C) during the row nystrom, PyTorch ops: the rows above are "
                         "those measured before it.")


@pytest.mark.parametrize("flags, says", [
    (["--accumulate"], "--accumulate counts the micro-batches of a training step: give it with --step"),
    (["--step", "--host-time"], "--host-time times the attention core's forward + backward")])
def test_launch_count_refuses_flags_it_would_ignore_even_in_a_dry_run(monkeypatch, capsys, flags, says):
    monkeypatch.syspath_prepend(str(BENCH))
    import launch_count
    monkeypatch.setattr(launch_count, "run_child", lambda *args: pytest.fail("counted despite the flags"))
    with pytest.raises(SystemExit) as stop:
        launch_count.main(flags)
    assert stop.value.code == 2 and says in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "bench/gpu_session_dry_run.py", "bench/launch_count.py", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and says in proc.stderr, proc.stderr


def saved_memory_rows(output: dict) -> tuple[int, list, list]:
    proc = run_injected("saved_memory", FAKE_CHILDREN.format(output=output), "--n", "128")
    lines = proc.stdout.splitlines()
    return proc.returncode, table_rows(lines), [line for line in lines if line.startswith("Failed")]


def test_saved_memory_names_a_failing_variant_and_its_ratios_are_to_softmax_alone():
    mib = 1 << 20
    # softmax's sequence-sized figure 0: no ratio to it, and none to another row either
    status, rows, failed = saved_memory_rows({"softmax": f"{2 * mib} 0 {4 * mib} Node 1.0",
                                              "nystrom": f"{3 * mib} {mib} {8 * mib} Node 2.0"})
    assert status == 1
    assert [r[0] for r in rows] == ["softmax (SDPA)", "nystrom, PyTorch ops", "nystrom, NYSTROM_TRITON=1 (default)",
                                    "nystrom, NYSTROM_TRITON=all", "nystrom, NYSTROM_TRITON=all, NYSTROM_OVERLAP=1",
                                    "nystrom, NYSTROM_TRITON=all, NYSTROM_RECOMPUTE=1"]
    assert rows[0][1:] == ["2.0", "0.0", "n/a", "4.0", "1.000", "Node 1.0"]
    assert rows[2][1:] == ["n/a"] * 6
    for row in rows[1:2] + rows[3:]:
        assert row[1:] == ["3.0", "1.0", "n/a", "8.0", "2.000", "Node 2.0"]
    assert failed == ["Failed (its row is n/a): nystrom, NYSTROM_TRITON=1 (default): ChildFailed: exit status 1: "
                      "ValueError: planted"]


def test_saved_memory_without_a_softmax_figure_gives_no_ratio():
    mib = 1 << 20
    status, rows, failed = saved_memory_rows({"softmax": None,
                                              "nystrom": f"{3 * mib} {mib} {8 * mib} Node 2.0"})
    assert status == 1 and len(rows) == 6 and len(failed) == 2
    assert rows[0][1:] == ["n/a"] * 6 and all(r[3] == r[5] == "n/a" for r in rows)
    assert failed[0] == "Failed (its row is n/a): softmax (SDPA): ChildFailed: exit status 1: ValueError: planted"


# --- glue_batch_dependence: batch size 1 is the baseline -----------------------------------------------------------

@pytest.mark.parametrize("sizes, bad", [("16,x", "'x'"), ("0,16", "'0'"), ("16,,64", "''")])
def test_glue_batch_dependence_refuses_bad_batch_sizes_before_loading_anything(monkeypatch, capsys, sizes, bad):
    status, err = main_exit(monkeypatch, capsys, "glue_batch_dependence", "--model-dir", "/nonexistent", "--run",
                            "r", "--task", "MRPC", "--batch-sizes", sizes)
    assert status == 2 and f"--batch-sizes {sizes}: {bad} is not a positive integer" in err, err


def test_glue_batch_dependence_compares_with_batch_size_1_even_when_not_listed(shared_dir, tmp_path):
    from nystromformer.glue.finetune import FinetuneSettings, finetune
    from test_glue_finetune import FIXTURES, make_model_folder
    model_dir = make_model_folder(tmp_path / "tiny", shared_dir / "tokenizers" / "roberta-base", FIXTURES)
    settings = FinetuneSettings(task="MRPC", checkpoint=0, lr=1e-3, batch_size=4, epochs=1, progress=False,
                                submission=False)
    run = Path(finetune(model_dir, settings, log=lambda line: None)["best_weights"]).parent.name
    lines = run_script("bench/glue_batch_dependence.py", "--model-dir", str(model_dir), "--run", run, "--task",
                       "MRPC", "--batch-sizes", "8,3")
    rows = table_rows(lines)
    assert [(r[0], r[1]) for r in rows] == [(p, b) for p in ("longest", "fixed") for b in ("1", "8", "3")]
    assert all(r[3] == "0" and r[4] == "0.00e+00" for r in rows if r[1] == "1")  # the baseline itself
    assert all(r[3] == "0" and float(r[4]) < 1e-3 for r in rows if r[0] == "fixed")
