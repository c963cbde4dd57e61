"""Build the target runner and a drafter from checkpoint folders, and the embedded engine over
them (the CLI, the services, the evaluation and the benchmarks all load through here, and
every Engine is put together by `build_engine`).

Glossary
- checkpoints folder: one subfolder per trained drafter (`dspark-markov`, `dspark-rnn`, `dflash`,
  `eagle`), each as written by `dspark train` (config.json + model.safetensors, optionally the
  STS `calibration.json` written by `dspark calibrate`).
- The drafter reads the hidden states of the target layers its config names
  (`target_layer_ids`), so the runner that serves it must return exactly those layers; its token
  embedding and LM head are the target's own tensors, shared while the drafter runs in the
  target's dtype (a copy in the drafter's dtype otherwise).
- drafter weights (`DrafterWeights`): by default the drafter's tensors in its dtype (dense); asked
  for, on a CPU with the block kernel, Q8_0 blocks quantised from its float32 checkpoint and
  multiplied in float32 (`dspark.models.drafter_block_weights`; `choose_drafter_weights` says
  why that is not the default).
- drafter dtype (dense weights): the target's, except on a CPU that multiplies bf16 natively (oneDNN's bf16
  support: AVX512-BF16, AMX) under a float32 target, where the drafter runs in bf16
  (`drafter_dtype`). The drafts stay exact either way: each is drawn from the distribution the
  drafter reports for it, and verification accepts against the target's own float32 logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.admission import AdmissionPolicy
from dspark.calibration.sts_map import CALIBRATION_FILENAME, CalibrationSet, STSCalibration
from dspark.cost_table import CostTable
from dspark.cpu_info import cpu_description
from dspark.devices import resolve_device  # noqa: F401 (the services and CLIs import it here)
from dspark.engine import AdmissionConfig, BatchingConfig, Engine, EngineConfig
from dspark.models.drafter import DSparkDrafter
from dspark.models.drafter_block_weights import DrafterWeights, use_block_weights
from dspark.models.drafter_config import DrafterConfig
from dspark.models.draft_types import Drafter
from dspark.models.drafter_io import AnyDrafter, load_drafter
from dspark.models.packed_linear import packing_available
from dspark.models.quantized_linear import kernel_isa as block_kernel_isa
from dspark.models.runner import RunnerConfig, TargetRunner
from dspark.rejection import VerificationRule
from dspark.step_timing import cached_startup_cost_table
from dspark.structured_output import GrammarCompiler
from dspark.verifier import TargetVerifier


def is_checkpoint(folder: Path) -> bool:
    """A drafter folder: config.json and at least one safetensors file."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def load_target(model_dir: str | Path, hidden_layer_ids: tuple[int, ...], *,
                kv_cache_tokens: int, device: str = "cpu", dtype: str | None = None,
                weights: str | None = None) -> TargetRunner:
    """The target runner returning the hidden states of `hidden_layer_ids` for every token
    (`weights`: RunnerConfig.weights)."""
    return TargetRunner(model_dir, RunnerConfig(device=device, dtype=dtype, weights=weights,
                                                hidden_layer_ids=tuple(hidden_layer_ids),
                                                kv_cache_tokens=kv_cache_tokens))


def load_calibration_set(folder: str | Path) -> CalibrationSet | None:
    """All STS fits stored beside a drafter checkpoint, or None if it has none."""
    path = Path(folder) / CALIBRATION_FILENAME
    return CalibrationSet.load(path) if path.is_file() else None


def load_calibration(folder: str | Path, sampling_temperature: float = 1.0) -> STSCalibration | None:
    """The checkpoint's STS fit for a sampling temperature (the nearest fitted one), or None."""
    fits = load_calibration_set(folder)
    return None if fits is None else fits.for_temperature(sampling_temperature)


def has_confidence_head(drafter: AnyDrafter) -> bool:
    """True when the drafter's confidences come from a trained head (DSpark, DFlash with a head);
    the Eagle-style drafter's max-probability heuristic does not count."""
    return getattr(drafter, "confidence_head", None) is not None


