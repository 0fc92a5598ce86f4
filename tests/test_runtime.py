"""The pieces every command shares: the device a --device names, the fine-tuning learning-rate schedule."""
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nystromformer.cli import main
from nystromformer.errors import UserError
from nystromformer.runtime import linear_warmup_decay, resolve_device


def test_the_default_device_is_the_local_ranks_gpu_when_there_is_one_else_the_cpu():
    expected = torch.device("cuda", 1) if torch.cuda.is_available() and torch.cuda.device_count() > 1 else None
    if torch.cuda.is_available():
        assert resolve_device(None) == torch.device("cuda", 0)
        assert resolve_device("cuda") == torch.device("cuda", 0)  # an index, as torch.cuda.set_device needs
        if expected is not None:
            assert resolve_device(None, local_rank=1) == expected
    else:
        assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name, says", [
    ("gpu", "--device gpu: not a device; use cpu, cuda or cuda:N"),
    ("cuda:x", "--device cuda:x: not a device"),
    ("mps", "--device mps: only cpu and cuda devices are supported"),
    ("cuda:99", "--device cuda:99: "),
])
def test_a_device_this_machine_cannot_use_is_an_error_naming_the_flag(name, says):
    with pytest.raises(UserError) as error:
        resolve_device(name)
    assert str(error.value).startswith(says)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_asking_for_cuda_on_a_machine_without_a_gpu_says_so():
    with pytest.raises(UserError, match="--device cuda: PyTorch sees no CUDA GPU here .* use --device cpu"):
        resolve_device("cuda")


def rates(total_steps, warmup_steps, peak=1e-3):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    schedule = linear_warmup_decay(opt, total_steps, warmup_steps)
    out = []
    for _ in range(total_steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    return out


def test_fine_tuning_schedule_rises_linearly_to_the_peak_then_falls_linearly_to_zero_at_the_end():
    lr = rates(total_steps=10, warmup_steps=4)
    assert lr == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3 * 5 / 6, 1e-3 * 4 / 6, 1e-3 * 3 / 6,
                                1e-3 * 2 / 6, 1e-3 / 6])


def test_fine_tuning_schedule_without_warm_up_starts_at_the_peak():
    assert rates(total_steps=4, warmup_steps=0) == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])


@pytest.mark.parametrize("command", [["pretrain"], ["validate"], ["glue", "--task", "RTE", "--checkpoint", "0"],
                                     ["listops-train", "--generate", "--out", "unused"]])
def test_every_command_that_takes_a_device_names_a_bad_one_in_one_line(capsys, command):
    model_dir = ["--model-dir", str(Path(__file__).parents[1] / "nystrom-512")] if command[0] != "listops-train" else []
    assert main([*command, *model_dir, "--device", "gpu"]) == 2
    assert capsys.readouterr().err == "error: --device gpu: not a device; use cpu, cuda or cuda:N\n"


@pytest.mark.parametrize("step", ["-1", "0"])  # 0 would exit 143 having done nothing: a restart policy would loop
def test_stopping_pretraining_before_its_first_step_is_an_error_naming_the_flag(capsys, step):
    model_dir = str(Path(__file__).parents[1] / "nystrom-512")
    assert main(["pretrain", "--model-dir", model_dir, "--stop-at-step", step]) == 2
    assert capsys.readouterr().err == f"error: --stop-at-step: must be at least 1 (a global step), got {step}\n"


def test_mixed_precision_off_computes_in_fp32_on_every_device_and_the_cpu_never_autocasts():
    from nystromformer.runtime import autocast_dtype
    assert autocast_dtype(torch.device("cuda", 0), False) is None
    assert autocast_dtype(torch.device("cpu"), True) is None and autocast_dtype(torch.device("cpu"), False) is None


def test_a_user_error_spanning_lines_is_still_one_error_line(capsys):
    from nystromformer.cli import run_command

    def fails(args):
        raise UserError("x.json: bad\n   value")  # e.g. a library's message wrapped into ours

    assert run_command(fails, None) == 2
    assert capsys.readouterr().err == "error: x.json: bad value\n"


