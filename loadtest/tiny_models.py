"""A tiny random target (Llama-shaped, 64-token vocabulary with a word-level tokenizer "t0".."t63"
and a chat template) and an untrained DSpark drafter for it, written to a folder.

For smoke runs of the service stack where the real model is too slow (`loadtest.sweep --tiny`,
the fuzz and soak runs, `bench/services.py --tiny`, the tests): everything the services load from disk is real (safetensors weights,
tokenizer files, drafter checkpoint, cost table), only small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 64
LAYER_IDS = (0, 2, 3)
GAMMA = 4
# The tiny target: a random 4-layer Llama over the VOCAB-token vocabulary.
TINY_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True)


@dataclass(frozen=True)
class TinyModels:
    target_dir: Path
    drafter_dir: Path
    cost_table: Path
    work: Path


def build_tokenizer(folder: Path) -> None:
    """Word-level: "t<i>" is token i, words joined by spaces; chat: t1 <content> t2 ... t3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0")
    fast.chat_template = ("{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}"
                          "{% if add_generation_prompt %}t3{% endif %}")
    fast.save_pretrained(folder)


def build_tiny_models(work: Path, seed: int = 0) -> TinyModels:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dspark.cost_table import CostTable
    from dspark.models.drafter import DSparkDrafter
    from dspark.models.drafter_config import DrafterConfig
    from dspark.models.drafter_io import save_drafter

    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_LLAMA)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # peakier logits, so drafts get accepted now and then
        model.lm_head.weight.mul_(8.0)
    target_dir = work / "tiny_llama"
    model.save_pretrained(target_dir)
    build_tokenizer(target_dir)

    torch.manual_seed(seed + 1)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                        target_layer_ids=list(LAYER_IDS), num_target_layers=4, block_size=GAMMA,
                        mask_token_id=1, markov_rank=16)
    drafter = DSparkDrafter(cfg).eval()
    with torch.no_grad():  # an untrained but non-trivial sequential head
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5)
    drafter_dir = work / "tiny_drafter"
    save_drafter(drafter, drafter_dir)
    # A smooth table: verifying more tokens costs a little more.
    table = CostTable.from_step_seconds({b: 0.01 + 0.001 * b for b in (1, 2, 4, 8, 16, 32, 64)})
    table_path = work / "cost_table.json"
    table.save(table_path)
    return TinyModels(target_dir, drafter_dir, table_path, work)
