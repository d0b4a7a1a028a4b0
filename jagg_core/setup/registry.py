"""The plugin registry: every backbone and every reward is one spec, registered where it is defined.

As timm's ``@register_model``: a backbone module declares its :class:`BackboneSpec` (options, the files it needs, cost
facts for ``jagg plan``, export and evaluation facts, a tiny random stand-in) beside its policy factory, a reward
module its :class:`RewardSpec` beside its factory, and registers it there (``jagg_core.policies.register_backbone``,
``jagg_core.rewards.register_reward``). The configuration, ``jagg plan``, export, evaluation and the report read the
specs; none of them names a backbone or a reward.

Where plugins come from (:func:`load_plugins`), the built-in ones included, so that a user's plugin is found the way
jagg finds its own:

- the entry-point group ``jagg.plugins`` of every installed package (jagg's own pyproject.toml lists its built-ins
  there; a user's package adds ``[project.entry-points."jagg.plugins"] my_reward = "my_pkg.my_reward"``);
- the files named in params.yaml's ``plugins`` list (paths inside the project), imported by path.

A plugin that fails to import or registers a name that is already taken is one sentence (:class:`PluginError`)
naming the plugin and its file (or entry point). docs/extending.md is the guide.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import sys
import threading
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from ..errors import UserError, sentence
from .names import is_name, name_rule
from .options import OptionSchema, option_reader, read_options
from .storage import read_regular

__all__ = ["ENTRY_POINT_GROUP", "BackboneSpec", "CostFacts", "PluginError", "RewardSpec", "add", "backbone_names",
           "backbone_spec", "load_plugins", "remove", "reward_names", "reward_spec"]

ENTRY_POINT_GROUP = "jagg.plugins"
log = logging.getLogger(__name__)


class PluginError(UserError, ValueError):
    """A plugin that cannot be loaded or registered; the message is one sentence for the user."""


@dataclass(frozen=True)
class CostFacts:
    """What the cost of one transformer forward depends on (the published config), for ``jagg plan``."""

    name: str  # the model's published name
    params: float  # transformer parameters
    layers: int  # attention layers (joint image-text attention in each)
    hidden: int  # width d
    pixels_per_token: int  # image pixels per token side (VAE downsampling × patch size)
    text_tokens: int  # text tokens in the attention (an assumption for prompts of HPDv2's length where noted)
    frozen_params: float  # text encoders + VAE, held on every rank in the dtype
    source: str  # where the numbers come from
    frames_per_latent: int = 0  # video: the VAE's temporal compression (F' = (F − 1) / it + 1); 0: an image model
    cross_attention: bool = False  # text by cross-attention (Wan), not in the joint sequence
    true_cfg: bool = False  # guidance_scale > 1 runs the conditional and unconditional halves: 2 forwards a step
    # text padded to model.options.max_sequence_length: the text tokens are this many (CLIP's 77) + that length, the
    # profile's or the policy's default (None: text_tokens, an unpadded prompt's length, at most that length)
    text_fixed: int | None = None


@dataclass(frozen=True)
class BackboneSpec:
    """A backbone: its policy factory ``(path, *, device, dtype, options) -> Policy`` and what the rest of jagg needs
    to know of it without loading it."""

    name: str
    factory: Callable[..., Any]
    options: OptionSchema  # model.options: {option: (type, default)}, read strictly (jagg_core.setup.options)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # the policy's defaults (resolution, guidance, ...)
    hub_id: str | None = None  # where `hf download` fetches it (the HF cache is read offline)
    components: Mapping[str, str] = field(default_factory=dict)  # sub-folder -> the files it must hold
    check_files: Callable[[str | None], None] | None = None  # files checked without loading (None: by components)
    cost: CostFacts | None = None  # jagg plan's arithmetic (None: not planned, e.g. a laptop-sized model)
    export_pipeline: str | None = None  # the diffusers pipeline whose LoRA format an export writes
    video: bool = False  # samples are clips (B, F, 3, H, W): frame-averaged image scores, frame strips
    world: bool = False  # the embedded toy world's model: prompts from the world, base model from `jagg pretrain`
    stand_in: Callable[[Path], Path] | None = None  # writes a tiny random model folder (tests)
    # options whose values are secrets under names the redaction's word list does not know (a key, a passphrase):
    # `***` in params.json, state.json, MLflow and every log; a fingerprint hashes them as `***`
    secret: tuple[str, ...] = ()
    origin: str = ""  # the module or file that registered it (filled in by add())

    def read_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        return read_options(_reader("model.options", self), options, "model.options", repr(self.name), self.secret)


@dataclass(frozen=True)
class RewardSpec:
    """A reward: its factory ``(**options) -> RewardFn`` and what evaluation and the report say of its scores."""

    name: str
    factory: Callable[..., Any]
    options: OptionSchema = field(default_factory=dict)  # reward.options.<name>: {option: (type, default)}
    # groupwise: sees a prompt's whole group at once (or a function of the options that says which)
    kind: str | Callable[[Mapping[str, Any]], str] = "pointwise"
    # its calls may run in a thread while the policy samples, each on a part of the rollout as soon as that part is
    # sampled (a pointwise one on consecutive slices of its built function's `request_size` images, a groupwise one per
    # group): it draws from no random stream of the run and its scores of an image do not depend on when it is called
    # (rewards/weighted.py); or a function of the options that says whether
    beside_policy: bool | Callable[[Mapping[str, Any]], bool] = False
    table: tuple[str, float, str] | None = None  # the table value: (score key, scale, label); None: the reward's value
    describe: Callable[[Mapping[str, Any]], str] | None = None  # what it scores with (model, weights), one line
    # options that say how it is reached, not what it scores (a served reward's token, timeout): a run's fingerprint
    # leaves them out, so a rotated token resumes the run
    transport: tuple[str, ...] = ()
    # options whose values are secrets under names the redaction's word list does not know (a key, a passphrase):
    # `***` in params.json, state.json, MLflow and every log; a fingerprint hashes them as `***`
    secret: tuple[str, ...] = ()
    # what its scores are read from beyond its code and options, for evaluation to reuse a score only while they are
    # unchanged (evaluation/score_cache.py): the local paths or hub ids of its weights (a function of the options;
    # None: each option value that names a local file or folder); its content is digested, so a file replaced at
    # the same path is seen
    weights: Callable[[Mapping[str, Any]], list[str]] | None = None
    # bumped where its scores change with code outside its own module (its module's source is digested already)
    version: str = ""
    # its scores of an image are a function of the image, the prompt, its options, weights and code: False for a
    # reward answered elsewhere (a server), whose scores evaluation never reuses
    reusable: bool = True
    origin: str = ""

    def read_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        where = f"reward.options.{self.name}"
        return read_options(_reader(where, self), options, where, repr(self.name), self.secret)

    @property
    def table_value(self) -> tuple[str, float, str]:
        return self.table or (self.name, 1.0, "the reward's value")


_READERS: dict[tuple[str, int], Any] = {}


def _reader(where: str, spec: BackboneSpec | RewardSpec):
    key = (where, id(spec))
    if key not in _READERS:
        _READERS[key] = option_reader(f"{where} ({spec.name})", spec.options)
    return _READERS[key]


_SPECS: dict[str, dict[str, BackboneSpec | RewardSpec]] = {"backbone": {}, "reward": {}}
_LOADED: set[str] = set()  # entry points and files already imported by this process
_FAILED: dict[str, "PluginError"] = {}  # those whose import failed, with their sentence
_LOCK = threading.RLock()
# the plugin being imported: (its label, its module; None for a file); its registrations are attributed to it
_loading: list[tuple[str, str | None]] = []


def _origin(spec: BackboneSpec | RewardSpec) -> str:
    """Who registers ``spec``: the plugin being imported, or, for an entry point whose import registers specs of
    other modules too (a package's ``__init__`` importing its siblings: jagg's own built-ins), the spec's module."""
    module = getattr(spec.factory, "__module__", None) or "?"
    if not _loading:
        return module
    label, own = _loading[-1]
    return label if own is None or module == own or module.startswith(own + ".") else module


