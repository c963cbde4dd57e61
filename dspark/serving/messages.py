"""Conversions between the core dataclasses and `dspark.v1` messages, in one place.

Both sides of every RPC use these, so a field added to a message is handled once. Decoding
validates what the core would otherwise trust (sampling parameters, block shapes) and raises
ValueError naming the field, which the servers turn into INVALID_ARGUMENT.
"""

from __future__ import annotations

import torch

from dspark.logprobs import TokenLogprobs, check_num_top
from dspark.models.draft_types import DraftBlock
from dspark.random_draws import CounterGenerator
from dspark.sampling import SamplingParams
from dspark.serving import tensor_codec
from dspark.structured_output import GrammarRequest, GrammarSpec, InvalidGrammar
from dspark.serving.protos import pb

def sampling_to_pb(params: SamplingParams, generator: CounterGenerator | None = None
                   ) -> "pb.common.SamplingParams":
    """`generator`: the scheduler's for this request; its seed goes in the message when the
    request has none of its own (a fresh one, drawn at admission), so that the verifier and the
    drafter services key the request's numbers alike, as the embedded engine's one generator
    does (the drafter-invariant rule's drafts use the target's noise)."""
    msg = pb.common.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                   top_p=params.top_p, min_p=params.min_p,
                                   presence_penalty=params.presence_penalty,
                                   frequency_penalty=params.frequency_penalty,
                                   logit_bias=dict(params.logit_bias),
                                   min_tokens=params.min_tokens,
                                   stop_token_ids=list(params.stop_token_ids))
    seed = params.seed if params.seed is not None or generator is None else generator.seed
    if seed is not None:
        msg.seed = int(seed)
    if params.repetition_penalty != 1.0:
        msg.repetition_penalty = params.repetition_penalty
    return msg


def sampling_from_pb(msg: "pb.common.SamplingParams") -> SamplingParams:
    """Raises ValueError (from SamplingParams) naming a bad field (temperature, top_k, top_p,
    min_p, a penalty, logit_bias, min_tokens)."""
    seed = msg.seed if msg.HasField("seed") else None
    return SamplingParams(
        temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, seed=seed,
        min_p=msg.min_p, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty")
                            else 1.0),
        logit_bias=dict(msg.logit_bias), min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids))


def grammar_to_pb(grammar: GrammarRequest | None) -> "pb.verifier.Grammar | None":
    if grammar is None:
        return None
    return pb.verifier.Grammar(spec_json=grammar.spec.to_json(),
                               stop_token_ids=list(grammar.stop_token_ids),
                               rebuild=grammar.replay is not None,
                               replay_tokens=list(grammar.replay or ()))


def grammar_from_pb(item) -> GrammarRequest | None:
    """An item's grammar (None when absent); raises ValueError naming a bad spec."""
    if not item.HasField("grammar"):
        return None
    msg = item.grammar
    return GrammarRequest(*_spec_and_stops(item.request_id, msg),
                          tuple(int(t) for t in msg.replay_tokens) if msg.rebuild else None)


def draft_grammar_to_pb(grammar: GrammarRequest | None) -> "pb.drafter.DraftGrammar | None":
    """A draft item's grammar: the spec and stop tokens (the drafter follows the output itself)."""
    if grammar is None:
        return None
    return pb.drafter.DraftGrammar(spec_json=grammar.spec.to_json(),
                                   stop_token_ids=list(grammar.stop_token_ids))


def draft_grammar_from_pb(item) -> GrammarRequest | None:
    """A DraftItem's grammar (None when absent); raises ValueError naming a bad spec."""
    if not item.HasField("grammar"):
        return None
    return GrammarRequest(*_spec_and_stops(item.request_id, item.grammar))


def _spec_and_stops(request_id: str, msg) -> tuple[GrammarSpec, tuple[int, ...]]:
    """A grammar message's spec and stop tokens; ValueError naming what is wrong."""
    try:
        spec = GrammarSpec.from_json(msg.spec_json)
    except (ValueError, KeyError, TypeError) as e:  # InvalidGrammar is a ValueError
        raise ValueError(f"{request_id}: grammar.spec_json: {e}") from None
    if not msg.stop_token_ids:
        raise InvalidGrammar(f"{request_id}: grammar without stop_token_ids")
    return spec, tuple(int(t) for t in msg.stop_token_ids)


def logprobs_to_pb(logprobs: TokenLogprobs | None) -> "pb.common.TokenLogprobs":
    if logprobs is None:
        return pb.common.TokenLogprobs()
    return pb.common.TokenLogprobs(token_logprobs=tensor_codec.encode(logprobs.token_logprobs),
                                   top_token_ids=tensor_codec.encode(logprobs.top_token_ids),
                                   top_logprobs=tensor_codec.encode(logprobs.top_logprobs))


