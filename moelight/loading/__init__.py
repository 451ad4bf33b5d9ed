"""From `--model` to weights in memory: config.json through its family's adapter (`hf_config.py`),
presets for dummy weights (`presets.py`), the model resolved without loading (`model_source.py`,
`resolved_model.py` with its tokenizer), and safetensors or dummy weights (`weights.py`)."""
