"""How a batch reaches the model and becomes a loss: the contract for tuples and dicts.

- Samples that are `(input, target)` tuples: `output = model(input)`,
  `loss = loss_fn(output, target)`.
- Samples that are dicts (transformers style: `input_ids`, `attention_mask`, `labels`, ...) go
  in as keyword arguments, `model(**batch)`. With a `loss_fn` in the cell, `labels` stays out of
  the call and `loss = loss_fn(logits, labels)`, where `logits` is the output's `logits` (a
  `ModelOutput` or dict) or the output itself. Without one, the model's own loss is used, as
  the model computes it, whatever its head: `labels` goes in and the output's `loss` is read.
  A model that names its targets otherwise (nanoGPT's `forward(idx, targets=None)` returning
  `(logits, loss)`) is read by its own convention, for dict and tuple samples alike
  (engine/model/own_loss.py).
  A pipeline does the same: the labels travel with the inputs to the last stage, which
  computes the loss the traced forward computes there (the head's own code, its signature and
  its `config.problem_type` included), so no head needs a rule of sagenb's.

A step's loss is the mean over every counted target of the global batch, as one process would
compute it, however the batch is cut into engines' shares, grad-accum slices and microbatches.
A mean-reduced loss over a piece is weighted by the targets it counted: integer targets count
their entries other than -100 (cross_entropy's `ignore_index`: padding, prompts; the model's
own loss's `ignore_index` where its forward passes another, as nanoGPT's -1), after the
first position of each sequence when the loss is a transformers causal LM's own (it predicts
token t + 1 from token t: the model's `loss_function` is transformers' `ForCausalLMLoss`, and
its forward calls it; T5 and BART compute cross_entropy on aligned labels themselves);
other targets count samples. So a language-model or token-classification head counts its
tokens, a sequence or image classifier (one integer label a sample, or a row of floats for
multi-label and regression) its samples. Weighting each piece by its own count
over the global count is what Hugging Face's Trainer got wrong for gradient accumulation until
late 2024 (transformers issue #34242): averaging per-slice means over-weights short slices.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sagenb.config.job import JobError
from sagenb.engine.data.collation import Collate
from sagenb.engine.model import own_loss
from sagenb.engine.model.own_loss import IGNORE_INDEX, LABELS

__all__ = [
    "Objective",
    "IGNORE_INDEX",
    "logits_of",
    "batch_size_of",
    "model_inputs",
    "weighted",
    "piece_loss",
    "attached",
    "summed_note",
]


@dataclass(frozen=True)
class Objective:
    """The cell's loss, and how batches are fed to the model to compute it."""

    #: the cell's loss_fn, or None for the model's own loss (dict samples only)
    loss_fn: Callable[..., torch.Tensor] | None
    #: whether samples are dicts (keyword arguments) rather than (input, target) tuples
    dict_samples: bool
    #: whether the model's own loss drops each sequence's first label (a causal LM's shift)
    shifted: bool = False
    #: the cell's collate_fn, which makes every piece's batch (None: default_collate)
    collate_fn: Collate | None = None
    #: the key of dict batches' targets: "labels", or the model's own keyword for them
    target_key: str = LABELS
    #: the target value a mean-reduced loss leaves out of its mean (engine/model/own_loss.py)
    ignore_index: int = IGNORE_INDEX

    @classmethod
    def build(
        cls, model: nn.Module, loss_fn: Any, first: Any, collate_fn: Collate | None = None
    ) -> Objective:
        """`first`: the dataset's first sample, or with a collate_fn the batch it makes of
        the first samples (engine/data/collation.py example_batch): what the model will be given
        is what is checked, so labels a collator builds count."""
        dict_samples = isinstance(first, Mapping)
        _check_pair(first, collated=collate_fn is not None)
        if loss_fn is not None:
            return cls(loss_fn=loss_fn, dict_samples=dict_samples, collate_fn=collate_fn)
        key = _own_targets(model, first, collated=collate_fn is not None)
        return cls(
            loss_fn=None,
            dict_samples=dict_samples,
            shifted=_shifts_labels(model),
            collate_fn=collate_fn,
            target_key=key,
            ignore_index=own_loss.ignore_index(model),
        )

    # -- feeding the model -----------------------------------------------------------------
    def split(self, batch: Any) -> tuple[tuple, dict, Any]:
        """(positional args, keyword args, target) of a collated batch. The labels go in with
        the rest when the model's own loss is read, in every strategy (a pipeline's included)."""
        if not self.dict_samples:
            inputs, target = batch
            return ((inputs,) if self.loss_fn is not None else (inputs, target)), {}, target
        key, labels_in = self.target_key, self.loss_fn is None
        kwargs = dict(batch) if labels_in else {k: v for k, v in batch.items() if k != key}
        return (), kwargs, batch.get(key)

    def target(self, batch: Any) -> Any:
        return batch.get(self.target_key) if self.dict_samples else batch[1]

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        """The mean-reduced loss of one piece, from the model's output on it."""
        if self.loss_fn is not None:
            return _scalar(self.loss_fn(logits_of(output) if self.dict_samples else output, target))
        own = own_loss.loss_in(output)
        if own is None:
            raise JobError(
                f"the cell defines no loss_fn, and the model's output ({_shape(output)}), given "
                f"the targets as '{self.target_key}', carries no loss: sagenb reads its "
                f"'loss' (a ModelOutput or dict) or a tuple's one scalar tensor. Define "
                f"loss_fn(logits, labels), or return the loss so when forward is given targets"
            )
        return own

    def stage_output(self, output: Any) -> torch.Tensor:
        """What a pipeline's last stage hands its schedule, which sends tensors only: the
        logits a loss_fn takes, or the model's own loss, computed inside the stage."""
        return logits_of(output) if self.loss_fn is not None else self.loss(output, None)

    def stage_loss(self, handed: torch.Tensor, target: Any) -> torch.Tensor:
        """The loss of what stage_output handed over."""
        return self.loss(handed, target) if self.loss_fn is not None else handed

    # -- weighting ---------------------------------------------------------------------------
    def count(self, target: Any, batch: Any = None) -> torch.Tensor:
        """How many targets a mean-reduced loss over this piece averages (see the module)."""
        if torch.is_tensor(target) and not (target.is_floating_point() or target.is_complex()):
            # a causal LM's labels are (batch, positions); one label a sample is not shifted
            kept = target[..., 1:] if self.shifted and target.dim() > 1 else target
            return (kept != self.ignore_index).sum()
        n = batch_size_of(target if target is not None else batch)
        device = target.device if torch.is_tensor(target) else None
        return torch.tensor(n, device=device)

    def counts_vary(self, target: Any) -> bool:
        """Whether pieces of equal size can count different numbers of targets (integer
        targets may hold -100); otherwise the count is the sample count, known to every rank."""
        return torch.is_tensor(target) and not (target.is_floating_point() or target.is_complex())


