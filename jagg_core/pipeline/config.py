"""The typed, validated configuration: ``params.yaml`` (sections + named profiles) loaded once per entrypoint.

``params.yaml`` holds the default configuration in sections (model, world, pretrain, sample, train, jagg, methods, run,
reward, eval, tracking, resources), a ``profile`` key naming the active profile, and ``profiles``: named overlays
deep-merged onto the sections. Everything is validated before any work starts; a bad value fails with one sentence
naming the field, the value and the fix (:class:`ParamsError`).
"""

from __future__ import annotations

import copy
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import UserError
from ..modes import MODES, VARIANTS

__all__ = [
    "KNOWN_BACKBONES",
    "KNOWN_REWARDS",
    "Params",
    "ParamsError",
    "load_params",
    "deep_merge",
    "parse_yaml",
]

# The registries' names, known without importing them (tests check these equal the registries).
KNOWN_BACKBONES = ("flux", "qwenimage", "sd3", "toy-flux")
KNOWN_REWARDS = ("clipscore", "hpsv2.1", "jpeg_compressibility", "pickscore", "toy_background", "toy_fidelity",
                 "toy_objects", "toy_precision", "toy_preference")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


class ParamsError(UserError, ValueError):
    """An invalid configuration; the message is one sentence for the user."""


def _jagg_frac(v: Any) -> float | str | None:
    if v is None or v == "auto":
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= float(v) <= 1.0:
        return float(v)
    raise ValueError("jagg_frac must be a number in [0, 1] or 'auto'")


JaggFrac = Annotated[Union[float, str, None], BeforeValidator(_jagg_frac)]


class _Section(BaseModel):
    # No inf or NaN anywhere (lr = inf would train nothing and say nothing).
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_silent_coercion(cls, data: Any) -> Any:
        """true/false is not a number and "5" is not a count: refuse what pydantic would quietly convert.

        A float field still takes a numeric string, because YAML 1.1 reads ``3e-4`` (no dot) as one.
        """
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is None:
                continue
            types = set(get_args(field.annotation) or (field.annotation,))
            if isinstance(value, bool) and types & {int, float} and bool not in types:
                raise ValueError(f"{name} = {value!r} must be a number, not true/false")
            if (isinstance(value, str) and int in types and float not in types and str not in types
                    and re.fullmatch(r"\s*[+-]?\d+\s*", value)):
                raise ValueError(f"{name} = {value!r} must be a whole number, not a quoted string")
        return data


class LoraConfig(_Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains the full transformer")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (default: the rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout")
    target_modules: list[str] = Field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        description="module names adapted by LoRA",
    )


class ModelConfig(_Section):
    backbone: str = Field("toy-flux", description=f"backbone name, one of {', '.join(KNOWN_BACKBONES)}")
    path: str | None = Field(None, description="local model folder or a hub id already in the HF cache")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="transformer dtype")
    options: dict[str, Any] = Field(default_factory=dict, description="backbone options (resolution, guidance, ...)")
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("backbone")
    @classmethod
    def _known_backbone(cls, v: str) -> str:
        if v not in KNOWN_BACKBONES:
            raise ValueError(f"unknown backbone; use one of {', '.join(KNOWN_BACKBONES)}")
        return v


class WorldConfig(_Section):
    """The embedded default's procedural world (toy-flux only)."""

    image_size: int = Field(24, ge=16, le=128, description="image side in pixels (a multiple of the patch size)")
    n_train: int = Field(32, ge=1, description="training prompts")
    n_test_per_style: int = Field(32, ge=1, description="test prompts per style (4 styles)")
    seed: int = Field(0, description="seed of the prompt splits")


class DataConfig(_Section):
    train_prompts: str | None = Field(
        None, description="training prompts (.txt, one per line, or .jsonl with 'prompt') for real profiles"
    )


