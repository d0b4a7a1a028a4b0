"""The typed, validated configuration: the schema of ``params.yaml`` (sections + named profiles).

``params.yaml`` holds the default configuration in sections (model, world, pretrain, sample, train, jagg, methods, run,
reward, eval, tracking, resources), a ``profile`` key naming the active profile, and ``profiles``: named overlays
deep-merged onto the sections. Everything is validated before any work starts; a bad value fails with one sentence
naming the field, the value and the fix (:class:`ParamsError`). Reading a params file and ``--set`` values is
:mod:`jagg_core.setup.params_io` (:func:`~jagg_core.setup.params_io.load_params`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from ..errors import UserError
from ..modes import MODES, RANDOM_ANCHOR, VARIANTS, placed_anchors
from .names import MAX_NAME, NAME as _NAME, is_name as _is_name
from .options import Count, Number, Section
from .paths import inside
from .redact import holds_secret, mask, redact, remember
from .registry import PluginError, backbone_names, backbone_spec, load_plugins, reward_spec

__all__ = [
    "Params",
    "ParamsError",
]

# A rollout keeps every image's latent at every step until the update: the product of its sizes is bounded before
# anything is allocated (the paper's recipes take at most 384 images of 51 steps; the toy 128 of 13).
MAX_IMAGES_PER_ITERATION = 8192
MAX_IMAGE_STEPS = 262_144


class ParamsError(UserError, ValueError):
    """An invalid configuration; the message is one sentence for the user."""


def _jagg_frac(v: Any) -> float | str | None:
    if v is None or v == "auto":
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= float(v) <= 1.0:
        return float(v)
    raise ValueError("jagg_frac must be a number in [0, 1] or 'auto'")


JaggFrac = Annotated[Union[float, str, None], BeforeValidator(_jagg_frac)]


class LoraConfig(Section):
    rank: int = Field(0, ge=0, description="LoRA rank; 0 trains the full transformer")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (default: the rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout")
    target_modules: list[str] = Field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        description="module names adapted by LoRA",
    )


class ModelConfig(Section):
    backbone: str = Field("toy-flux", description="backbone name: a registered backbone (jagg's: toy-flux, flux, sd3, "
                                                  "qwenimage, wan; a plugin's: docs/extending.md)")
    path: str | None = Field(None, description="local model folder or a hub id already in the HF cache")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="transformer dtype")
    options: dict[str, Any] = Field(default_factory=dict, description="backbone options (resolution, guidance, ...)")
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @field_validator("backbone")
    @classmethod
    def _known_backbone(cls, v: str) -> str:
        if v not in backbone_names():
            raise ValueError(f"unknown backbone; use one of {', '.join(backbone_names())}")
        return v

    @model_validator(mode="after")
    def _typed(self) -> "ModelConfig":
        self.options = backbone_spec(self.backbone).read_options(self.options)
        return self


class WorldConfig(Section):
    """The embedded default's procedural world (toy-flux only)."""

    image_size: int = Field(24, ge=16, le=128, description="image side in pixels (a multiple of the patch size)")
    n_train: int = Field(32, ge=1, le=1_000_000, description="training prompts")
    n_test_per_style: int = Field(128, ge=1, le=100_000, description="test prompts per style (4 styles): the split "
                                  "results are reported on, never used for a choice")
    n_validation_per_style: int = Field(32, ge=0, le=100_000, description="validation prompts per style (4 styles): "
                                        "the split studies and pilots choose on; held out of the base's pretraining")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="seed of the prompt splits")


class DataConfig(Section):
    train_prompts: str | None = Field(
        None, description="training prompts (.txt, one per line, or .jsonl with 'prompt') for real profiles"
    )


class PretrainConfig(Section):
    """Flow-matching pretraining of the toy-flux base model."""

    steps: int = Field(4000, ge=1, description="optimizer steps")
    batch_size: int = Field(64, ge=1, le=65536, description="images per step")
    lr: float = Field(2e-3, gt=0, description="peak AdamW learning rate (cosine decay, linear warmup)")
    warmup: int = Field(100, ge=0, description="warmup steps")
    caption_noise: float = Field(0.15, ge=0, le=1, description="probability that a caption is imperfect")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="seed")
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