@pytest.mark.parametrize("variable, value, says", [
    ("NYSTROM_IMPL", "fastt", "NYSTROM_IMPL / impl: expected one of auto, reference, fast, got 'fastt'"),
    ("NYSTROM_TRITON", "2", "NYSTROM_TRITON: expected one of 0, 1, all, got '2'"),
    ("NYSTROM_OVERLAP", "yes", "NYSTROM_OVERLAP: expected one of 0, 1, got 'yes'"),
    ("NYSTROM_RECOMPUTE", "2", "NYSTROM_RECOMPUTE: expected one of 0, 1, got '2'"),
    ("NYSTROM_RECOMPUTE", "1", "NYSTROM_RECOMPUTE=1 applies to the one-node layer of NYSTROM_TRITON=all"),
    ("NYSTROM_LAUNCH_SETTINGS", "/no/such/settings.json",
     "NYSTROM_LAUNCH_SETTINGS=/no/such/settings.json: cannot read it (No such file or directory)"),
    ("WORLD_SIZE", "abc", "WORLD_SIZE=abc: expected an integer >= 1"),
    ("WORLD_SIZE", "0", "WORLD_SIZE=0: expected an integer >= 1"),
    ("WORLD_SIZE", "2", "WORLD_SIZE=2 without RANK, MASTER_ADDR, MASTER_PORT: start the processes with torchrun"),
    ("RANK", "1", "RANK=1 with WORLD_SIZE=1: a rank must be below the world size"),
    ("LOCAL_RANK", "x", "LOCAL_RANK=x: expected an integer >= 0"),
])
def test_a_bad_environment_variable_is_one_error_line_when_the_command_starts(capsys, monkeypatch, variable, value,
                                                                             says):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NYSTROM_TRITON",
                 "NYSTROM_OVERLAP", "NYSTROM_RECOMPUTE", "NYSTROM_LAUNCH_SETTINGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, value)
    model_dir = str(Path(__file__).parents[1] / "nystrom-512")
    for command in (["pretrain", "--model-dir", model_dir], ["validate", "--model-dir", model_dir]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {says}") and len(err.splitlines()) == 1, err
    if variable.startswith("NYSTROM"):  # GLUE and LRA check them too, before their data
        for command in (["glue", "--task", "RTE", "--checkpoint", "0", "--model-dir", model_dir],
                        ["listops-train", "--generate", "--out", "unused"]):
            assert main(command) == 2
            assert capsys.readouterr().err.startswith(f"error: {says}")


@pytest.mark.parametrize("code, says", [
    (errno.EROFS, "error: /runs/x/best.model: the file system is read-only; it needs an output folder with room"),
    (errno.ENOSPC, "error: /runs/x/best.model: no space left on the device; it needs an output folder with room"),
    (errno.EACCES, "error: /runs/x/best.model: permission denied; it needs an input this user can read, or an output "
                   "folder this user can write to"),
    (errno.EPERM, "error: /runs/x/best.model: permission denied; it needs an input this user can read, or an output "
                  "folder this user can write to"),
    (errno.EDQUOT, "error: /runs/x/best.model: disk quota exceeded; it needs an output folder with room"),
])
def test_a_write_the_file_system_refuses_is_one_error_line_naming_the_file(capsys, code, says):
    from nystromformer.cli import run_command

    def writes(args):
        raise OSError(code, os.strerror(code), "/runs/x/best.model")
    assert run_command(writes, None) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and len(err.splitlines()) == 1, err


def test_other_os_errors_stay_tracebacks_and_ctrl_c_ends_with_status_130_and_one_line(capsys):
    from nystromformer.cli import run_command

    def missing(args):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/nowhere")
    with pytest.raises(FileNotFoundError):  # not a refused write: ours to find, with its traceback
        run_command(missing, None)

    def interrupted(args):
        raise KeyboardInterrupt
    assert run_command(interrupted, None) == 130
    assert capsys.readouterr().err == ("interrupted (Ctrl-C); rerun the same command to resume where it can, or to "
                                       "start again\n")


def test_console_warnings_go_to_stderr_and_other_lines_to_stdout(capsys):
    from nystromformer.cli import say
    say("resuming from cp-0000.cp")
    say("warning: skipping cp-0001.cp")
    say("a line that mentions a warning: later on")
    console = capsys.readouterr()
    assert console.out == "resuming from cp-0000.cp\na line that mentions a warning: later on\n"
    assert console.err == "warning: skipping cp-0001.cp\n"


def test_python_dash_m_nystromformer_is_the_nystromformer_command():
    # For a checkout whose entry point is not installed (or another venv's): the same subcommands and status.
    code = Path(__file__).resolve().parents[1] / "code"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(code)}
    helped = subprocess.run([sys.executable, "-m", "nystromformer", "--help"], env=env, capture_output=True, text=True)
    assert helped.returncode == 0 and "pretrain" in helped.stdout and "glue-sweep" in helped.stdout
    wrong = subprocess.run([sys.executable, "-m", "nystromformer", "validate", "--model-dir", "/nonexistent/m"],
                           env=env, capture_output=True, text=True)
    assert wrong.returncode != 0 and "/nonexistent/m: no such model folder" in wrong.stderr


def test_a_console_line_is_written_whole_in_one_call(monkeypatch):
    # A parallel sweep's threads each say() lines: a line and its newline written apart ran two lines together.
    import io
    from nystromformer.cli import say
    writes = {"stdout": [], "stderr": []}
    for name in writes:
        stream = io.StringIO()
        stream.write = writes[name].append
        monkeypatch.setattr(sys, name, stream)
    say("start MRPC-0-0.001-2-1 on CUDA_VISIBLE_DEVICES=0")
    say("warning: the tokenizer differs")
    assert writes == {"stdout": ["start MRPC-0-0.001-2-1 on CUDA_VISIBLE_DEVICES=0\n"],
                      "stderr": ["warning: the tokenizer differs\n"]}


def test_an_explicit_cuda_index_wins_over_the_local_rank_even_when_it_is_0(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:0", local_rank=1) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", local_rank=0) == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 1)