def cpu_multiplies_bf16(device: torch.device | str) -> bool:
    """A CPU device whose oneDNN runs bf16 products on bf16 instructions (AVX512-BF16 or AMX-BF16;
    on a plain AVX-512 CPU oneDNN reports bf16 support but converts to float32 to multiply)."""
    if not packing_available(device, torch.bfloat16):  # a CPU whose oneDNN reports bf16 support
        return False
    return bool(set(cpu_description()["flags"]) & {"avx512_bf16", "amx_bf16"})


def drafter_dtype(runner: TargetRunner) -> torch.dtype:
    """The dtype a drafter serving this runner computes in: bf16 on a CPU with native bf16
    products when the target runs in float32, the target's dtype otherwise.

    A drafting round is a few dozen rows through the drafter's 12M weights (2 layers and an
    8,192-token LM head): weight reads at one request, products at eight. bf16 halves both on
    such a CPU: `bench/draft_step.py` on an AVX512-BF16 EPYC, one thread, 8 T=1 requests,
    23.6 ms a round in float32 against 19.7 in bf16 (products 14.5 against 8.5 ms); on an
    AVX2-only CPU bf16 products are emulated and slower, so the drafter keeps float32 there."""
    if runner.dtype == torch.float32 and cpu_multiplies_bf16(runner.device):
        return torch.bfloat16
    return runner.dtype


def choose_drafter_weights(weights: DrafterWeights | str | None, runner: TargetRunner,
                           dtype: torch.dtype | None = None) -> DrafterWeights:
    """`weights` resolved for a drafter serving this runner: None is DENSE; Q8 where it does not
    apply (not a CPU, no block kernel, a dtype other than float32) raises ValueError.

    Why not Q8 by default: the block kernel keeps one fixed summation order per output (batch
    invariance, which the target needs), so it is bound by arithmetic beyond one row, and a
    drafting round multiplies gamma = 7 rows per request through weights that mostly stay in
    the cache (26 MB in bf16). On an AVX512-BF16 EPYC, one thread, a round at one stream took
    45 ms on Q8 against 47 in float32 and 31 in bf16, at 8 streams 306 against 213 and 123
    (`bench/draft_step.py`, paired; docs/results/q4_drafter.md). On an AVX2 Zen 3 (float32 the
    dense default there) Q8 drafts one request in 7.7 ms against 10.3 but 8 in 35.2 against 32.6,
    and one-stream DSpark served 0.91x target-only with it against 0.98x dense
    (docs/results/target_decode_q4.md)."""
    if weights is not None:
        weights = DrafterWeights(weights)
    problems = []
    if runner.device.type != "cpu":
        problems.append("it runs on a CPU only")
    elif block_kernel_isa() is None:
        problems.append("the block kernel does not build here")
    if dtype is not None and dtype != torch.float32:
        problems.append(f"it computes in float32, not {dtype}")
    if weights is DrafterWeights.Q8 and problems:
        raise ValueError("drafter weights 'q8' do not apply: " + "; ".join(problems))
    return DrafterWeights.DENSE if weights is None else weights


def load_method_drafter(folder: str | Path, runner: TargetRunner, *,
                        apply_calibration: bool = False,
                        dtype: torch.dtype | None = None,
                        weights: DrafterWeights | str | None = None,
                        round_graphs: bool | None = None) -> AnyDrafter:
    """Load the drafter in `folder` onto the runner's device, with the runner's embedding and LM
    head, ready for inference (no autograd: see `FrozenTargetHead.pack_for_inference`), with
    `weights` (`choose_drafter_weights`; "q8": Q8_0 blocks, float32 activations), dense ones in
    `dtype` (default `drafter_dtype(runner)`). With
    `apply_calibration`, the folder's STS temperatures (if any) are applied to the confidences
    it returns; evaluation and calibration keep them raw (the default). `round_graphs`: a DSpark
    or DFlash drafter drafts over static per-bucket buffers, as CUDA graphs on CUDA
    (`DSparkDrafter.use_round_graphs`); None: on for CUDA, off elsewhere.
    """
    weights = choose_drafter_weights(weights, runner, dtype)
    if weights is DrafterWeights.Q8:
        dtype = torch.float32
    folder = Path(folder)
    config = DrafterConfig.load(folder)
    mc = runner.model_config
    layer_ids = tuple(int(i) for i in config.target_layer_ids)
    if tuple(runner.config.hidden_layer_ids) != layer_ids:
        raise ValueError(f"{folder}: the drafter reads target layers {list(layer_ids)} but the runner "
                         f"returns {list(runner.config.hidden_layer_ids)}")
    if config.vocab_size != mc.vocab_size or config.hidden_size != mc.hidden_size:
        raise ValueError(f"{folder}: drafter built for vocab {config.vocab_size} / hidden "
                         f"{config.hidden_size}, target has {mc.vocab_size} / {mc.hidden_size}")
    drafter = load_drafter(folder, runner.model.embed_tokens.weight, runner.model.lm_head.weight,
                           device=runner.device,
                           dtype=drafter_dtype(runner) if dtype is None else dtype)
    if apply_calibration:
        calibration = load_calibration_set(folder)
        if calibration is not None and has_confidence_head(drafter):
            if calibration.gamma != drafter.gamma:
                raise ValueError(f"{folder}: {CALIBRATION_FILENAME} has gamma={calibration.gamma}, "
                                 f"the drafter {drafter.gamma}")
            drafter.set_confidence_calibration(calibration)
    if weights is DrafterWeights.Q8:
        use_block_weights(drafter)  # a hidden size that is not whole blocks: ValueError
    else:
        drafter.pack_for_inference()  # a CPU: oneDNN-packed products (no-op elsewhere)
    if isinstance(drafter, DSparkDrafter):  # the Eagle-style drafter's chain has no graphs
        drafter.use_round_graphs(round_graphs)
    elif round_graphs:
        raise ValueError(f"{folder}: round graphs need a DSpark or DFlash drafter")
    return drafter


