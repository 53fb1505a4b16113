"""Structured output: a completion constrained to JSON that matches a schema, to a regular
expression, or to one of a list of choices (SamplingParams.json_schema, regex, choice).

llguidance (the grammar engine vLLM and SGLang also use) compiles the constraint and, token by
token, says which tokens may come next; the sampler sets the others' logits to -inf. A sequence
holds its own matcher, fed each token it appends (runtime/sequence.py), and is done once the
grammar is: the JSON value is complete, the choice made, the regex unable to go on.

The JSON is compact (no whitespace between its tokens) unless the schema's "x-guidance" says
otherwise (`{"whitespace_flexible": true}`): a model free to add whitespace may add it until
max_tokens, as small models do.
"""

import json
import re
import threading

import llguidance
import llguidance.hf
import llguidance.numpy  # not llguidance.torch: importing it starts torch.compile (~2 s a process)
import torch


def canonical_json_schema(schema) -> str:
    """The schema (a mapping, or JSON text) as canonical JSON text: params stay hashable, and
    equal schemas are equal text. Keys keep their order: llguidance writes an object's
    properties in the schema's order, which users pick (a "reasoning" before its "answer"), as
    OpenAI and vLLM keep it. ValueError where llguidance cannot compile it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"json_schema must be a JSON schema (an object), got text that is not "
                             f"JSON ({exc})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema must be a JSON schema (an object), got one JSON cannot hold "
                         f"({exc})") from None
    for node in _schemas(schema):
        for _, keyword, bound, _ in _own_bounds(node):
            if isinstance(bound, int) and abs(bound) > _EXACT_IN_FLOAT64:
                raise ValueError(f"json_schema must be a schema with integer bounds within 2**53: {keyword} "
                                 f"{bound} is past it (the grammar engine reads it as the nearest float64)")
        lost = _exclusion_lost(node, schema)
        if lost:
            raise ValueError(f"json_schema must be a schema whose excluded bounds the grammar engine keeps out: "
                             f"llguidance 1.9.1 lets {lost}")
    try:  # llguidance's schema reader raises on some schemas (nested past its depth limit)
        error = llguidance.LLMatcher.validate_grammar(grammar_of(text))
    except ValueError as exc:
        error = str(exc)
    if error:
        raise ValueError(f"json_schema must be a schema the grammar engine compiles: {_one_line(error)}")
    return text


_EXACT_IN_FLOAT64 = 2 ** 53
# Keywords whose value maps names to schemas, and those whose value is data, not a schema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples")


def _schemas(node):
    """Every schema object within a schema, at any depth (not the data of const, enum, default,
    examples and x- keys)."""
    if not isinstance(node, dict):
        return
    yield node
    for key, value in node.items():
        if key in _DATA or key.startswith("x-"):
            continue
        children = (value.values() if key in _SCHEMA_MAPS and isinstance(value, dict)
                    else value if isinstance(value, list) else [value])
        for child in children:
            yield from _schemas(child)


def _own_bounds(node: dict) -> list[tuple[bool, str, int | float, bool]]:
    """(a lower bound?, its keyword, its value, excluded?) of each numeric bound a schema object
    holds itself (draft-04 excludes minimum / maximum with a boolean beside them)."""
    bounds = []
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        value = node.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            lower = key.endswith("inimum")
            draft4_flag = "exclusiveMinimum" if lower else "exclusiveMaximum"
            bounds.append((lower, key, value, key.startswith("exclusive") or node.get(draft4_flag) is True))
    return bounds


def _merged_bounds(node: dict, root: dict, seen: frozenset = frozenset()) -> list:
    """The bounds a value of `node` is held to: its own, its allOf members' and its (local) $ref
    target's, which llguidance merges into one range."""
    if id(node) in seen:
        return []
    seen |= {id(node)}
    bounds = _own_bounds(node)
    parts = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    ref = node.get("$ref")
    for part in parts + ([_resolve(root, ref)] if isinstance(ref, str) else []):
        if isinstance(part, dict):
            bounds += _merged_bounds(part, root, seen)
    return bounds


