"""The tokens that end a generation: the tokenizer's EOS and, for chat models, the template's
end-of-turn token (`<|im_end|>` in SmolLM2's ChatML template)."""

from __future__ import annotations

END_OF_TURN = "<|im_end|>"


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """EOS and the chat template's end-of-turn token (when the tokenizer has one), ascending."""
    ids = {tokenizer.eos_token_id}
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        ids.add(end)
    ids.discard(None)
    return tuple(sorted(ids))