def _own_targets(model: nn.Module, first: Any, *, collated: bool) -> str:
    """Without a loss_fn, where the model's own loss takes the targets (engine/model/own_loss.py):
    a dict batch's key, or "" for (input, target) pairs that go in as model(input, target).
    Anything else is refused in the words of samples or of the collate_fn's batches."""
    if isinstance(first, Mapping):
        key, why = own_loss.target_key(model, [str(k) for k in first])
        if key is not None:
            return key
        given = "the batches its collate_fn returns" if collated else "its dict samples"
        fix = (
            "make collate_fn add labels (transformers' DataCollatorForLanguageModeling("
            "tokenizer, mlm=False) copies input_ids, padding as -100)"
            if collated
            else "add labels, or define a collate_fn(samples) whose batches have them"
        )
        raise JobError(
            f"the cell defines no loss_fn, and {given} carry no targets its model takes: "
            f"{why}. {fix[0].upper()}{fix[1:]}, or define loss_fn(logits, labels)"
        )
    if isinstance(first, (tuple, list)) and len(first) == 2 and own_loss.takes_target(model):
        return ""
    kind = type(first).__name__
    given = f"its collate_fn returns a {kind}" if collated else f"its samples are {kind}s"
    raise JobError(
        f"the cell defines no loss_fn, and {given}: define loss_fn(output, target); or "
        f"{'return' if collated else 'give'} dict {'batches' if collated else 'samples'} with "
        f"'labels' to use the model's own loss. (input, target) pairs go in as "
        f"model(input, target) only when forward takes exactly those two parameters "
        f"({type(model).__name__}.forward takes {own_loss.parameter_names(model)})"
    )


def summed_note(loss_fn: Any) -> str | None:
    """What to say when the cell's loss_fn sums over the batch rather than averaging: every
    strategy weights a piece's loss as a mean of the targets it counts, so a sum trained
    another model than one process (0.0099 apart after SGD steps on 2 engines). Read from
    the loss_fn itself, never by calling it (a cell's loss_fn may count its calls, print,
    or take part in a collective): a torch loss module's `reduction`, a partial's keyword, or
    a `reduction="sum"` in its own code."""
    if loss_fn is None or not _sums(loss_fn):
        return None
    return (
        "loss_fn sums over the batch (reduction='sum'): sagenb weights each engine's, "
        "slice's and microbatch's loss as a mean over the targets it counts, as one "
        "process's mean over the global batch, so a summed loss trains another model "
        "than one process; return the mean (reduction='mean', torch's default) and scale "
        "the learning rate instead"
    )


def _sums(loss_fn: Any) -> bool:
    if isinstance(loss_fn, nn.Module):  # nn.MSELoss(reduction="sum") and the like
        return getattr(loss_fn, "reduction", None) == "sum"
    if isinstance(loss_fn, functools.partial):
        return loss_fn.keywords.get("reduction") == "sum" or _sums(loss_fn.func)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(loss_fn)))
    except (OSError, TypeError, SyntaxError):  # a builtin, or source nobody kept
        return False
    return any(
        k.arg == "reduction" and isinstance(k.value, ast.Constant) and k.value.value == "sum"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for k in node.keywords
    )


