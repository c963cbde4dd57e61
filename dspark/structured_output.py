"""Structured output: OpenAI's `response_format` (json_object, json_schema) as a grammar that
masks the target's distribution, exact under speculation.

Glossary
- spec (`GrammarSpec`): what the client asked for, the kind and (json_schema) the schema as
  compact JSON text; hashable, so compiled grammars are cached by it.
- compiled grammar: xgrammar's automaton of the spec over the target's tokenizer
  (`GrammarCompiler.compile`, cached by spec).
- state (`GrammarState`): one request's matcher, advanced by the tokens it has committed
  (`observe`). Its stop tokens are the request's: they are allowed only where the grammar is
  complete, and accepting one terminates the matcher.
- row mask (`GrammarState.row_masks`): for a verified block [anchor, x_1..x_l] the target has
  l + 1 rows; row j predicts the token after x_1..x_j, so its mask is the matcher's after the
  committed output and drafts[:j]. The matcher is advanced through the drafts to fill the rows
  and rolled back after: only committed tokens move it for real.

Why the speculation stays exact (docs/design.md section 5): masking a row's logits (-inf where
the grammar refuses) makes it the target's constrained distribution p'(x), temperature, top-k
and top-p applied after the mask as vLLM applies its grammar bitmask; every verification rule
reads the target only through those logits. A draft the grammar refuses has p'(x) = 0 at its
row, so it is rejected, and the rows after it are never used (token rule: the first rejection
ends the block; block rule: its weight and every later one are 0); they keep the unmasked
logits. Rejection sampling is exact for any draft distribution, so the drafts need no mask for
exactness; the drafter masks them too (dspark.models.draft_processing: each position
with this state's `allowed_tokens`, following the drafts by `try_accept` and `rollback`), so
that fewer are rejected: in the embedded engine with the verifier's state, in the drafter
service with its own, compiled from the spec and advanced through the request's output
(services/drafter/request_tokens.py).
"""

from __future__ import annotations

import enum
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

BITS_PER_WORD = 32
"""xgrammar's token bitmask packs 32 tokens into each int32 word, token t at bit t % 32."""


class InvalidGrammar(ValueError):
    """A response_format that cannot be compiled (bad schema, unknown type)."""


