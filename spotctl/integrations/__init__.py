"""Adapters for training frameworks: Hugging Face Trainer, Lightning, torchtitan.

Each module imports its framework only when used (install the matching extra:
``spotctl[hf]``, ``spotctl[lightning]``). Importing this package imports no framework.
See docs/integrations.md.
"""
