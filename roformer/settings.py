"""What values a setting allows, written beside the setting and checked where it is defined.

A config dataclass (TrainConfig, DataConfig, ModelConfig, the GLUE protocol) or a config
check (the ablation's) keeps a table `key -> rule` and calls `check_all`; a value the rule
refuses is a `ConfigError` whose one line names the key, the value and what is allowed,
e.g. `train.checkpoint_every=0 is not allowed: an integer >= 1`.

A rule is a short text:
  "int >= 1", "float > 0", "float in [0, 1)", "int >= -1"   a number and its range
  "int >= 1 or None"                                         also None (unset)
  "choice linear cosine", "choice '' copy"                   one of the words ('' the empty text)
  "bool"
Integers are not floats' halves: an `int` rule refuses 2.5 (and True: a bool is no number);
a `float` rule takes an integer. NaN and the infinities are in no range: a setting is a
finite number (`train.eps=inf` would train with no updates).
"""
from __future__ import annotations

import functools
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

from roformer.errors import ConfigError

_RANGE = re.compile(r"^(int|float)(?: (>=|>|<=|<) (-?[\d.e+-]+)| in ([\[(])(-?[\d.e+-]+), (-?[\d.e+-]+)([\])]))?"
                    r"( or None)?$")
_KINDS = {"int": "an integer", "float": "a number"}


@functools.lru_cache(maxsize=None)
def _parse(rule: str) -> tuple:
    if rule == "bool":
        return ("bool",)
    if rule.startswith("choice "):
        return ("choice", tuple("" if word == "''" else word for word in rule.split()[1:]))
    match = _RANGE.match(rule)
    if not match:
        raise ValueError(f"malformed setting rule {rule!r}")
    kind, op, bound, lo_bracket, lo, hi, hi_bracket, none = match.groups()
    return ("number", kind, op, float(bound) if bound else None,
            (lo_bracket, float(lo), float(hi), hi_bracket) if lo_bracket else None, bool(none))


def allowed(rule: str) -> str:
    """`rule` in words: 'an integer >= 1', 'one of linear, cosine', ..."""
    parsed = _parse(rule)
    if parsed[0] == "bool":
        return "True or False"
    if parsed[0] == "choice":
        return "one of " + ", ".join(repr(c) for c in parsed[1])
    _, kind, op, bound, interval, none = parsed
    text = _KINDS[kind]
    if op:
        text += f" {op} {_number(bound)}"
    elif interval:
        lo_bracket, lo, hi, hi_bracket = interval
        text += f" in {lo_bracket}{_number(lo)}, {_number(hi)}{hi_bracket}"
    return text + (" (or None)" if none else "")


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def is_allowed(value: Any, rule: str) -> bool:
    """Whether `rule` allows `value`."""
    parsed = _parse(rule)
    if parsed[0] == "bool":
        return isinstance(value, bool)
    if parsed[0] == "choice":
        return isinstance(value, str) and value in parsed[1]
    _, kind, op, bound, interval, none = parsed
    if value is None:
        return none
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if kind == "int" and not isinstance(value, numbers.Integral):
        return False
    try:
        value = float(value)
    except OverflowError:   # an integer beyond any float
        return False
    if not math.isfinite(value):
        return False
    if op:
        return {">=": value >= bound, ">": value > bound, "<=": value <= bound, "<": value < bound}[op]
    if interval:
        lo_bracket, lo, hi, hi_bracket = interval
        return ((value >= lo if lo_bracket == "[" else value > lo)
                and (value <= hi if hi_bracket == "]" else value < hi))
    return True


def refusal(key: str, value: Any, rule: str) -> str | None:
    """The one line that refuses `value` of setting `key` (its full name, e.g. 'train.steps'),
    None when `rule` allows it."""
    return None if is_allowed(value, rule) else f"{key}={value!r} is not allowed: {allowed(rule)}"


def check(key: str, value: Any, rule: str) -> None:
    """Refuse `value` of setting `key` unless `rule` allows it."""
    message = refusal(key, value, rule)
    if message:
        raise ConfigError(message)


def problems(prefix: str, values: Mapping[str, Any] | Any, rules: Mapping[str, str]) -> list[str]:
    """The refusal of every key of `rules` in `values` (a mapping, or an object with those
    attributes) that its rule does not allow; `prefix` names the section ('train.')."""
    found = []
    for key, rule in rules.items():
        value = values[key] if isinstance(values, Mapping) else getattr(values, key)
        found += [message] if (message := refusal(prefix + key, value, rule)) else []
    return found


def check_all(prefix: str, values: Mapping[str, Any] | Any, rules: Mapping[str, str]) -> None:
    """`check` every key of `rules` in `values`; the first refused value raises."""
    found = problems(prefix, values, rules)
    if found:
        raise ConfigError(found[0])
