"""The tokenizer stage: text or chat messages -> token ids (a HF fast tokenizer)."""
