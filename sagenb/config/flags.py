"""The options as flags: argparse's arguments for each (`flag_arguments`, which the magic's
parser is built from), the flags an export leaves out (`notebook_only_flags`), and the flag
reference (`flag_reference`: docs/flags.md holds it, and a test keeps it so).

All of it reads `every_option` (options.py), the config's fields and the options the strategies
declare alike, so a new option is a flag, a row of the reference and a line of `--help` with
nothing to edit here. The spelling of one value as its flag is the option's own
(spec.py `Option.flag`), as `to_flags` writes it too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from sagenb.config.errors import flag_name
from sagenb.config.options import SECTIONS, TrainConfig, every_option, option_owners
from sagenb.config.spec import Option

__all__ = ["flag_arguments", "flag_reference", "notebook_only_flags"]


def _help(option: Option) -> str:
    """Its help, and for an option a strategy declares, the strategy (its fields' help texts
    name theirs in their own words)."""
    if option.name in TrainConfig.__dataclass_fields__:
        return option.help
    return f"{option.help} (--strategy {' or '.join(option_owners(option.name))})"


def flag_arguments(option: Option) -> tuple[tuple[str, ...], dict[str, Any]]:
    """argparse's option strings and keywords for `option` (every_option): a bool that is off
    by default is a `--x` switch, one that is on is `--x/--no-x` (BooleanOptionalAction); any
    other option takes a value, converted by its `parse` or its type."""
    if option.is_switch:
        action: Any = "store_true" if option.default is False else argparse.BooleanOptionalAction
        return (flag_name(option.name),), dict(
            dest=option.name, action=action, default=option.default, help=_help(option)
        )
    choices = option.allowed()
    extra = {"choices": choices} if choices else {}
    convert: Callable[[str], Any] = option.parse or option.type
    return (flag_name(option.name),), dict(
        dest=option.name,
        type=convert,
        default=option.default,
        help=_help(option),
        metavar=option.name.upper(),
        **extra,
    )


def notebook_only_flags() -> list[str]:
    """The flags of the notebook-only sections (display, cost, output), spelled as given
    when they change something: what an exported script leaves out."""
    return [
        o.flag(not o.default) if o.is_switch else flag_name(o.name)
        for o in every_option(TrainConfig)
        if not SECTIONS[o.section].engines
    ]


# -- the flag reference (docs/flags.md) ----------------------------------------------------


def flag_reference() -> str:
    """Markdown tables of every flag, one per section in SECTIONS order: flag, default and
    meaning, from the options themselves, the registered strategies' own included
    (docs/flags.md holds this; a test keeps it so)."""
    out = []
    for name, section in SECTIONS.items():
        where = "sent to the engines" if section.engines else "the notebook's own"
        out += [f"## {section.title}", "", f"{section.about} ({where}).", ""]
        out += ["| flag | default | meaning |", "|---|---|---|"]
        for option in every_option(TrainConfig):
            if option.section == name:
                row = (_reference_flags(option), _shown(option), _meaning(option))
                out.append("| {} | {} | {} |".format(*row))
        out.append("")
    return "\n".join(out)


def _reference_flags(option: Option) -> str:
    if option.is_switch and option.default is True:
        return f"`{flag_name(option.name)}`, `--no-{flag_name(option.name)[2:]}`"
    return f"`{flag_name(option.name)}`"


def _shown(option: Option) -> str:
    if option.shown is not None:
        return str(option.shown)
    if option.is_switch:
        return "on" if option.default else "off"
    if isinstance(option.default, str):
        return f"`{option.default}`"
    return f"{option.default:g}" if isinstance(option.default, float) else str(option.default)


def _meaning(option: Option) -> str:
    text = _help(option).replace("%%", "%").replace("|", "\\|")
    values = option.allowed() or ()
    if values and not all(v in text for v in values):
        text += ": " + ", ".join(f"`{v}`" for v in values)
    return text
