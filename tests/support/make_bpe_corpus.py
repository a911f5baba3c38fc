"""Trains a small byte-level BPE vocabulary with Hugging Face `tokenizers` on a corpus of varied
strings and writes what tests/unit/model/gpt2_test.cpp compares Loom's GPT-2 tokenizer with:

    python make_bpe_corpus.py OUT

OUT/vocab.json, OUT/merges.txt  the vocabulary (GPT-2's file formats; no GPT-2 vocabulary can be
                                downloaded here, and the algorithm does not depend on which one)
OUT/corpus.json                 [{"text": ..., "ids": [...]}, ...]: at least 1,000 strings and the
                                ids `tokenizers` gives them

Exit 77 (the test reports "skipped") when tokenizers is not installed.
"""
import json
import os
import random
import sys

try:
    from tokenizers import ByteLevelBPETokenizer
except ImportError as e:
    print(f"make_bpe_corpus: {e}; scripts/setup.sh installs tokenizers", file=sys.stderr)
    sys.exit(77)

FRAGMENTS = [
    # words, contractions (GPT-2's pattern knows lower-case ones only), capitals
    "the", "quick", "brown", "fox", "Jumps", "OVER", "lazy", "dogs", "movie", "Toy Story", "Matrix",
    "don't", "I'm", "they'll", "we've", "it's", "I'd", "you're", "DON'T", "O'Neil", "rock'n'roll",
    # accents, combining marks, other Latin
    "café", "naïve", "Ångström", "São Paulo", "Zoë", "e\u0301", "façade", "Straße", "œuvre", "Łódź",
    # CJK, other scripts
    "東京", "北京大学", "こんにちは", "カタカナ", "한국어", "Привет мир", "مرحبا", "שלום", "हिन्दी", "ภาษาไทย",
    # emoji, with modifiers and joiners
    "😀", "👍🏽", "🇫🇷", "👨\u200d👩\u200d👧", "❤️", "🎬🍿",
    # digits and numbers
    "0", "42", "2024", "3.14159", "1,000,000", "1e-5", "٣٤", "½", "Ⅻ", "(1995)", "#7",
    # punctuation and symbols
    "!?", "...", "(x)", "—", "“quotes”", "«guillemets»", "$9.99", "100%", "a+b=c", "<tag/>", "|::|", "@home",
    # whitespace of every kind
    "   ", "\n", "\n\n", "\r\n", "\t", " \t ", "\u00a0", "\u2003", "\u3000", "\u200b",
]
SEPARATORS = [" ", "", "  ", "\n", " \n ", "\t", "   ", ", ", "\u00a0"]


def corpus(n, seed=0):
    rng = random.Random(seed)
    texts = list(FRAGMENTS)  # each fragment alone
    texts += ["  leading", "trailing   ", " ", "", "a   b", "line1\nline2\n\n", "end \n"]
    while len(texts) < n:
        parts = [rng.choice(FRAGMENTS) for _ in range(rng.randint(2, 8))]
        text = parts[0]
        for p in parts[1:]:
            text += rng.choice(SEPARATORS) + p
        texts.append(text)
    return texts


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    texts = corpus(1200)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts * 3, vocab_size=1000, min_frequency=2, show_progress=False)
    tok.save_model(out)
    with open(os.path.join(out, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump([{"text": t, "ids": tok.encode(t).ids} for t in texts], f, ensure_ascii=False)


if __name__ == "__main__":
    main()
