"""LoRA on a diffusers transformer (via peft), and checkpoints of exactly the trainable tensors.

``apply_lora`` wraps the transformer in a ``peft.PeftModel``: its ``disable_adapter()`` context gives the frozen base
model back, which is what :meth:`Policy.reference` uses for the KL term. Checkpoints hold only the parameters with
``requires_grad`` (the adapters under LoRA, everything under a full fine-tune), keyed by their names in the module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from .base import PolicyError

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_TARGET_MODULES", "apply_lora", "load_trainable_state_dict", "trainable_state_dict"]

# The attention projections of both streams of an MMDiT block (Flux, SD3, Qwen-Image name them alike), as in
# Flow-GRPO's LoRA config.
DEFAULT_TARGET_MODULES = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)


def apply_lora(
    transformer: torch.nn.Module,
    *,
    rank: int,
    alpha: float | None = None,
    target_modules: Sequence[str] = DEFAULT_TARGET_MODULES,
    dropout: float = 0.0,
) -> torch.nn.Module:
    """Freeze ``transformer`` and return it wrapped with trainable LoRA adapters of ``rank`` (scale ``alpha / rank``).

    Adapter weights are kept in float32 even on a bf16 base (peft's ``autocast_adapter_dtype``); B starts at zero, so
    the adapted model equals the base model until the first update.
    """
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise PolicyError(f"model.lora.rank must be a positive integer, got {rank}.")
    names = {name for name, _ in transformer.named_modules()}
    unmatched = [t for t in target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise PolicyError(
            f"model.lora.target_modules {unmatched} match no module of {type(transformer).__name__}; "
            f"use module names such as {', '.join(DEFAULT_TARGET_MODULES)}."
        )
    transformer.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=list(target_modules),
    )
    return get_peft_model(transformer, config)


def _unwrap_ddp(module: torch.nn.Module) -> torch.nn.Module:
    # DDP prefixes every name with "module."; checkpoints must not depend on how the trainer wrapped the model.
    import torch

    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module.module
    return module


def _full(tensor: torch.Tensor) -> torch.Tensor:
    # An FSDP2-sharded parameter is a DTensor: gather it (a collective: every rank must call this).
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def trainable_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``module`` by name, as CPU copies in their own dtype."""
    module = _unwrap_ddp(module)
    return {
        name: _full(p.detach()).to("cpu", copy=True) for name, p in module.named_parameters() if p.requires_grad
    }


def load_trainable_state_dict(module: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`trainable_state_dict`) into the trainable parameters of ``module``, all or none."""
    import torch

    module = _unwrap_ddp(module)
    params = {name: p for name, p in module.named_parameters() if p.requires_grad}
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    mismatched = [
        f"{name} {tuple(state[name].shape)} vs {tuple(p.shape)}"
        for name, p in params.items()
        if name in state and tuple(state[name].shape) != tuple(p.shape)
    ]
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing (e.g. {missing[0]!r})")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected (e.g. {unexpected[0]!r})")
        if mismatched:
            problems.append(f"{len(mismatched)} of another shape (e.g. {mismatched[0]})")
        raise PolicyError(
            f"the checkpoint does not fit the trainable parameters: {'; '.join(problems)}; "
            "load it with the model.backbone and model.lora settings it was saved with."
        )
    with torch.no_grad():
        for name, p in params.items():
            value = state[name]
            if hasattr(p, "device_mesh"):  # FSDP2: shard the full tensor the way the parameter is sharded
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(value.to(p.device, p.dtype), p.device_mesh, p.placements)
            p.copy_(value)
