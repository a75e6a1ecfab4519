"""Random flags and values: every line either trains or is refused with a clear UsageError
before any engine runs user code; never an internal traceback (hypothesis)."""

from __future__ import annotations

import os
import re
import shlex
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError

import sagenb
from sagenb.config import ConfigError
from sagenb.config.job import Job, JobError
from sagenb.notebook.magics import parse_cluster_line, parse_train_line
from sagenb.run import session

from .conftest import REGRESSION_CELL

JUNK = st.one_of(
    st.integers(-5, 70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(
        [
            "",
            "x",
            "1,2",
            "3,1",
            "data",
            "model",
            "hybrid",
            "sharded",
            "gpipe",
            "1f1b",
            "interleaved",
            "auto",
            "manual",
            "ml.g5.xlarge",
            "ml.nope",
            "'",
        ]
    ),
    st.text(max_size=6),
)
FLAGS = [
    "--strategy",
    "--engines",
    "--batch-size",
    "--epochs",
    "--steps",
    "--lr",
    "--seed",
    "--grad-accum",
    "--clip-grad-norm",
    "--eval-every",
    "--instance",
    "--threads",
    "--timeout",
    "--partitions",
    "--microbatches",
    "--schedule",
    "--virtual-stages",
    "--partition-by",
    "--cuts",
    "--memory-budget",
    "--out",
    "--bogus",
    "-n",
]
SWITCHES = ["--no-dashboard", "--delay-init", "--help-me"]


@st.composite
def train_lines(draw) -> str:
    parts = []
    for flag in draw(st.lists(st.sampled_from(FLAGS), max_size=5)):
        parts += [flag, shlex.quote(draw(JUNK)) if draw(st.booleans()) else draw(JUNK)]
    parts += draw(st.lists(st.sampled_from(SWITCHES), max_size=2))
    return " ".join(parts)


def checked(line: str, pool) -> sagenb.TrainConfig | None:
    """Everything the magic checks before an engine runs user code."""
    config = parse_train_line(line)  # UsageError for any bad flag or value
    if config is None:
        return None
    try:
        Job.of(REGRESSION_CELL)
        return session._resolve_engines(config, pool)
    except (ConfigError, JobError) as exc:
        raise UsageError(str(exc)) from None


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(line=train_lines())
def test_train_lines_are_accepted_or_refused_clearly(pool, line):
    try:
        checked(line, pool)
    except UsageError as exc:
        assert str(exc).strip(), line  # says something
        assert "Traceback" not in str(exc)


@settings(max_examples=200, deadline=None)
@given(
    action=st.one_of(st.sampled_from(["start", "status", "stop", "restart"]), st.text(max_size=5)),
    n=st.one_of(st.none(), JUNK),
)
def test_cluster_lines_are_accepted_or_refused_clearly(action, n):
    line = shlex.quote(action) + ("" if n is None else f" -n {shlex.quote(n)}")
    try:
        args = parse_cluster_line(line)
    except UsageError as exc:
        assert str(exc).strip()
        return
    assert args is None or args.action in ("start", "status", "stop", "restart")


@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(line=train_lines())
def test_accepted_lines_really_train(pool, line):
    """A handful of random lines go all the way: train briefly, or a clear UsageError."""
    try:
        config = checked(line + " --steps 2 --no-dashboard --timeout 60", pool)
    except UsageError:
        return
    if config is None:
        return
    try:
        result = sagenb.train(REGRESSION_CELL, config)
    except (ConfigError, JobError):  # found on the engines: the dataset is too small, ...
        return
    assert 1 <= len(result.history) <= 2


def _table(tmp_path, content: str) -> str:
    path = tmp_path / "prices.json"
    path.write_text(content)
    return str(path)


@pytest.mark.parametrize("option", ["price_table", "hardware_table"])
@pytest.mark.parametrize("kind", ["device", "fifo", "oversized"])
def test_a_table_that_is_not_a_small_regular_file_is_refused_unread(tmp_path, option, kind):
    """--price-table /dev/zero grew the kernel to 22 GB; a 2 GB file was read whole to be
    refused. Both tables are refused by what the file is (a device, a FIFO: opening one
    without a writer used to block) or by its size, before any pool starts."""
    from sagenb.pool import cluster
    from sagenb.sizing.cost import check_price
    from sagenb.sizing.hardware import check_hardware

    path = tmp_path / "table.json"
    if kind == "device":
        path = Path("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.truncate(2 * 2**30)  # sparse: 2 GB that take no disk and no time to make
    config = sagenb.TrainConfig(**{option: str(path)})
    what = {"device": "a character device", "fifo": "a FIFO", "oversized": "2147483648 bytes"}
    message = rf"--{option.replace('_', '-')} '{path}': cannot be read: must be a regular file"
    message += rf" of at most \d+ MiB; this .*{what[kind]}"
    running = cluster.current_pool()
    started = time.monotonic()
    with pytest.raises(ConfigError, match=message):
        (check_price if option == "price_table" else check_hardware)(config)
    if option == "price_table":
        with pytest.raises(ConfigError, match=message):
            sagenb.train(REGRESSION_CELL, config)
    assert time.monotonic() - started < 5  # refused, not read
    assert cluster.current_pool() is running  # none started


@pytest.mark.parametrize(
    "options, message",
    [
        ({"out": "class"}, "--out 'class': must be a Python identifier that is neither"),
        ({"out": "print"}, "--out 'print': must be a Python identifier that is neither"),
        ({"timeout": 1e10}, "--timeout 10000000000.0: must be a finite number > 0 and at most"),
        ({"timeout": 1e300}, "--timeout 1e+300: must be a finite number > 0 and at most"),
        ({"seed": 10**20}, "--seed 100000000000000000000: must be an integer from 0 to"),
        ({"threads": 100000}, "--threads 100000: must be an integer from 1 to 1024"),
        ({"price_per_hour": -1.0}, "--price-per-hour -1.0: must be a finite number > 0"),
        ({"if_busy": "queue"}, "--if-busy 'queue': must be one of wait, fail"),
    ],
)
def test_values_that_would_fail_later_are_refused_now(options, message):
    """Each of these used to fail on the engines, after the run, or not at all."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        sagenb.TrainConfig(**options)


@pytest.mark.parametrize(
    "name",
    ["__builtins__", "__name__", "_", "__", "___", "_i", "_ii", "_i3", "_7", "_oh", "_dh", "_ih"]
    + ["In", "Out", "get_ipython", "exit", "quit", "len", "class", "2x", "a-b", ""],
)
def test_out_refuses_names_the_notebook_needs(name):
    """`--out __builtins__` made every later cell fail (`len` raised TypeError); IPython's
    own names (history, In/Out) and builtins are refused alike, by the magic's line too."""
    allowed = "must be a Python identifier that is neither a keyword nor a builtin's name"
    with pytest.raises(ConfigError, match=re.escape(f"--out {name!r}: {allowed}")):
        sagenb.TrainConfig(out=name)
    with pytest.raises(UsageError, match="--out .*does not start with '_'"):
        parse_train_line(f"--out {shlex.quote(name)}")
    assert sagenb.TrainConfig(out="run_2").out == "run_2"


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    with pytest.raises(ConfigError, match="--checkpoint-dir .*exists and is not a directory"):
        sagenb.TrainConfig(checkpoint_dir=str(path))
    sagenb.TrainConfig(checkpoint_dir=str(tmp_path / "new" / "dir"))  # made when written


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(checkpoint_dir=""), "--checkpoint-dir '': must be a directory's path"),
        (dict(checkpoint_dir="  "), "--checkpoint-dir '  ': must be a directory's path"),
        (dict(log_dir="/dev/null"), "--log-dir '/dev/null': exists and is not a directory"),
    ],
)
def test_a_folder_option_that_names_no_folder_is_refused(options, message):
    """--checkpoint-dir "" was taken as no folder (the run wrote no checkpoint, silently), and
    --log-dir /dev/null failed at the first write with a raw OSError."""
    with pytest.raises(ConfigError) as caught:
        sagenb.TrainConfig(**options)
    assert str(caught.value).startswith(message)