def build_engine(target: TargetRunner | TargetVerifier, drafter: Drafter | None,
                 cost_table: CostTable, config: EngineConfig = EngineConfig(),
                 verification: VerificationRule | str = VerificationRule.TOKEN,
                 grammars: GrammarCompiler | None = None) -> Engine:
    """The one place an Engine is put together: the target (a runner, verified by a
    TargetVerifier under `verification`; or a verifier already made, such as the scheduler's
    RemoteVerifier), the drafter (dropped under policy `none`, which decodes with the target
    alone) and the cost table SPS(B) the admission reads (refined in place while serving when
    `config.update_cost_table`: give each engine its own); `grammars`: the structured-output
    compiler over the target's tokenizer (None: requests with a grammar are refused)."""
    verifier = (TargetVerifier(target, VerificationRule(verification), grammars)
                if isinstance(target, TargetRunner) else target)
    if not config.admission.policy.drafts:
        drafter = None
    return Engine(verifier, drafter, cost_table, config)


def load_engine(model_dir: Path, drafter_dir: Path | None, policy: str, dtype: str,
                cost_table_path: Path | None, max_running: int = 16,
                sparse_top_k: int | None = None, device: str = "cpu",
                verification: str = "token", weights: str | None = None,
                drafter_weights: str | None = None):
    """The embedded engine over the target in `model_dir` and the drafter in `drafter_dir` (none
    when it is None or the policy is `none`); returns (engine, tokenizer). The cost table SPS(B)
    is read from `cost_table_path` when that file exists and is plausible, else measured now (and
    saved there when a path is given and the measurement is plausible:
    `dspark.step_timing.cached_startup_cost_table`). `weights`: the target's (RunnerConfig.weights);
    `drafter_weights`: the drafter's ("q8" | "dense", `choose_drafter_weights`). The table times
    target passes only, so it is keyed by the target's weights and not by the drafter's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    parsed = AdmissionPolicy.parse(policy)
    use_drafter = drafter_dir is not None and parsed.drafts
    layer_ids = tuple(DrafterConfig.load(drafter_dir).target_layer_ids) if use_drafter else ()
    runner = load_target(model_dir, layer_ids, kv_cache_tokens=max_running * 4096, device=device,
                         dtype=dtype, weights=weights)
    drafter = (load_method_drafter(drafter_dir, runner, apply_calibration=True,
                                   weights=drafter_weights)
               if use_drafter else None)
    table = cached_startup_cost_table(runner, cost_table_path)
    config = EngineConfig(AdmissionConfig(policy=parsed),
                          batching=BatchingConfig(max_running=max_running),
                          sparse_top_k=sparse_top_k)
    grammars = GrammarCompiler(tokenizer=tokenizer, vocab_size=runner.vocab_size)
    return build_engine(runner, drafter, table, config, verification, grammars), tokenizer
