"""Reading params: ``params.yaml`` and ``--set`` values as untrusted YAML, profiles merged, the tree validated.

:func:`load_params` is what every entrypoint calls: it reads the file (one sentence when it is a folder, a symlink loop,
not UTF-8 or absurdly large), parses it with the safe loader (duplicate keys refused, aliases bounded), merges it
over the file its ``extends`` key names (a user's small file on the project's params.yaml), deep-merges the
active profile's overlay, applies dotted overrides and validates the result against the schema of
:mod:`jagg_core.setup.config`; every failure is one :class:`~jagg_core.setup.config.ParamsError` sentence.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import BaseModel, ValidationError

from .config import _NAME, Params, ParamsError
from .paths import PathRuleError, inside
from .redact import flatten, hide, holds_secret, invalid_value, redact_value
from .storage import read_regular

__all__ = ["deep_merge", "load_params", "parse_yaml"]


# Mappings that a profile replaces as a whole: a profile's reward mix is its own, not added to the default's.
_REPLACED = {"reward.weights"}


def deep_merge(base: Mapping[str, Any], overlay: Mapping[str, Any], _path: str = "") -> dict[str, Any]:
    """``overlay`` onto ``base``: mappings merge key by key (except :data:`_REPLACED`), anything else replaces."""
    out = copy.deepcopy(dict(base))
    for k, v in overlay.items():
        path = f"{_path}{k}"
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and path not in _REPLACED:
            out[k] = deep_merge(out[k], v, path + ".")
        else:
            out[k] = copy.deepcopy(v)
    return out


_MAX_KEY_DEPTH = 32  # parts of a dotted override key; the deepest params key (a plugin's options) has a few


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if len(keys) > _MAX_KEY_DEPTH:  # validating a tree that deep ends in a RecursionError, not in a sentence
        raise ParamsError(f"override {dotted[:60]}… names a key {len(keys):,} levels deep; a params key has at most "
                          f"{_MAX_KEY_DEPTH} (e.g. train.iterations).")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ParamsError(f"override {dotted}: {k} is not a section.")
    node[keys[-1]] = value


def _describe(exc: ValidationError, source: str, tree: Mapping[str, Any]) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal[", "float", "tagged")))
    more = f" ({len(exc.errors()) - 1} more problem(s) after this one)" if len(exc.errors()) > 1 else ""
    if err["type"] == "extra_forbidden":
        parent = loc.rsplit(".", 1)[0] if "." in loc else ""
        model = Params
        for part in parent.split(".") if parent else []:
            field = model.model_fields.get(part)
            ann = getattr(field, "annotation", None)
            model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
            if model is None:
                break
        valid = f"; valid keys there: {', '.join(model.model_fields)}" if model is not None else ""
        return f"{source}: unknown key '{loc}'{valid}{more}."
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "value_error" and isinstance(err.get("input"), Mapping):  # a whole-section check
        named = loc and not msg.startswith(loc)  # a typed option's sentence names its dotted path itself
        field = re.match(r"[\w-]+ = ", msg)  # a section's check naming its field: the dotted path, as elsewhere
        return f"{source}: {(loc + ('.' if field else ': ')) if named else ''}{msg}{more}."
    if "input" in err and err["type"] != "missing":
        # the value as typed, less a URL's credentials (a password with a space is no URL the free-text redaction,
        # which ends at a space, recognises, but this input is one value); a secret field's not at all
        return f"{source}: {invalid_value(loc or 'params', err['input'], msg)}{more}."
    return f"{source}: {loc} is invalid: {msg}{more}."


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last).

    Merge keys (``<<: *base``, ``<<: [*a, *b]``) are YAML's own: PyYAML flattens them (a key written beside the merge
    overrides the merged one, as ``yaml.safe_load`` reads it); only the keys written in the mapping itself must be
    distinct. A merge copies its mapping's entries, so a chain of merges is bounded like an alias bomb."""

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        super().flatten_mapping(node)  # PyYAML's recursion comes back here for every merged mapping
        if len(node.value) > _MAX_NODES:
            raise yaml.YAMLError(f"merge keys expand a mapping to more than {_MAX_NODES:,} entries "
                                 f"(line {node.start_mark.line + 1})")


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:  # flattened by construct_mapping below
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.YAMLError(f"key {key!r} appears twice in one mapping (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


# A params tree is small; YAML aliases can make a tiny file expand to billions of nodes ("billion laughs") or loop.
_MAX_FILE_BYTES = 16 << 20
_MAX_NODES = 1_000_000  # values, a string counting as its length in characters (an alias of it as many again)
_MAX_SET_CHARS = 64 << 10  # one --set value
_PLAIN = (str, int, float, bool, type(None))  # what a value may be: YAML's !!binary, !!set, timestamps are not params


def _read_params_file(path: Path) -> str:
    """The text of a params file, or one sentence saying why it cannot be read (missing, a folder, a device or a
    FIFO, a symlink loop, unreadable, absurdly large, not UTF-8): the project's one bounded read,
    :func:`~jagg_core.setup.storage.read_regular`."""
    data = read_regular(path, ParamsError, limit=_MAX_FILE_BYTES,
                        fix="pass --params PATH/TO/params.yaml (a params file of a few KiB), or run from the "
                            "repository root")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParamsError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8.") from None


def parse_yaml(text: str, source: str) -> Any:
    """YAML from an untrusted source (a params file, a ``--set`` value): the safe loader, duplicate keys refused,
    aliases bounded; any failure is one :class:`ParamsError` sentence, never a traceback."""
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ParamsError(f"{source} is not valid YAML ({_yaml_problem(e)}); fix the syntax or quote the "
                          f"value.") from None
    except RecursionError:
        raise ParamsError(f"{source} nests too deeply to be params; flatten it.") from None
    except (ValueError, UnicodeDecodeError, OverflowError) as e:  # an int of 5000 digits, !!binary of non-UTF-8
        first = " ".join(str(e).split())[:120]
        raise ParamsError(f"{source} holds a value YAML cannot read as params ({type(e).__name__}: {first}); "
                          f"write it as a plain number or string.") from None
    _bounded(value, source)
    return value


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What is wrong and where (line, column), never the text of the line: PyYAML's own message quotes the line with a
    caret under it, and a file that is no params file (a forged pool unit's ``params_file``, a `--params` typo) may be
    anyone's secrets; the sentence goes to the console, Prefect's database and MLflow."""
    if not isinstance(e, yaml.MarkedYAMLError):
        return " ".join(str(e).split())[:200]  # ours (a key twice, a merge too large): no quoted line
    parts = []
    for what, mark in ((e.context, e.context_mark), (e.problem, e.problem_mark)):
        if what:
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            parts.append(" ".join(str(what).split())[:120] + where)
    return "; ".join(parts) or type(e).__name__


def _bounded(tree: Any, source: str) -> None:
    """Refuse a tree that refers to itself or expands (through shared YAML aliases) to more than :data:`_MAX_NODES`
    nodes: validating it would never end."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: Any, depth: int) -> int:
        if not isinstance(node, (dict, list, tuple)):
            if not isinstance(node, _PLAIN):
                raise ParamsError(f"{source} holds a {type(node).__name__} value (a YAML tag such as !!binary, !!set "
                                  f"or a timestamp); params are strings, numbers, true/false, lists and mappings.")
            if isinstance(node, str):  # an aliased string counts each time it is used: it is copied that often
                if len(node) > _MAX_NODES:
                    raise ParamsError(f"{source} holds a string of {len(node):,} characters; a value of params is "
                                      f"short.")
                return 1 + len(node)
            return 1
        if id(node) in open_ or depth > 100:
            raise ParamsError(f"{source} refers to itself or nests too deeply (a YAML alias loop?); write it out.")
        if id(node) not in sizes:
            open_.add(id(node))
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            total = 1
            for c in children:
                total += size(c, depth + 1)
                if total > _MAX_NODES:
                    break
            sizes[id(node)] = total
            open_.discard(id(node))
        if sizes[id(node)] > _MAX_NODES:
            raise ParamsError(f"{source} expands to more than {_MAX_NODES:,} values (YAML aliases?); write it out.")
        return sizes[id(node)]

    size(tree, 0)


_MAX_EXTENDS = 8  # files in one `extends` chain: a user's file on the project's, perhaps on a shared one


def _shown(path: Path, root: Path) -> str:
    """How a sentence names a params file: relative to the project (``params.yaml``, ``mine/params.yaml``) when it is
    in it, else as given: a sentence about ``mine/params.yaml`` named it ``params.yaml``."""
    where = Path(os.path.abspath(path))
    if where.is_relative_to(root):
        return where.relative_to(root).as_posix()
    with contextlib.suppress(OSError, RuntimeError):  # a symlink loop is the read's sentence, not this one's
        if path.resolve().is_relative_to(root):
            return path.resolve().relative_to(root).as_posix()
    return str(path)


def _profiles_of(raw: dict[str, Any], shown: str) -> dict[str, Any]:
    profiles = raw.get("profiles", {}) or {}
    if not isinstance(profiles, dict):
        raise ParamsError(f"{shown}: profiles must be a mapping of profile name -> overlay.")
    return profiles


def _extended(base: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a file that extends ``base``) deep-merged over ``base``: its sections key by key, its profiles too
    (``profiles.ci.train.lr`` changes that one value of ci's overlay); a reward mix and a list replace as a whole."""
    out = deep_merge({k: v for k, v in base.items() if k != "profiles"},
                     {k: v for k, v in raw.items() if k != "profiles"})
    profiles = copy.deepcopy(base.get("profiles") or {})
    for name, overlay in (raw.get("profiles") or {}).items():
        mine = profiles.get(name)
        profiles[name] = (deep_merge(mine, overlay) if isinstance(mine, dict) and isinstance(overlay, dict)
                          else copy.deepcopy(overlay))
    if profiles or "profiles" in base or "profiles" in raw:
        out["profiles"] = profiles
    return out


def _read_tree(path: Path, root: Path, chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], bool]:
    """The params tree of ``path`` with its ``extends`` chain merged under it (each extended file held to the path
    rule, the chain bounded, a cycle refused), and whether ``path`` extends another file."""
    shown = _shown(path, root)
    raw = parse_yaml(_read_params_file(path), shown)
    if raw is None:  # an empty file would silently run on the code's defaults
        raise ParamsError(f"{path} is empty; a params file holds the sections (model, sample, train, ...) and "
                          f"profiles, as the repository's params.yaml does.")
    if not isinstance(raw, dict):
        raise ParamsError(f"{shown} must be a mapping of sections, got {type(raw).__name__}.")
    _profiles_of(raw, shown)
    if "extends" not in raw:
        return raw, False
    given = raw.pop("extends")
    if not isinstance(given, str) or not given.strip() or len(given) > 1000:
        raise ParamsError(f"{shown}: extends must be the path of the params file it builds on, relative to "
                          f"{shown} (e.g. extends: ../params.yaml).")
    if holds_secret(given):
        raise ParamsError(f"{shown}: extends {redact_value(given)} holds a URL's credentials; a params file extends "
                          f"a local file of the project: pass its path.")
    target = Path(os.path.abspath(path)).parent / given
    try:  # the project's rule for a path argument: inside the project, a file
        target = inside(root, os.path.relpath(target, root), f"{shown}: extends", kind="file")
    except PathRuleError as e:
        raise ParamsError(str(e)) from None
    chain = (*chain, path.resolve())
    if target in chain:
        loop = " -> ".join(_shown(p, root) for p in (*chain, target))
        raise ParamsError(f"{shown}: extends {given!r} makes a cycle ({loop}); a params file extends one that does "
                          f"not extend it back: remove one of the extends.")
    if len(chain) >= _MAX_EXTENDS:
        raise ParamsError(f"{shown}: extends {given!r} makes a chain of more than {_MAX_EXTENDS} params files; "
                          f"extend the project's params.yaml directly.")
    base, _ = _read_tree(target, root, chain)
    return _extended(base, raw), True


_MAX_PROFILE_EXTENDS = 8  # profiles in one chain of `extends: <profile>`


def _overlay(profiles: Mapping[str, Any], name: str, source: str, chain: tuple[str, ...] = ()) -> dict[str, Any]:
    """Profile ``name``'s overlay, merged over the profile its ``extends:`` names (``ci-mine: {extends: ci, train:
    {iterations: 5}}`` is ci's overlay with that one value changed: a profile of one's own, with its own folders,
    built on one of the project's)."""
    overlay = profiles.get(name) or {}
    if not isinstance(overlay, dict):
        raise ParamsError(f"{source}: profiles.{name} must be a mapping of sections.")
    if "extends" not in overlay:
        return overlay
    base = overlay["extends"]
    if not isinstance(base, str) or base not in profiles:
        raise ParamsError(f"{source}: profiles.{name}.extends must name a profile of the params "
                          f"({', '.join(profiles)}).")
    if base in (*chain, name) or len(chain) >= _MAX_PROFILE_EXTENDS:
        raise ParamsError(f"{source}: profiles.{name}.extends {base!r} makes a cycle or a chain of more than "
                          f"{_MAX_PROFILE_EXTENDS} profiles; extend a profile that does not extend it back.")
    return deep_merge(_overlay(profiles, base, source, (*chain, name)),
                      {k: v for k, v in overlay.items() if k != "extends"})


def _not_the_projects_profile(tree: dict[str, Any], name: str, source: str, root: Path) -> None:
    """A file of one's own runs a profile of the project's params.yaml only as that file defines it: the profile's
    name is its folders (data/<p>, models/<p>, runs/<p>, checkpoints/<p>) and MLflow experiment, which the project's
    own runs use (docs/extending.md's example changed ci: it rewrote data/ci's prompts and blocked ci's training
    until --restart). Changes go in a profile of its own, which ``extends:`` the project's profile."""
    project = root / "params.yaml"
    theirs, _ = _read_tree(project, root)
    their_profiles = _profiles_of(theirs, "params.yaml")
    if name not in their_profiles and name != theirs.get("profile", "toy"):
        return  # a profile of its own: its own folders
    ignored = {"profile", "plugins"}  # what the profile is called; plugins alone change no setting of it
    mine = flatten({k: v for k, v in tree.items() if k not in ignored})
    project_tree = deep_merge({k: v for k, v in theirs.items() if k != "profiles"},
                              _overlay(their_profiles, name, "params.yaml"))
    base = flatten({k: v for k, v in project_tree.items() if k not in ignored})
    changed = sorted(k for k in set(mine) | set(base) if mine.get(k, base.get(k)) != base.get(k, mine.get(k))
                     or (k in mine) != (k in base))
    if changed:
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        raise ParamsError(f"{source} changes profile {name!r} of params.yaml ({changed[0]}{more}), whose folders "
                          f"(data/{name}, runs/{name}, checkpoints/{name}) and MLflow experiment are the project's "
                          f"own runs'; put the changes in a profile of your own that builds on it (profiles: "
                          f"{{{name}-mine: {{extends: {name}, ...}}}} with profile: {name}-mine), which gets folders "
                          f"of its own.")


def load_params(
    path: str | os.PathLike = "params.yaml",
    profile: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    root: str | os.PathLike | None = None,
) -> Params:
    """Read ``params.yaml``, apply the profile overlay and dotted ``overrides``, validate.

    The profile is, in order: the ``profile`` argument, ``$JAGG_PROFILE``, the file's ``profile`` key, ``toy``.

    A file with ``extends: <path>`` (relative to it, inside the project ``root``, the working directory unless given)
    is deep-merged over the file it names, profiles too (docs/extending.md). A file in the project that does not
    extend another and is not the project's ``params.yaml`` is refused, profiles or not (outside the project, one
    without ``profiles``): every key it leaves out would silently be the code's default (a user's small file replacing
    the project's). A file of one's own runs a profile of the project's params.yaml only as that defines it: changes
    go in a profile of its own (``profiles: {ci-mine: {extends: ci, ...}}``), whose folders and experiment are its own.
    """
    path = Path(path)
    root = Path(root if root is not None else Path.cwd()).resolve()
    source = _shown(path, root)
    if holds_secret(str(path)):
        # a URL's credentials (`http://alice:pw@host/params.yaml`, which a path prints as `http:/alice:…`) would be
        # printed in every sentence about the file and stored where a flow run's parameters are (Prefect)
        raise ParamsError(f"{redact_value(str(path))} holds a URL's credentials; a params file is a local file: save "
                          f"it and pass its local path.")
    raw, extends = _read_tree(path, root)
    own = path.resolve() == (root / "params.yaml").resolve()  # the project's own params file
    # a file of one's own that does not extend the project's is refused below, profiles or not: it ran on the code's
    # defaults and wrote into the project's profiles' folders (data/ci/prompts: 64 lines became 32)
    partial = not extends and not own and ("profiles" not in raw or path.resolve().is_relative_to(root))
    profiles = _profiles_of(raw, source)
    raw.pop("profiles", None)
    env = os.environ.get("JAGG_PROFILE")
    for given, where in ((profile, "--profile"), (env, "JAGG_PROFILE")):
        if given is not None and not given.strip():
            raise ParamsError(f"{where} is empty; name a profile of {source} ({', '.join(profiles) or 'none'}) or "
                              f"leave it out.")
    name = profile or env or raw.get("profile") or "toy"
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > 64:
        raise ParamsError(f"profile name {name!r} must match [a-z0-9][a-z0-9_-]* in at most 64 characters (it names "
                          f"folders).")
    if name not in profiles and name != raw.get("profile", "toy"):
        raise ParamsError(f"unknown profile {name!r}; profiles in {source}: {', '.join(profiles) or 'none'}.")
    overlay = _overlay(profiles, name, source)
    if not overlay and not (set(raw) - {"profile"}):
        # `profile: ci` alone, or with `profiles: {ci: {}}`: every value would be the code's default (and prepare
        # would overwrite ci's prompts with the code's sizes)
        where = "defines it as nothing" if name in profiles else "defines it nowhere"
        raise ParamsError(f"{source} {where} (profile {name!r}) and holds no sections: every value would be the "
                          f"code's default; add `profiles: {{{name}: ...}}` with its settings or the sections, or "
                          f"`extends: <path to the project's params.yaml>`, or pass the project's params.yaml.")
    given = (overrides or {}).get("profile", name)
    if given != name and (given in profiles or given == raw.get("profile", "toy")):
        # the profile names the folders (prompts, base model, runs): its settings would be written into those of
        # another profile of the file (a name no profile has is a scratch layout of its own, as the tests use)
        raise ParamsError(f"--set profile={str(given)[:64]} would write profile {name!r}'s settings into the folders "
                          f"of {str(given)[:64]!r}; pass --profile {str(given)[:64]} instead.")
    tree = deep_merge(raw, overlay)
    if extends and not own:
        _not_the_projects_profile(tree, name, source, root)
    tree["profile"] = name
    for dotted, value in (overrides or {}).items():
        _bounded(value, f"override {dotted}")
        _set_dotted(tree, dotted, value)
    try:
        params = Params.model_validate(tree)
    except ValidationError as e:
        # params that did not validate were never remembered as secrets: the sentence loses its tree's own, whichever
        # check quoted one (a secret key's value whatever its type, a URL's credentials or query)
        raise ParamsError(hide(_describe(e, f"{source} (profile {name})", tree), tree)) from None
    if partial:  # after its values' own sentences: a typo in it is named before the file as a whole
        project = os.path.relpath(root / "params.yaml", Path(os.path.abspath(path)).parent)
        raise ParamsError(f"{source} does not extend the project's params file, so every key it leaves out would be "
                          f"the code's default, not the project's; add `extends: {project}` "
                          f"(the project's params.yaml, relative to {source}) at its top to build on it.")
    return params
