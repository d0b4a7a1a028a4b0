"""Scores reused while nothing they depend on changed: an evaluation scores again exactly what changed.

An evaluation step's ``score_cache.json`` holds its per-image scores with what each was computed from:

- per metric, its scorer's key: the name, its options (less how it is reached, the spec's ``transport``; secrets as
  ``***``), the content digest of the files its weights are read from (its spec's ``weights``: a file replaced at
  the same path changes it; :func:`jagg_core.setup.storage.paths_digest`), its code (the source of the module that
  defines it and of every module of its package that one imports, transitively, but the registry's plumbing, and the
  spec's ``version``), the scoring path's source (``benchmark.py``, ``clips.py``), the evaluation's conventions (protocol,
  resolution, steps, seed rule: ``conventions.py``) and ``eval.batch_size``;
- per image, the digest of its prompt and its bytes (a clip's: its scored frames').

The scorers are called on batches (``eval.batch_size`` images of one style, in order: a *chunk*); a chunk is scored
again for a metric when that metric's key or any of the chunk's images changed, and its cached scores are reused
otherwise. A chunk is the unit so that a reused score is the one a fresh scoring gives, bit for bit: the same images
reach the scorer in the same batch. A reward answered elsewhere (``reusable=False``: a served reward) is scored
every time. The file is written whole (atomically) after the scoring, on rank 0; an unreadable one reuses nothing.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..setup.registry import reward_spec
from ..setup.json_read import read_json
from ..setup.storage import atomic_write_text, open_regular, paths_digest, read_regular
from .benchmark import IMAGE_FIX, ImageFileError, image_path
from .clip_layout import frame_path
from .conventions import evaluation_conventions

__all__ = ["CACHE_NAME", "ScoreCache", "image_digests", "scorer_key", "weights_digest"]

CACHE_NAME = "score_cache.json"
_FORMAT = 1
# the scoring path's own modules, their source alone: how an image reaches a scorer (decoding, batching, the mean
# over a clip's frames)
_SCORING_CODE = ("jagg_core.evaluation.benchmark", "jagg_core.evaluation.clips")
# how a reward is found and its options read, not what it computes: an edit there rescores nothing
_PLUMBING = ("jagg_core.setup", "jagg_core.errors")


def _module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _imported(name: str, path: Path, package: str) -> set[str]:
    """The modules of ``package`` that module ``name`` (its source at ``path``) imports, relative imports resolved."""
    tree = ast.parse(read_regular(path, ValueError).decode("utf-8"))
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if node.module:  # `from . import clips` imports the submodule, not every one its package holds
                out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # a submodule, where it is one
    return {m for m in out if m == package or m.startswith(package + ".")}


@functools.cache
def _code_digest(module: str) -> str:
    """The source of ``module`` and of every module of its top-level package it imports, transitively (but the
    plumbing), as one digest; a module loaded from a file outside a package (a plugin file): its own source."""
    package = module.partition(".")[0]
    sources: dict[str, bytes] = {}
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name in seen or name.startswith(_PLUMBING):
            continue
        seen.add(name)
        path = _module_file(name) if name != module else _source_of(module)
        if path is None:
            continue
        sources[name] = read_regular(path, ValueError)
        todo.extend(_imported(name, path, package) if "." in module else ())
    h = hashlib.sha256()
    for name in sorted(sources):  # by name: the walk's order is a set's
        h.update(name.encode() + b"\0" + sources[name] + b"\0")
    return h.hexdigest()[:16]


def _source_of(module: str) -> Path | None:
    import sys

    mod = sys.modules.get(module)
    try:
        return Path(inspect.getsourcefile(mod)) if mod is not None else _module_file(module)
    except TypeError:  # a built-in module
        return None


def _weight_paths(name: str, options: Mapping[str, Any]) -> list[str]:
    """What ``name``'s weights are read from: its spec's ``weights``, else every option value naming a local path."""
    spec = reward_spec(name)
    if spec.weights is not None:
        return [str(v) for v in spec.weights(options)]
    values = [v for v in options.values() if isinstance(v, str) and v]
    return [v for v in values if Path(v).expanduser().exists()]


def _resolved(value: str) -> Path | None:
    """A local file or folder, else a hub id's snapshot folder in the local HF cache (never the network); None where
    there is neither (the reward says so when it loads)."""
    path = Path(value).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(value, local_files_only=True))
    except Exception:  # noqa: BLE001  (not a hub id, not cached: the reward's own sentence follows)
        return None


def weights_digest(name: str, options: Mapping[str, Any]) -> dict[str, str | None]:
    """``{path or hub id: content digest}`` of what ``name``'s weights are read from with ``options`` (None: not
    found; the reward says so when it loads)."""
    located = {v: _resolved(v) for v in _weight_paths(name, dict(options))}
    return {v: (paths_digest(p) if p is not None else None) for v, p in located.items()}


def scorer_key(params, name: str) -> str | None:  # noqa: ANN001 (a pipeline Params)
    """What metric ``name``'s scores of an image depend on, beyond the image and its prompt, as one digest (the
    module docstring); None for a reward whose scores are never reused."""
    spec = reward_spec(name)
    if not spec.reusable:
        return None
    options = dict(params.masked()["reward"]["options"].get(name, {}))
    module = getattr(spec.factory, "__module__", "") or ""
    tree = {
        "name": name,
        "options": {k: v for k, v in options.items() if k not in spec.transport},
        "weights": weights_digest(name, params.reward.options.get(name, {})),
        "code": [_code_digest(module), spec.version,
                 *(hashlib.sha256(read_regular(_module_file(m), ValueError)).hexdigest()[:16] for m in _SCORING_CODE)],
        "conventions": evaluation_conventions(params),
        "batch_size": params.eval.batch_size,
    }
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()


def image_digests(images_dir: Path, prompts: Mapping[str, Sequence[str]],
                  frames: Sequence[int] | None) -> dict[str, str]:
    """``{"<style>/<index>": digest}`` of each image's prompt and bytes (a clip's: its scored frames' bytes)."""
    out = {}
    for style, ps in prompts.items():
        for i, prompt in enumerate(ps):
            h = hashlib.sha256(prompt.encode("utf-8") + b"\0")
            files = [image_path(images_dir, style, i)] if frames is None else \
                [frame_path(images_dir, style, i, f) for f in frames]
            for f in files:  # never through a link (an image linked outside the project was scored as the model's)
                with open_regular(f, ImageFileError, limit=64 << 20, follow=False, fix=IMAGE_FIX) as image:
                    h.update(image.read())
            out[f"{style}/{i}"] = h.hexdigest()
    return out