class SampleConfig(Section):
    num_steps: int = Field(12, ge=2, le=1000, description="denoising steps T of a rollout")
    noise_level: float = Field(0.7, ge=0, description="SDE noise: Flow-GRPO's a or DanceGRPO's eta")
    sde_kind: Literal["flow_grpo", "dance_grpo", "cps"] = Field("flow_grpo", description="SDE form (cps: "
                                                                "coefficients-preserving sampling, noise_level <= 1)")
    recipe: Literal["dance_grpo", "flow_grpo_fast", "mix_grpo"] = Field(
        "flow_grpo_fast", description="dance_grpo: SDE on all steps; flow_grpo_fast: SDE in a window drawn per "
        "rollout, ODE elsewhere; mix_grpo: SDE in a window that slides along the trajectory over training, ODE elsewhere"
    )
    timestep_fraction: float = Field(1.0, gt=0, le=1, description="fraction of groups trained per iteration")
    sde_window_size: int = Field(4, ge=1, description="flow_grpo_fast, mix_grpo: SDE (trained) steps per rollout")
    sde_window_range: tuple[Annotated[Count, Field(ge=0, le=1000)], Annotated[Count, Field(ge=0, le=1000)]] = Field((0, 1), description="flow_grpo_fast, mix_grpo: [lo, hi) of the window "
                                              "start")
    window_shift_every: int = Field(25, ge=1, description="mix_grpo: iterations before the window moves on "
                                    "(MixGRPO's shift interval)")
    window_stride: int = Field(1, ge=1, description="mix_grpo: steps the window moves each time; past the range's "
                               "end it rolls back to its start")
    group_size: int = Field(32, ge=2, le=1024, description="G: images per prompt")
    prompts_per_iteration: int = Field(4, ge=1, le=65536, description="prompts per iteration, over all processes")
    shared_noise: bool = Field(True, description="the G images of a prompt start from the same noise")
    batch_size: int = Field(64, ge=1, le=65536, description="rollout micro-batch per process")

    @property
    def trained_steps(self) -> int:
        """Steps trained per rollout: every step under DanceGRPO, the SDE window's otherwise (the one place this is
        worked out: the rollout, the trainer, `jagg plan` and the smoke test read it)."""
        return self.num_steps if self.recipe == "dance_grpo" else self.sde_window_size

    @property
    def group_fraction(self) -> float:
        """The share of a rollout's groups the update trains: DanceGRPO's timestep_fraction (a random subset of whole
        groups), every group otherwise."""
        return self.timestep_fraction if self.recipe == "dance_grpo" else 1.0

    @model_validator(mode="after")
    def _window_fits(self) -> "SampleConfig":
        images = self.group_size * self.prompts_per_iteration
        if images > MAX_IMAGES_PER_ITERATION:  # each bounded on its own, their product was an out-of-memory error
            raise ValueError(f"group_size {self.group_size} × prompts_per_iteration {self.prompts_per_iteration} is "
                             f"{images:,} images per iteration, more than the {MAX_IMAGES_PER_ITERATION:,} a rollout "
                             f"holds (its latents at every step are kept for the update); lower one of them")
        if images * (self.num_steps + 1) > MAX_IMAGE_STEPS:
            raise ValueError(f"{images:,} images per iteration × (num_steps {self.num_steps} + 1) is "
                             f"{images * (self.num_steps + 1):,} stored latents, more than the {MAX_IMAGE_STEPS:,} a "
                             f"rollout holds; lower group_size, prompts_per_iteration or num_steps")
        if self.sde_kind == "cps" and self.noise_level > 1:
            raise ValueError(f"noise_level {self.noise_level} is above 1, the most the cps SDE takes (its std is "
                             f"sigma_next·sin(noise_level·π/2))")
        lo, hi = self.sde_window_range
        if self.recipe in ("flow_grpo_fast", "mix_grpo") and not (0 <= lo < hi and hi - 1 + self.sde_window_size <= self.num_steps):
            raise ValueError(
                f"sde_window_range {list(self.sde_window_range)} with sde_window_size {self.sde_window_size} "
                f"does not fit in num_steps {self.num_steps}"
            )
        return self


