"""Prompt sources: the built-in ShareGPT alias and user files, split deterministically."""