class PretrainConfig(_Section):
    """Flow-matching pretraining of the toy-flux base model."""

    steps: int = Field(4000, ge=1, description="optimizer steps")
    batch_size: int = Field(64, ge=1, description="images per step")
    lr: float = Field(2e-3, gt=0, description="peak AdamW learning rate (cosine decay, linear warmup)")
    warmup: int = Field(100, ge=0, description="warmup steps")
    caption_noise: float = Field(0.15, ge=0, le=1, description="probability that a caption is imperfect")
    seed: int = Field(0, description="seed")
    logit_mean: float = Field(0.0, description="sigma ~ sigmoid(N(logit_mean, logit_std)); > 0 favours high noise")
    logit_std: float = Field(1.0, gt=0, description="spread of the logit-normal sigma sampling")
    patch_size: int = Field(8, ge=1, description="pixels per token side (packed-pixel tokens)")
    num_layers: int = Field(2, ge=1, description="double-stream Flux blocks")
    num_single_layers: int = Field(2, ge=0, description="single-stream Flux blocks")
    num_attention_heads: int = Field(4, ge=1, description="attention heads")
    attention_head_dim: int = Field(16, ge=8, description="head dim (multiple of 8, for 3-axis RoPE)")
    text_hidden_size: int = Field(64, ge=8, description="text encoder width")
    text_layers: int = Field(2, ge=1, description="text encoder layers")
    max_text_length: int = Field(32, ge=4, description="tokens per prompt")
    prediction: Literal["x0", "velocity"] = Field("x0", description="what the transformer outputs (x0: v = (z - x0)/sigma)")
    caption_dropout: float = Field(0.1, ge=0, lt=1, description="share of empty captions (the unconditional model)")
    guidance_scale: float = Field(3.0, ge=1, description="classifier-free guidance of the saved model (1 = off)")


class SampleConfig(_Section):
    num_steps: int = Field(12, ge=2, description="denoising steps T of a rollout")
    noise_level: float = Field(0.7, ge=0, description="SDE noise: Flow-GRPO's a or DanceGRPO's eta")
    sde_kind: Literal["flow_grpo", "dance_grpo"] = Field("flow_grpo", description="SDE form")
    recipe: Literal["dance_grpo", "flow_grpo_fast", "mix_grpo"] = Field(
        "flow_grpo_fast", description="dance_grpo: SDE on all steps; flow_grpo_fast: SDE in a window drawn per "
        "rollout, ODE elsewhere; mix_grpo: SDE in a window that slides along the trajectory over training, ODE elsewhere"
    )
    timestep_fraction: float = Field(1.0, gt=0, le=1, description="fraction of groups trained per iteration")
    sde_window_size: int = Field(8, ge=1, description="flow_grpo_fast, mix_grpo: SDE (trained) steps per rollout")
    sde_window_range: tuple[int, int] = Field((0, 1), description="flow_grpo_fast, mix_grpo: [lo, hi) of the window "
                                              "start")
    window_shift_every: int = Field(25, ge=1, description="mix_grpo: iterations before the window moves on "
                                    "(MixGRPO's shift interval)")
    window_stride: int = Field(1, ge=1, description="mix_grpo: steps the window moves each time; past the range's "
                               "end it rolls back to its start")
    group_size: int = Field(16, ge=2, description="G: images per prompt")
    prompts_per_iteration: int = Field(4, ge=1, description="prompts per iteration, over all processes")
    shared_noise: bool = Field(True, description="the G images of a prompt start from the same noise")
    batch_size: int = Field(64, ge=1, description="rollout micro-batch per process")

    @model_validator(mode="after")
    def _window_fits(self) -> "SampleConfig":
        lo, hi = self.sde_window_range
        if self.recipe in ("flow_grpo_fast", "mix_grpo") and not (0 <= lo < hi and hi - 1 + self.sde_window_size <= self.num_steps):
            raise ValueError(
                f"sde_window_range {list(self.sde_window_range)} with sde_window_size {self.sde_window_size} "
                f"does not fit in num_steps {self.num_steps}"
            )
        return self


