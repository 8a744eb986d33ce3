"""Hugging Face interchange: import a model folder into any layout (model.init_from) and export a
checkpoint as a folder transformers loads (python -m pipetrain.hf export).

Modules (import the one you need; this package re-exports nothing, so reading a config.json does not
load the weight reader, and the export never loads at import time what it does not use):
- config.py       config.json -> ModelConfig (model_config_from_hf, read_hf_config), the families
- weights.py      HF tensor names <-> ours (hf_sources, hf_shapes), HFWeights, load_hf_weights
- tokenizer.py    the model folder's tokenizer, checked against the model's vocab_size
- export.py       checkpoint or model -> HF folder (merged LoRA included), the sharded writer
- peft_export.py  LoRA adapters -> a PEFT folder

May import: config, data (tokenizer), models, checkpoint (export only), parallel.mesh and
parallel.tensor.lora (export only). Never: trainer, build, cli.
"""
