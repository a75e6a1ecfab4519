"""`%%smp_export` and `sagenb.export`: a cell and its options as a standalone training script.

The script embeds the cell's source and the resolved engine options (an EngineConfig built from
keyword arguments, a strategy's own options among them: the notebook-only sections, display,
cost and output, stay behind) and
runs sagenb's own engine code under torchrun (sagenb/engine/launch.py), so
`torchrun --nproc-per-node N train.py` trains the model `%%smp_train` would, with the same
sample order, steps and final parameters, without a notebook or ipyparallel.

`to="sagemaker"` also writes, beside the script, `<stem>_sagemaker.py`: a SageMaker PyTorch
estimator that runs it (text for the user to run; nothing here imports sagemaker or talks to
AWS), a copy of the sagenb package (the engine code the notebook ran) and a requirements.txt.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from sagenb.config.errors import ConfigError
from sagenb.config.flags import notebook_only_flags
from sagenb.config.job import Job, JobError
from sagenb.config.options import EngineConfig, TrainConfig, describe, every_option
from sagenb.pool import cluster
from sagenb.sizing.cost import InstancePrice, check_price, meter_for, price_table

__all__ = ["TARGETS", "Exported", "ExportError", "export", "render_script", "render_sagemaker"]

#: sagenb/ itself, copied beside a SageMaker job (this module is sagenb/notebook/export.py)
SAGENB_DIR = Path(__file__).resolve().parents[1]

TARGETS = ("torchrun", "sagemaker")
#: marks a sagenb/ folder or requirements.txt as written by an export (so it may be replaced)
MARK = "written by sagenb's %%smp_export"
SAGEMAKER_MODEL_DIR = "/opt/ml/model"  # uploaded to S3 when the job ends
SAGEMAKER_CHECKPOINTS = "/opt/ml/checkpoints"  # synced with checkpoint_s3_uri, when given


class ExportError(ValueError):
    """The files cannot be written where asked; says why and what to do instead."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote and how to run it."""

    script: Path
    files: tuple[Path, ...]
    command: str
    sagemaker: Path | None = None

    def summary(self) -> str:
        lines = [f"wrote {', '.join(map(str, self.files))}", f"run: {self.command}"]
        if self.sagemaker is not None:
            lines.append(f"on SageMaker: python {self.sagemaker}")
        return "\n".join(lines)


