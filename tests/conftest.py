"""Shared fixtures: the demo target (prepared once per machine), the eval prompt files, one torch
thread for every test, and the tiny random Llama targets, tokenizer and DSpark drafter the tests
build (`tiny_dspark`, a plain function: test modules import it with `from .conftest import`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton kernels (AttentionImpl.TRITON) run under Triton's interpreter where there is no GPU. It
# must be chosen before triton.language is first imported: the library's own helpers are
# compiled or interpreted from then on.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# REPO_ROOT also for the test modules that import it from here (`from .conftest import REPO_ROOT`).
from dspark.paths import EVAL_PROMPTS_DIR, REPO_ROOT, require_folder  # noqa: F401
from loadtest.tiny_models import TINY_LLAMA

# The tiny stack's service processes (tiny_models, launcher, shared_verifier), for tests/serving/
# and tests/services/ alike; pytest reads pytest_plugins only from this top-level conftest.
pytest_plugins = ["tests.stack_fixtures"]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors folder (`dspark fetch-model`; cached across runs)."""
    from dspark.fetch import ensure_model

    return ensure_model()


@pytest.fixture(scope="session")
def eval_dir() -> Path:
    """The shared eval sets: `$DSPARK_SHARED_DIR/data/eval`, else `../shared/data/eval` beside the
    repository (CI clones the repository with shared/ next to it)."""
    return require_folder(EVAL_PROMPTS_DIR, "eval prompts")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Every test runs torch on one thread (also after a test or a CLI it calls set another): the
    tiny models gain nothing from two, and on a shared machine two OpenMP threads per process can
    spin against each other and run many times slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def save_tiny_llama():
    """`save(folder, peaked=True, **config) -> model`: a random Llama (TINY_LLAMA, with `config`
    overriding it) built right after `torch.manual_seed(0)` and saved in Hugging Face format.
    `peaked` multiplies the LM head by 8, so that sampled tokens repeat and drafts get accepted
    now and then. A function, so that a caller's later draws follow the same seeded stream."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def save(folder: Path, peaked: bool = True, **config):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **config})).eval()
        if peaked:
            with torch.no_grad():
                model.lm_head.weight.mul_(8.0)
        model.save_pretrained(folder)
        return model

    return save


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, save_tiny_llama):
    """(folder, model) of the peaked TINY_LLAMA."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    return folder, save_tiny_llama(folder)


@pytest.fixture(scope="session")
def save_char_tokenizer():
    """`save(folder)`: a character-level tokenizer (45 ids below 64: `<unk>`, `<|im_start|>`,
    `<|im_end|>` (EOS), then a-z, 0-9 and " .,?!\n") with a ChatML template."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def save(folder: Path) -> None:
        specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
        chars = list(string.ascii_lowercase + string.digits + " .,?!\n")
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)},
                                         unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tok.add_special_tokens(specials)
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                chat_template=CHATML_TEMPLATE).save_pretrained(folder)

    return save


JSON_CHARS = '{}[]":,-. \n' + "0123456789abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="session")
def save_json_tokenizer():
    """`save(folder)`: a character-level tokenizer that can write JSON (50 ids below 64:
    `<unk>`, `<|im_start|>`, `<|im_end|>` (EOS), then JSON_CHARS) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def save(folder: Path) -> None:
        specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
        tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + list(JSON_CHARS))},
                                         unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
        tok.decoder = decoders.Fuse()  # characters joined as they are
        tok.add_special_tokens(specials)
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                chat_template=CHATML_TEMPLATE).save_pretrained(folder)

    return save


def tiny_dspark(seed: int | None = None, runner=None, noisy_confidence: bool = False, **config):
    """An untrained DSpark drafter for TINY_LLAMA: gamma 4, context from target layers 0, 2 and 3,
    mask token 1, a Markov head of rank 16 (`config` overrides any DrafterConfig field), built
    right after `torch.manual_seed(seed)`, or on the caller's random stream when seed is None.

    The Markov head's second layer is drawn from N(0, 0.5^2), so that the untrained sequential
    head is not trivial; `noisy_confidence` draws the confidence head from N(0, 1), so that
    confidences spread over (0, 1). `runner` (a TargetRunner) ties the drafter to its target's
    embeddings and LM head, as loading a checkpoint does."""
    import torch

    from dspark.models.drafter import DSparkDrafter
    from dspark.models.drafter_config import DrafterConfig
    from loadtest.tiny_models import GAMMA, LAYER_IDS

    if seed is not None:
        torch.manual_seed(seed)
    fields = dict(block_size=GAMMA, mask_token_id=1, target_layer_ids=list(LAYER_IDS),
                  markov_rank=16)
    drafter = DSparkDrafter(DrafterConfig.from_target_config(TINY_LLAMA, **{**fields, **config}))
    drafter.eval()
    with torch.no_grad():
        if drafter.markov_head is not None:
            drafter.markov_head.markov_w2.weight.normal_(0, 0.5)
        if noisy_confidence:
            drafter.confidence_head.proj.weight.normal_(0, 1.0)
    if runner is not None:
        drafter.set_target_weights(runner.model.embed_tokens.weight, runner.model.lm_head.weight)
    return drafter


@pytest.fixture(scope="session")
def save_tiny_chat_target(save_tiny_llama, save_char_tokenizer):
    """`save(folder) -> model`: the peaked TINY_LLAMA with 1024 positions, EOS 2 and BOS 1, and
    the character-level ChatML tokenizer beside it, as `dspark eval` and `dspark bench` load it."""

    def save(folder: Path):
        model = save_tiny_llama(folder, max_position_embeddings=1024, eos_token_id=2, bos_token_id=1)
        save_char_tokenizer(folder)
        return model

    return save
