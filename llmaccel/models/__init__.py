"""One Transformer for the Llama and Qwen2 families: configs, loaders, tokenizers, layers."""
