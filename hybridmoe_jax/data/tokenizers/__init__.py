"""Tokenizers: the contract (`base`), bytes (`byte`), tokenizer.json (`hf`), tiktoken files
(`tiktoken_bpe`), the one load path (`load`, the only module importing the others)."""