def test_a_log_dir_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match="--log-dir .*exists and is not a directory"):
        sagenb.TrainConfig(log_dir=str(tmp_path / "a_file"))


@pytest.mark.parametrize(
    "content, message",
    [
        ("[1, 2]", 'must be a JSON object with "instances"'),
        (
            '{"instances": {"ml.x": {"usd_per_hour": "3.5", "accelerators": 1}}}',
            r"instances\['ml.x'\].usd_per_hour must be a number >= 0",
        ),
        (
            '{"instances": {"ml.x": {"usd_per_hour": -2, "accelerators": 1}}}',
            r"instances\['ml.x'\].usd_per_hour must be a number >= 0",
        ),
        (
            '{"instances": {"ml.x": {"usd_per_hour": 2}}}',
            r"instances\['ml.x'\].accelerators must be an integer >= 0",
        ),
    ],
)
def test_a_price_table_of_the_wrong_shape_is_refused(tmp_path, content, message):
    """Refused by sagenb.train before any pool starts (the table is read there, not in the
    config's validation, which reads no file)."""
    from sagenb.pool import cluster

    config = sagenb.TrainConfig(price_table=_table(tmp_path, content), instance="ml.x")
    running = cluster.current_pool()
    with pytest.raises(ConfigError, match=r"--price-table .*cannot be read: " + message):
        sagenb.train(REGRESSION_CELL, config)
    assert cluster.current_pool() is running  # none started