class TrainConfig(Section):
    iterations: int = Field(32, ge=1, description="GRPO iterations (rollout + update)")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_betas: tuple[Number, Number] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW eps")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient-norm clip")
    clip_range: float = Field(1e-3, gt=0, description="PPO clip range epsilon_c")
    adv_clip: float = Field(5.0, gt=0, description="advantages clipped to +-adv_clip")
    adv_eps: float = Field(1e-4, ge=0, description="added to the group std")
    global_std: bool = Field(True, description="normalise advantages by the batch std instead of the group's")
    beta: float = Field(0.0, ge=0, description="KL coefficient (needs LoRA or a reference copy)")
    kl_convention: Literal["gaussian", "flow_grpo"] = Field(
        "gaussian", description="the KL that beta weighs (jagg_core/loss.py): gaussian, the transition kernels' own "
        "(||mu - mu_ref||^2 / 2 std^2); flow_grpo, Flow-GRPO's train_sd3.py (/ 2 s^2, s its std_dev_t: 1/(-dt) times "
        "the gaussian one) - a beta taken from a Flow-GRPO recipe needs flow_grpo")
    kl_ref: bool = Field(True, description="log train/kl_ref, KL(policy || reference) at each group's two endpoint "
                         "steps, even at beta 0 (a no-grad reference forward each; a full fine-tune keeps a frozen copy)")
    kl_ref_every: int = Field(8, ge=1, description="at beta 0, measure train/kl_ref every N iterations, from the "
                              "first (1, 1 + N, …); at beta > 0 the loss's KL is logged every iteration")
    inner_epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    optimizer_steps_per_epoch: int = Field(1, ge=1, description="optimizer steps per pass (batch split evenly)")
    micro_batch: int = Field(64, ge=1, le=65536, description="images per forward in the update, per process")
    ema_decay: float = Field(0.0, ge=0, lt=1, description="EMA of the trained weights; 0 disables")
    checkpoint_every: int = Field(8, ge=1, description="iterations between checkpoints (and one at the end)")
    keep_checkpoints: int = Field(4, ge=1, description="checkpoints kept")
    fidelity_every: int = Field(8, ge=0, description="log cos(jagg, exact) per group every N iterations; 0 = off")
    fidelity_batch: int = Field(4, ge=1, description="images of the rollout the fidelity monitor differentiates "
                                "(3 gradients per group: keep it small, it is a monitor)")
    max_consecutive_skips: int = Field(3, ge=1, description="non-finite updates skipped in a row before stopping")
    log_images_every: int = Field(8, ge=0, description="iterations between sample images logged; 0 = off")
    update_size_every: int = Field(0, ge=0, description="every N iterations, from the first, log the optimizer's "
                                   "update: train/update_norm ||d theta||, train/update_rel ||d theta|| / ||theta|| "
                                   "and train/update_cos_grad cos(d theta, -gradient), and keep d theta in the run's "
                                   "updates/ folder (costs a float32 copy of the trained tensors at those steps: "
                                   "for LoRA and small models); 0 = off")

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"both AdamW betas must lie in [0, 1), e.g. [0.9, 0.999]; got {list(v)}")
        return v


def check_anchors(window: int, anchors: int, anchor_at: list[int] | None, random_anchor: str | None,
                  random_anchor_p: str | list[float]) -> None:
    """The anchor settings of one group fit its window (the algorithm's own rules, said before any work)."""
    if anchor_at is None and anchors > window:
        raise ValueError(f"anchors ({anchors}) cannot exceed the window ({window})")
    try:
        pos = placed_anchors(window, anchors, anchor_at)  # anchor_at's own rule: one sentence if it breaks it
    except ValueError as e:  # the schema's error ends the sentence itself
        raise ValueError(str(e).rstrip(".")) from None
    k = len(pos)
    if random_anchor is not None and k >= window:
        raise ValueError(f"random_anchor needs a step that is not an anchor; {k} anchors fill the window of {window}")
    if isinstance(random_anchor_p, list):
        if len(random_anchor_p) != window:
            raise ValueError(f"random_anchor_p must give one weight per step of the window ({window}), "
                             f"got {len(random_anchor_p)}")
        if any(w <= 0 for j, w in enumerate(random_anchor_p) if j not in pos):
            raise ValueError(f"random_anchor_p must be positive at every step that is not an anchor (a step never "
                             f"drawn keeps its error: not unbiased), got {random_anchor_p}")


