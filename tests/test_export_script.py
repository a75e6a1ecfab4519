"""`%%smp_export` / `sagenb.export`: the exported script, run under a real torchrun, trains the
model `sagenb.train` trains on the pool; the SageMaker launcher is valid Python naming the
instances; bad input writes nothing."""

from __future__ import annotations

import ast
import json
import os
import runpy
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from IPython.core.error import UsageError

import sagenb
from sagenb.config import ConfigError, EngineConfig, TrainConfig
from sagenb.notebook.export import ExportError

from .conftest import REGRESSION_CELL
from .helpers import TORCHRUN, assert_params_equal, run, wait_clean
from .lab import free_port
from .models import SEQUENTIAL_CELL

TOL = 1e-6

STRATEGIES = {
    "data": dict(strategy="data"),
    "model": dict(strategy="model", partitions=2, microbatches=4, partition_by="parameters"),
}


def options_for(strategy: str) -> dict:
    # threads=1 in the pool and under torchrun alike: the same kernels, the same rounding
    return dict(STRATEGIES[strategy], batch_size=32, steps=6, threads=1, dashboard=False)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_torchrun_script_trains_what_the_pool_trains(pool, tmp_path, strategy):
    options = options_for(strategy)
    result = sagenb.train(SEQUENTIAL_CELL, **options)
    exported = sagenb.export(SEQUENTIAL_CELL, tmp_path / "train.py", **options)
    assert exported.command == f"torchrun --nproc-per-node 2 {tmp_path / 'train.py'}"
    command = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port())]
    run([*command, "train.py", "--metrics-file", "metrics.jsonl"], cwd=tmp_path)
    state = torch.load(tmp_path / "train_state.pt", weights_only=True)  # the default --output
    assert_params_equal(state, result.state_dict(), tol=TOL)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # logged by default: the first step, every 10th, the last (no gather on the others)
    assert [r["step"] for r in rows] == [1, 6]
    losses = [result.losses[0], result.losses[5]]
    torch.testing.assert_close([r["loss"] for r in rows], losses, rtol=0, atol=TOL)


#: a cell whose steps last long enough for the agent to be killed mid-run
SLOW_CELL = """
import time, torch
model = torch.nn.Linear(4, 1)
dataset = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
def loss_fn(out, y):
    time.sleep(0.05)
    return torch.nn.functional.mse_loss(out, y)
"""