def _scalar(loss: Any) -> Any:
    """loss_fn's value, when it is one number: a loss per sample (reduction="none") failed in
    backward with autograd's "grad can be implicitly created only for scalar outputs"."""
    if isinstance(loss, torch.Tensor) and loss.dim() != 0 and loss.numel() != 1:
        raise JobError(
            f"loss_fn returned a tensor of shape {tuple(loss.shape)}, not one number: return "
            f"the mean over the batch (loss.mean(), or reduction='mean', torch's default), "
            f"which sagenb weights by the targets each piece counts"
        )
    return loss


def _check_pair(first: Any, *, collated: bool) -> None:
    """A tuple sample (or batch) is (input, target): any other length is refused naming the
    fix, not unpacked into "too many values to unpack"."""
    if isinstance(first, Mapping) or not isinstance(first, (tuple, list)) or len(first) == 2:
        return
    given = "its collate_fn returns" if collated else "its samples are"
    raise JobError(
        f"{given} {type(first).__name__}s of {len(first)}, and sagenb reads a tuple as "
        f"(input, target): give (input, target) pairs, or dicts of the model's keyword "
        f"inputs (model(**batch)), or define collate_fn(samples) that returns one of them"
    )


def _shape(output: Any) -> str:
    """What a model's output is, for an error: its type, and a tuple's element types."""
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {', '.join(type(o).__name__ for o in output)}"
    return f"a {type(output).__name__}"


def weighted(loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """loss x count, detached, for reporting: 0 for a piece that counts no target (its mean
    is 0/0 = nan; the backward of loss x 0 is a zero gradient all the same)."""
    loss = loss.detach()
    return torch.where(count > 0, loss, torch.zeros_like(loss)) * count


def piece_loss(objective: Objective, module: Any, batch: Any, scale: float) -> torch.Tensor:
    """Forward and backward of one piece on a module that takes whole batches (data, sharded,
    tensor parallel): its loss enters the gradient as loss x counted targets x `scale`;
    returns loss x count, detached."""
    args, kwargs, target = objective.split(batch)
    output = module(*args, **kwargs)
    loss = attached(objective.loss(output, target), output)
    count = objective.count(target, batch)
    (loss * (count * scale)).backward()
    return weighted(loss, count)


def attached(loss: Any, output: Any) -> torch.Tensor:
    """`loss`, when it is a tensor computed from the model's parameters; else a JobError:
    a float (or a detached tensor) has no gradient, so the step would fail in backward with
    torch's words, or train nothing and still finish."""
    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
        return loss
    what = (
        f"a tensor with no gradient history ({loss!r})"
        if isinstance(loss, torch.Tensor)
        else f"{type(loss).__name__} {loss!r}"
    )
    raise JobError(
        f"the loss is {what}, not a tensor computed from the model's parameters, so nothing "
        f"would train (the model returned {type(output).__name__}). Return tensors from "
        f"forward and loss_fn: float(x), x.item(), x.tolist(), x.detach() and torch.tensor(x) "
        f"cut the gradient"
    )


def logits_of(output: Any) -> Any:
    """The logits of a model's output: its `logits` field, or the output itself."""
    found = _field(output, "logits")
    return output if found is None else found


def _field(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):  # transformers' ModelOutput is an OrderedDict too
        return output.get(name)
    return getattr(output, name, None) if not torch.is_tensor(output) else None


def model_inputs(batch: Any) -> Any:
    """The token-id tensor of a batch, if it has one (for tokens/s): a tuple's input, or a
    dict's `input_ids`."""
    if isinstance(batch, Mapping):
        return batch.get("input_ids")
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def batch_size_of(batch: Any) -> int:
    """Samples in a collated batch: the leading size of its first tensor."""
    if torch.is_tensor(batch):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return batch_size_of(batch[0])
    raise JobError(f"cannot tell the batch size of a {type(batch).__name__}")


def _shifts_labels(model: nn.Module) -> bool:
    """Whether the model's own loss is transformers' causal-LM loss, which predicts token t + 1
    from token t: the loss_function of the model (or of its first submodule that has one),
    the callable its forward uses (transformers' loss/loss_utils.py, LOSS_MAPPING; a model
    whose class names no head, GPT2LMHeadModel among them, gets ForCausalLMLoss), when its
    forward calls it. An encoder-decoder such as T5 or BART is given ForCausalLMLoss too (by
    its class name, ...ForConditionalGeneration) but computes cross_entropy itself, on labels
    aligned with its logits (its decoder reads them shifted right): nothing is dropped."""
    for module in model.modules():
        if hasattr(type(module), "loss_function") and hasattr(module, "config"):
            found = getattr(module, "loss_function", None)
            causal = getattr(found, "__name__", None) == "ForCausalLMLoss"
            return causal and _reads(type(module).forward, "loss_function")
    return False


def _reads(function: Any, name: str) -> bool:
    """Whether `function`'s own code (under its decorators) reads an attribute `name`."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is None or name in code.co_names