class JaggConfig(Section):
    window: int = Field(4, ge=2, description="W: consecutive steps per group")
    jagg_frac: JaggFrac = Field(
        0.6, description="fraction of groups (high-noise first) using JAGG, or 'auto' (from gradient fidelity)"
    )
    variant: Literal[VARIANTS] = Field("joint", description="one joint backward or one per anchor")
    anchors: int = Field(2, ge=2, description="K anchors per group (2 = the paper's JAGG, W = exact)")
    anchor_at: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="the anchors' positions in a group (0 and W - 1 included) instead of K evenly spread")
    random_anchor: Literal[RANDOM_ANCHOR] | None = Field(
        None, description="one more anchor drawn at random per group or per image, which makes JAGG unbiased "
                          "(docs/frontier.md); none = the deterministic interpolation")
    random_anchor_p: Literal["uniform", "alpha"] | list[Annotated[float, Field(ge=0)]] = Field(
        "uniform", description="the random anchor's law over the non-anchor steps: uniform, alpha (∝ α(1 − α)), or "
                               "one weight per step of the group")
    random_anchor_weight: float = Field(1.0, ge=0, le=1, description="λ: the share of the random anchor's correction "
                                        "applied (1 unbiased, 0 JAGG; the draw's variance scales as λ²)")
    auto_threshold: float = Field(0.5, ge=-1, le=1, description="jagg_frac 'auto': cosine threshold")
    auto_every: int = Field(0, ge=0, description="jagg_frac 'auto': re-estimate every N iterations; 0 = at start")
    reuse_rollout_velocity: bool = Field(
        False, description="take middle-step velocities from the rollout while the policy is unchanged"
    )

    @property
    def anchor_count(self) -> int:
        """K: the anchors a group keeps graphs for (``anchor_at``'s, else ``anchors``), the random anchor not counted."""
        return len(self.anchor_at) if self.anchor_at is not None else min(self.anchors, self.window)

    @model_validator(mode="after")
    def _anchors_fit(self) -> "JaggConfig":
        check_anchors(self.window, self.anchors, self.anchor_at, self.random_anchor, self.random_anchor_p)
        return self


class MethodConfig(Section):
    """A training method: the backward mode plus optional overrides of the jagg section."""

    mode: Literal[MODES] = Field(
        ..., description="backward mode, one of jagg_core.modes.MODES (ablate_matched: the ablation with its anchors "
                         "weighted W/K; exact_batched: exact in one forward call and one backward per group)"
    )
    window: int | None = Field(None, ge=2, description="override jagg.window")
    jagg_frac: JaggFrac = Field(None, description="override jagg.jagg_frac")
    variant: Literal[VARIANTS] | None = Field(None, description="override jagg.variant")
    anchors: int | None = Field(None, ge=2, description="override jagg.anchors")
    anchor_at: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="override jagg.anchor_at")
    random_anchor: Literal[RANDOM_ANCHOR] | None = Field(None, description="override jagg.random_anchor")
    random_anchor_p: Literal["uniform", "alpha"] | list[Annotated[float, Field(ge=0)]] | None = Field(
        None, description="override jagg.random_anchor_p")
    random_anchor_weight: float | None = Field(None, ge=0, le=1, description="override jagg.random_anchor_weight")
    reuse_rollout_velocity: bool | None = Field(None, description="override jagg.reuse_rollout_velocity")
    lr_scale: float | None = Field(None, gt=0, le=100, description="this method's learning rate, a multiple of "
                                   "train.lr (each method at its own rate: docs/frontier.md); default 1")


class RunConfig(Section):
    methods: list[str] = Field(default_factory=lambda: ["baseline", "jagg", "ablate"], description="methods run")
    seeds: list[Annotated[Count, Field(ge=0, le=2**31 - 1)]] = Field(default_factory=lambda: [0],
                                                                   description="training seeds (0 or more)")

    @field_validator("methods", "seeds")
    @classmethod
    def _distinct(cls, v: list) -> list:
        if not v:
            raise ValueError("needs at least one entry")
        twice = sorted({x for x in v if v.count(x) > 1}, key=str)
        if twice:
            raise ValueError(f"lists {twice[0]!r} twice; two runs of one name would overwrite each other")
        return v


def _known(names: list[str], what: str = "reward") -> None:
    """Every name is a registered reward, else one sentence naming the first that is not."""
    for name in names:
        try:
            reward_spec(name)
        except PluginError as e:
            raise ValueError(str(e).replace("unknown reward", f"unknown {what}", 1)) from None