def _resolve(root: dict, ref: str):
    """The object a local JSON pointer ("#/$defs/a") names, or None."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _exclusion_lost(node: dict, root: dict) -> str | None:
    """What llguidance 1.9.1 would let through of the bounds a schema object excludes, or None.
    It takes an excluded whole number as allowed where the other bound lies less than 1 from
    it, on its side away from zero: (1, 1.5) takes 1, (-1.5, -1) takes -1, (-0.5, 0) takes -0;
    (1, 2), (0.5, 1) and (-1, -0.5) are right (measured over every such pair of bounds, in both
    forms, up to +-1000). An anyOf or oneOf alternative is held to its parent's bounds too."""
    merged = _merged_bounds(node, root)
    alternatives = [alt for key in ("anyOf", "oneOf") if isinstance(node.get(key), list)
                    for alt in node[key] if isinstance(alt, dict)]
    for bounds in [merged] + [merged + _merged_bounds(alt, root) for alt in alternatives]:
        for lower, key, value, excluded in bounds:
            if not (excluded and value == int(value) and (value >= 0 if lower else value <= 0)):
                continue
            for other_lower, other_key, other, _ in bounds:
                if other_lower != lower and (other < value + 1 if lower else other > value - 1):
                    return (f"{value} through ({key} {value} excluded, with {other_key} {other} less than 1 "
                            f"from it)")
    return None


def check_regex(regex: str) -> str:
    """ValueError where llguidance cannot compile the regex (Rust's regex syntax)."""
    if not isinstance(regex, str) or not regex:
        raise ValueError(f"regex must be a non-empty string, got {regex!r}")
    if (len(regex) - len(regex.rstrip("\\"))) % 2:  # llguidance would drop the lone backslash
        raise ValueError("regex must be a regular expression the grammar engine compiles: it ends "
                         "in a backslash that escapes nothing")
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_regex(regex))
    if error:
        raise ValueError(f"regex must be a regular expression the grammar engine compiles: "
                         f"{_one_line(error)}")
    return regex


def _one_line(error: str) -> str:
    """llguidance's message (it draws the grammar, over lines) on one line, for an error row."""
    return " ".join(error.split())


def choice_regex(choices: tuple[str, ...]) -> str:
    """A regex that matches exactly one of the choices."""
    return "(" + "|".join(re.escape(choice) for choice in choices) + ")"


COMPACT = {"whitespace_flexible": False}


def grammar_of(json_schema: str | None = None, regex: str | None = None) -> str:
    """llguidance's grammar for a schema (compact unless the schema says otherwise) or a regex."""
    if json_schema is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(json_schema, defaults=COMPACT)
    return llguidance.LLMatcher.grammar_from_regex(regex)


class Grammars:
    """Matchers over one model's vocabulary. Wrapping the tokenizer takes about a second, so it
    happens once, at the first matcher."""

    def __init__(self, tokenizer, vocab_size: int):
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = None
        self._lock = threading.Lock()  # engines of one process may share it

    def matcher(self, grammar: str, generated: list[int]) -> llguidance.LLMatcher:
        """A matcher for the grammar (grammar_of's) that has consumed the tokens already
        generated (a migrated sequence's)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        for token in generated:
            consume(matcher, token)
        return matcher


class UnfollowableGrammar(ValueError):
    """The grammar allowed no token that goes on (a regex whose language is empty, one too large
    for llguidance's lexer): the request's own doing, as the engine masks what it samples."""


def consume(matcher: llguidance.LLMatcher, token: int) -> None:
    """Feed the matcher the token chosen; UnfollowableGrammar if the grammar did not allow it."""
    if not matcher.consume_token(token) or matcher.is_error():
        # The first line says what went wrong (a regex too large to compile, say); the lines
        # after it are the matcher's state, of no use in an error row.
        reason = (matcher.get_error() or "").strip().split("\n")[0]
        raise UnfollowableGrammar(f"no text it allows goes on from here (the grammar engine refused "
                                  f"token {token}: {reason or 'no reason given'})")


def allowed_tokens(matcher: llguidance.LLMatcher, vocab_size: int) -> torch.Tensor:
    """The tokens the grammar allows next, as llguidance's bitmask (int32 [ceil(vocab / 32)])."""
    mask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    return torch.from_numpy(mask[0])


def keep_allowed(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [vocab] with every token the bitmask leaves out set to -inf, in place."""
    bitmask = bitmask.to(logits.device)
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32, device=logits.device)) & 1
    allowed = bits.flatten()[:logits.shape[-1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))