class GrammarKind(enum.Enum):
    JSON_OBJECT = "json_object"
    """Any JSON object (OpenAI's JSON mode)."""
    JSON_SCHEMA = "json_schema"
    """JSON valid under the spec's schema."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    schema: str | None = None
    """json_schema: the schema as compact JSON text; None for json_object."""

    def __post_init__(self) -> None:
        if (self.kind is GrammarKind.JSON_SCHEMA) != (self.schema is not None):
            raise InvalidGrammar(f"{self.kind.value} {'needs' if self.schema is None else 'takes no'}"
                                 " schema")

    @staticmethod
    def json_schema(schema: Any) -> "GrammarSpec":
        """A schema given as a dict (or JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidGrammar(f"the schema is not JSON: {e}") from None
        if not isinstance(schema, dict):
            raise InvalidGrammar("the schema must be a JSON object")
        # Keys keep their order: the output's properties come in the schema's order.
        return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @staticmethod
    def from_response_format(value: Any) -> "GrammarSpec | None":
        """OpenAI's `response_format`: {"type": "text"} (or None) -> None; {"type":
        "json_object"}; {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}.
        Raises InvalidGrammar naming what is wrong with its shape (the schema itself is checked
        by compiling it)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise InvalidGrammar("response_format must be an object")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == GrammarKind.JSON_OBJECT.value:
            return GrammarSpec(GrammarKind.JSON_OBJECT)
        if kind == GrammarKind.JSON_SCHEMA.value:
            body = value.get("json_schema")
            if not isinstance(body, dict):
                raise InvalidGrammar("response_format.json_schema must be an object")
            if "schema" not in body:
                raise InvalidGrammar("response_format.json_schema.schema is required")
            return GrammarSpec.json_schema(body["schema"])
        raise InvalidGrammar(f"response_format.type must be 'text', 'json_object' or "
                             f"'json_schema', got {str(kind)[:40]!r}")

    def to_json(self) -> str:
        """The spec as one JSON text (how it travels in the protocol and the request store)."""
        return json.dumps({"kind": self.kind.value, "schema": self.schema})

    @staticmethod
    def from_json(text: str) -> "GrammarSpec":
        fields = json.loads(text)
        return GrammarSpec(GrammarKind(fields["kind"]), fields["schema"])


@dataclass(frozen=True)
class GrammarRequest:
    """What a verifier needs to constrain one request's tokens, sent with each of its items."""

    spec: GrammarSpec
    stop_token_ids: tuple[int, ...]
    """The request's stop tokens: allowed only where the grammar is complete."""
    replay: tuple[int, ...] | None = None
    """None: the verifier holds the request's state already. Else: (re)build it from the spec
    and advance it through these committed output tokens (the request's first item, or after
    the verifier released it: a preemption)."""


class GrammarCompiler:
    """Compiles specs over the target's tokenizer, caching them by spec. The tokenizer's
    vocabulary is read on the first compile (a vocabulary of 49,152 tokens: about 4 s), so a
    verifier that never sees a grammar never pays for it. Thread-safe."""

    def __init__(self, tokenizer_dir: str | Path | None = None, vocab_size: int | None = None,
                 tokenizer: Any = None, max_cached: int = 64) -> None:
        """`tokenizer_dir` (where AutoTokenizer finds the target's tokenizer) or `tokenizer`;
        `vocab_size`: the target's logits width (it may exceed the tokenizer's: padding)."""
        if (tokenizer_dir is None) == (tokenizer is None):
            raise ValueError("give exactly one of tokenizer_dir and tokenizer")
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        self._tokenizer = tokenizer
        self._compiler = None
        self._special_ids: tuple[int, ...] = ()
        self._cache: dict[GrammarSpec, Any] = {}
        self._lock = threading.Lock()

    def _xgrammar_compiler(self):
        import xgrammar

        if self._compiler is None:
            tokenizer = self._tokenizer
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self.vocab_size = info.vocab_size
            self._special_ids = special_token_ids(tokenizer)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec` (cached); InvalidGrammar if it cannot be compiled."""
        with self._lock:
            if spec in self._cache:
                return self._cache[spec]
            compiler = self._xgrammar_compiler()
            try:
                if spec.kind is GrammarKind.JSON_OBJECT:
                    compiled = compiler.compile_builtin_json_grammar()
                else:
                    # Compact separators (", " and ": "), no free whitespace: a small model
                    # otherwise strays into runs of spaces and newlines (vLLM's
                    # disable-any-whitespace); the values are the same JSON.
                    compiled = compiler.compile_json_schema(spec.schema, any_whitespace=False,
                                                            strict_mode=True)
            except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError
                raise InvalidGrammar(f"the schema cannot be compiled: {str(e)[:300]}") from None
            if len(self._cache) >= self.max_cached:
                self._cache.pop(next(iter(self._cache)))  # the oldest
            self._cache[spec] = compiled
            return compiled

    def state_for(self, request: GrammarRequest) -> "GrammarState":
        """A state built for `request` (its replay observed); needs request.replay."""
        assert request.replay is not None
        state = self.start(request.spec, request.stop_token_ids)
        state.observe(request.replay)
        return state

    def start(self, spec: GrammarSpec, stop_token_ids: Sequence[int]) -> "GrammarState":
        """A fresh state of `spec` for a request that stops at `stop_token_ids` (non-empty)."""
        compiled = self.compile(spec)
        return GrammarState(compiled, stop_token_ids, self.vocab_size,
                            [t for t in self._special_ids if t not in set(stop_token_ids)])


def special_token_ids(tokenizer) -> tuple[int, ...]:
    """The tokenizer's special tokens (`<|im_start|>`, `<repo_name>`, ...): xgrammar reads a
    byte-level vocabulary's added tokens as their literal text, which a JSON string would take;
    they are control tokens, never content, so every grammar refuses them (the request's stop
    tokens aside, which the matcher places)."""
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return tuple(sorted(ids))


class GrammarState:
    """One request's matcher: where its committed output stands in the grammar."""

    def __init__(self, compiled, stop_token_ids: Sequence[int], vocab_size: int,
                 refused_ids: Sequence[int] = ()) -> None:
        """`refused_ids`: tokens no row allows (the tokenizer's special tokens but the stops)."""
        import xgrammar

        if not stop_token_ids:
            raise InvalidGrammar("structured output needs an end-of-sequence token to end the "
                                 "output where the grammar is complete (not with ignore_eos)")
        self.vocab_size = vocab_size
        self.matcher = xgrammar.GrammarMatcher(compiled,
                                               override_stop_tokens=sorted(set(stop_token_ids)))
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # [1, words] int32
        self._refused = torch.tensor(sorted(set(refused_ids)), dtype=torch.int64)  # [s]
        self._stops = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.int64)  # [t]
        self._bitmask_fresh = False
        """_bitmask holds the matcher's mask at its current state (set by allowed_tokens)."""

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""
        return self.matcher.is_terminated()

    def observe(self, committed: Sequence[int]) -> None:
        """Advance through committed output tokens (those after a stop token are ignored: the
        request ends there). A token the grammar refuses is an error: only a masked row can
        have produced it, so the caller is broken."""
        for token in committed:
            if self.matcher.is_terminated():
                return
            self._bitmask_fresh = False
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"token {int(token)} was committed but the grammar refuses it")

    def row_masks(self, drafts: Sequence[int]) -> torch.Tensor:
        """Allowed tokens of the rows of a block with these drafts: [len(drafts) + 1, V] bool.

        Row j: after the committed output and drafts[:j]. Rows after a draft the grammar
        refuses are all True (they are never used, see the module docstring); the matcher is
        back where it was on return."""
        num_rows = len(drafts) + 1
        words = torch.zeros(num_rows, self._bitmask.shape[1], dtype=torch.int32)  # [rows, W]
        words[:] = -1  # all bits set: every token allowed
        advanced = num_filled = 0
        try:
            for j in range(num_rows):
                self.matcher.fill_next_token_bitmask(words, j)  # row j in place
                num_filled += 1
                if j == len(drafts) or not _bit(words[j], int(drafts[j])):
                    break  # the grammar refuses the draft (so would accept_token, noisily)
                if not self.matcher.accept_token(int(drafts[j])):
                    break
                advanced += 1
                if self.matcher.is_terminated():  # a stop token drafted: nothing follows it
                    break
        finally:
            if advanced:
                self.matcher.rollback(advanced)
        allowed = unpack_bitmask(words, self.vocab_size)  # [rows, V]
        allowed[:num_filled, self._refused] = False
        # A dead end (no token of this vocabulary continues the grammar) ends the output:
        # its stop tokens, rather than a row of -inf with no distribution at all.
        dead = ~allowed[:num_filled].any(dim=1)  # [filled]
        if bool(dead.any()):
            allowed[:num_filled][dead.nonzero().squeeze(1).unsqueeze(1), self._stops] = True
        return allowed

    def allowed_tokens(self) -> torch.Tensor:
        """The tokens allowed next, after the committed output and any drafts accepted by
        `try_accept` since: [V] bool, as one row of `row_masks` (a dead end allows the stops)."""
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        self._bitmask_fresh = True
        allowed = unpack_bitmask(self._bitmask, self.vocab_size)[0]  # [V]
        allowed[self._refused] = False
        if not bool(allowed.any()):
            allowed[self._stops] = True
        return allowed

    def try_accept(self, token: int) -> bool:
        """Advance through one drafted token if the grammar allows it (undone by `rollback`):
        the drafter follows its own drafts with the matcher. False (not advanced) otherwise."""
        if self.matcher.is_terminated():
            return False
        if not self._bitmask_fresh:  # allowed_tokens filled it at this state already
            self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        self._bitmask_fresh = False
        return _bit(self._bitmask[0], int(token)) and bool(self.matcher.accept_token(int(token)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` drafts accepted by `try_accept`."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self._bitmask_fresh = False

    def can_start(self) -> bool:
        """Some token of the vocabulary continues the output from here, or it may end here (a
        word-level vocabulary without "{" cannot begin any JSON)."""
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        self._bitmask_fresh = True
        allowed = unpack_bitmask(self._bitmask, self.vocab_size)[0]  # [V]
        allowed[self._refused] = False
        return bool(allowed.any())


def _bit(words: torch.Tensor, token: int) -> bool:
    """Token `token`'s bit in one row of a packed bitmask [W] int32."""
    return 0 <= token < words.shape[0] * BITS_PER_WORD and bool(
        (int(words[token // BITS_PER_WORD]) >> (token % BITS_PER_WORD)) & 1)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed bitmask [n, ceil(V / 32)] int32 -> [n, V] bool (token t: bit t % 32 of
    word t // 32). Plain tensor ops, so it runs on any device."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=words.device)  # [32]
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The constrained logits: -inf where not allowed. logits [n, V], allowed [n, V] bool ->
    [n, V] (a new tensor: the raw logits stay for log-probabilities)."""
    assert logits.shape == allowed.shape, (logits.shape, allowed.shape)
    return logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