@pytest.mark.pool  # starts processes of its own: two torch ranks
def test_ranks_die_with_their_torchrun_agent(tmp_path):
    """torchrun's agent SIGKILLed mid-run (it can stop nothing): its ranks exit within
    seconds and release their ports, rather than train on with ppid 1."""
    sagenb.export(SLOW_CELL, tmp_path / "train.py", batch_size=8, epochs=10_000, threads=1)
    metrics = tmp_path / "metrics.jsonl"
    command = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port())]
    agent = subprocess.Popen(
        [*command, "train.py", "--metrics-file", str(metrics)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metrics.exists() and metrics.read_text(), "the ranks never trained a step"
        ranks += [p for p in psutil.Process(agent.pid).children() if "train.py" in p.cmdline()]
        ports = sorted(
            {
                c.laddr.port
                for p in ranks
                for c in p.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN
            }
        )
        assert len(ranks) == 2 and ports
        os.kill(agent.pid, signal.SIGKILL)
        wait_clean([p.pid for p in ranks], ports, timeout=5.0)
    finally:
        for proc in ranks:  # torchrun starts each in a session of its own
            try:
                proc.kill()  # psutil's: never a pid reused since
            except psutil.NoSuchProcess:
                pass
        agent.kill()
        agent.wait(timeout=10)


#: an "agent" that starts a rank (TORCHELASTIC_RUN_ID set, as torchrun does) and exits at once,
#: before the rank, importing torch, gets to set PR_SET_PDEATHSIG
ORPHANED_RANK = """
import os, subprocess, sys
rank = '''
import os
from sagenb.engine import launch
ppid = os.getppid()
try:
    launch._die_with_agent()
    print(ppid, "trains on", flush=True)
except SystemExit as exc:
    print(ppid, "exit", exc.code, flush=True)
'''
env = dict(os.environ, TORCHELASTIC_RUN_ID="test")
subprocess.Popen([sys.executable, "-c", rank], env=env, stdout=open(sys.argv[1], "w"))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_whose_agent_is_already_gone_stops(tmp_path):
    out = tmp_path / "rank.txt"
    subprocess.run([sys.executable, "-c", ORPHANED_RANK, str(out)], check=True, timeout=30)
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.1)
    ppid, said = out.read_text().split(" ", 1)
    if ppid != "1":  # a subreaper (systemd --user, some containers) adopted it: not detectable
        pytest.skip(f"the orphaned rank was adopted by pid {ppid}, not init")
    assert said == "exit 1\n"


def test_script_reads_back_the_cell_and_the_options(tmp_path):
    config = TrainConfig(strategy="data", engines=2, batch_size=16, lr=0.01, grad_accum=2)
    cell = REGRESSION_CELL + 'note = r"a \\ backslash" + """triple"""\n'
    sagenb.export(cell, tmp_path / "job.py", config, instance="ml.g5.xlarge", out="r")
    text = (tmp_path / "job.py").read_text()
    assert "    batch_size=16,\n    lr=0.01,\n    grad_accum=2,\n" in text  # readable
    assert "instance=" not in text and "out=" not in text  # they change nothing in training
    names = runpy.run_path(str(tmp_path / "job.py"), run_name="not_main")
    assert names["CELL"] == cell
    assert names["CONFIG"] == config.for_engines()  # the engine options, and only those


def test_plain_python_trains_on_one_process_with_checkpoints(pool, tmp_path):
    """Without torchrun the script hosts its own store and trains as one process: the same
    model (data parallel on 2 engines equals one process up to rounding)."""
    options = options_for("data")
    result = sagenb.train(SEQUENTIAL_CELL, **options)
    sagenb.export(SEQUENTIAL_CELL, tmp_path / "train.py", **options)
    flags = ["--output", "out/model.pt", "--checkpoint-dir", "ck", "--checkpoint-every", "3"]
    done = run([sys.executable, "train.py", *flags, "--log-every", "2"], cwd=tmp_path)
    assert "exported for 2 processes, training on 1" in done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]  # stdout: JSON lines only
    assert [r["step"] for r in rows] == [1, 2, 4, 6]
    state = torch.load(tmp_path / "out/model.pt", weights_only=True)
    assert_params_equal(state, result.state_dict())
    assert_params_equal(sagenb.load_checkpoint(tmp_path / "ck"), state, tol=0)


def test_sagemaker_launcher_names_the_instances(tmp_path):
    options = dict(strategy="data", engines=8, batch_size=32, instance="ml.g5.12xlarge")
    exported = sagenb.export(
        SEQUENTIAL_CELL, tmp_path / "job" / "train.py", to="sagemaker", **options
    )
    folder = tmp_path / "job"
    launcher = folder / "train_sagemaker.py"
    assert exported.sagemaker == launcher
    text = launcher.read_text()
    call = next(
        node
        for node in ast.walk(ast.parse(text))  # it compiles
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "PyTorch"
    )
    kwargs = {k.arg: k.value for k in call.keywords}
    assert ast.literal_eval(kwargs["entry_point"]) == "train.py"
    assert ast.literal_eval(kwargs["instance_type"]) == "ml.g5.12xlarge"
    assert ast.literal_eval(kwargs["instance_count"]) == 2  # 8 engines, 4 GPUs each
    assert ast.literal_eval(kwargs["distribution"]) == {"torch_distributed": {"enabled": True}}
    assert ast.literal_eval(kwargs["hyperparameters"])["output"].startswith("/opt/ml/model/")
    assert "estimator.fit()" in text
    assert "psutil" in (folder / "requirements.txt").read_text()
    assert (folder / "sagenb" / "engine" / "launch.py").exists()  # the code the script runs
    assert (folder / "sagenb" / "sizing" / "tables" / "prices.json").exists()
    sagenb.export(SEQUENTIAL_CELL, folder / "train.py", to="sagemaker", **options)  # again


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(to="docker"), r"--to 'docker': must be one of torchrun, sagemaker"),
        (dict(to="sagemaker", instance="ml.c5.xlarge"), r"runs only on GPU .*ml\.g5\.xlarge"),
        (
            dict(to="sagemaker", strategy="model", partitions=2, instance="ml.p4d.24xlarge"),
            r"--engines 8: --strategy model uses one engine per partition.*8 in all",
        ),
        (dict(batch_size=33, engines=2), r"--batch-size 33: must be divisible by"),
    ],
)
def test_bad_input_writes_nothing(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        sagenb.export(SEQUENTIAL_CELL, tmp_path / "job" / "train.py", **options)
    assert not (tmp_path / "job").exists()


def test_sagemaker_export_keeps_a_requirements_file_it_did_not_write(tmp_path):
    (tmp_path / "requirements.txt").write_text("numpy\n")
    with pytest.raises(ExportError, match="export into a folder of its own"):
        sagenb.export(SEQUENTIAL_CELL, tmp_path / "train.py", to="sagemaker", engines=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requirements.txt"]


def test_magic_writes_the_script(shell, tmp_path, capsys):
    path = tmp_path / "train.py"
    shell.run_cell_magic(
        "smp_export", f"--to torchrun {path} --strategy data --engines 2 --steps 4", REGRESSION_CELL
    )
    assert f"torchrun --nproc-per-node 2 {path}" in capsys.readouterr().out
    names = runpy.run_path(str(path), run_name="not_main")
    assert names["CONFIG"] == EngineConfig(strategy="data", engines=2, steps=4)
    assert "--to {torchrun,sagemaker}" in shell.find_cell_magic("smp_export").__doc__


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "--to docker {path}",
            r"--to: invalid choice: 'docker' \(choose from '?torchrun'?, '?sagemaker",
        ),
        ("--to torchrun", r"the following arguments are required: FILE"),
        ("{path} --batch-size 33 --engines 2", r"%%smp_export: --batch-size 33: must be divisible"),
        ("{dir}", r"job: the script's name must end in \.py"),
    ],
)
def test_magic_bad_input_writes_nothing(shell, tmp_path, line, message):
    line = line.format(path=tmp_path / "train.py", dir=tmp_path / "job")
    with pytest.raises(UsageError, match=message):
        shell.run_cell_magic("smp_export", line, REGRESSION_CELL)
    assert list(tmp_path.iterdir()) == []


def test_magic_refuses_a_cell_without_a_model(shell, tmp_path):
    with pytest.raises(UsageError, match="the cell defines no model"):
        shell.run_cell_magic("smp_export", f"{tmp_path / 't.py'}", "x = 1\n")
    assert list(tmp_path.iterdir()) == []
