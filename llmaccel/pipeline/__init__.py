"""Recipes: the workflow (analyze -> finetune -> quantize -> eval -> ...) as one command whose
stages are cached by a hash of their config and inputs (`llmaccel run`)."""
