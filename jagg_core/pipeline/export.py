"""A training checkpoint as files diffusers loads: a full fine-tune as a transformer folder
(``FluxTransformer2DModel.from_pretrained(out / "transformer")`` and alike), LoRA as ``pytorch_lora_weights.safetensors``
for ``pipe.load_lora_weights(out)``.

The export is written into a temporary folder beside ``out`` and renamed into place: a failed export leaves nothing, and
an existing ``out`` is never overwritten.
"""

from __future__ import annotations

import json
import re
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import UserError
from ..setup.registry import backbone_spec
from ..setup.storage import atomic_write_text, move, temp_dir

__all__ = ["ExportError", "export_transformer"]

_PEFT_PREFIX = "base_model.model."


class ExportError(UserError, RuntimeError):
    """An export that cannot be written; the message is one sentence for the user."""


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module


def _remove_stale_temporaries(folder: Path) -> None:
    """The ``.tmp-<name>-<pid>-*`` folders of exports whose process no longer runs (SIGKILLed mid-export)."""
    if not folder.is_dir():
        return
    for p in folder.glob(".tmp-*"):
        m = re.fullmatch(r"\.tmp-.+-(\d+)-[^-]+", p.name)
        if not m or not p.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (PermissionError, OverflowError, ValueError):
            pass


def export_transformer(transformer: torch.nn.Module, out: str | Path, *, backbone: str,
                       card: Mapping[str, Any]) -> Path:
    """Write ``transformer`` (a diffusers transformer, or a peft LoRA wrapper of one) to ``out``; returns ``out``.

    Full fine-tune: ``out/transformer/`` (config + safetensors). LoRA: ``out/pytorch_lora_weights.safetensors`` in the
    backbone pipeline's format (keys ``transformer.<module>.lora_A.weight`` …). ``out/export.json`` records ``card``
    (the checkpoint, its iteration, the base model) and what was written.
    """
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} already exists and is not empty; choose another --out or move it away first.")
    module = _unwrap(transformer)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(out.parent)
    pipeline_name = backbone_spec(backbone).export_pipeline  # whose LoRA format the adapters are saved in
    tmp = temp_dir(out.parent, f".tmp-{out.name}-{os.getpid()}-")
    try:
        from peft import PeftModel

        if isinstance(module, PeftModel):
            import diffusers
            from peft.utils import get_peft_model_state_dict

            state = {k[len(_PEFT_PREFIX):] if k.startswith(_PEFT_PREFIX) else k: v.detach().cpu().contiguous()
                     for k, v in get_peft_model_state_dict(module).items()}
            if pipeline_name is None:
                raise ExportError(f"backbone {backbone!r} declares no diffusers pipeline (its spec's export_pipeline), "
                                  f"so its LoRA adapters have no file format to be exported in.")
            pipeline = getattr(diffusers, pipeline_name)
            # The adapter config (rank, alpha, targets) travels in the file's metadata: load_lora_weights then scales
            # by alpha / rank as training did.
            metadata = module.peft_config[module.active_adapter].to_dict()
            pipeline.save_lora_weights(tmp, transformer_lora_layers=state, safe_serialization=True,
                                       transformer_lora_adapter_metadata=metadata)
            kind, files = "lora", ["pytorch_lora_weights.safetensors"]
        else:
            module.save_pretrained(tmp / "transformer", safe_serialization=True)
            kind, files = "full", ["transformer/"]
        atomic_write_text(tmp / "export.json", json.dumps({**card, "backbone": backbone, "kind": kind, "files": files,
                                                           "pipeline": pipeline_name}, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        move(tmp, out)
    except Exception as e:  # noqa: BLE001  (OSError; safetensors' SafetensorError on a full disk, not an OSError)
        shutil.rmtree(tmp, ignore_errors=True)
        why = getattr(e, "strerror", None) or " ".join(str(e).split())[:160] or type(e).__name__
        raise ExportError(f"could not write the export to {out} ({why}); nothing was written.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