class RewardConfig(Section):
    weights: dict[str, Number] = Field(
        default_factory=lambda: {"toy_fidelity": 1.0},
        description="reward name -> weight of the training reward"
    )
    options: dict[str, dict[str, Any]] = Field(default_factory=dict, description="reward name -> factory options")
    normalize: Literal["sum", "per_reward"] = Field(
        "per_reward",
        description="sum: the weighted sum of the rewards is group-normalised (Flow-GRPO's multi-reward); per_reward: "
        "each reward's advantages are group-normalised, then weighted and summed, so a reward with a small spread "
        "is not drowned by one with a large spread",
    )
    frames: Literal["first", "last", "all"] | Annotated[int, Field(ge=1)] | list[Count] = Field(
        "all", description="which frames of a clip (video backbones) the image rewards score, averaged per clip: "
        "first, last, all, a count N (evenly spaced) or a list of frame indices; images ignore it")

    @field_validator("weights", "options")
    @classmethod
    def _known_rewards(cls, v: dict) -> dict:
        _known(sorted(v))
        return v

    @field_validator("options")
    @classmethod
    def _typed(cls, v: dict) -> dict:
        return {name: reward_spec(name).read_options(opts) for name, opts in v.items()}

    @field_validator("weights")
    @classmethod
    def _some_weight(cls, v: dict[str, float]) -> dict[str, float]:
        if not any(w != 0 for w in v.values()):
            raise ValueError("needs at least one reward with a non-zero weight (all-zero rewards give all-zero "
                             "advantages: a run that never learns)")
        return v


class EvalConfig(Section):
    protocol: Literal["hpdv2-benchmark", "hpdv2-test"] = Field(
        "hpdv2-benchmark", description="test set and summary: HPDv2's benchmark/ (4 styles, block means) or its "
        "400-prompt test.json (plain mean); jagg_core/evaluation/protocols.py, docs/evaluation.md")
    benchmark: str | None = Field(
        None, description="HPDv2 folder with benchmark/<style>.json and test.json (default: the HF cache; the toy: "
        "its test split)"
    )
    metrics: list[str] = Field(default_factory=lambda: ["toy_fidelity", "toy_preference"], min_length=1,
                               description="metrics scored (at least one: the first is the report's primary score)")
    subset: int | None = Field(None, ge=1, description="first N prompts per style (of the test list)")
    curve_subset: int | None = Field(
        None, ge=1, description="the learning curve's checkpoints on the first N prompts per style only (a fixed subset, "
        "the same for every run); the final checkpoint is evaluated on the whole split, and its curve point is the "
        "same subset of those images (null: every checkpoint on the whole split)")
    split: Literal["test", "validation"] = Field(
        "test", description="the toy world's split to evaluate on: test (what results report) or validation (what "
                            "studies choose on; evaluations go to eval-validation/)")
    num_steps: int = Field(12, ge=1, le=1000, description="ODE sampling steps")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="base seed; image i of prompt group g uses derive_seed(seed, g, i)")
    batch_size: int = Field(64, ge=1, le=65536, description="images per sampling batch")
    block_size: int = Field(16, ge=1, description="HPSv2 protocol block size")
    num_images_logged: int = Field(8, ge=0, description="test images logged to MLflow per checkpoint")

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, v: list[str]) -> list[str]:
        _known(v, "metric")
        return v


class TrackingConfig(Section):
    mlflow_uri: str = Field("sqlite:///mlflow.db", description="MLflow store; relative sqlite paths are repo-relative")
    experiment: str = Field("jagg-{profile}", description="MLflow experiment ('{profile}' is filled in)")
    retries: int = Field(5, ge=0, le=20, description="retries of a failed MLflow call (exponential backoff, at most "
                                                   "20: a store down for longer is buffered or one sentence)")
    lock_wait_s: Number = Field(120.0, gt=0, le=3600, description="how long a stage waits for the lock another "
                                "process holds while it opens a SQLite store (mlflow.db.lock), then one sentence")
    ui_url: str = Field("http://127.0.0.1:5000", pattern=r"^https?://\S+$",
                        description="the MLflow UI that links (Prefect artifacts) point to: `jagg services up`'s")

    @field_validator("experiment")
    @classmethod
    def _placeholders(cls, v: str) -> str:
        import string

        try:
            fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(v) if f is not None]
        except ValueError:
            fields = [("?", "", None)]
        if any(f != "profile" or spec or conv for f, spec, conv in fields):  # `{profile:>99999999999}`: 100 GB
            raise ValueError("it may hold only the placeholder {profile}, without a format spec")
        if not v.strip() or len(v) > 200 or any(not c.isprintable() for c in v):
            raise ValueError("the experiment name must be 1 to 200 printable characters (MLflow's names)")
        return v


