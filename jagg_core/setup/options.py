"""Typed reading of untrusted values: the base of every params section, and the option types a plugin's schema uses.

A backbone's ``model.options`` and a reward's ``reward.options.<name>`` are free-form mappings in params.yaml; each
plugin declares what its options take as a schema ``{option: (type, default)}`` (:mod:`jagg_core.setup.registry`),
read here with the same strictness as the sections (:func:`coercion_problem`, one rule for every field): true/false is
never a number, ``"5"`` or ``5.0`` never a count, ``"no"`` or ``1`` never a flag, ``"60"`` never a number, no NaN or
inf. The types below are the ones the built-in plugins use; a plugin of your own may use them or any pydantic type.
"""

from __future__ import annotations

import re
from types import UnionType
from typing import Annotated, Any, Mapping, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, create_model, model_validator

from .redact import hide, invalid_value, is_secret_path

__all__ = ["coercion_problem", "Count", "Number", "OptionSchema", "Size", "Tokens", "Scale", "Shift", "Share", "RGB",
           "Frames", "LORA", "DIFFUSERS_COMMON", "HF_SCORER", "TAU_OPTIONS", "option_reader", "read_options"]

OptionSchema = Mapping[str, tuple[Any, Any]]  # option -> (type, default)


def _a_number(v: Any) -> Any:
    problem = coercion_problem(v, {float})
    if problem:
        raise ValueError(f"{v!r} {problem}")
    return v


# Typed all the way down: what a list or a dict holds is read as strictly as a top-level field (round 4's
# `Section._no_silent_coercion` sees top-level values only). A count is pydantic's strict int: a whole number as
# written, never true/false, "3" or 3.0. A number is a float that is never true/false or a quoted string (but YAML
# 1.1's 3e-4, which it reads as a string): :func:`coercion_problem`, the one rule.
Count = Annotated[int, Strict()]
Number = Annotated[float, BeforeValidator(_a_number)]