def logprobs_from_pb(msg: "pb.common.TokenLogprobs", num_tokens: int) -> TokenLogprobs | None:
    """None when the message is empty (not asked); raises ValueError unless it has one row for
    each of the num_tokens tokens."""
    values = tensor_codec.decode(msg.token_logprobs)
    if values is None:
        return None
    top_ids, top_values = (tensor_codec.decode(msg.top_token_ids),
                           tensor_codec.decode(msg.top_logprobs))
    if (values.shape != (num_tokens,) or top_ids is None or top_values is None
            or top_ids.dim() != 2 or top_ids.shape != top_values.shape
            or top_ids.shape[0] != num_tokens):
        raise ValueError(f"logprobs for {num_tokens} tokens have shapes "
                         f"{tuple(values.shape)} / {None if top_ids is None else tuple(top_ids.shape)}")
    return TokenLogprobs(values.float(), top_ids.long(), top_values.float())


def num_top_from_pb(msg, field: str = "logprobs") -> int | None:
    """An `optional int32 logprobs` field: None when absent; raises ValueError outside 0..20."""
    if not msg.HasField(field):
        return None
    check_num_top(getattr(msg, field))
    return int(getattr(msg, field))


def block_to_pb(round_id: int, request_id: str,
                block: DraftBlock) -> "pb.drafter.DraftedBlock":
    return pb.drafter.DraftedBlock(
        round_id=round_id, request_id=request_id, tokens=tensor_codec.encode(block.tokens),
        probs=tensor_codec.encode(block.probs.float()),
        confidences=tensor_codec.encode(block.confidences.float()),
        indices=tensor_codec.encode(block.indices))


def block_from_pb(msg: "pb.drafter.DraftedBlock") -> DraftBlock:
    tokens = tensor_codec.decode(msg.tokens)
    probs = tensor_codec.decode(msg.probs)
    confidences = tensor_codec.decode(msg.confidences)
    if tokens is None or probs is None or confidences is None:
        raise ValueError(f"block of {msg.request_id!r} lacks tokens, probs or confidences")
    return DraftBlock(tokens.long(), probs.float(), confidences.float(),
                      tensor_codec.decode(msg.indices))


def admitted_drafts_to_pb(block: DraftBlock | None, num_drafts: int
                          ) -> tuple["pb.common.Tensor", "pb.common.Tensor", "pb.common.Tensor"]:
    """Only the l_r admitted drafts travel to the verifier: (tokens, probs, indices)."""
    if block is None or num_drafts == 0:
        return pb.common.Tensor(), pb.common.Tensor(), pb.common.Tensor()
    indices = block.indices[:num_drafts] if block.indices is not None else None
    return (tensor_codec.encode(block.tokens[:num_drafts]),
            tensor_codec.encode(block.probs[:num_drafts].float()), tensor_codec.encode(indices))


def admitted_drafts_from_pb(item: "pb.verifier.VerifyItem", vocab_size: int
                            ) -> tuple[DraftBlock | None, int]:
    """The admitted drafts as a DraftBlock of length l (confidences unused by verification)."""
    tokens = tensor_codec.decode(item.draft_tokens)
    if tokens is None or tokens.numel() == 0:
        return None, 0
    probs = tensor_codec.decode(item.draft_probs)
    indices = tensor_codec.decode(item.draft_indices)
    n = int(tokens.shape[0])
    if tokens.dim() != 1 or probs is None or probs.dim() != 2 or probs.shape[0] != n:
        raise ValueError(f"{item.request_id}: draft_tokens [l] and draft_probs [l, *] disagree")
    if indices is None and probs.shape[1] != vocab_size:
        raise ValueError(f"{item.request_id}: dense draft_probs must have {vocab_size} columns")
    if indices is not None and indices.shape != probs.shape:
        raise ValueError(f"{item.request_id}: draft_indices must have draft_probs' shape")
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise ValueError(f"{item.request_id}: draft token outside the vocabulary")
    # Indices and probabilities reach gather/scatter and sampling kernels: out of range there is
    # a device-side assert on a GPU (the whole process's CUDA context is lost), NaN a poisoned
    # batch. Refuse them here, for this call only.
    if indices is not None and (indices.dtype.is_floating_point or bool(
            ((indices < 0) | (indices >= vocab_size)).any())):
        raise ValueError(f"{item.request_id}: draft_indices must be integers in "
                         f"0..{vocab_size - 1}")
    if not bool((torch.isfinite(probs) & (probs >= 0) & (probs <= 1)).all()):
        raise ValueError(f"{item.request_id}: draft_probs must be finite and in [0, 1]")
    block = DraftBlock(tokens.long(), probs.float(), torch.zeros(n),
                       None if indices is None else indices.long())
    return block, n
