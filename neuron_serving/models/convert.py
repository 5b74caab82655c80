"""GGUF file -> Hugging Face directory vLLM loads: config, safetensors, tokenizer, chat template.

transformers (with the `gguf` package) reads the GGUF's tensors, dequantised to
float32, and builds the tokenizer and chat template from the GGUF's metadata. The
model then still carries transformers' GGUF quantizer, which refuses to save; the
weights are plain float32 tensors by then, so dropping the quantizer and the
`quantization_config` marker writes an ordinary float32 checkpoint (vLLM would
otherwise look for a GGUF file). Float32 keeps the dequantised values exactly;
vLLM casts at load time to whatever `--dtype` asks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from neuron_serving.models.fetch import PullError

# What a converted directory must hold for vLLM and the OpenAI chat API to use it.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def convert_gguf(
    gguf: Path, out: Path, served_name: str, log: Callable[[str], None] = print
) -> None:
    """Write the Hugging Face directory for ``gguf`` into ``out`` (which exists, empty).
    ``served_name`` (the catalog name) names the model in errors."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as e:
        raise PullError(f"converting needs transformers: {e}") from e
    try:
        log("  reading the tokenizer and chat template from the GGUF metadata ...")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        log("  dequantising the weights to float32 ...")
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except ImportError as e:  # gguf or accelerate missing: say which
        raise PullError(f"converting a GGUF needs the gguf and accelerate packages: {e}") from e
    except Exception as e:  # noqa: BLE001 - any parse failure is one clear error
        raise PullError(f"{served_name}: {gguf.name} could not be read as a GGUF model: {e}") from e
    if not getattr(tokenizer, "chat_template", None):
        raise PullError(f"{served_name}: {gguf.name} carries no chat template in its metadata")
    config = model.config
    # The marker would make vLLM treat the directory as a GGUF checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # torch types Module.__setattr__ for tensors and modules; any value is stored.
    model.hf_quantizer = None  # type: ignore[assignment]
    # The GGUF's general.name, a training-run label ("Smollm2 135M 8k Lc100K Mix1 Ep2").
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path
    # The GGUF tokenizer has no length; vLLM warns on an unbounded model_max_length.
    tokenizer.model_max_length = config.max_position_embeddings
    log(f"  writing {out} ...")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)
    missing = [name for name in REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise PullError(f"conversion of {gguf.name} wrote no {', '.join(missing)}")
    for path in out.iterdir():
        os.chmod(path, 0o644)  # safetensors writes 0600; a shared cache is read by other users
