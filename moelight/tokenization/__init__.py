"""Tokenizers without transformers: the interface (`tokenizer_base.py`), `tokenizer.json` through the
`tokenizers` library (`tokenizer.py`), a byte-level fallback for dummy models (`byte_tokenizer.py`),
and chat templates rendered as transformers renders them (`chat_template.py`)."""