def _scalar_types(annotation: Any) -> set[Any]:
    """The scalar types a field takes: ``Annotated`` and ``Optional`` / ``Union`` unwrapped (``Union[Annotated[float,
    ...], None]`` is {float, NoneType})."""
    if get_origin(annotation) is Annotated:
        return _scalar_types(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        return set().union(*(_scalar_types(a) for a in get_args(annotation)))
    return {annotation}


# What PyYAML (YAML 1.1) leaves a string although it is a number: an exponent without a dot (`3e-4`, `1E5`). A float
# field takes it; any other string (`"60"`, quoted) is the user's string, not a number.
_YAML11_NUMBER = re.compile(r"[+-]?\d+[eE][+-]?\d+")


def coercion_problem(value: Any, types: set[Any]) -> str | None:
    """Why ``value`` may not go into a field of ``types`` (from :func:`_scalar_types`) although pydantic would quietly
    convert it, or None: one strictness for every section and option. true/false is a flag only (never a number),
    a flag is true/false only (never ``"no"`` or ``1``), a count a whole number as written (never ``"8"`` or
    ``8.0``), a number never a quoted string (but YAML 1.1's ``3e-4``)."""
    if types & {Any, str} or value is None:
        return None
    if isinstance(value, bool):
        return None if bool in types else "must be a number, not true/false" if types & {int, float} else None
    if bool in types and not types & {int, float} and isinstance(value, (int, float, str)):
        return "must be true or false (unquoted)"
    if isinstance(value, str) and types & {int, float}:
        if float in types and _YAML11_NUMBER.fullmatch(value.strip()):
            return None
        if re.fullmatch(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*", value):
            return "must be a number, not a quoted string" if float in types else \
                "must be a whole number, not a string"
        return None
    if isinstance(value, float) and int in types and float not in types:
        return "must be a whole number (without a decimal point)"
    return None


class Section(BaseModel):
    """The base of every params section and option schema: nothing unknown, no inf or NaN, no silent coercion."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_silent_coercion(cls, data: Any) -> Any:
        """true/false is not a number, "5" or 5.0 not a count, "no" or 1 not a flag, "60" not a number: refuse what
        pydantic would quietly convert (:func:`coercion_problem`), in every section and every plugin's options.

        A float field still takes an exponent that YAML 1.1 reads as a string (``3e-4``, no dot).
        """
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is None:
                continue
            problem = coercion_problem(value, _scalar_types(field.annotation))
            if problem:
                raise ValueError(f"{name} = {value!r} {problem}")
        return data


class _Options(Section):
    model_config = ConfigDict(extra="forbid", validate_default=False, allow_inf_nan=False)


Size = Annotated[int, Field(ge=1, le=16384)]  # pixels
Tokens = Annotated[int, Field(ge=1, le=8192)]  # text tokens
Scale = Annotated[float, Field(ge=0, le=1000)]  # a guidance scale
Shift = Annotated[float, Field(gt=0, le=1000)]  # a flow-matching timestep shift
Share = Annotated[float, Field(ge=0, le=1)]  # a weight in [0, 1]
RGB = Annotated[float, Field(ge=0, le=255)]  # a distance in RGB units
Frames = Annotated[int, Field(ge=1, le=4096)]  # frames of a clip


class _LoraOptions(BaseModel):
    """``model.options.lora`` (the policies' LoRA keys; ``model.lora`` is the usual place)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)
    rank: Annotated[Count, Field(ge=0, le=4096)] = 0
    alpha: Union[Annotated[Number, Field(gt=0, le=1e6)], None] = None
    dropout: Annotated[Number, Field(ge=0, lt=1)] = 0.0
    target_modules: list[Annotated[str, Field(max_length=200)]] = Field(default_factory=list, max_length=1000)


def _lora_dict(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, Mapping):
        raise ValueError("lora must be a mapping of rank, alpha, dropout, target_modules")
    typed = _LoraOptions.model_validate(dict(v))
    return {k: getattr(typed, k) for k in v}


LORA = (Annotated[Union[dict[str, Any], None], BeforeValidator(_lora_dict)], None)
# The options every diffusers backbone takes (resolution, guidance, text length, LoRA, checkpointing)
DIFFUSERS_COMMON: dict[str, tuple[Any, Any]] = {
    "height": (Size, None), "width": (Size, None), "guidance_scale": (Scale, None), "max_sequence_length": (Tokens, None),
    "lora": LORA, "gradient_checkpointing": (bool, None)}
# The options every scorer on a network takes
HF_SCORER: dict[str, tuple[Any, Any]] = {
    "device": (str, None), "dtype": (str, None), "batch_size": (Annotated[int, Field(ge=1, le=65536)], None)}
TAU_OPTIONS: dict[str, tuple[Any, Any]] = {"tau": (RGB, None), "tau_full": (RGB, None)}  # the toy rewards' colour distances


def option_reader(where: str, schema: OptionSchema) -> type[BaseModel]:
    """A typed reading of one free-form option dict: the options it takes, each with its type (a float takes a number
    or a numeric string, never true/false or "1e400"; an int a whole number; a str a string)."""
    return create_model(where, __base__=_Options, **{k: (t, d) for k, (t, d) in schema.items()})


def read_options(model: type[BaseModel], options: Mapping[str, Any], where: str, what: str,
                 secret: tuple[str, ...] = ()) -> dict[str, Any]:
    """``options`` read through ``model``: the values as typed (numeric strings become numbers), or one sentence
    naming the dotted option, the value and what it takes; a secret option's value (its name a secret word, or one
    of ``secret``, its plugin's marks) is in no sentence, whatever its type (:func:`~.redact.invalid_value`)."""
    if not isinstance(options, Mapping):
        raise ValueError(f"{where} must be a mapping of option -> value")
    try:
        typed = model.model_validate(dict(options))
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ValueError(f"{where}: {what} has no option {key!r}; its options: "
                             f"{', '.join(model.model_fields) or 'none'}") from None
        # no value of a secret option in any sentence, whichever check quotes it
        msg = hide(err["msg"].removeprefix("Value error, "), also=[v for k, v in options.items()
                                                                   if is_secret_path((str(k),), secret)])
        if not key:  # a whole-dict check (true/false where a number goes) names the option itself
            raise ValueError(f"{where}.{msg}") from None
        raise ValueError(invalid_value(f"{where}.{key}", err.get("input"), msg, secret)) from None
    return {k: getattr(typed, k) for k in options}
