"""Feature recipes: which numbers of one prefill a readout reads, named so that every part agrees.

A recipe is a list of blocks concatenated into one feature vector: `last@L`, `mean@L`, `entropy@L`
(hidden states after layer L), `prompt`, `decoding` and `domain=a/b/c`. Its name, the blocks joined by
`+` (e.g. `last@17+prompt+decoding`), is what capture, the corpus, the fit flow and the readout file all
record, so they cannot disagree; a readout without one is `last@<its layer>`. A readout may use any
recipe whose blocks the capture holds (`columns`), so one wide capture lets the fit flow choose among
many recipes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

RECIPE_VERSION = 1
STATE_KINDS = ("last", "mean", "entropy")  # blocks read from a layer's residual stream
DECODING_COLUMNS = ("temperature", "top_p", "log_max_tokens", "repetition_penalty", "frequency_penalty",
                    "presence_penalty")
_STATE = re.compile(r"^(last|mean|entropy)@(-?\d+)$")
_DOMAIN = re.compile(r"^domain=([A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)*)$")


class RecipeError(ValueError):
    """A recipe name that does not parse, or a recipe that does not fit a model or a capture."""


@dataclass(frozen=True)
class Block:
    """One block of a recipe: a state block (`kind`, `layer`), `prompt`, `decoding` or `domain` (`domains`)."""

    kind: str
    layer: int | None = None
    domains: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        if self.kind in STATE_KINDS:
            return f"{self.kind}@{self.layer}"
        if self.kind == "domain":
            return "domain=" + "/".join(self.domains)
        return self.kind

    def width(self, hidden: int) -> int:
        if self.kind in STATE_KINDS:
            return hidden
        if self.kind == "decoding":
            return len(DECODING_COLUMNS)
        if self.kind == "domain":
            return len(self.domains)
        return 1


def _block(text: str) -> Block:
    text = text.strip()
    state = _STATE.match(text)
    if state:
        return Block(state.group(1), layer=int(state.group(2)))
    if text in ("prompt", "decoding"):
        return Block(text)
    domain = _DOMAIN.match(text)
    if domain:
        names = tuple(domain.group(1).split("/"))
        if len(set(names)) != len(names):
            raise RecipeError(f"recipe block {text!r} names a domain twice")
        return Block("domain", domains=names)
    raise RecipeError(f"unknown recipe block {text!r}: expected last@L, mean@L, entropy@L, prompt, decoding "
                      f"or domain=a/b")


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe: its blocks in order. `Recipe.parse("last@17+mean@17")`; `str(recipe)` is its name."""

    blocks: tuple[Block, ...]

    @classmethod
    def parse(cls, name: str | Recipe) -> Recipe:
        if isinstance(name, Recipe):
            return name
        if not isinstance(name, str) or not name.strip():
            raise RecipeError(f"a recipe is a non-empty name like 'last@22', not {name!r}")
        blocks = tuple(_block(part) for part in name.split("+"))
        names = [b.name for b in blocks]
        if len(set(names)) != len(names):
            raise RecipeError(f"recipe {name!r} repeats a block")
        if sum(b.kind == "domain" for b in blocks) > 1:
            raise RecipeError(f"recipe {name!r} has more than one domain block")
        if not any(b.kind in STATE_KINDS for b in blocks):
            raise RecipeError(f"recipe {name!r} reads no hidden state: it needs a last@, mean@ or entropy@ block")
        return cls(blocks)

    @classmethod
    def last(cls, layer: int) -> Recipe:
        """Today's recipe: the last prompt token of one layer."""
        return cls((Block("last", layer=int(layer)),))

    def __str__(self) -> str:
        return "+".join(b.name for b in self.blocks)

    @property
    def name(self) -> str:
        return str(self)

    @property
    def layers(self) -> tuple[int, ...]:
        """The decoder layers the capture must return, sorted."""
        return tuple(sorted({b.layer for b in self.blocks if b.layer is not None}))

    def state_blocks(self, kind: str) -> tuple[Block, ...]:
        return tuple(b for b in self.blocks if b.kind == kind)

    @property
    def pools(self) -> bool:
        """Whether the capture must accumulate over every prompt token (mean or entropy blocks)."""
        return any(b.kind in ("mean", "entropy") for b in self.blocks)

    @property
    def domains(self) -> tuple[str, ...]:
        return next((b.domains for b in self.blocks if b.kind == "domain"), ())

    def dim(self, hidden: int) -> int:
        return sum(b.width(hidden) for b in self.blocks)

    def check_layers(self, num_layers: int) -> Recipe:
        """This recipe with negative layers counted from the end; RecipeError for a layer out of range."""
        blocks = []
        for b in self.blocks:
            if b.layer is not None:
                if not -num_layers <= b.layer < num_layers:
                    raise RecipeError(f"recipe {self} reads layer {b.layer}, but the model has {num_layers} "
                                      f"decoder layers")
                b = Block(b.kind, layer=b.layer % num_layers)
            blocks.append(b)
        return Recipe(tuple(blocks))

    def hidden_for(self, dim: int) -> int:
        """The hidden size that makes this recipe's vector `dim` floats long; RecipeError when none does."""
        states = sum(b.kind in STATE_KINDS for b in self.blocks)
        hidden = (int(dim) - self.dim(0)) // states
        if hidden <= 0 or self.dim(hidden) != dim:
            raise RecipeError(f"features of {dim} floats are not a capture of recipe {self}")
        return hidden

    def offsets(self, hidden: int) -> dict[str, tuple[int, int]]:
        """{block name: (start, stop)} of each block in this recipe's vector."""
        out, start = {}, 0
        for b in self.blocks:
            out[b.name] = (start, start + b.width(hidden))
            start += b.width(hidden)
        return out

    def columns(self, capture: Recipe | str, hidden: int) -> np.ndarray:
        """Indices into a `capture` vector that give this recipe's vector; RecipeError if it lacks a block.

        A domain block is covered by a capture's domain block that lists every one of its domains.
        """
        capture = Recipe.parse(capture)
        where = capture.offsets(hidden)
        parts = []
        for b in self.blocks:
            if b.kind == "domain":
                held = capture.domains
                missing = [d for d in b.domains if d not in held]
                if missing:
                    raise RecipeError(f"recipe {self} needs domains {missing}, which capture {capture} does not hold")
                start = where["domain=" + "/".join(held)][0]
                parts.append(np.asarray([start + held.index(d) for d in b.domains], dtype=np.int64))
                continue
            if b.name not in where:
                raise RecipeError(f"recipe {self} needs block {b.name}, which capture {capture} does not record")
            parts.append(np.arange(*where[b.name], dtype=np.int64))
        return np.concatenate(parts)

    def covered_by(self, capture: Recipe | str, hidden: int) -> bool:
        try:
            self.columns(capture, hidden)
            return True
        except RecipeError:
            return False