def add(kind: Literal["backbone", "reward"], spec: BackboneSpec | RewardSpec) -> None:
    """Register ``spec`` (what ``register_backbone`` / ``register_reward`` call); a taken name is one sentence."""
    origin = _origin(spec)
    if not is_name(spec.name, dots=True):  # it becomes metric keys (reward/<name>/…), MLflow params and file names
        shown = repr(spec.name)[:80] if isinstance(spec.name, str) else type(spec.name).__name__
        raise PluginError(f"{kind} name {shown} of {origin} must match {name_rule(dots=True)} (it names metric keys, "
                          f"MLflow params and folders); give it such a name.")
    secret = spec.secret
    if not isinstance(secret, tuple) or not all(isinstance(k, str) and k in spec.options for k in secret):
        # a typo would leave the secret in clear, silently: the names must be the spec's own options
        raise PluginError(f"{kind} {spec.name!r} of {origin} marks secret {repr(secret)[:80]}, which is not a tuple "
                          f"of its options ({', '.join(spec.options) or 'none'}); name its secret options in a tuple.")
    spec = type(spec)(**{**spec.__dict__, "origin": origin})
    taken = _SPECS[kind].get(spec.name)
    if taken is not None:
        raise PluginError(f"{kind} {spec.name!r} of {origin} clashes with the {kind} of that name from "
                          f"{taken.origin}; give it another name.")
    _SPECS[kind][spec.name] = spec