class TrainConfig(_Section):
    iterations: int = Field(32, ge=1, description="GRPO iterations (rollout + update)")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW eps")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient-norm clip")
    clip_range: float = Field(1e-3, gt=0, description="PPO clip range epsilon_c")
    adv_clip: float = Field(5.0, gt=0, description="advantages clipped to +-adv_clip")
    adv_eps: float = Field(1e-4, ge=0, description="added to the group std")
    global_std: bool = Field(True, description="normalise advantages by the batch std instead of the group's")
    beta: float = Field(0.0, ge=0, description="KL coefficient (needs LoRA or a reference copy)")
    inner_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    optimizer_steps_per_epoch: int = Field(1, ge=1, description="optimizer steps per pass (batch split evenly)")
    micro_batch: int = Field(64, ge=1, description="images per forward in the update, per process")
    ema_decay: float = Field(0.0, ge=0, lt=1, description="EMA of the trained weights; 0 disables")
    checkpoint_every: int = Field(8, ge=1, description="iterations between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(4, ge=1, description="checkpoints kept")
    fidelity_every: int = Field(8, ge=0, description="log cos(jagg, exact) per group every N iterations; 0 = off")
    fidelity_batch: int = Field(4, ge=1, description="images of the rollout the fidelity monitor differentiates "
                                "(3 gradients per group: keep it small, it is a monitor)")
    max_consecutive_skips: int = Field(3, ge=1, description="non-finite updates skipped in a row before stopping")
    log_images_every: int = Field(8, ge=0, description="iterations between sample images logged; 0 = off")

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"both AdamW betas must lie in [0, 1), e.g. [0.9, 0.999]; got {list(v)}")
        return v


class JaggConfig(_Section):
    window: int = Field(4, ge=2, description="W: consecutive steps per group")
    jagg_frac: JaggFrac = Field(
        0.6, description="fraction of groups (high-noise first) using JAGG, or 'auto' (from gradient fidelity)"
    )
    variant: Literal[VARIANTS] = Field("joint", description="one joint backward or one per anchor")
    anchors: int = Field(2, ge=2, description="K anchors per group (2 = the paper's JAGG, W = exact)")
    auto_threshold: float = Field(0.5, ge=-1, le=1, description="jagg_frac 'auto': cosine threshold")
    auto_every: int = Field(0, ge=0, description="jagg_frac 'auto': re-estimate every N iterations; 0 = at start")
    reuse_rollout_velocity: bool = Field(
        False, description="take middle-step velocities from the rollout while the policy is unchanged"
    )

    @model_validator(mode="after")
    def _anchors_fit(self) -> "JaggConfig":
        if self.anchors > self.window:
            raise ValueError(f"anchors ({self.anchors}) cannot exceed the window ({self.window})")
        return self


class MethodConfig(_Section):
    """A training method: the backward mode plus optional overrides of the jagg section."""

    mode: Literal[MODES] = Field(
        ..., description="backward mode, one of jagg_core.modes.MODES (ablate_matched: the ablation with its anchors "
                         "weighted W/K; exact_batched: exact in one forward call and one backward per group)"
    )
    window: int | None = Field(None, ge=2, description="override jagg.window")
    jagg_frac: JaggFrac = Field(None, description="override jagg.jagg_frac")
    variant: Literal[VARIANTS] | None = Field(None, description="override jagg.variant")
    anchors: int | None = Field(None, ge=2, description="override jagg.anchors")
    reuse_rollout_velocity: bool | None = Field(None, description="override jagg.reuse_rollout_velocity")


class RunConfig(_Section):
    methods: list[str] = Field(default_factory=lambda: ["baseline", "jagg", "ablate"], description="methods run")
    seeds: list[int] = Field(default_factory=lambda: [0], description="training seeds")

    @field_validator("methods", "seeds")
    @classmethod
    def _distinct(cls, v: list) -> list:
        if not v:
            raise ValueError("needs at least one entry")
        twice = sorted({x for x in v if v.count(x) > 1}, key=str)
        if twice:
            raise ValueError(f"lists {twice[0]!r} twice; two runs of one name would overwrite each other")
        return v