def export(
    cell: str,
    path: str | os.PathLike,
    config: TrainConfig | None = None,
    *,
    to: str = "torchrun",
    **options: Any,
) -> Exported:
    """Write a script that trains `cell` with these options under torchrun (and, with
    to="sagemaker", its SageMaker launcher). Options are TrainConfig's fields, or pass a
    config. Everything is checked before anything is written."""
    if to not in TARGETS:
        raise ConfigError("to", to, f"must be one of {', '.join(TARGETS)}")
    script = _script_path(path)
    if config is None:
        config = TrainConfig(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    if not isinstance(cell, str):
        raise JobError(f"export needs the cell's source (a str), not {type(cell).__name__}")
    Job.from_cell(cell)
    check_price(config)  # the sagemaker launcher's instance; the price table is read here
    config = config.with_engines(_engines(config))
    text = render_script(cell, config, name=script.name)
    command = f"torchrun --nproc-per-node {config.engines} {script}"
    if to == "sagemaker":
        return _export_sagemaker(script, text, config, command)
    _write(script, text)
    return Exported(script, (script,), command)


def _script_path(path: str | os.PathLike) -> Path:
    script = Path(path)
    if script.is_dir():
        raise ExportError(f"{script} is a directory: give the script's file name (train.py)")
    if script.suffix != ".py" or not script.stem:
        raise ExportError(f"{script}: the script's name must end in .py (torchrun runs Python)")
    return script


def _engines(config: TrainConfig) -> int:
    """Processes the script is written for: --engines, one per partition with --strategy
    model, else the running pool's size, else what %%smp_train would start."""
    pool = cluster.current_pool()
    if pool is None:
        return config.engines_to_start()
    return describe(config.strategy).engines_for(config, pool.size)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# -- the torchrun script --------------------------------------------------------------------

SCRIPT = '''\
"""Train the cell below with sagenb's engines under torchrun: no notebook, no ipyparallel.

Exported by sagenb {version} (%%smp_export) from a cell and the options of
    {flags}
Run it with one process per engine:

    torchrun --nproc-per-node {engines} {name} [--output {stem}_state.pt] [--metrics-file FILE]
        [--checkpoint-dir DIR] [--checkpoint-every N] [--resume]

It trains what %%smp_train trains with these options (the same sample order, steps and final
parameters). Rank 0 writes each step's metrics (loss over the whole global batch, each rank's
loss, learning rate, step time, throughput) to stdout as JSON lines, or to --metrics-file, and
saves the trained model's full state_dict with torch.save to --output.
"""

from sagenb.config import EngineConfig
from sagenb.engine.launch import main

# the cell, run on every process after torch.manual_seed(CONFIG.seed)
CELL = {cell}

# the resolved options the engines train with; the notebook's own (display, cost estimate,
# result's name) are left out: {left_out}
CONFIG = EngineConfig(
{fields}
)

if __name__ == "__main__":
    main(CELL, CONFIG, script=__file__)
'''


def render_script(cell: str, config: EngineConfig, *, name: str = "train.py") -> str:
    """The script's text: the cell and the config, readable, and checked to compile."""
    left_out = ", ".join(notebook_only_flags())
    text = SCRIPT.format(
        version=version("sagenb"),
        flags=" ".join(config.to_flags().splitlines()),
        engines=config.engines,
        name=name,
        stem=Path(name).stem,
        cell=_literal(cell),
        left_out=left_out,
        fields=_config_fields(config),
    )
    compile(text, name, "exec")  # a value that did not survive repr() fails here, not later
    return text


def _config_fields(config: EngineConfig) -> str:
    """`    name=value,` for the strategy, the engines and every other engine option that
    differs from its default (a strategy's own as a keyword too), each value a Python literal
    that reads back equal."""
    lines = []
    for option in every_option(EngineConfig):
        value = config.option(option.name)
        if value == option.default and option.name not in ("strategy", "engines"):
            continue
        literal = _q(value) if isinstance(value, str) else repr(value)
        if ast.literal_eval(literal) != value:
            raise ValueError(f"cannot write {option.name}={value!r} into a script")
        lines.append(f"    {option.name}={literal},")
    return "\n".join(lines)


def _literal(text: str) -> str:
    """The cell as a raw triple-quoted string that reads back exactly, its first line on a
    line of its own; repr() when no such string can hold it."""
    lead, cut = ("", "") if text.startswith("\n") else ("\n", "[1:]")
    for quote in ('"""', "'''"):
        literal = f"r{quote}{lead}{text}{quote}"
        try:
            if ast.literal_eval(literal) == lead + text:
                return literal + cut
        except (SyntaxError, ValueError):
            continue
    return repr(text)


# -- SageMaker ------------------------------------------------------------------------------

SAGEMAKER = '''\
"""Run {name} on SageMaker: {instances} x {instance}, {processes} processes in all.

Written by sagenb's %%smp_export --to sagemaker. Nothing has been sent to AWS: run this file
where the SageMaker Python SDK (pip install sagemaker) and your AWS credentials are set up.
SageMaker uploads this folder (source_dir): {name}, the sagenb package copied beside it (the
engine code the notebook ran) and requirements.txt, which its PyTorch container pip-installs.
It then starts torchrun on each instance, one process per GPU. {name} prints each step's
metrics as JSON lines (CloudWatch logs) and saves the trained state_dict in {model_dir}, which
SageMaker uploads to S3 when the job ends.
"""

import os
from pathlib import Path

import sagemaker
from sagemaker.pytorch import PyTorch

estimator = PyTorch(
    entry_point={name_q},
    source_dir=str(Path(__file__).resolve().parent),
    # an IAM role SageMaker may assume: set SAGEMAKER_ROLE, or run this inside SageMaker
    role=os.environ.get("SAGEMAKER_ROLE") or sagemaker.get_execution_role(),
    instance_type={instance_q},  # {accelerators} x {accelerator} each
    instance_count={instances},  # ceil(--engines {engines} / {accelerators} GPUs each)
    distribution={{"torch_distributed": {{"enabled": True}}}},
    # the torch and Python the cell was exported with. SageMaker's PyTorch containers come in
    # fixed versions: if this one is not offered, choose the nearest that is (sagenb needs
    # torch >= 2.6). torch comes from the container, never from requirements.txt.
    framework_version={framework_q},
    py_version={python_q},
    hyperparameters={{{hyperparameters}
    }},{checkpoints}
    metric_definitions=[{{"Name": "loss", "Regex": {loss_regex!r}}}],
)
{note}estimator.fit()
'''

REQUIREMENTS = """\
# {mark}: SageMaker's PyTorch container pip-installs
# these before it runs {name}.
# sagenb itself is the copy in ./sagenb (the exact code the notebook ran), not a package from
# an index. torch is deliberately absent: the container's own build (framework_version in
# {stem}_sagemaker.py) is the one to use; listing torch here could replace its CUDA build with
# another, and so could installing a sagenb whose torch range the container's torch misses.
psutil>=5.9
"""


def _export_sagemaker(script: Path, text: str, config: TrainConfig, command: str) -> Exported:
    price, instances, processes = _sagemaker_layout(config)
    folder = script.parent
    launcher = folder / f"{script.stem}_sagemaker.py"
    requirements = folder / "requirements.txt"
    package = folder / "sagenb"
    _check_replaceable(requirements, package)
    snippet = render_sagemaker(config, script.name, price, instances, processes)
    _write(script, text)
    _write(launcher, snippet)
    requirements.write_text(REQUIREMENTS.format(mark=MARK, name=script.name, stem=script.stem))
    copied = _copy_package(package)
    files = (script, launcher, requirements, *([package] if copied else []))
    return Exported(script, files, command, sagemaker=launcher)


def _sagemaker_layout(config: TrainConfig) -> tuple[InstancePrice, int, int]:
    """The instance type, how many instances, and how many processes SageMaker's torchrun
    starts on them (one per GPU), refusing what SageMaker or the split cannot run."""
    meter = meter_for(config, _engines(config))
    price = meter.price
    if price.accelerators < 1 or not price.name.startswith(("ml.p", "ml.g")):
        gpus = sorted(
            name
            for name, row in price_table(config.price_table).items()
            if row.accelerators and name.startswith(("ml.p", "ml.g"))
        )
        raise ConfigError(
            "instance",
            config.instance,
            f"SageMaker's torch_distributed runs only on GPU (and Trainium) instances, and "
            f"sagenb's engines use CUDA GPUs: choose one of {', '.join(gpus)}",
        )
    processes = meter.instances * price.accelerators
    if processes != config.engines:
        try:
            config.with_engines(processes)
        except ConfigError as exc:
            raise ConfigError(
                exc.name,
                exc.value,
                f"{exc.allowed}. On SageMaker, --engines {config.engines} on {config.instance} "
                f"({price.accelerators} GPUs each) runs {meter.instances} instance(s) with one "
                f"process per GPU, {processes} in all: choose --engines {processes} (and "
                f"options that split across {processes}), or an instance with fewer GPUs",
            ) from None
    return price, meter.instances, processes


def render_sagemaker(
    config: TrainConfig, name: str, price: InstancePrice, instances: int, processes: int
) -> str:
    """The SageMaker launcher's text (checked to compile)."""
    stem = Path(name).stem
    hyperparameters = {"output": f"{SAGEMAKER_MODEL_DIR}/{stem}_state.pt"}
    checkpoints = ""
    if config.checkpoint_dir:
        hyperparameters["checkpoint-dir"] = SAGEMAKER_CHECKPOINTS
        checkpoints = (
            f"\n    # keeps {SAGEMAKER_CHECKPOINTS} across jobs (run again with --resume):"
            '\n    # checkpoint_s3_uri="s3://YOUR-BUCKET/checkpoints",'
        )
    note = ""
    if processes != config.engines:
        note = (
            f"# --engines {config.engines} was exported; SageMaker starts {processes} processes "
            f"(one per GPU)\n# and {name} trains on all of them: the same model (every "
            "strategy trains as one process\n# would), up to rounding.\n"
        )
    text = SAGEMAKER.format(
        name=name,
        name_q=_q(name),
        instances=instances,
        instance=price.name,
        instance_q=_q(price.name),
        processes=processes,
        model_dir=SAGEMAKER_MODEL_DIR,
        accelerators=price.accelerators,
        accelerator=price.accelerator or "GPU",
        engines=config.engines,
        framework_q=_q(torch.__version__.split("+")[0]),
        python_q=_q(f"py{sys.version_info.major}{sys.version_info.minor}"),
        hyperparameters="".join(f"\n        {_q(k)}: {_q(v)}," for k, v in hyperparameters.items()),
        checkpoints=checkpoints,
        loss_regex=r'"loss": ([-+0-9.eE]+)',
        note=note,
    )
    compile(text, f"{stem}_sagemaker.py", "exec")
    return text


def _q(text: str) -> str:
    """A string as a double-quoted Python literal."""
    return json.dumps(text)


def _check_replaceable(requirements: Path, package: Path) -> None:
    """Refuse, before writing anything, to replace a requirements.txt or a sagenb/ folder
    that an export did not write (export into a folder of its own)."""
    if requirements.exists() and MARK not in requirements.read_text():
        raise ExportError(
            f"{requirements} exists and was not written by %%smp_export: export into a folder "
            "of its own (SageMaker uploads the whole folder)"
        )
    if package.exists() and not _same_package(package) and not (package / ".export").exists():
        raise ExportError(
            f"{package} exists and is not a copy of sagenb made by %%smp_export: export into "
            "a folder of its own"
        )


def _same_package(folder: Path) -> bool:
    """Whether `folder` is the installed sagenb package itself (exporting beside it)."""
    return folder.resolve() == SAGENB_DIR


def _copy_package(dest: Path) -> bool:
    """Copy the sagenb package that is running now to `dest` (False: it is already there)."""
    if _same_package(dest):
        return False
    shutil.rmtree(dest, ignore_errors=True)
    source = SAGENB_DIR
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / ".export").write_text(f"{MARK} from {source}\n")
    return True
