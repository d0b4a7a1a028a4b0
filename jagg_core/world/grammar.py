"""The prompt grammar: a :class:`PromptSpec` written as text (:func:`caption`) and read back (:func:`parse_prompt`).

    prompt := body ["on a" BACKGROUND "background"]
    body   := NUMBER [SIZE] [COLOR] SHAPES                      (count)
            | object RELATION object                            (pair)
            | object ["at the" CELL] {"and" object ["at the" CELL]}   (single: one object; scene: several)
    object := ("a" | "an") [SIZE] [COLOR] SHAPE

Words are separated by single spaces and there is no punctuation, so a word-level tokenizer covers every prompt
and caption with :func:`vocabulary`. The family of a prompt is read from its structure.
"""

from __future__ import annotations

from .scene import BACKGROUNDS, CELLS, COLORS, NUMBERS, PLURALS, RELATIONS, SHAPES, SIZES, ObjectSpec, PromptSpec

__all__ = ["caption", "parse_prompt", "shown_prompt", "vocabulary"]

_SINGULAR = {plural: shape for shape, plural in PLURALS.items()}


def _object_words(o: ObjectSpec, plural: bool = False) -> list[str]:
    return [w for w in (o.size, o.color) if w is not None] + [PLURALS[o.shape] if plural else o.shape]


def _article(next_word: str) -> str:
    return "an" if next_word[0] in "aeiou" else "a"


def _object_phrase(o: ObjectSpec, with_cell: bool = False) -> str:
    words = _object_words(o)
    phrase = " ".join([_article(words[0]), *words])
    return f"{phrase} at the {o.cell}" if with_cell and o.cell is not None else phrase


def caption(spec: PromptSpec) -> str:
    """The prompt text of ``spec``; ``parse_prompt(caption(spec)) == spec``."""
    if spec.family == "count":
        number = next(word for word, n in NUMBERS.items() if n == len(spec.objects))
        body = " ".join([number, *_object_words(spec.objects[0], plural=True)])
    elif spec.family == "pair":
        a, b = spec.objects
        body = f"{_object_phrase(a)} {spec.relation} {_object_phrase(b)}"
    else:
        body = " and ".join(_object_phrase(o, with_cell=True) for o in spec.objects)
    return body if spec.background is None else f"{body} on a {spec.background} background"


def vocabulary() -> list[str]:
    """Every word a prompt or caption of the world can contain, sorted."""
    words = {"a", "an", "and", "at", "the", "on", "background"}
    words |= set(SIZES) | set(COLORS) | set(SHAPES) | set(PLURALS.values()) | set(NUMBERS) | set(BACKGROUNDS)
    for phrase in CELLS + RELATIONS:
        words |= set(phrase.split(" "))
    return sorted(words)


class _Parser:
    """Recursive descent over the words of one prompt; every failure is one ``ValueError`` sentence."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt
        self.words = prompt.split(" ")
        self.pos = 0

    def fail(self, expected: str, pos: int | None = None) -> None:
        pos = self.pos if pos is None else pos
        got = repr(self.words[pos]) if pos < len(self.words) else "the end of the prompt"
        raise ValueError(
            f"{self.prompt!r} is not a prompt of the toy world: expected {expected} at word {pos + 1}, got {got}."
        )

    def peek(self, ahead: int = 0) -> str | None:
        i = self.pos + ahead
        return self.words[i] if i < len(self.words) else None

    def take(self, allowed, expected: str) -> str:
        word = self.peek()
        if word is None or word not in allowed:
            self.fail(expected)
        self.pos += 1
        return word

    def optional(self, allowed) -> str | None:
        word = self.peek()
        if word is not None and word in allowed:
            self.pos += 1
            return word
        return None

    def object(self) -> ObjectSpec:
        article = self.take(("a", "an"), "'a' or 'an'")
        if self.peek() is not None and _article(self.peek()) != article:
            self.fail(f"{_article(self.peek())!r} before {self.peek()!r}", pos=self.pos - 1)
        size = self.optional(SIZES)
        color = self.optional(COLORS)
        shape = self.take(SHAPES, "a size, colour or shape" if size is None and color is None else "a shape")
        return ObjectSpec(shape=shape, color=color, size=size)

    def cell(self) -> str | None:
        if self.optional(("at",)) is None:
            return None
        self.take(("the",), "'the'")
        two = f"{self.peek()} {self.peek(1)}"
        if two in CELLS:
            self.pos += 2
            return two
        return self.take(CELLS, "a position")

    def relation(self) -> str | None:
        first = self.optional({r.split(" ")[0] for r in RELATIONS})
        if first is None:
            return None
        if first in RELATIONS:
            return first
        self.take(("of",), "'of'")
        return f"{first} of"

    def parse(self) -> PromptSpec:
        if self.peek() in NUMBERS:
            n = NUMBERS[self.take(NUMBERS, "a number")]
            size = self.optional(SIZES)
            color = self.optional(COLORS)
            shape = _SINGULAR[self.take(_SINGULAR, "a plural shape")]
            family, objects, relation = "count", (ObjectSpec(shape, color, size),) * n, None
        else:
            if self.peek() not in ("a", "an"):
                self.fail("'a', 'an' or a number")
            first = self.object()
            relation = self.relation()
            if relation is not None:
                family, objects = "pair", (first, self.object())
            else:
                objects = [ObjectSpec(first.shape, first.color, first.size, self.cell())]
                while self.optional(("and",)):
                    o = self.object()
                    objects.append(ObjectSpec(o.shape, o.color, o.size, self.cell()))
                family, objects = ("single" if len(objects) == 1 else "scene"), tuple(objects)
        background = None
        if self.optional(("on",)):
            self.take(("a",), "'a'")
            background = self.take(BACKGROUNDS, "a background colour")
            self.take(("background",), "'background'")
        if self.pos != len(self.words):
            self.fail("the end of the prompt")
        return PromptSpec(family=family, objects=objects, relation=relation, background=background)


def shown_prompt(prompt: str, limit: int = 60) -> str:
    """``prompt`` quoted for an error sentence, cut after ``limit`` characters with its length (a 10 MB prompt is not
    echoed)."""
    return repr(prompt[:limit]) + (f"… ({len(prompt):,} characters)" if len(prompt) > limit else "")


def parse_prompt(prompt: str) -> PromptSpec:
    """What ``prompt`` asks for; a ``ValueError`` (one sentence) for text the grammar cannot produce."""
    if not isinstance(prompt, str):
        raise ValueError(f"a prompt is a string, got {type(prompt).__name__}.")
    try:
        return _Parser(prompt).parse()
    except ValueError as e:
        if str(e).startswith(repr(prompt)):
            raise
        raise ValueError(f"{prompt!r} is not a prompt of the toy world: {e}") from None