class RewardConfig(_Section):
    weights: dict[str, float] = Field(
        default_factory=lambda: {"toy_preference": 1.0, "toy_fidelity": 1.0},
        description="reward name -> weight of the training reward"
    )
    options: dict[str, dict[str, Any]] = Field(default_factory=dict, description="reward name -> factory options")
    normalize: Literal["sum", "per_reward"] = Field(
        "per_reward",
        description="sum: the weighted sum of the rewards is group-normalised (Flow-GRPO's multi-reward); per_reward: "
        "each reward's advantages are group-normalised, then weighted and summed, so a reward with a small spread "
        "is not drowned by one with a large spread",
    )

    @field_validator("weights", "options")
    @classmethod
    def _known_rewards(cls, v: dict) -> dict:
        unknown = sorted(set(v) - set(KNOWN_REWARDS))
        if unknown:
            raise ValueError(f"unknown reward {unknown[0]!r}; use one of {', '.join(KNOWN_REWARDS)}")
        return v

    @field_validator("weights")
    @classmethod
    def _some_weight(cls, v: dict[str, float]) -> dict[str, float]:
        if not any(w != 0 for w in v.values()):
            raise ValueError("needs at least one reward with a non-zero weight (all-zero rewards give all-zero "
                             "advantages: a run that never learns)")
        return v


class EvalConfig(_Section):
    protocol: Literal["hpdv2-benchmark", "hpdv2-test"] = Field(
        "hpdv2-benchmark", description="test set and summary: HPDv2's benchmark/ (4 styles, block means) or its "
        "400-prompt test.json (plain mean); jagg_core/evaluation/protocols.py, docs/evaluation.md")
    benchmark: str | None = Field(
        None, description="HPDv2 folder with benchmark/<style>.json and test.json (default: the HF cache; the toy: "
        "its test split)"
    )
    metrics: list[str] = Field(default_factory=lambda: ["toy_preference", "toy_fidelity"],
                               description="metrics scored")
    subset: int | None = Field(None, ge=1, description="first N prompts per style (of the test list)")
    num_steps: int = Field(12, ge=1, description="ODE sampling steps")
    seed: int = Field(0, description="base seed; image i of prompt group g uses derive_seed(seed, g, i)")
    batch_size: int = Field(64, ge=1, description="images per sampling batch")
    block_size: int = Field(16, ge=1, description="HPSv2 protocol block size")
    num_images_logged: int = Field(8, ge=0, description="test images logged to MLflow per checkpoint")

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: list[str]) -> list[str]:
        unknown = [m for m in v if m not in KNOWN_REWARDS]
        if unknown:
            raise ValueError(f"unknown metric {unknown[0]!r}; use one of {', '.join(KNOWN_REWARDS)}")
        return v


class TrackingConfig(_Section):
    mlflow_uri: str = Field("sqlite:///mlflow.db", description="MLflow store; relative sqlite paths are repo-relative")
    experiment: str = Field("jagg-{profile}", description="MLflow experiment ('{profile}' is filled in)")
    retries: int = Field(5, ge=0, description="retries of a failed MLflow call (exponential backoff)")
    ui_url: str = Field("http://127.0.0.1:5000", pattern=r"^https?://\S+$",
                        description="the MLflow UI that links (Prefect artifacts) point to: `jagg services up`'s")

    @field_validator("experiment")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        try:
            v.format(profile="p")
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"{v!r} may hold only the placeholder {{profile}}") from None
        return v


