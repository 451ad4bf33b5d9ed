"""Tokenizers without transformers: `tokenizer.json` through the `tokenizers` library, a byte-level
fallback for dummy models (`tokenizer.py`), and chat templates rendered as transformers renders
them (`chat_template.py`)."""
