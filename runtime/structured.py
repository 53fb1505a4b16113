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
import urllib.parse

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
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"json_schema must be a JSON schema (an object), got text that is not "
                             f"JSON Python reads ({type(exc).__name__}: {exc})") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"json_schema must be a JSON schema (an object), got one JSON cannot hold "
                         f"({exc})") from None
    for node in _schemas(schema):
        for _, keyword, bound, _ in _own_bounds(node):
            if isinstance(bound, int) and abs(bound) > _EXACT_IN_FLOAT64:
                raise ValueError(f"json_schema must be a schema with integer bounds within 2**53: {keyword} "
                                 f"{bound} is past it (the grammar engine reads it as the nearest float64)")
        lost = _exclusion_lost(_joined_bounds(node, schema))
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


def _schemas(schema):
    """Every schema object within a schema, at any depth (not the data of const, enum, default,
    examples and x- keys)."""
    stack = [schema]
    while stack:  # not recursive: a schema may nest deeper than Python's stack
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node
        for key, value in node.items():
            if key in _DATA or key.startswith("x-"):
                continue
            stack.extend(value.values() if key in _SCHEMA_MAPS and isinstance(value, dict)
                         else value if isinstance(value, list) else [value])


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


def _joined_bounds(node: dict, root: dict) -> list:
    """The bounds of every schema object llguidance may merge into one range with `node`: those
    reached through allOf, anyOf, oneOf and local $refs. Alternatives count too (a parent's
    bounds reach into each), which errs on the side of refusing."""
    stack, seen, bounds = [node], {id(node)}, []
    while stack:
        current = stack.pop()
        bounds += _own_bounds(current)
        linked = [member for key in ("allOf", "anyOf", "oneOf") if isinstance(current.get(key), list)
                  for member in current[key]]
        if isinstance(current.get("$ref"), str):
            linked.append(_resolve(root, current["$ref"]))
        for child in linked:
            if isinstance(child, dict) and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    return bounds


def _resolve(root: dict, ref: str):
    """The object a local JSON pointer ("#/$defs/a") names, or None (other references: $anchor
    names, $id-relative URIs)."""
    pointer = urllib.parse.unquote(ref[1:]) if ref.startswith("#") else None
    if pointer is None or (pointer and not pointer.startswith("/")):
        return None
    node = root
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _exclusion_lost(bounds: list) -> str | None:
    """What llguidance 1.9.1 would let through of the excluded ones among `bounds`, which it
    merges into one range, or None. It takes an excluded whole number as allowed where the
    other bound lies less than 1 from it, on its side away from zero: (1, 1.5) takes 1,
    (-1.5, -1) takes -1, (-0.5, 0) takes -0; (1, 2), (0.5, 1) and (-1, -0.5) are right
    (measured over every such pair of bounds, in both forms, up to +-1000)."""
    lowest_upper = min(((value, key) for lower, key, value, _ in bounds if not lower), default=None)
    highest_lower = max(((value, key) for lower, key, value, _ in bounds if lower), default=None)
    for lower, key, value, excluded in bounds:
        if not excluded or value != int(value):
            continue
        if lower:
            other = lowest_upper if value >= 0 and lowest_upper and lowest_upper[0] < value + 1 else None
        else:
            other = highest_lower if value <= 0 and highest_lower and highest_lower[0] > value - 1 else None
        if other:
            return f"{value} through ({key} {value} excluded, with {other[1]} {other[0]} less than 1 from it)"
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
