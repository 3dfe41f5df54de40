"""Train the byte-level BPE tokenizer (8,192 tokens) on the training split and tokenize the corpus.

Writes ``train/data/tokenizer/{tokenizer.json,tokenizer_config.json}`` and ``train/data/<domain>.<split>.bin``
(uint16 token ids, documents separated by ``<|endoftext|>``). Run ``train/corpus.py`` first.

Usage::

    python train/tokenizer.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
DOMAINS = ("code", "shakespeare", "vimdoc")
EOT = "<|endoftext|>"
SPECIAL = [EOT, "<|system|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 8192

# A deliberately simple chat template: role markers on their own lines, turns ended by <|endoftext|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|endoftext|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": SPECIAL[1:],
        "chat_template": CHAT_TEMPLATE,
    }


def train_tokenizer(out_dir: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def docs():
        for d in DOMAINS:
            yield from (DATA / f"{d}.train.txt").read_text(encoding="utf-8").split(EOT)

    tok.train_from_iterator(docs(), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)  # minified: 0.22 MB instead of 0.54
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return tok


def encode_corpus(tok: Tokenizer) -> dict:
    eot = tok.token_to_id(EOT)
    stats = {}
    for d in DOMAINS:
        for split in ("train", "heldout"):
            docs = (DATA / f"{d}.{split}.txt").read_text(encoding="utf-8").split(EOT)
            ids: list[int] = []
            for enc in tok.encode_batch(docs):
                ids.extend(enc.ids)
                ids.append(eot)
            arr = np.asarray(ids, dtype=np.uint16)
            arr.tofile(DATA / f"{d}.{split}.bin")
            nbytes = sum(len(x.encode()) for x in docs)
            stats[f"{d}.{split}"] = {"tokens": len(arr), "bytes_per_token": round(nbytes / len(arr), 3)}
            print(f"{d:12s} {split:8s} {len(arr):10,d} tokens  {nbytes / len(arr):.2f} bytes/token")
    (DATA / "tokens.json").write_text(json.dumps(stats, indent=1))
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DATA / "tokenizer")
    args = ap.parse_args()
    tok = train_tokenizer(args.out)
    encode_corpus(tok)


if __name__ == "__main__":
    main()
