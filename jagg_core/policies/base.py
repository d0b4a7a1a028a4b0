"""The policy interface every backbone implements, and the backbone registry.

A policy is a flow-matching text-to-image model seen by the trainer: prompts are encoded once into
:class:`PromptEmbeds`; ``velocity(latents, timesteps, embeds)`` runs the trained transformer (classifier-free guidance
inside, where the backbone uses it); ``decode`` turns final latents into images. The trainer never looks inside.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from ..errors import UserError, sentence
from ..setup.registry import BackboneSpec, PluginError, add, backbone_names, backbone_spec

if TYPE_CHECKING:
    import torch

    from ..schedules import Schedule

__all__ = [
    "PolicyError",
    "PromptEmbeds",
    "Policy",
    "available_backbones",
    "load_policy",
    "register_backbone",
]


class PolicyError(UserError, ValueError):
    """A policy that cannot be built: unknown backbone, missing or incomplete weights. The message is for the user."""


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch of prompts: named tensors, batch dimension first."""

    tensors: dict[str, torch.Tensor]

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def __getitem__(self, index: int | slice | torch.Tensor | Sequence[int]) -> "PromptEmbeds":
        import torch

        if isinstance(index, int):
            index = slice(index, index + 1)
        elif not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        return PromptEmbeds({k: v[index] for k, v in self.tensors.items()})

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "PromptEmbeds":
        return PromptEmbeds(
            {k: v.to(device=device, dtype=dtype if v.is_floating_point() else None) for k, v in self.tensors.items()}
        )

    @staticmethod
    def cat(parts: Sequence["PromptEmbeds"]) -> "PromptEmbeds":
        import torch

        keys = parts[0].tensors.keys()
        return PromptEmbeds({k: torch.cat([p.tensors[k] for p in parts]) for k in keys})


class Policy(abc.ABC):
    """A text-to-image flow-matching policy.

    Attributes:
        transformer: the trained ``nn.Module`` (wrapped by DDP/FSDP by the trainer; ``velocity`` calls it).
        device, dtype: where and in what precision the transformer runs.
    """

    transformer: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    num_train_timesteps: int = 1000

    @abc.abstractmethod
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Encode prompts once (no grad); negative prompts for CFG are included where the backbone uses CFG."""

    @abc.abstractmethod
    def latent_shape(self) -> tuple[int, ...]:
        """Shape of one sample's (packed) latent, e.g. ``(tokens, channels)``."""

    @abc.abstractmethod
    def schedule(self, num_steps: int) -> Schedule:
        """The sampling schedule (sigmas and network timesteps) of ``num_steps`` steps at this resolution."""

    @abc.abstractmethod
    def velocity(self, latents: torch.Tensor, timesteps: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        """v_θ(z, t): (B, *latent_shape) from latents (B, *latent_shape), network timesteps (B,) and B embeds."""

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Final latents (B, *latent_shape) -> images (B, 3, H, W) float32 in [0, 1] (no grad)."""

    def initial_noise(self, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """z_0 ~ N(0, I) of shape (batch, *latent_shape) in float32 on the policy's device."""
        import torch

        device = generator.device if generator is not None else self.device
        noise = torch.randn((batch, *self.latent_shape()), generator=generator, device=device, dtype=torch.float32)
        return noise.to(self.device)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def keep_reference(self) -> None:
        """Freeze the transformer as it is now as the KL reference (call before any update or resume).

        With LoRA nothing is copied: the reference is the base with the adapters disabled. A full fine-tune keeps a
        frozen copy of the transformer (its memory once more; for the toy-flux model 2 MB).
        """
        module = getattr(self.transformer, "module", self.transformer)
        if hasattr(module, "disable_adapter"):
            return
        self._reference = copy.deepcopy(module).requires_grad_(False).eval()

    def has_reference(self) -> bool:
        """Whether :meth:`reference` has a reference to switch to (a frozen copy, or LoRA adapters to disable)."""
        module = getattr(self.transformer, "module", self.transformer)
        return getattr(self, "_reference", None) is not None or hasattr(module, "disable_adapter")

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Within this context ``velocity`` is the frozen reference policy (for the KL term).

        LoRA disables its adapters; a full fine-tune swaps in the copy that :meth:`keep_reference` froze.
        """
        frozen = getattr(self, "_reference", None)
        if frozen is not None:
            live, self.transformer = self.transformer, frozen
            try:
                yield
            finally:
                self.transformer = live
            return
        module = getattr(self.transformer, "module", self.transformer)  # through a DDP wrapper
        if not hasattr(module, "disable_adapter"):
            raise PolicyError("a KL term (beta > 0) needs LoRA (model.lora.rank > 0) or a frozen reference copy "
                              "(Policy.keep_reference, which the trainer calls when train.beta > 0).")
        with module.disable_adapter():
            yield


def no_grad(method: Callable[..., Any]) -> Callable[..., Any]:
    """``@torch.no_grad()`` with torch imported when ``method`` runs: a backbone's module registers it (validating a
    params file imports every backbone's module) without importing torch."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return method(*args, **kwargs)

    return wrapper


def register_backbone(name: str, **facts: Any) -> Callable[[Callable[..., Policy]], Callable[..., Policy]]:
    """Decorator: register ``factory(path, *, device, dtype, options) -> Policy`` under ``name`` with its spec's
    ``facts`` (:class:`jagg_core.setup.registry.BackboneSpec`: ``options`` at least)."""

    def deco(factory: Callable[..., Policy]) -> Callable[..., Policy]:
        add("backbone", BackboneSpec(name=name, factory=factory, **facts))
        return factory

    return deco


def available_backbones() -> list[str]:
    return backbone_names()


def load_policy(
    backbone: str,
    path: str | None,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    options: Mapping[str, Any] | None = None,
) -> Policy:
    """Build the policy of ``backbone`` from the weights at ``path`` (a local folder or an HF-cache hub id), in
    ``dtype`` (default float32)."""
    import torch

    try:
        spec = backbone_spec(backbone)
    except PluginError as e:
        raise PolicyError(sentence(e)) from None
    return spec.factory(path, device=torch.device(device),
                        dtype=torch.float32 if dtype is None else dtype, options=dict(options or {}))