class ResourcesConfig(_Section):
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="cpu, cuda, or auto (cuda when available)")
    num_processes: int = Field(1, ge=1, description="training processes per machine (accelerate)")
    distributed: Literal["ddp", "fsdp"] = Field("ddp", description="multi-process strategy")
    accelerate_config: str | None = Field(None, description="accelerate config file (e.g. configs/accelerate/...)")
    cuda_visible_devices: dict[str, str] = Field(
        default_factory=dict, description="method -> CUDA_VISIBLE_DEVICES for its training task"
    )
    main_process_port: int = Field(29500, ge=1024, le=65535, description="base rendezvous port (+ method index)")
    num_machines: int = Field(1, ge=1, description="machines one training run spans (multi-node; each machine's rank "
                                                   "and the rank-0 address come from `jagg train`'s command line or "
                                                   "the environment, never from this shared file)")
    mixed_precision: Literal["no", "bf16", "fp16"] = Field("no", description="accelerate mixed precision")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads per process")

    @model_validator(mode="before")
    @classmethod
    def _per_machine(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for key, flag, env in (("machine_rank", "--machine-rank", "JAGG_MACHINE_RANK"),
                                   ("main_process_ip", "--main-process-ip", "JAGG_MAIN_PROCESS_IP")):
                if key in data:
                    raise ValueError(f"{key} differs per machine and is not read from params.yaml: pass {flag} to "
                                     f"`jagg train` or set {env}")
        return data


class Params(_Section):
    """The whole resolved configuration of one profile."""

    # The pattern is on the field, not only on --profile: `--set profile=../../x` names folders too.
    profile: str = Field("toy", pattern=_NAME.pattern, description="profile name (it names folders)")
    outputs: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9_-]*$",
        description="folder name of the runs, checkpoints, evaluations and report (default: the profile's name; a "
                    "flow run with parameter overrides gets its own)",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    world: WorldConfig = Field(default_factory=WorldConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    jagg: JaggConfig = Field(default_factory=JaggConfig)
    methods: dict[str, MethodConfig] = Field(
        default_factory=lambda: {
            "baseline": MethodConfig(mode="exact"),
            "jagg": MethodConfig(mode="jagg"),
            "ablate": MethodConfig(mode="ablate"),
        }
    )
    run: RunConfig = Field(default_factory=RunConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)

    @model_validator(mode="before")
    @classmethod
    def _finite_everywhere(cls, data: Any) -> Any:
        """No NaN or inf anywhere, free-form dicts included (``model.options.guidance_scale = .nan`` would render
        black images and score them); the typed fields already refuse them, this catches the untyped ones."""
        bad = _first_non_finite(data, "")
        if bad is not None:
            raise ValueError(f"{bad[0]} = {bad[1]!r} must be a finite number")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Params":
        for name in self.methods:
            if not _NAME.match(name):
                raise ValueError(f"method name {name!r} must match [a-z0-9][a-z0-9_-]*")
        for name in self.run.methods:
            if name not in self.methods:
                raise ValueError(f"run.methods names {name!r}, which is not defined under methods")
        for name in self.resources.cuda_visible_devices:
            if name not in self.methods:
                raise ValueError(f"resources.cuda_visible_devices names {name!r}, which is not defined under methods")
        for name, m in self.methods.items():
            window = m.window or self.jagg.window
            anchors = m.anchors or self.jagg.anchors
            if anchors > window:
                raise ValueError(f"methods.{name}: anchors ({anchors}) cannot exceed the window ({window})")
        return self

    def method(self, name: str) -> "ResolvedMethod":
        """The jagg settings of one method: its overrides applied to the jagg section."""
        if name not in self.methods:
            raise ParamsError(f"unknown method {name!r}; defined methods: {', '.join(self.methods)}.")
        m = self.methods[name]
        base = self.jagg.model_dump()
        base.update({k: v for k, v in m.model_dump().items() if v is not None and k != "mode"})
        return ResolvedMethod(name=name, mode=m.mode, **base)

    @property
    def is_toy(self) -> bool:
        return self.model.backbone == "toy-flux"


class ResolvedMethod(JaggConfig):
    name: str
    mode: Literal[MODES]


def _first_non_finite(tree: Any, path: str) -> tuple[str, float] | None:
    """The dotted path and value of the first NaN / inf in ``tree`` (dicts and lists walked), or None."""
    if isinstance(tree, float) and not math.isfinite(tree):
        return path or "params", tree
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    for k, v in items:
        found = _first_non_finite(v, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


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


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
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
        return f"{source}: {loc + ': ' if loc else ''}{msg}{more}."
    if "input" in err and err["type"] != "missing":
        return f"{source}: {loc or 'params'} = {err['input']!r} is invalid: {msg}{more}."
    return f"{source}: {loc} is invalid: {msg}{more}."


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last)."""


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.YAMLError(f"key {key!r} appears twice in one mapping (line {key_node.start_mark.line + 1})")
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


# A params tree is small; YAML aliases can make a tiny file expand to billions of nodes ("billion laughs") or loop.
_MAX_FILE_BYTES = 16 << 20
_MAX_NODES = 1_000_000


def _read_params_file(path: Path) -> str:
    """The text of a params file, or one sentence saying why it cannot be read (a folder, a symlink loop, not UTF-8,
    unreadable, absurdly large)."""
    try:
        if path.stat().st_size > _MAX_FILE_BYTES:
            raise ParamsError(f"{path} is larger than {_MAX_FILE_BYTES >> 20} MiB; a params file is a few KiB.")
        return path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path} does not exist; run from the repository root or pass --params PATH.") from None
    except IsADirectoryError:
        raise ParamsError(f"{path} is a folder, not a params file; pass --params PATH/TO/params.yaml.") from None
    except UnicodeDecodeError as e:
        raise ParamsError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8.") from None
    except OSError as e:
        raise ParamsError(f"{path} cannot be read ({e.strerror or e}); pass a readable params file.") from None


def parse_yaml(text: str, source: str) -> Any:
    """YAML from an untrusted source (a params file, a ``--set`` value): the safe loader, duplicate keys refused,
    aliases bounded; any failure is one :class:`ParamsError` sentence, never a traceback."""
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        first = " ".join(str(e).split())[:200]
        raise ParamsError(f"{source} is not valid YAML ({first}); fix the syntax or quote the value.") from None
    except RecursionError:
        raise ParamsError(f"{source} nests too deeply to be params; flatten it.") from None
    _bounded(value, source)
    return value


def _bounded(tree: Any, source: str) -> None:
    """Refuse a tree that refers to itself or expands (through shared YAML aliases) to more than :data:`_MAX_NODES`
    nodes: validating it would never end."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: Any, depth: int) -> int:
        if not isinstance(node, (dict, list, tuple)):
            return 1
        if id(node) in open_ or depth > 100:
            raise ParamsError(f"{source} refers to itself or nests too deeply (a YAML alias loop?); write it out.")
        if id(node) not in sizes:
            open_.add(id(node))
            children = node.values() if isinstance(node, dict) else node
            sizes[id(node)] = 1 + sum(size(c, depth + 1) for c in children)
            open_.discard(id(node))
        if sizes[id(node)] > _MAX_NODES:
            raise ParamsError(f"{source} expands to more than {_MAX_NODES:,} values (YAML aliases?); write it out.")
        return sizes[id(node)]

    size(tree, 0)


def load_params(
    path: str | os.PathLike = "params.yaml",
    profile: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Params:
    """Read ``params.yaml``, apply the profile overlay and dotted ``overrides``, validate.

    The profile is, in order: the ``profile`` argument, ``$JAGG_PROFILE``, the file's ``profile`` key, ``toy``.
    """
    path = Path(path)
    source = path.name
    raw = parse_yaml(_read_params_file(path), source) or {}
    if not isinstance(raw, dict):
        raise ParamsError(f"{source} must be a mapping of sections, got {type(raw).__name__}.")
    profiles = raw.pop("profiles", {}) or {}
    if not isinstance(profiles, dict):
        raise ParamsError(f"{source}: profiles must be a mapping of profile name -> overlay.")
    name = profile or os.environ.get("JAGG_PROFILE") or raw.get("profile") or "toy"
    if not isinstance(name, str) or not _NAME.match(name):
        raise ParamsError(f"profile name {name!r} must match [a-z0-9][a-z0-9_-]* (it names folders).")
    if name not in profiles and name != raw.get("profile", "toy"):
        raise ParamsError(f"unknown profile {name!r}; profiles in {source}: {', '.join(profiles) or 'none'}.")
    overlay = profiles.get(name) or {}
    if not isinstance(overlay, dict):
        raise ParamsError(f"{source}: profiles.{name} must be a mapping of sections.")
    tree = deep_merge(raw, overlay)
    tree["profile"] = name
    for dotted, value in (overrides or {}).items():
        _bounded(value, f"override {dotted}")
        _set_dotted(tree, dotted, value)
    try:
        return Params.model_validate(tree)
    except ValidationError as e:
        raise ParamsError(_describe(e, f"{source} (profile {name})", tree)) from None
