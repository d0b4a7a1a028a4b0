"""Objects built from the params: the device, the policy (with LoRA) and the training reward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .setup.config import Params, ParamsError
from .setup.paths import Layout
from .setup.registry import backbone_spec
from .policies import load_policy
from .policies.diffusers_common import check_model_dir, resolve_model_dir
from .rewards import make_weighted_reward

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "check_model_files", "pick_device", "policy_from_params", "reward_from_params"]

DTYPES = ("float32", "bfloat16", "float16")  # model.dtype: torch's names (torch is imported where a dtype is made)


def pick_device(params: Params) -> torch.device:
    """``resources.device``: cpu, cuda, or auto (cuda when one is visible)."""
    import torch

    want = params.resources.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ParamsError("resources.device is 'cuda' but no CUDA device is visible; set it to 'auto' or 'cpu'.")
    return torch.device("cuda" if want != "cpu" and torch.cuda.is_available() else "cpu")


def policy_from_params(params: Params, layout: Layout, device: torch.device):
    """The policy of ``params.model`` (the toy base model defaults to the pretrain stage's output)."""
    import torch

    options = dict(params.model.options)
    lora = params.model.lora
    if lora.rank > 0:
        options["lora"] = {"rank": lora.rank, "alpha": lora.alpha or lora.rank, "dropout": lora.dropout,
                           "target_modules": list(lora.target_modules)}
    path = params.model.path or (str(layout.base_model) if params.is_toy else None)
    return load_policy(params.model.backbone, path, device=device, dtype=getattr(torch, params.model.dtype),
                       options=options)


def check_model_files(params: Params, layout: Layout) -> None:
    """The model's files are where ``params.model`` says (a folder, or a hub id in the HF cache), checked without
    loading anything: a launcher says what is missing in one sentence before it starts any worker."""
    path = params.model.path or (str(layout.base_model) if params.is_toy else None)
    spec = backbone_spec(params.model.backbone)
    if spec.check_files is not None:
        spec.check_files(path)
        return

    check_model_dir(resolve_model_dir(path, hub_id=spec.hub_id), spec.components, hub_id=spec.hub_id)


def reward_from_params(params: Params):
    """The weighted training reward of ``params.reward``."""
    return make_weighted_reward(params.reward.weights, params.reward.options, frames=params.reward.frames)
