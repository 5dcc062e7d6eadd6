"""Which dotted keys the configuration models accept, for override checks, interpolation defaults and
"did you mean" hints. Works on the model classes only, never on a configuration."""

from __future__ import annotations

import difflib
import types
from dataclasses import dataclass
from typing import Annotated, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def section_models(annotation: object) -> list[type[BaseModel]]:
    """The models an annotation may hold (several for a union such as the actor section)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = get_origin(annotation)
    if origin is Annotated:
        return section_models(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        found: list[type[BaseModel]] = []
        for member in get_args(annotation):
            found.extend(section_models(member))
        return found
    return []


def _is_mapping(annotation: object) -> bool:
    origin = get_origin(annotation)
    if origin is Annotated:
        return _is_mapping(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return any(_is_mapping(member) for member in get_args(annotation))
    return origin is dict


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """Where a dotted key leads in the models."""

    known: bool
    """The models accept the key."""
    problem: str = ""
    """Why not, with a suggestion, when `known` is false."""
    has_default: bool = False
    """A leaf field (or a free-form mapping entry is not) with a default value."""
    default: object = None
    """That default, as plain data (sections dumped to dicts)."""


def field_names(models: list[type[BaseModel]]) -> list[str]:
    """Field names of `models`, in declaration order, without repeats."""
    names: list[str] = []
    for model in models:
        names.extend(name for name in model.model_fields if name not in names)
    return names


def member_for(members: list[type[BaseModel]], backend: object) -> type[BaseModel]:
    """The member of a union of sections (the actor section) that a `backend` value selects: the member
    whose `backend` default it is, else the member whose `backend` is free text, else the first."""
    for member in members:
        info = member.model_fields.get("backend")
        if info is not None and not info.is_required() and info.default == backend:
            return member
    for member in members:
        info = member.model_fields.get("backend")
        if info is not None and info.is_required() and isinstance(backend, str):
            return member
    return members[0]


def field_names_at(root: type[BaseModel], parents: list[str], backend: str = "") -> list[str]:
    """Field names of the section at `parents` below `root`; in a union of sections, the member that
    `backend` selects (the default member when it is empty). Empty when `parents` names no section."""
    models = [root]
    for part in parents:
        info = field_names_and_infos(models).get(part)
        if info is None:
            return []
        models = section_models(info.annotation)
        if not models:
            return []
        if len(models) > 1:
            models = [member_for(models, backend or "torch")]
    return field_names(models)


def field_names_and_infos(models: list[type[BaseModel]]) -> dict[str, FieldInfo]:
    """Fields of `models` by name (the first model that declares a name wins)."""
    fields: dict[str, FieldInfo] = {}
    for model in models:
        for name, info in model.model_fields.items():
            fields.setdefault(name, info)
    return fields


def suggest(word: str, choices: list[str]) -> str:
    """A `did you mean` clause for the closest of `choices`, or an empty string."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`? " if close else ""


def lookup(root: type[BaseModel], parts: list[str]) -> KeyLookup:
    """Follow `parts` (a dotted key split at the dots) through the models from `root`."""
    models = [root]
    for index, part in enumerate(parts):
        fields = {name: info for model in models for name, info in model.model_fields.items()}
        info = fields.get(part)
        where = ".".join(parts[:index]) or "the top level"
        if info is None:
            names = field_names(models)
            return KeyLookup(
                False,
                f"unknown key `{part}` in {where}; {suggest(part, names)}known keys: {', '.join(names)}",
            )
        nested = section_models(info.annotation)
        if nested:
            models = nested
            continue
        if _is_mapping(info.annotation):
            return KeyLookup(True)  # free-form mapping: any key below it is the user's
        if index != len(parts) - 1:
            return KeyLookup(False, f"`{'.'.join(parts[: index + 1])}` is a value, not a section")
        if info.default is not PydanticUndefined:
            return KeyLookup(True, has_default=True, default=info.default)
        if info.default_factory is not None:
            return KeyLookup(True, has_default=True, default=info.get_default(call_default_factory=True))
        return KeyLookup(True)
    # The key names a whole section.
    return KeyLookup(True)
