"""Training: LoRA fine-tuning (`lora.py`) with held-out perplexity and early stopping."""
