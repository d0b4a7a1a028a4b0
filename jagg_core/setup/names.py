"""The one rule for a name that becomes folder names, MLflow run names and metric keys.

A method's name (``methods.<name>``: ``runs/<outputs>/<method>-s<seed>``) and a plugin's (a reward's: the metric keys
``reward/<name>/…``, evaluation's ``eval/<name>``; a backbone's) are read by one rule: lowercase ASCII letters, digits,
``_`` and ``-``, starting with a letter or a digit, at most :data:`MAX_NAME` characters; a plugin's name may also hold
single inner dots (jagg's own ``hpsv2.1``), never a leading, trailing or doubled one. No ``/`` (a metric key's
separator: MLflow refused the run's logging), no ``..``, no whitespace or newline, nothing 300 characters long.

Imported by :mod:`.config` (method names) and :mod:`.registry` (plugin names), which imports nothing of the two.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MAX_NAME", "NAME", "PLUGIN_NAME", "is_name", "name_rule"]

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*\Z")
PLUGIN_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*(?:\.[a-z0-9][a-z0-9_-]*)*\Z")
MAX_NAME = 64  # a name (profile, outputs, method, plugin) becomes folder names and MLflow run names: keep it short


def is_name(value: Any, *, dots: bool = False) -> bool:
    """Whether ``value`` is a name by the rule (``dots``: a plugin's name, which may hold single inner dots)."""
    rule = PLUGIN_NAME if dots else NAME
    return isinstance(value, str) and len(value) <= MAX_NAME and rule.fullmatch(value) is not None


def name_rule(*, dots: bool = False) -> str:
    """The rule in words, for a sentence."""
    inner = ", single dots inside" if dots else ""
    return f"[a-z0-9][a-z0-9_-]*{inner} in at most {MAX_NAME} characters"