class ScoreCache:
    """One step's cached scores (``score_cache.json``) against this evaluation's keys and images.

    ``keys``: ``{metric: scorer_key}``; ``images``: :func:`image_digests`."""

    def __init__(self, path: Path, keys: Mapping[str, str | None], images: Mapping[str, str], batch_size: int):
        self.path, self.keys, self.images, self.batch_size = path, dict(keys), dict(images), batch_size
        self.old = self._read()

    def _read(self) -> dict[str, Any]:
        if not (self.path.exists() or self.path.is_symlink()):
            return {}
        try:
            old = read_json(self.path, ValueError, limit=1 << 28)
        except ValueError:  # unreadable, not UTF-8, not JSON: nothing is reused, the file is rewritten
            return {}
        ok = (isinstance(old, dict) and old.get("format") == _FORMAT and isinstance(old.get("metrics"), dict)
              and isinstance(old.get("images"), dict) and isinstance(old.get("scores"), dict))
        return old if ok else {}

    def _reusable(self, metric: str, style: str, idx: Sequence[int]) -> bool:
        entry = self.old.get("metrics", {}).get(metric)
        key = self.keys.get(metric)
        if key is None or not isinstance(entry, dict) or entry.get("key") != key:
            return False
        old_images, scores = self.old["images"], self.old["scores"]
        for i in idx:
            image = f"{style}/{i}"
            if old_images.get(image) != self.images[image]:
                return False
            if not all(isinstance(scores.get(f, {}).get(image), (int, float)) for f in entry.get("fields", [])):
                return False
        return bool(entry.get("fields"))

    def needed(self, style: str, start: int, stop: int) -> list[str]:
        """The metrics to score the chunk ``[start, stop)`` of ``style`` with: those whose cached scores of it
        cannot be reused."""
        idx = range(start, stop)
        return [m for m in self.keys if not self._reusable(m, style, idx)]

    def reused(self, prompts: Mapping[str, Sequence[str]],
               needed: Callable[[str, int, int], list[str]]) -> dict[str, dict[str, dict[int, float]]]:
        """The cached scores of every chunk a metric does not score again, as one process's share
        (``merge_score_parts``'s input): ``{field: {style: {index: value}}}``."""
        out: dict[str, dict[str, dict[int, float]]] = {}
        for style, ps in prompts.items():
            for start in range(0, len(ps), self.batch_size):
                stop = min(start + self.batch_size, len(ps))
                again = needed(style, start, stop)
                for metric in self.keys:
                    if metric in again:
                        continue
                    for f in self.old["metrics"][metric]["fields"]:
                        values = self.old["scores"][f]
                        out.setdefault(f, {s: {} for s in prompts})[style].update(
                            (i, float(values[f"{style}/{i}"])) for i in range(start, stop))
        return out

    def write(self, scores: Mapping[str, Mapping[str, Sequence[float]]]) -> None:
        """``scores`` (every field of every metric, per image in prompt order) with this evaluation's keys."""
        fields = {m: [f for f in scores if f == m or f.startswith(m + "/")] for m in self.keys}  # scoring order
        body = {
            "format": _FORMAT,
            "metrics": {m: {"key": k, "fields": fields[m]} for m, k in self.keys.items()},
            "images": self.images,
            "scores": {f: {f"{s}/{i}": float(v) for s, values in by_style.items() for i, v in enumerate(values)}
                       for f, by_style in scores.items()},
        }
        atomic_write_text(self.path, json.dumps(body, sort_keys=True) + "\n")
