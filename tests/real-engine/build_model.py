"""Builds the tiny model the real-engine tier serves, with nothing downloaded.

vLLM needs a model directory; no weights can be fetched here, and the tier only needs an engine
that schedules, batches, streams and counts tokens like a real one. So the directory holds a
hand-written `config.json` for a small `LlamaForCausalLM` (vLLM fills it with random weights:
`--load-format dummy`), a byte-level BPE tokenizer trained here on the repository's own text, and
a chat template. The output is a pure function of this script and its training text: the stamp
file holds their hash, and a run whose stamp matches does nothing.

Usage: python build_model.py OUT_DIR
"""

import hashlib
import json
import sys
from pathlib import Path

# Training text: copies of the repository's prose and two sources as they were on 2026-11-26, kept
# in tests/real-engine/tokenizer-corpus/ so that editing (or moving) those files never changes the
# tokenizer, and with it the prompt counts the tests expect. Read in name order, for determinism.
CORPUS = Path(__file__).resolve().parent / "tokenizer-corpus"
VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3, referenced by config.json
MAX_MODEL_LEN = 2048

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}

# A plain role-tagged template: what matters to the tests is that the engine, not the client,
# turns messages into tokens (so usage.prompt_tokens includes the template's tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def training_text() -> list[str]:
    files = sorted(CORPUS.glob("*.txt"))
    if not files:
        sys.exit(f"build_model: no training text in {CORPUS}")
    return [f.read_text(encoding="utf-8") for f in files]


def build(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = training_text()
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for t in texts:
        digest.update(t.encode())
    stamp = out / ".stamp"
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        print(f"model: {out} is current")
        return
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3], "special token ids moved"
    tok.save(str(out / "tokenizer.json"))

    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "model_max_length": MAX_MODEL_LEN,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, indent=2) + "\n"
    )
    stamp.write_text(digest.hexdigest())
    print(f"model: wrote {out} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build(Path(sys.argv[1]))