def union(recipes: Sequence[Recipe | str]) -> Recipe:
    """One recipe holding every block of `recipes` (state blocks first, by kind then layer), for a capture
    or a corpus that serves all of them."""
    parsed = [Recipe.parse(r) for r in recipes]
    state = {(b.kind, b.layer) for r in parsed for b in r.blocks if b.kind in STATE_KINDS}
    blocks = [Block(kind, layer=layer) for kind, layer in
              sorted(state, key=lambda kl: (STATE_KINDS.index(kl[0]), kl[1]))]
    if any(r.state_blocks("prompt") for r in parsed):
        blocks.append(Block("prompt"))
    if any(r.state_blocks("decoding") for r in parsed):
        blocks.append(Block("decoding"))
    domains: list[str] = []
    for r in parsed:
        domains += [d for d in r.domains if d not in domains]
    if domains:
        blocks.append(Block("domain", domains=tuple(domains)))
    return Recipe(tuple(blocks))


def readout_recipe(metadata: Mapping) -> Recipe:
    """The recipe a readout file's metadata records; `last@<layer>` for files from before recipes."""
    name = metadata.get("recipe")
    if name:
        return Recipe.parse(str(name))
    layer = metadata.get("layer")
    if layer is None:
        raise RecipeError("the readout records neither a recipe nor a layer")
    return Recipe.last(int(layer))


# ---------------------------------------------------------------------------- the non-state columns

GREEDY = {"temperature": 0.0, "top_p": 1.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
          "presence_penalty": 0.0}


def decoding_columns(settings: Mapping[str, float], max_tokens: int) -> np.ndarray:
    """The `decoding` block for one request: its settings (greedy where one is not given) and log(1 + M)."""
    values = {**GREEDY, **{k: v for k, v in settings.items() if v is not None}}
    row = [float(values["temperature"]), float(values["top_p"]), math.log1p(max(int(max_tokens), 0)),
           float(values["repetition_penalty"]), float(values["frequency_penalty"]), float(values["presence_penalty"])]
    return np.asarray(row, dtype=np.float32)


def prompt_column(prompt_tokens: int) -> np.ndarray:
    return np.asarray([math.log1p(max(int(prompt_tokens), 0))], dtype=np.float32)


DOMAIN_VALUE = 100.0
"""The value of a request's own domain column (the others are 0). The readout standardizes its columns,
and a column that is constant in the training rows (a domain with no training rows) keeps scale 1, so
its ridge penalty on the intercept shift is alpha / DOMAIN_VALUE^2: RLS moves a new domain's intercept
after a few of its finished requests instead of shrinking it by the shared penalty. A domain present in
the training rows is standardized like any column."""


def domain_columns(domains: Sequence[str], domain: str | None) -> np.ndarray:
    row = np.zeros(len(domains), dtype=np.float32)
    if domain in domains:
        row[list(domains).index(domain)] = DOMAIN_VALUE
    return row


def request_columns(recipe: Recipe, prompt_tokens: int, settings: Mapping[str, float], max_tokens: int,
                    domain: str | None) -> dict[str, np.ndarray]:
    """{block name: values} of a recipe's non-state blocks for one request."""
    out = {}
    for b in recipe.blocks:
        if b.kind == "prompt":
            out[b.name] = prompt_column(prompt_tokens)
        elif b.kind == "decoding":
            out[b.name] = decoding_columns(settings, max_tokens)
        elif b.kind == "domain":
            out[b.name] = domain_columns(b.domains, domain)
    return out
