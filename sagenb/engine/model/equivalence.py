"""What keeps a run from training the model one process would, said out loud (issue 15).

Every strategy trains as one process would (docs/contract.md), with exceptions that come
from the model itself: BatchNorm normalises whatever batch reaches it, and dropout draws its
masks from each engine's own generator; a mixture-of-experts model's own load-balancing loss
is computed over the tokens of each forward. `equivalence_warnings` names each exception a run will
hit, from the built model and the config, with what to do about it; rank 0 sends them to the
notebook with the first step's metrics (entry.py), which shows each once (run/training_run.py).

data and sharded synchronise BatchNorm across engines (sync_batchnorm.py), so BatchNorm warns
only where the batch reaching it is still a part of the global batch: pipeline microbatches (as
GPipe has it, Huang et al. 2019, section 2.2), gradient-accumulation slices, and replicas of
strategies that do not synchronise it.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from torch import nn

from sagenb.config.job import JobError
from sagenb.config.registry import describe  # the strategies import model/: ask their seam
from sagenb.engine.model.blocks import find_blocks
from sagenb.engine.torch_private import BatchNormBase, DropoutBase

if TYPE_CHECKING:
    from sagenb.config.options import EngineConfig

__all__ = ["EquivalenceWarning", "equivalence_warnings"]

NORM_FIX = "or use GroupNorm/LayerNorm, which normalise each sample on its own"


class EquivalenceWarning(UserWarning):
    """A run that cannot train exactly the model one process would, and why."""


# Each run warns its own causes (the session dedupes within a run): without this, Python's
# "default" action would show a sentence once per kernel, and a second run would stay silent.
# Appended, so that a user's own filter for the category (e.g. "ignore") still wins.
warnings.filterwarnings("always", category=EquivalenceWarning, append=True)


def equivalence_warnings(
    model: nn.Module, config: EngineConfig, *, collate_draws: bool = False
) -> list[str]:
    """One sentence per cause that makes this run differ from one process's, each naming
    the construct, the option and what to do; [] when it trains as one process would.
    `collate_draws`: the cell's collate_fn drew random numbers (engine/data/collation.py)."""
    out = []
    batchnorm = [n or "the model" for n, m in model.named_modules() if _is_batchnorm(m)]
    if batchnorm:
        out += _batchnorm_warnings(_names(batchnorm, "BatchNorm"), config)
    recomputed = _in_blocks(model, batchnorm) if config.activation_checkpointing else []
    if recomputed:
        out.append(
            f"{_names(recomputed, 'BatchNorm')} inside a block that --activation-checkpointing "
            "recomputes in backward updates its running stats (and num_batches_tracked) twice "
            "per step, in the forward and again in the recompute: drop "
            f"--activation-checkpointing, {NORM_FIX}"
        )
    dropout = _dropout(model)
    engines = config.engines if config.engines is not None else 2  # unknown: assume several
    if dropout and engines > 1:
        out.append(
            f"{_names(dropout, 'dropout')} draws its masks on each engine from that engine's "
            "own random generator, so this run trains correctly but not bit-for-bit like one "
            "process: set the dropout probabilities to 0 (or model.eval() the dropout layers) "
            "for an exact comparison"
        )
    if collate_draws and _collated_in_pieces(config):
        out.append(
            "collate_fn draws random numbers (masked-LM masking, random crops): each engine "
            "draws for its own pieces of the global batch (with --data-workers, from each "
            "worker's generator), so the batches differ from those one process would draw for "
            "the whole global batch: this run trains correctly but not bit-for-bit like one "
            "process; for an exact comparison draw nothing in collate_fn (e.g. mlm=False, or "
            "masks fixed in the dataset)"
        )
    routed = getattr(getattr(model, "config", None), "output_router_logits", False)
    if routed is True and _forwards_in_pieces(config):
        out.append(
            "the model's auxiliary load-balancing loss (its config's output_router_logits) "
            "is a product of two means over the tokens of one forward (the share of tokens "
            "each expert received, its mean routing probability): each engine computes it "
            "over its own piece of the global batch, so this run trains correctly but not "
            "bit-for-bit like one process, which computes it over the whole batch; set "
            "output_router_logits=False (or --engines 1 --grad-accum 1) for an exact comparison"
        )
    return out


