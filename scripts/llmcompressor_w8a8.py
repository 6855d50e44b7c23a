"""Write a W8A8 checkpoint of a float checkpoint with llm-compressor itself (data-free oneshot).

Run in a separate venv (llmcompressor 0.14 pins transformers <= 5.17; orch's has 5.23):
``python -m venv /tmp/llmc && /tmp/llmc/bin/pip install torch==2.13.0 llmcompressor``, then
``/tmp/llmc/bin/python scripts/llmcompressor_w8a8.py SRC DST`` and serve DST with orch
(docs/quantization.md, "Writing quantized checkpoints").
"""

import json
import shutil
import sys
from pathlib import Path

import torch
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM


def main(src: Path, dst: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="W8A8",
                                                     ignore=["lm_head"]))
    model.save_pretrained(dst, save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dst / name)
    config = json.loads((dst / "config.json").read_text())
    print(json.dumps(config["quantization_config"], indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