def remove(kind: Literal["backbone", "reward"], name: str) -> None:
    """Unregister ``name`` (a test's temporary plugin); nothing if it is not registered."""
    _SPECS[kind].pop(name, None)


def _import(label: str, load: Callable[[], Any], module: str | None = None) -> None:
    if label in _FAILED:  # a plugin that failed is not imported again (half a registration twice): its sentence is
        raise _FAILED[label]  # said again each time it is asked for, never an "unknown reward" later
    if label in _LOADED:
        return
    _LOADED.add(label)
    _loading.append((label, module))
    try:
        load()
    except PluginError as e:
        _FAILED[label] = e
        raise
    except KeyboardInterrupt:  # Ctrl-C (or a plugin raising it) stays an interruption, named, never a silent skip:
        _LOADED.discard(label)  # asked for again, the plugin is imported again
        log.error("interrupted while importing plugin %s", label)
        raise
    except SystemExit as e:  # sys.exit() in a plugin ended `jagg train` with its status, silently, having done nothing
        _FAILED[label] = PluginError(f"plugin {label} exited while importing (SystemExit({repr(e.code)[:60]})); a "
                                     f"plugin registers its rewards and backbones and returns: remove the exit.")
        raise _FAILED[label] from None
    except BaseException as e:  # noqa: BLE001  (a plugin's own error, whatever it is, is one sentence naming it)
        _FAILED[label] = PluginError(f"plugin {label} failed to import: {type(e).__name__}: {sentence(e, 300)}")
        raise _FAILED[label] from None
    finally:
        _loading.pop()


# A plugin file is source code a person wrote: a few hundred KiB at most. Larger (a 2 GB sparse `.py` took 16 s and
# 2.8 GB of memory before its sentence) is refused before it is read.
MAX_PLUGIN_BYTES = 4 << 20


def _load_file(path: Path) -> None:
    name = f"jagg_plugin_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin file {path} is not a Python module (a .py file).")
    # read once, bounded and regular (storage's one reader), then compiled from those bytes: what runs is what was
    # checked (the loader would read the file again, unbounded)
    source = read_regular(path, PluginError, limit=MAX_PLUGIN_BYTES, fix="params.yaml's plugins names Python files")
    code = compile(source, str(path), "exec", dont_inherit=True)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up
    exec(code, module.__dict__)  # noqa: S102  (a plugin file is code the user asked to run, as import would run it)


@functools.cache
def _plugin_entry_points() -> tuple[EntryPoint, ...]:
    """The ``jagg.plugins`` entry points, in a fixed order, read once per process: reading them scans every installed
    distribution's metadata (~5 ms on 2 cores), and :func:`load_plugins` runs at every registry lookup (70 times in one
    `jagg evaluate`)."""
    return tuple(sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: (e.value, e.name)))


def load_plugins(files: tuple[Path, ...] = ()) -> None:
    """Import every plugin once per process: the ``jagg.plugins`` entry points (jagg's built-ins among them), then
    ``files`` (resolved paths of params.yaml's ``plugins``)."""
    with _LOCK:
        for ep in _plugin_entry_points():
            _import(f"{ep.name} ({ep.value})", ep.load, ep.module)
        for path in files:
            if not path.is_file():
                raise PluginError(f"plugin file {path} does not exist; params.yaml's plugins names files inside the "
                                  f"project.")
            _import(str(path), lambda p=path: _load_file(p))
        if not _SPECS["backbone"]:
            raise PluginError(f"no backbone is registered: jagg's entry points ({ENTRY_POINT_GROUP}) are missing; "
                              f"install the project (`make setup`, or `pip install -e .`).")


def _lookup(kind: Literal["backbone", "reward"], name: str) -> BackboneSpec | RewardSpec:
    load_plugins()
    spec = _SPECS[kind].get(name)
    if spec is None:
        raise PluginError(f"unknown {kind} {name!r}; use one of {', '.join(sorted(_SPECS[kind]))}")
    return spec


def backbone_spec(name: str) -> BackboneSpec:
    return _lookup("backbone", name)  # type: ignore[return-value]


def reward_spec(name: str) -> RewardSpec:
    return _lookup("reward", name)  # type: ignore[return-value]


def backbone_names() -> list[str]:
    load_plugins()
    return sorted(_SPECS["backbone"])


def reward_names() -> list[str]:
    load_plugins()
    return sorted(_SPECS["reward"])