def _forwards_in_pieces(config: EngineConfig) -> bool:
    """Whether a global batch goes through the model in more than one forward."""
    engines = config.engines if config.engines is not None else 2  # unknown: assume several
    pieces = describe(config.strategy).split(config, engines)[0]
    pipelined = describe(config.strategy).pipelined
    return pieces > 1 or (pipelined and config.option("microbatches") > 1)


def _collated_in_pieces(config: EngineConfig) -> bool:
    """Whether a global batch is collated in more than one piece, or outside the engine."""
    engines = config.engines if config.engines is not None else 2  # unknown: assume several
    return describe(config.strategy).split(config, engines)[0] > 1 or config.data_workers > 0


def _batchnorm_warnings(what: str, config: EngineConfig) -> list[str]:
    out = []
    strategy = describe(config.strategy)
    microbatches = config.option("microbatches")
    if strategy.pipelined and microbatches > 1:
        out.append(
            f"{what} normalises each pipeline microbatch on its own (--microbatches "
            f"{microbatches}), as in GPipe, so its batch statistics and running stats "
            "differ from one process's over the whole batch: use --microbatches 1, "
            f"{NORM_FIX}"
        )
    if config.grad_accum > 1:
        out.append(
            f"{what} normalises each of the --grad-accum {config.grad_accum} slices of a "
            f"global batch on its own, so its statistics are those of "
            f"{config.batch_size // config.grad_accum} samples, not of the --batch-size "
            f"{config.batch_size} one process would see: use --grad-accum 1, {NORM_FIX}"
        )
    replicas = config.replicas(config.engines) if config.engines is not None else 1
    if not strategy.syncs_norm and replicas > 1:
        out.append(
            f"{what} is not synchronised across the {replicas} replicas of --strategy "
            f"{config.strategy}: each normalises its own share of the batch: use --strategy "
            f"data or sharded (which synchronise BatchNorm across engines), {NORM_FIX}"
        )
    return out


def _is_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, BatchNormBase)  # BatchNorm1d/2d/3d, lazy and sync


def _in_blocks(model: nn.Module, names: list[str]) -> list[str]:
    """Those of `names` inside the blocks recompute.checkpoint_blocks wraps."""
    try:
        blocks = find_blocks(model)
    except JobError:  # no blocks: --activation-checkpointing fails on its own
        return []
    prefixes = [blocks.qualified(i) for i in range(len(blocks))]
    return [n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)]


def _dropout(model: nn.Module) -> list[str]:
    """Modules that drop at random in training: nn.Dropout* (and MultiheadAttention) with
    p > 0, and transformers models whose config sets an attention dropout probability > 0
    (Llama's attention_dropout is a float handed to F.dropout, not a module)."""
    found, configs = [], set()
    for name, m in model.named_modules():
        label = name or "the model"
        if isinstance(m, DropoutBase) and m.p > 0 and m.training:
            found.append(label)
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0 and m.training:
            found.append(label)
        elif (cfg := getattr(m, "config", None)) is not None and id(cfg) not in configs:
            configs.add(id(cfg))  # submodules share their model's config: name it once
            if drops := _config_dropout(cfg):
                found.append(f"{label} ({', '.join(drops)})")
    return found


#: transformers config keys of dropout applied with F.dropout inside attention (no module to
#: find); the other dropouts (hidden, residual, embedding) are nn.Dropout modules, found as such,
#: and keys such as GPT-2's summary_first_dropout belong to heads the model may not have
FUNCTIONAL_DROPOUT = frozenset(
    {"attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout"}
)


def _config_dropout(config: Any) -> list[str]:
    if not hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return []
    return [
        f"config.{k}={v}"
        for k, v in config.to_dict().items()
        if k in FUNCTIONAL_DROPOUT
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and v > 0
    ]


def _names(names: list[str], kind: str) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{kind} ({shown})"