def local_store(uri: str) -> bool:
    """Whether an MLflow tracking URI names a file of the host that reads it (``sqlite:``, ``file:``, a plain path),
    not a server or database that workers on several hosts share."""
    if "://" not in uri:
        return not uri.lower().startswith("databricks")  # a plain path; `databricks` names a workspace
    scheme = uri.partition("://")[0].lower()
    return scheme == "file" or scheme.startswith("sqlite")


class ResourcesConfig(Section):
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
    speed_rounds: int = Field(7, ge=0, le=1000, description="rounds of the `speed` stage, which times every method's "
                              "update side by side for the report's speed table (0: off; the table then shows each "
                              "run's own times only)")
    dispatch: Literal["in-process", "pool"] = Field(
        "in-process", description="where a flow's trainings and evaluations run: in the flow's own process "
        "(in-process), or each as a flow run of its own on the Prefect work pool, taken by whichever worker of it is "
        "free on any host (pool: the project folder on a filesystem every worker sees and an MLflow server in "
        "tracking.mlflow_uri; docs/scaling.md)")
    pool_wait_s: float = Field(3600.0, ge=0, le=7 * 86400, description="with dispatch: pool, seconds a sweep waits "
                               "while no worker has taken any of its units in flight, then fails in one sentence (0: "
                               "for ever; docs/scaling.md)")

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

    @field_validator("speed_rounds")
    @classmethod
    def _rounds(cls, v: int) -> int:
        if 0 < v < 3:
            raise ValueError(f"speed_rounds {v} must be 0 (off) or at least 3 (a median one disturbed round cannot move)")
        return v


