"""The names of the metrics: what the engines publish each step and what the notebook reads.

One name, one constant: the engines (engine/loop.py, memory.py, the pipeline strategy) write
these keys, the notebook (stream.py, result.py, display/dashboard.py, display/charts.py,
sizing/whatif.py) reads them, and a misspelt constant fails at import where a misspelt string read
nothing (issue 18: the keys were string literals in 11 modules). The values are part of the
public surface: `result.metrics`, `result.history`, the torchrun script's JSON lines and saved
checkpoints carry them, so they never change. A unit rides in the name, as TensorBoard-style
tags do: "step_time(s)", "memory/...(MiB)".

Pure Python, importing nothing: the engine side imports it without IPython or plotly.
"""

from __future__ import annotations

from typing import Final

# -- every rank, every step (engine/loop.py) --------------------------------------------------
STEP: Final = "step"
TOTAL_STEPS: Final = "total_steps"  # steps the whole run makes (a resumed one included)
EPOCH: Final = "epoch"
LR: Final = "lr"
LOSS: Final = "loss"  # the mean over this rank's counted targets; only ranks that compute it
COUNTED: Final = "counted"  # targets that loss counted: its weight in the global loss
LOSS_SCALE: Final = "loss_scale"  # --precision fp16
SKIPPED_STEP: Final = "skipped_step"  # --precision fp16: 1 when the gradients overflowed
GRAD_NORM: Final = "grad_norm"  # --clip-grad-norm
EVAL_LOSS: Final = "eval_loss"  # on steps that evaluate (--eval-every, the last)
STEP_TIME: Final = "step_time(s)"
DATA_WAIT: Final = "data_wait(s)"
#: the steps that wrote a checkpoint (--checkpoint-dir): this rank's seconds in checkpoint.save,
#: from its start to the last rank's agreement that the checkpoint is in place
CHECKPOINT_WRITE: Final = "checkpoint_write(s)"
SAMPLES: Final = "samples"
TOKENS: Final = "tokens"  # token-id inputs only
THROUGHPUT: Final = "throughput(samples/s)"
TOKEN_THROUGHPUT: Final = "throughput(tokens/s)"  # history rows, token-id inputs only
TIME: Final = "time(unix s)"  # when the step ended
WARNINGS: Final = "warnings"  # the first step's, rank 0: why the run cannot equal one process
#: the first step's, each rank: the bytes of tensors it read from the cell's pretrained
#: checkpoint (engine/model/pretrained.py), in MiB; absent when the cell names none
PRETRAINED_READ: Final = "pretrained_read(MiB)"

# -- memory per rank (engine/memory.py) -------------------------------------------------------
MEMORY_PREFIX: Final = "memory/"
MEMORY_KINDS: Final = ("params", "grads", "optimizer", "activations")


def memory(kind: str) -> str:
    """The key of one kind of memory, in MiB: memory("params") == "memory/params(MiB)"."""
    return f"{MEMORY_PREFIX}{kind}(MiB)"


MEMORY_PARAMS: Final = memory("params")
MEMORY_GRADS: Final = memory("grads")
MEMORY_OPTIMIZER: Final = memory("optimizer")
MEMORY_ACTIVATIONS: Final = memory("activations")
MEMORY_RSS: Final = memory("rss")  # the process's resident set, read every few seconds
MEMORY_DEVICE_PEAK: Final = memory("device_peak")  # CUDA only
MEMORY_DEVICE_CAPACITY: Final = memory("device_capacity")  # CUDA only
#: --offload-activations: the peak of saved activations held in host memory until backward
#: (those in MEMORY_ACTIVATIONS stay on the device)
MEMORY_OFFLOADED: Final = memory("offloaded_activations")

# -- pipelines (engine/strategies/pipeline/) ---------------------------------------------------
STAGES: Final = "stages"  # the pipeline stages this rank holds
BUSY_FORWARD: Final = "busy/forward(s)"
BUSY_BACKWARD: Final = "busy/backward(s)"
IDLE: Final = "idle(s)"  # the bubble: the step's span less this stage's forward and backward
TIMELINE: Final = "timeline"  # [kind "F"/"B", stage, microbatch, start, end] of the last step
TIMELINE_T0: Final = "timeline_t0(unix s)"
CUTS: Final = "cuts"  # the first step's: the blocks where stages 1, 2, ... begin

# -- mixture-of-experts models (engine/strategies/experts/) -----------------------------------
#: the (token, choice) pairs this rank's samples routed to each expert in the step, summed over
#: the MoE layers (a list, one count per expert); history rows: summed over the ranks
EXPERT_TOKENS: Final = "expert_tokens"

# -- --strategy own (engine/strategies/own.py) ----------------------------------------------------
#: the share of the step's all-reduced bytes whose all-reduce began before backward ended:
#: what the cell's DDP overlapped with backward (0 for one that reduces after it)
OVERLAPPED: Final = "overlapped"
ALL_REDUCES: Final = "all_reduces"  # the all-reduces the step's forward, backward and sync made
ALL_REDUCED: Final = "all_reduced(B)"  # and the bytes they reduced

# -- history rows only (metrics.History: the ranks of one step combined) ----------------------
RANK_LOSSES: Final = "rank_losses"  # each reporting rank's loss, in rank order
BUSY: Final = "busy(s)"  # mean over the engines of forward + backward
LOST_RANKS: Final = "lost_ranks"  # after a failure: ranks whose metrics of the step were lost


def unit(key: str) -> str:
    """The unit a key carries in its name: unit("throughput(tokens/s)") == "tokens/s"."""
    if not key.endswith(")") or "(" not in key:
        raise ValueError(f"metric key {key!r} names no unit: expected 'name(unit)'")
    return key[key.index("(") + 1 : -1]