class Params(Section):
    """The whole resolved configuration of one profile."""

    # The pattern is on the field, not only on --profile: `--set profile=../../x` names folders too.
    profile: str = Field("toy", pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=MAX_NAME, description="profile name (it names folders)")
    outputs: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=MAX_NAME,
        description="folder name of the runs, checkpoints, evaluations and report (default: the profile's name; a "
                    "flow run with parameter overrides gets its own)",
    )
    plugins: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field(
        default_factory=list, max_length=100,
        description="plugin files (a backbone or a reward each, paths inside the project): imported before the rest "
                    "is validated, as installed packages' `jagg.plugins` entry points are (docs/extending.md)")
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
    def _plugins_first(cls, data: Any) -> Any:
        """The plugin files are imported before any section is read: their backbones and rewards are names the
        sections may use. Paths are the project's (the working directory: every stage runs at its root)."""
        files = data.get("plugins") if isinstance(data, dict) else None
        if files is None:
            load_plugins()
            return data
        if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
            raise ValueError("plugins must be a list of file paths inside the project, e.g. [plugins/my_reward.py]")
        try:
            load_plugins(tuple(inside(Path.cwd(), f, "plugins", kind="file") for f in files))
        except UserError as e:  # the sentence is the plugin's; the params' location is added by the caller
            raise ValueError(str(e).rstrip(".")) from None
        return data

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
    def _secrets_remembered(self) -> "Params":
        """Every secret of valid params is redacted from whatever this process writes or logs later, also where a
        library quotes it without its key or URL (:func:`jagg_core.setup.redact.remember`)."""
        remember(self.model_dump(mode="json"), self.marked_secrets())
        return self

    @model_validator(mode="after")
    def _no_secret_in_names(self) -> "Params":
        """The experiment's name is shown to everyone who opens the store, in MLflow's experiments table: it holds no
        URL's credentials and no secret of these params. Refused, not redacted: a name with `***` would not be the
        one given, and two passwords would name one experiment."""
        if holds_secret(self.tracking.experiment, self.model_dump(mode="json"), self.marked_secrets()):
            raise ValueError("tracking.experiment holds a secret (a URL's credentials or the value of a secret param); "
                             "an experiment's name is shown to everyone who opens the MLflow store: name it without "
                             "the secret")
        return self

    @model_validator(mode="after")
    def _consistent(self) -> "Params":
        for name in self.methods:
            if not _is_name(name):
                raise ValueError(f"method name {name[:80]!r} must match [a-z0-9][a-z0-9_-]* in at most {MAX_NAME} "
                                 f"characters (it names folders and MLflow runs)")
        for name in self.run.methods:
            if name not in self.methods:
                raise ValueError(f"run.methods names {name!r}, which is not defined under methods")
        for name in self.resources.cuda_visible_devices:
            if name not in self.methods:
                raise ValueError(f"resources.cuda_visible_devices names {name!r}, which is not defined under methods")
        for name, m in self.methods.items():
            r = self.method(name)
            try:
                check_anchors(r.window, r.anchors, r.anchor_at, r.random_anchor, r.random_anchor_p)
            except ValueError as e:
                raise ValueError(f"methods.{name}: {e}") from None
        if self.resources.dispatch == "pool" and local_store(self.tracking.mlflow_uri):
            raise ValueError(f"resources.dispatch = pool needs tracking.mlflow_uri to be an MLflow server every worker "
                             f"reaches (e.g. http://<head host>:5000), not {self.tracking.mlflow_uri!r}, a file each "
                             f"host would read on its own")
        if self.resources.dispatch == "pool" and self.resources.num_machines > 1:
            raise ValueError(f"resources.dispatch = pool runs each training on the one machine of the worker that takes "
                             f"it; a run over resources.num_machines = {self.resources.num_machines} machines is "
                             f"started on each machine by hand (`jagg train --machine-rank`, docs/scaling.md)")
        if self.eval.split == "validation" and not (self.is_toy and self.world.n_validation_per_style):
            raise ValueError("eval.split = validation needs the toy world's validation split (world.n_validation_per_style "
                             "> 0); a real profile names its own held-out prompts in eval.benchmark")
        return self

    def redacted(self) -> dict[str, Any]:
        """The params as JSON-ready dicts, every secret ``***``: what MLflow, ``params.json`` and every checkpoint's
        ``state.json`` hold, and what a resumed run's params are compared with."""
        return redact(self.masked())

    def secret_options(self) -> list[tuple[str, ...]]:
        """The paths of the options set here that their plugin's spec marks secret (``secret=(...)``: a name the
        redaction's word list does not know), e.g. ``("reward", "options", "mine", "seed_phrase")``."""
        paths = [("model", "options", k) for k in backbone_spec(self.model.backbone).secret if k in self.model.options]
        paths += [("reward", "options", name, k) for name, options in self.reward.options.items()
                  for k in reward_spec(name).secret if k in options]
        return paths

    def marked_secrets(self) -> list[Any]:
        """The values of :meth:`secret_options` (those set: not None or empty)."""
        tree = self.model_dump(mode="json")
        values = []
        for path in self.secret_options():
            node = tree
            for k in path:
                node = node[k]
            if node not in (None, "", {}, []):
                values.append(node)
        return values

    def masked(self) -> dict[str, Any]:
        """The params as JSON-ready dicts with every option a plugin marks secret ``***`` (and nothing else changed):
        what anything that hashes or writes options starts from (the fingerprint, a provenance, MLflow's params)."""
        return mask(self.model_dump(mode="json"), self.secret_options())

    def check_sweep(self, sweep: str) -> str:
        """``sweep``, a sweep's name, refused in one sentence if it holds a URL's credentials or a secret of these
        params: it names the sweep's MLflow run (``runs.name``, the tags ``jagg.sweep`` and ``mlflow.runName``), a tag
        of every unit it sends to the work pool and its token file. Refused, not redacted, as the experiment's name."""
        if isinstance(sweep, str) and holds_secret(sweep, self.model_dump(mode="json"), self.marked_secrets()):
            raise ParamsError("the sweep name holds a secret (a URL's credentials or the value of a secret param); a "
                              "sweep's name is shown to everyone who opens the MLflow store or Prefect's UI: pass "
                              "another --sweep, without the secret.")
        return sweep

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
        """The backbone is the embedded toy world's (its prompts from the world, its base model from pretrain)."""
        return backbone_spec(self.model.backbone).world


class ResolvedMethod(JaggConfig):
    name: str
    mode: Literal[MODES]
    lr_scale: float = 1.0  # the method's learning rate over train.lr (MethodConfig.lr_scale)


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
